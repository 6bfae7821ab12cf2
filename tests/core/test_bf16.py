"""mpcourse.core.bf16: stochastic rounding, Kahan-compensated updates and the BF16Optimizer wrapper.

Oracles: torch's own BF16 casts and ``torch.nextafter`` (the two neighbours of a value), the binomial
distribution (unbiasedness, within 3 sigma), an FP64 exact sum (Kahan), and ``torch.optim.AdamW`` /
``torch.nn.utils.clip_grad_norm_`` run in FP32 on copies side by side.
"""
import copy
import math

import pytest
import torch

from mpcourse.core.bf16 import BF16Optimizer, kahan_add_, stochastic_round_bf16
from mpcourse.course.grading.formats import rounding_cases


def torch_neighbours(x):
    """(lo, hi) BF16 neighbours of float32 x from torch's cast and nextafter (lo == hi when representable)."""
    rn = x.to(torch.bfloat16)                                           # nearest, ties to even
    up = torch.nextafter(rn, torch.full_like(rn, math.inf))
    down = torch.nextafter(rn, torch.full_like(rn, -math.inf))
    other = torch.where(x > rn.float(), up, down).float()
    other = torch.where(x == rn.float(), rn.float(), other)
    return torch.minimum(rn.float(), other), torch.maximum(rn.float(), other)


def test_result_is_always_one_of_the_two_neighbours():
    x = rounding_cases("bf16", n_random=20_000)                        # every bf16 value, ties, +-1 ulp, specials
    finite = x.isfinite() & (x.abs() < 3.3e38)                         # overflow region tested separately
    x = x[finite]
    lo, hi = torch_neighbours(x)
    for seed in range(3):
        r = stochastic_round_bf16(x, torch.Generator().manual_seed(seed))
        assert r.dtype == torch.bfloat16 and r.shape == x.shape
        r = r.float()
        assert bool(((r == lo) | (r == hi)).all())
    exact = lo == hi
    assert torch.equal(stochastic_round_bf16(x[exact], torch.Generator()).float(), x[exact])


def test_specials_and_sign():
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0 - 1e-3])
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert r[0].isnan() and r[1] == math.inf and r[2] == -math.inf
    assert torch.equal(r[3:5].view(torch.int32), torch.tensor([0.0, -0.0]).view(torch.int32))
    assert float(r[5]) in (-1.0, -1.0078125)
    # just below the overflow point: rounds to max or (carry) inf, as round_to's stochastic policy
    big = torch.full((2000,), 3.3961e38)
    out = stochastic_round_bf16(big, torch.Generator().manual_seed(0)).float()
    bmax = torch.finfo(torch.bfloat16).max
    assert set(out.unique().tolist()) == {bmax, math.inf}


@pytest.mark.parametrize("x", [1 + 1e-3, -3.0e-3, 257.0, 1.7e-39, 12345.678, 0.1])
def test_unbiased_within_3_sigma(x):
    n = 200_000
    xs = torch.full((n,), x)
    lo, hi = torch_neighbours(xs[:1])
    lo, hi = float(lo), float(hi)
    p = (float(xs[0]) - lo) / (hi - lo)                                # exact probability of rounding to hi
    r = stochastic_round_bf16(xs, torch.Generator().manual_seed(1)).double()
    frac_hi = float((r == hi).double().mean())
    sigma_p = math.sqrt(p * (1 - p) / n)
    assert abs(frac_hi - p) < 3 * sigma_p
    assert abs(float(r.mean()) - float(xs[0])) < 3 * sigma_p * (hi - lo)


def test_seeded_generator_is_reproducible_and_advances():
    x = torch.randn(1000) * 1e-2 + 1
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    b = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    c1, c2 = stochastic_round_bf16(x, g), stochastic_round_bf16(x, g)
    assert torch.equal(a, b) and torch.equal(a, c1) and not torch.equal(c1, c2)


def test_refuses_non_fp32():
    with pytest.raises(TypeError, match=r"\.float\(\)"):
        stochastic_round_bf16(torch.ones(3, dtype=torch.bfloat16))


