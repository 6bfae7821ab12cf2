"""A gradient that stops: blockwise 8-bit AdamW state (``BlockQuantizedAdamW``, recipes ``fp8-moments`` and
``int8-moments``) against FP32 ``torch.optim.AdamW`` on constructed coordinates.

The case (a rare token's embedding row, a sparse feature): in one block of 256, coordinate 0 gets gradient 1 every
step (the block's largest), coordinate 1 gets a small gradient ``ratio`` for 50 steps and then 0. Stored as it is,
coordinate 1's second moment sits ``ratio**2`` under the block's largest: under half of E4M3's smallest code
(half of 2**-9 / 448 = 2.2e-6 of the block's amax) for ratio 1e-3, under half of the 8-bit unsigned map's smallest
positive value (3.25e-7) for ratio 3e-4 and less. It is stored as exactly 0 while the first moment (``ratio`` under
its block's largest) survives, and once the gradient is 0 the step is ``lr * m_hat / eps``: thousands to tens of
thousands of ``lr`` (torchao's ``AdamWFp8`` / ``AdamW8bit`` do the same: tests/core/test_optim_state_torchao.py).

Oracle: FP32 AdamW on the same coordinates steps 0.91 lr after the stop, then less (m decays by beta1 = 0.9).
Bound: every step of the stopped coordinate within 2x FP32 AdamW's largest step over the same 30 steps (1.8 lr).
(Per step the ratio to FP32's grows: where 0.9 m rounds back to m, the 8-bit default's step stays 0.85 lr while
FP32's decays; bounded, and not the failure tested here: ``mpcourse.core.optim.blockwise``.)
Quantization moves each moment by a relative rounding error (E4M3: 2**-4; the 8-bit map's coarsest decade:
under 50%), so 2x is "the same step up to rounding"; the failure is 4 orders of magnitude over it. It is also
under Adam's own bound lr * (1 - beta1) / sqrt(1 - beta2) = 3.16 lr (Kingma & Ba 2015, arXiv 1412.6980,
section 2.1). From below: the course's default must not starve the coordinate either (its first step after the
stop at least half FP32's): a rule that merely never stores 0 for v, storing v itself, rounds v up to the smallest
code and steps 0.43 lr (FP8, ratio 1e-3) or 0.14 lr (8-bit, ratio 1e-4) where FP32 steps 0.91 lr.
"""
import math

import pytest
import torch

from mpcourse.core.optim.blockwise import STATE_RULES, BlockQuantizedAdamW

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
ON, OFF, N = 50, 30, 4096          # steps with the small gradient, steps after it stopped, elements (quantized)


def _stopped(make, ratio, alternate=False):
    """Steps (in units of lr) of coordinate 1 over the OFF steps after its gradient stopped, and the optimizer.
    Coordinate 0 gets 1 (``alternate``: +1, -1, ...: a large v under a small m) every step; the rest 0."""
    p = torch.zeros(N, requires_grad=True)
    opt = make([p])
    steps = []
    for t in range(ON + OFF):
        g = torch.zeros(N)
        g[0] = (-1.0) ** t if alternate else 1.0
        g[1] = ratio if t < ON else 0.0
        before = p.detach()[1].item()
        p.grad = g
        opt.step()
        steps.append(abs(p.detach()[1].item() - before) / LR)
    return steps[ON:], opt, p


def _fp32(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False)


def _blockwise(fmt, **kw):
    return lambda params: BlockQuantizedAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fmt=fmt, **kw)


# (fmt, ratio): the brief's ratios (FP8 1e-3, 8-bit 1e-4) and the decades around them where the stored v underflows
CASES = [("fp8", 1e-3), ("fp8", 1e-4), ("fp8", 1e-5), ("int8", 3e-4), ("int8", 1e-4), ("int8", 1e-6)]


