"""Low-precision AdamW state (``LowPrecisionState``): the second moment's decay against FP32 ``torch.optim.AdamW``.

Oracle: torch.optim.AdamW with FP32 state on the same parameters and gradients. With zero gradients AdamW's
moments decay geometrically (m *= beta1, v *= beta2). Rounded to nearest in BF16, ``v * 0.999`` rounds back to
``v`` (a relative change of 2**-10, under half of BF16's 2**-8 spacing): the stall the stochastic rounding fixes.
"""
import copy

import pytest
import torch

from mpcourse.core.optim.state import LowPrecisionState

QUIET = 500


def _loud_then_quiet(opt_cls, seed=0, n=2048, quiet=QUIET, **kw):
    """One step with gradients of magnitude ~1, then ``quiet`` steps with zero gradients; returns (p, state)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    opt = opt_cls([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw)
    p.grad = 0.5 + torch.rand(n, generator=g)                 # (n,) fp32 in [0.5, 1.5)
    opt.step()
    p.grad = torch.zeros(n)
    for _ in range(quiet):
        opt.step()
    return p, opt.state[p]


def test_nearest_moments_stall_where_fp32_decays():
    """The failure the stochastic rounding exists for, measured against torch's FP32 AdamW."""
    _, ref = _loud_then_quiet(torch.optim.AdamW)
    _, low = _loud_then_quiet(LowPrecisionState(torch.optim.AdamW, torch.bfloat16))
    ratio = (low["exp_avg_sq"].double() / ref["exp_avg_sq"].double()).mean().item()
    assert ratio == pytest.approx(0.999 ** -QUIET, rel=2e-3)      # ~1.65: v never moved
    assert low["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_moments_decay_as_fp32(dtype):
    p_ref, ref = _loud_then_quiet(torch.optim.AdamW)
    p_low, low = _loud_then_quiet(LowPrecisionState(torch.optim.AdamW, dtype, rounding="stochastic"))
    assert low["exp_avg_sq"].dtype == low["exp_avg"].dtype == dtype
    ratio = low["exp_avg_sq"].double() / ref["exp_avg_sq"].double()
    assert ratio.mean().item() == pytest.approx(1.0, abs=5e-3)     # unbiased: the mean decays as FP32's
    assert ratio.std().item() < 0.1                                # each element near its FP32 value


def test_stochastic_rounding_lands_on_a_neighbour_of_the_fp32_step():
    """From the same stored state, one step: each stored moment is one of the two BF16 neighbours of FP32
    AdamW's (torch's nearest cast and the next BF16 value on the other side of it), and both occur."""
    low_cls = LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding="stochastic", seed=3)
    p, st = _loud_then_quiet(low_cls, quiet=3)
    p2 = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([p2], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref.state[p2] = {k: v.float().clone() if v.dim() else v.clone() for k, v in st.items()}
    opt = low_cls([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.state[p] = st
    p.grad = torch.linspace(-1e-3, 1e-3, p.numel())
    p2.grad = p.grad.clone()
    opt.step()
    ref.step()
    for k in ("exp_avg", "exp_avg_sq"):
        exact = ref.state[p2][k]                                   # fp32
        near = exact.to(torch.bfloat16)
        away = torch.where(near.float() < exact, torch.full_like(near, float("inf")), torch.full_like(near, -float("inf")))
        other = torch.where(near.float() == exact, near, torch.nextafter(near, away))
        got = opt.state[p][k]
        assert got.dtype == torch.bfloat16
        assert bool(((got == near) | (got == other)).all())
        assert bool(((got == other) & (other != near)).any()) and bool((got == near).any())


def test_stochastic_state_dict_resumes_the_draws():
    cls = LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding="stochastic", seed=1)
    p, _ = _loud_then_quiet(cls, quiet=0)
    p_a = torch.nn.Parameter(p.detach().clone())
    a = cls([p_a], lr=1e-3)
    a.state[p_a] = {}
    for _ in range(3):
        p_a.grad = torch.ones_like(p_a)
        a.step()
    sd = copy.deepcopy(a.state_dict())
    assert "low_precision_rng" in sd
    p_b = torch.nn.Parameter(p_a.detach().clone())
    b = cls([p_b], lr=1e-3)
    b.load_state_dict(sd)
    for opt, q in ((a, p_a), (b, p_b)):
        for _ in range(5):
            q.grad = torch.full_like(q, 1e-2)
            opt.step()
    assert torch.equal(a.state[p_a]["exp_avg_sq"], b.state[p_b]["exp_avg_sq"])
    assert torch.equal(p_a, p_b)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rounding"):
        LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding="up")
    with pytest.raises(TypeError, match="seed"):
        LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding="stochastic", seed=1.5)


def test_sr_recipe_stores_bf16_moments_rounded_stochastically_and_is_not_in_the_default_run():
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.recipes import RECIPES, default_recipes
    from mpcourse.experiment.training.train import TrainConfig, Trainer

    assert "bf16-master-bf16-moments-sr" in RECIPES and "bf16-master-bf16-moments-sr" not in default_recipes()
    assert "stochastic" in RECIPES["bf16-master-bf16-moments-sr"].description
    assert "nearest" in RECIPES["bf16-master-bf16-moments"].description
    cfg = TrainConfig(steps=2, batch_size=2, eval_interval=100, eval_batches=1,
                      model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    corpus = load_corpus()
    runs = {n: Trainer(n, corpus, cfg) for n in ("bf16-master-bf16-moments", "bf16-master-bf16-moments-sr")}
    for t in runs.values():
        t.run()
    states = {n: [s for st in t.recipe.master.optimizer.state.values() for k, s in st.items() if k == "exp_avg_sq"]
              for n, t in runs.items()}
    assert all(v.dtype == torch.bfloat16 for vs in states.values() for v in vs)
    assert any(not torch.equal(a, b) for a, b in zip(*states.values()))       # the rounding differs
    sd = runs["bf16-master-bf16-moments-sr"].recipe.state_dict()
    assert "low_precision_rng" in sd["master"]["optimizer"]