def test_kahan_recovers_the_fp64_sum_where_plain_bf16_stalls():
    g = torch.Generator().manual_seed(0)
    updates = (torch.rand(2000, 64, generator=g) * 2e-3 - 0.5e-3)      # small, mostly positive, fp32
    w = torch.ones(64, dtype=torch.bfloat16)
    comp = torch.zeros_like(w)
    naive = torch.ones(64, dtype=torch.bfloat16)
    for u in updates:
        kahan_add_(w, comp, u)
        naive = (naive.float() + u).to(torch.bfloat16)
    exact = 1 + updates.double().sum(0)                                # fp64 reference, ~2.0
    kahan_err = (w.double() + comp.double() - exact).abs().max()
    assert float(kahan_err) < 1e-3                                     # vs a sum of 1.0: plain bf16 loses it
    assert float((w.double() - exact).abs().max()) <= 2 ** -6          # w itself within one bf16 step (at ~2)
    assert float((naive.double() - exact).abs().min()) > 0.3           # naive: every update below half a step
    assert w.dtype == comp.dtype == torch.bfloat16


def test_kahan_refuses_fp32_buffers():
    with pytest.raises(TypeError, match="bf16"):
        kahan_add_(torch.ones(2), torch.zeros(2), torch.ones(2))


# -- the optimizer wrapper --------------------------------------------------------------------------------
def bf16_params(seed=0, shapes=((8, 4), (4,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g)).to(torch.bfloat16)) for s in shapes]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(torch.bfloat16)


def test_refuses_fp32_params_unknown_rounding_and_closures():
    with pytest.raises(ValueError, match="bfloat16"):
        BF16Optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    with pytest.raises(ValueError, match="rounding must be"):
        BF16Optimizer(torch.optim.AdamW(bf16_params()), rounding="truncate")
    opt = BF16Optimizer(torch.optim.AdamW(bf16_params()))
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="kahan=True with rounding='nearest'"):
        BF16Optimizer(torch.optim.AdamW(bf16_params()), rounding="kahan")
    with pytest.raises(ValueError, match="rounding='nearest'"):
        BF16Optimizer(torch.optim.AdamW(bf16_params()), kahan=True)      # default rounding is stochastic


def test_nearest_step_equals_fp32_adamw_then_torch_cast():
    """Oracle: torch.optim.AdamW on FP32 copies, one step, weights and state cast to BF16 by torch."""
    params = bf16_params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = BF16Optimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), rounding="nearest")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    set_grads(params, 0)
    for p, r in zip(params, ref):
        r.grad = p.grad.float()
    opt.step()
    ref_opt.step()
    for p, r in zip(params, ref):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), r.detach().to(torch.bfloat16))
        st, rs = opt.state[p], ref_opt.state[r]
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == torch.bfloat16 and torch.equal(st[k], rs[k].to(torch.bfloat16))
        assert st["step"].dtype == torch.float32


def test_stochastic_step_lands_on_a_neighbour_of_the_fp32_result():
    params = bf16_params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = BF16Optimizer(torch.optim.SGD(params, lr=1e-2, momentum=0.9), rounding="stochastic", seed=3)
    ref_opt = torch.optim.SGD(ref, lr=1e-2, momentum=0.9)
    set_grads(params, 0)
    for p, r in zip(params, ref):
        r.grad = p.grad.float()
    opt.step()
    ref_opt.step()
    for p, r in zip(params, ref):
        lo, hi = torch_neighbours(r.detach())
        w = p.detach().float()
        assert bool(((w == lo) | (w == hi)).all())
        assert opt.state[p]["momentum_buffer"].dtype == torch.bfloat16   # any optimizer's state