@pytest.mark.parametrize("fmt, ratio", CASES)
def test_stopped_coordinate_steps_as_fp32_adamw(fmt, ratio):
    ref, _, _ = _stopped(_fp32, ratio)
    assert 0.85 < max(ref) < 0.95 and ref[-1] < 0.1 * ref[0]          # the oracle: 0.91 lr, then decaying
    ours, opt, p = _stopped(_blockwise(fmt), ratio)
    assert opt.quantizes(p)
    assert max(ours) <= 2 * max(ref), f"{fmt} ratio {ratio}: step {max(ours):.3g} lr, FP32 AdamW {max(ref):.2f} lr"
    assert ours[0] >= 0.5 * ref[0], f"{fmt} ratio {ratio}: starved, {ours[0]:.3g} lr against FP32's {ref[0]:.2f} lr"
    assert max(ours) < (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])       # Adam's bound, 3.16 (in lr)


@pytest.mark.parametrize("fmt, ratio", [("fp8", 1e-6), ("int8", 1e-7)])
def test_stopped_coordinate_under_a_noisy_block_is_bounded(fmt, ratio):
    """Coordinate 0 alternates +1, -1: its v is 1 while its m is ~0.05, so coordinate 1's sqrt(v) sits further
    under its block's largest than its m does. Storing sqrt(v) alone lets it round to 0 here (FP8: 83 lr,
    8-bit: 2.7 lr, measured); the smallest positive code for a positive v keeps the step bounded."""
    ref, _, _ = _stopped(_fp32, ratio, alternate=True)
    ours, _, _ = _stopped(_blockwise(fmt), ratio, alternate=True)
    assert max(ours) <= 2 * max(ref) and 0.8 < max(ref) < 0.95


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_torchao_rule_keeps_the_blow_up(fmt):
    """The torchao-exact rule is still reachable, failure included: v stored as 0 under a surviving m."""
    ratio = 1e-3 if fmt == "fp8" else 1e-4
    theirs, opt, p = _stopped(_blockwise(fmt, state_rule="torchao"), ratio)
    assert max(theirs) > 1e3
    m, v = opt.moments(p)
    assert m[1] != 0 and v[1] == 0


def _heavy_tailed_run(opt, p, steps=60, seed=0):
    """Gradients whose per-coordinate size spans ~4 decades, a third of the coordinates present 5% of the steps
    (sparse features); yields after every step."""
    gen = torch.Generator().manual_seed(seed)
    n = p.numel()
    size = torch.exp(2.0 * torch.randn(n, generator=gen))                     # (n,) lognormal
    rate = torch.where(torch.rand(n, generator=gen) < 0.3, 0.05, 1.0)
    for _ in range(steps):
        present = (torch.rand(n, generator=gen) < rate).float()
        p.grad = (0.5 + torch.randn(n, generator=gen)) * size * present
        opt.step()
        yield


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_no_zero_second_moment_under_a_surviving_first_moment(fmt):
    """The rule's invariant, after every step of a heavy-tailed sparse run: wherever the stored m is nonzero the
    stored v is positive (torchao's rule breaks it in the same run, which is why it is a test)."""
    broken = {}
    for rule in STATE_RULES:
        p = torch.zeros(N, requires_grad=True)
        opt = _blockwise(fmt, state_rule=rule)([p])
        broken[rule] = 0
        for _ in _heavy_tailed_run(opt, p):
            m, v = opt.moments(p)
            broken[rule] += int(((m != 0) & (v == 0)).sum())
    assert broken["sqrt-nonzero"] == 0 and broken["torchao"] > 0, broken


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_heavy_tailed_run_stays_near_fp32_adamw(fmt):
    """The whole trajectory, not one coordinate: the displacement after 60 steps of the heavy-tailed sparse run
    against FP32 AdamW's (measured: default 0.08 FP8, 0.12 8-bit relative error; torchao's rule 5e6 and 1e6)."""
    p_ref, p = torch.zeros(N, requires_grad=True), torch.zeros(N, requires_grad=True)
    ref, opt = _fp32([p_ref]), _blockwise(fmt)([p])
    for _ in zip(_heavy_tailed_run(ref, p_ref), _heavy_tailed_run(opt, p)):
        pass
    err = ((p - p_ref).norm() / p_ref.norm()).item()
    assert err < 0.3, err


