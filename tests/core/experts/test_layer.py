"""The mixture-of-experts layer (mpcourse.core.experts.layer.MoEFeedForward) against a dense reference that runs
every expert on every token (the naive MoE: no grouping, no padding), its router's precision under every kind of
region, the format it picks from the recipe, and its load-balancing loss (Switch Transformer, Fedus et al. 2021,
eq. 4)."""
import pytest
import torch
import torch.nn.functional as F

from mpcourse.core import quant
from mpcourse.core.autocast import autocast as course_autocast
from mpcourse.core.experts.layer import MoEFeedForward, expert_hidden

C, H, E = 128, 128, 4


def layer(**kw):
    torch.manual_seed(0)
    return MoEFeedForward(C, H, E, **kw)


def naive(m: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the token's combine weight for it (0 where not chosen), FP32."""
    t = x.reshape(-1, C).float()
    p = F.softmax(t @ m.router.float().t(), dim=-1)                              # (S, E)
    top, idx = p.topk(m.top_k, dim=-1)
    g = torch.zeros_like(p).scatter(1, idx, top / top.sum(-1, keepdim=True) if m.top_k > 1 else top)
    out = sum(g[:, e:e + 1] * (F.gelu(t @ m.w_in[e].float().t()) @ m.w_out[e].float().t()) for e in range(E))
    if m.shared_fc is not None:
        out = out + m.shared_proj(F.gelu(m.shared_fc(t)))
    return out.reshape(x.shape)


@pytest.mark.parametrize("top_k, shared", [(1, False), (2, False), (2, True), (4, False)])
def test_forward_and_gradients_equal_the_naive_moe(top_k, shared):
    m = layer(top_k=top_k, shared_expert=shared)
    x = torch.randn(3, 50, C, requires_grad=True)
    y = m(x)
    ref = naive(m, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, m.w_in, m.w_out, m.router], g)
    want = torch.autograd.grad(ref, [x, m.w_in, m.w_out, m.router], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def regions():
    yield "none", lambda: quant.autocast(enabled=False)
    yield "torch.autocast bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    yield "course autocast bf16", lambda: course_autocast("cpu", dtype=torch.bfloat16)
    yield "course autocast fp16", lambda: course_autocast("cpu", dtype=torch.float16)
    yield "fp8-block region", lambda: quant.autocast(enabled=True, recipe=quant.Float8BlockScaling())


@pytest.mark.parametrize("name, region", list(regions()))
def test_router_softmax_topk_and_combine_weights_stay_fp32_in_every_region(name, region):
    m = layer()
    tokens = torch.randn(256, C)
    want = m.route(tokens)
    with region():
        got = m.route(tokens)
    assert all(t.dtype == w.dtype and torch.equal(t, w) for t, w in zip(got, want))
    assert got[0].dtype == got[2].dtype == torch.float32
    p = F.softmax(tokens @ m.router.t(), dim=-1)                                  # an FP32 reference
    assert torch.equal(got[2], p) and torch.equal(got[1], p.topk(2, dim=-1).indices)


def test_a_bf16_router_is_the_ablation_and_flips_decisions():
    """The same router in BF16 (``router_dtype``): its logits, softmax and top-k in BF16 change some tokens' experts;
    the layer's ``flipped`` counts them against the FP32 router (0 for the FP32 router itself)."""
    m = layer()
    x = torch.randn(4, 1024, C)
    tokens = x.reshape(-1, C)
    _, fp32, _ = m.route(tokens)
    m(x)
    assert m.flipped == 0.0
    m.router_dtype = torch.bfloat16
    w, bf16, p = m.route(tokens)
    assert w.dtype == torch.float32 and torch.equal(p, p.bfloat16().float())  # BF16 values, upcast
    want = sum(set(a) != set(b) for a, b in zip(fp32.tolist(), bf16.tolist())) / len(tokens)
    m(x)
    assert m.flipped == pytest.approx(want) and 0 < want < 0.2


def test_the_format_comes_from_the_recipe_region_the_autocast_or_the_weights():
    m, x = layer(), torch.randn(2, 8, C)
    assert m.format_in_effect(x).name == "fp32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.format_in_effect(x).name == "bf16"
    with course_autocast("cpu", dtype=torch.float16):
        assert m.format_in_effect(x).name == "fp16"
    for recipe, name in [(quant.Float8RowwiseScaling(), "fp8-rowwise"), (quant.Float8BlockScaling(), "fp8-block"),
                         (quant.MXFP8BlockScaling(), "mxfp8"), (quant.MXFP8BlockScaling(scale_rule="floor"), "mxfp8")]:
        with quant.autocast(enabled=True, recipe=recipe):
            f = m.format_in_effect(x)
        assert f.name == name and f.recipe == recipe                             # the region's own fields
    with quant.autocast(enabled=True, recipe=quant.CurrentScaling()):
        with pytest.raises(ValueError, match="Float8RowwiseScaling\\(\\), Float8BlockScaling\\(\\) or MXFP8"):
            m.format_in_effect(x)
    assert layer().bfloat16().format_in_effect(x.bfloat16()).name == "bf16"
    m.expert_format = "mxfp8"
    assert m.format_in_effect(x).name == "mxfp8"


@pytest.mark.parametrize("fmt", ["bf16", "fp8-rowwise", "fp8-block", "mxfp8"])
def test_low_precision_experts_stay_close_to_fp32(fmt):
    m, x = layer(), torch.randn(4, 64, C)
    ref = m(x)
    m.expert_format = fmt
    y = m(x).float()
    assert (y - ref).norm() / ref.norm() < 0.08


def test_balance_loss_is_switch_transformers_and_counts_are_recorded():
    m = layer()
    x = torch.randn(4, 64, C)
    m(x)
    p = F.softmax(x.reshape(-1, C) @ m.router.t(), dim=-1)
    onehot = F.one_hot(p.topk(2, dim=-1).indices, E).float().sum(1)              # (S, E)
    want = E * ((onehot.sum(0) / onehot.sum()) * p.mean(0)).sum()
    torch.testing.assert_close(m.aux_loss, want)
    assert m.tokens_per_expert.tolist() == onehot.sum(0).long().tolist() and m.routed.sum() == 512
    m.eval()
    m(x)
    assert m.routed.sum() == 512                                                  # evaluation is not counted
    uniform = layer()
    uniform.router.data.zero_()                                                   # equal probabilities: P_e = 1/E
    uniform(x)
    assert uniform.aux_loss.item() == pytest.approx(1.0)


def test_expert_width_and_bad_arguments():
    assert expert_hidden(128, 2) == 256 and expert_hidden(128, 1) == 512 and expert_hidden(96, 2) == 256
    assert expert_hidden(128, 2, 64) == 64
    with pytest.raises(ValueError, match="top_k must lie in"):
        MoEFeedForward(C, H, 4, top_k=5)