def test_kahan_step_keeps_weight_plus_compensation_on_the_fp32_trajectory():
    """SGD without momentum: the FP32 trajectory is w0 - lr * sum(g). Kahan keeps w + comp on it."""
    p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opt = BF16Optimizer(torch.optim.SGD([p], lr=1.0), rounding="nearest", kahan=True)
    nearest_p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    nearest = BF16Optimizer(torch.optim.SGD([nearest_p], lr=1.0), rounding="nearest")
    exact = torch.ones(256, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        grad = -(torch.rand(256, generator=g) * 1e-3)                  # updates of up to 1e-3 < half a step
        p.grad, nearest_p.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16)
        exact -= grad.to(torch.bfloat16).double()
        opt.step(), nearest.step()
        opt.zero_grad(), nearest.zero_grad()
    assert float((p.detach().double() + opt.comp[0].double() - exact).abs().max()) < 1e-3
    assert torch.equal(nearest_p.detach(), torch.ones_like(nearest_p))  # every update lost
    assert nearest.lost == nearest.changed == 256
    assert opt.extra_bytes() == 256 * 2


def test_fp32_grad_accumulation_and_clipping_match_torch():
    params = bf16_params()
    opt = BF16Optimizer(torch.optim.SGD(params, lr=1.0))
    ref = [torch.zeros(p.shape) for p in params]
    for k in range(5):                                                 # five micro-batches
        set_grads(params, k)
        for r, p in zip(ref, params):
            r += p.grad.float()
        opt.accumulate_grads()
        assert all(p.grad is None for p in params)
    assert all(torch.equal(g, r) and g.dtype == torch.float32 for g, r in zip(opt.grads, ref))
    copies = [torch.nn.Parameter(torch.zeros(r.shape)) for r in ref]
    for c, r in zip(copies, ref):
        c.grad = r.clone()
    want = torch.nn.utils.clip_grad_norm_(copies, 0.01)
    got = opt.clip_grad_norm_(0.01)
    assert got == pytest.approx(float(want), rel=1e-6)
    for g, c in zip(opt.grads, copies):
        torch.testing.assert_close(g, c.grad, rtol=1e-6, atol=0)
    assert opt.grad_bytes() == sum(p.numel() * 4 for p in params)
    opt.zero_grad()
    assert opt.grad_bytes() == 0


def test_bf16_grads_when_asked():
    params = bf16_params()
    opt = BF16Optimizer(torch.optim.SGD(params, lr=1.0), rounding="nearest", fp32_grads=False)
    set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    opt.step()
    for p, b, g in zip(params, before, grads):
        assert torch.equal(p.grad, g)                                  # left in place, bf16
        assert torch.equal(p.detach(), (b.float() - g.float()).to(torch.bfloat16))


@pytest.mark.parametrize("rounding,kahan", [("nearest", False), ("stochastic", False), ("nearest", True)])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_state_dict_resumes_bit_for_bit(rounding, kahan, state_dtype):
    def build(seed):
        params = bf16_params(seed)
        return params, BF16Optimizer(torch.optim.AdamW(params, lr=1e-3), rounding=rounding, kahan=kahan, seed=seed,
                                     state_dtype=state_dtype)

    def run(params, opt, steps, start):
        for k in range(start, start + steps):
            set_grads(params, k)
            opt.step()
            opt.zero_grad()

    full_p, full = build(0)
    run(full_p, full, 6, 0)
    a_p, a = build(0)
    run(a_p, a, 3, 0)
    ckpt = copy.deepcopy({"params": [p.detach() for p in a_p], "opt": a.state_dict()})
    b_p, b = build(1)                                                  # other weights, other seed: replaced
    with torch.no_grad():
        for p, s in zip(b_p, ckpt["params"]):
            p.copy_(s)
    b.load_state_dict(ckpt["opt"])
    run(b_p, b, 3, 3)
    for p, q in zip(b_p, full_p):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(b_p, full_p):
        for k in ("exp_avg", "exp_avg_sq"):
            assert b.state[p][k].dtype == state_dtype and torch.equal(b.state[p][k], full.state[q][k])
    if kahan:
        assert all(torch.equal(x, y) for x, y in zip(b.comp, full.comp))
    other = dict(rounding="stochastic") if (rounding, kahan) == ("nearest", False) else dict(rounding="nearest")
    with pytest.raises(ValueError, match="rounding="):
        BF16Optimizer(torch.optim.AdamW(bf16_params()), **other).load_state_dict(ckpt["opt"])