def _fp32_closed_form(ratio, on, k):
    """FP32 AdamW's step (in lr) k steps after a constant gradient ``ratio`` stopped after ``on`` steps, in float64:
    m = ratio (1 - b1**on) b1**k, v = ratio**2 (1 - b2**on) b2**k, bias-corrected at t = on + k + 1."""
    b1, b2 = BETAS
    t = on + k + 1
    m = ratio * (1 - b1 ** on) * b1 ** (k + 1)
    v = ratio ** 2 * (1 - b2 ** on) * b2 ** (k + 1)
    return (m / (1 - b1 ** t)) / (math.sqrt(v / (1 - b2 ** t)) + EPS)


def test_lesson_table_of_the_stopped_coordinate():
    """``moment_decay.stopped_gradient_steps`` (lesson 11's side-by-side): the FP32 row against Adam's closed form,
    torchao's rows blown up, the default's rows within 2x of FP32's."""
    from mpcourse.core.optim.moment_decay import STOPPED_RULES, stopped_gradient_steps, stopped_gradient_table
    steps = stopped_gradient_steps(ratio=1e-4, on_steps=50, after=5)
    assert list(steps) == [label for label, _, _ in STOPPED_RULES] and all(len(r) == 5 for r in steps.values())
    exact = [_fp32_closed_form(1e-4, 50, k) for k in range(5)]
    assert steps["fp32 AdamW"] == pytest.approx(exact, rel=1e-5)
    assert min(steps["fp8 torchao"] + steps["int8 torchao"]) > 1e3
    for label in ("fp8 sqrt-nonzero", "int8 sqrt-nonzero"):
        assert max(steps[label]) <= 2 * exact[0] and steps[label][0] >= 0.5 * exact[0]
    table = stopped_gradient_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(STOPPED_RULES)
    assert lines[2].split()[2:] == [f"{float(f'{x:.3g}'):.3g}" for x in exact]     # "fp32 AdamW" is two words


@pytest.mark.parametrize("bad, msg", [(dict(numel=1000), "numel must be a multiple of 256"),
                                      (dict(after=0), "on_steps and after must be at least 1")])
def test_lesson_table_refuses_what_would_show_nothing(bad, msg):
    from mpcourse.core.optim.moment_decay import stopped_gradient_steps
    with pytest.raises(ValueError, match=msg):
        stopped_gradient_steps(**bad)


def test_unknown_state_rule_names_the_choices():
    with pytest.raises(ValueError, match="state_rule must be one of"):
        BlockQuantizedAdamW([torch.zeros(4, requires_grad=True)], state_rule="sqrt")
    assert STATE_RULES == ("sqrt-nonzero", "torchao")


@pytest.mark.parametrize("saved_fmt, load_fmt", [("fp8", "int8"), ("int8", "fp8")])
def test_state_stored_in_another_format_is_refused(saved_fmt, load_fmt):
    """FP8 codes loaded into an int8 optimizer (or the reverse) used to load, then fail with an IndexError or read
    the codes as the other format's; refused before anything loads, naming the fmt to build."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = BlockQuantizedAdamW([p], fmt=saved_fmt)
    p.grad = torch.randn(64, 64)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    other = BlockQuantizedAdamW([q], fmt=load_fmt)
    with pytest.raises(ValueError, match=rf"stored with fmt={saved_fmt!r} and this optimizer uses fmt={load_fmt!r}: "
                                         rf"build BlockQuantizedAdamW\(\.\.\., fmt={saved_fmt!r}\)"):
        other.load_state_dict(opt.state_dict())
    assert not other.state                                           # nothing loaded
    same = BlockQuantizedAdamW([q], fmt=saved_fmt)
    same.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(same.moments(q), opt.moments(p)))
