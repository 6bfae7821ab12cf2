"""The GPT's mixture-of-experts switch (``GPTConfig.n_experts``): the dense model is untouched, the MoE model reports
the cross-entropy as its loss while its gradient carries the load-balancing loss, and it trains in every format."""
import pytest
import torch
import torch.nn.functional as F

from mpcourse.core import quant
from mpcourse.core.experts.layer import MoEFeedForward
from mpcourse.experiment.gpt.model import GPT, MLP, GPTConfig


def batch(seed=0, B=4, T=64, V=103):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def test_the_dense_default_builds_the_same_modules_and_draws_the_same_init():
    """n_experts=0 (the default) has the dense MLPs and the parameter list and values the dense model always had;
    the same seed gives the same init with the switch's fields present or not (they draw nothing)."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig())
    assert all(isinstance(b.mlp, MLP) for b in dense.blocks)
    names = [n for n, _ in dense.named_parameters()]
    assert names[:4] == ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias"]
    assert not any("router" in n or "w_in" in n for n in names) and len(names) == 2 + 5 * 12 + 2
    torch.manual_seed(0)
    again = GPT(GPTConfig(top_k=1, expert_hidden=64, shared_expert=True, aux_loss_coef=0.5))   # inert without experts
    assert all(torch.equal(a, b) for a, b in zip(dense.state_dict().values(), again.state_dict().values()))


def test_the_reported_loss_is_the_cross_entropy_and_the_gradient_has_the_balance_loss():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_experts=4, top_k=2, n_layer=2))
    idx, tgt = batch()
    logits, loss = m(idx, tgt)
    assert loss.item() == F.cross_entropy(logits.float().view(-1, 103), tgt.view(-1)).item()
    loss.backward()
    with_balance = m.blocks[0].mlp.router.grad.clone()
    m.zero_grad()
    m.cfg.aux_loss_coef = 0.0
    m(idx, tgt)[1].backward()
    plain = m.blocks[0].mlp.router.grad
    m.zero_grad()
    m(idx, tgt)                                                                     # the blocks' aux_loss again
    balance = torch.autograd.grad(0.01 * m.aux_loss(), m.blocks[0].mlp.router)[0]
    torch.testing.assert_close(with_balance, plain + balance)
    with torch.no_grad():
        assert m(idx, tgt)[1].item() == loss.item()                                # evaluation: the same number


@pytest.mark.parametrize("fmt, region", [("fp32", None), ("bf16", "bf16"), ("fp8-rowwise", quant.Float8RowwiseScaling()),
                                         ("fp8-block", quant.Float8BlockScaling()),
                                         ("mxfp8", quant.MXFP8BlockScaling())])
def test_the_moe_model_trains_in_every_format(fmt, region):
    """A few AdamW steps on one batch lower the loss; the experts ran in the format the region gives, and every block
    routed all 4 x 64 x 2 assignments."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_experts=4, top_k=2, shared_expert=True, n_layer=1))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    idx, tgt = batch()
    losses = []
    for _ in range(3):
        if region is None:
            ctx = torch.autocast("cpu", enabled=False)
        elif region == "bf16":
            ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            ctx = quant.autocast(enabled=True, recipe=region)
        with ctx:
            assert m.blocks[0].mlp.format_in_effect(torch.zeros(1, 128)).name == fmt
            loss = m(idx, tgt)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert all(isinstance(b.mlp, MoEFeedForward) and b.mlp.tokens_per_expert.sum() == 4 * 64 * 2 for b in m.blocks)


def test_moe_config_errors():
    for kw in ({"n_experts": -1}, {"n_experts": 4, "top_k": 5}, {"n_experts": 4, "top_k": 0}, {"expert_hidden": -8}):
        with pytest.raises(ValueError, match="top_k <= n_experts"):
            GPTConfig(**kw)
