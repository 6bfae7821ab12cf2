"""No inf or NaN reaches the optimizer, in any configuration of the loss scalers; checkpoints validated on load.

Oracles: exact arithmetic (an fp32 gradient times an fp32 1/S, computed in float64, is exact; rounding it once to
fp32 is the fused kernel's product), and torch.amp.GradScaler run side by side where it lets an inf through
(a scale below 1, where the fused ATen kernel checks g but not g / S; uncoalesced sparse gradients).
"""
import math

import numpy as np
import pytest
import torch

from mpcourse.core import kernels_switch, scaling
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler

BIG = 3.0e38  # finite in fp32 (max 3.4028e38); BIG / 0.5 is not


def param(values):
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))


def one_step(scaler, opt, w, grad):
    """Set w.grad to an already scaled gradient (as a backward of the scaled loss would leave it), step, update."""
    opt.zero_grad()
    scaler.scale(torch.ones(()))  # creates the scale tensor on first use
    w.grad = torch.as_tensor(grad, dtype=torch.float32).clone()
    out = scaler.step(opt)
    scaler.update()
    return out


@pytest.fixture(params=["fused", "fallback"])
def unscale_path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(scaling.fused, "HAS_FUSED_UNSCALE", False)
    with kernels_switch.flags(enabled=True):      # "fused": the kernel, whatever MPCOURSE_FUSED says
        yield request.param


@pytest.mark.parametrize("make", [
    lambda: DynamicLossScaler(init_scale=0.5),
    lambda: StaticLossScaler(0.5),
    lambda: DynamicLossScaler(init_scale=0.5, hysteresis=2, min_scale=2.0 ** -10),
], ids=["dynamic", "static", "dynamic-general-rule"])
def test_scale_below_one_set_by_hand_never_lets_inf_through(make, unscale_path):
    ours, w = make(), param([1.0, 2.0])
    opt = torch.optim.SGD([w], lr=1.0)
    assert one_step(ours, opt, w, [BIG, 1.0]) is None and ours.last_step_skipped
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    # the oracle's behaviour: torch.amp.GradScaler checks g (finite) and steps with g / S = inf
    ref, w_ref = torch.amp.GradScaler("cpu", init_scale=0.5), param([1.0, 2.0])
    one_step(ref, torch.optim.SGD([w_ref], lr=1.0), w_ref, [BIG, 1.0])
    assert torch.isinf(w_ref.detach()[0])


def test_scale_below_one_reached_by_backoff_and_by_update_new_scale(unscale_path):
    s, w = DynamicLossScaler(init_scale=2.0, backoff_factor=0.125, growth_interval=100), param([1.0])
    opt = torch.optim.SGD([w], lr=1.0)
    one_step(s, opt, w, [float("inf")])          # backoff: 2 -> 0.25
    assert s.get_scale() == 0.25
    assert one_step(s, opt, w, [BIG]) is None     # BIG / 0.25 overflows: skipped
    assert w.item() == 1.0 and s.get_scale() == 2.0 ** -5
    s.update(new_scale=1.0)  # back above 1 by hand; then below again by hand
    s.update(new_scale=torch.tensor(0.5))
    assert one_step(s, opt, w, [BIG]) is None and w.item() == 1.0
    assert s.get_scale() == 2.0 ** -4             # backed off from 0.5
    one_step(s, opt, w, [2.0 ** -4])               # a clean step below 1 still steps: g / S = 1 exactly
    assert w.item() == 0.0 and not s.last_step_skipped


def test_fused_optimizer_below_one_gets_unscaled_grads():
    """torch's fused Adam declares _step_supports_amp_scaling and divides by grad_scale itself: with S < 1 the
    division overflows inside the optimizer. Ours unscales first (products checked) and skips."""
    ours, w = DynamicLossScaler(init_scale=0.5), param([1.0, 2.0])
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    assert opt._step_supports_amp_scaling
    one_step(ours, opt, w, [BIG, 1.0])
    assert ours.last_step_skipped and torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    ref, w_ref = torch.amp.GradScaler("cpu", init_scale=0.5), param([1.0, 2.0])
    one_step(ref, torch.optim.Adam([w_ref], lr=0.1, fused=True), w_ref, [BIG, 1.0])
    assert not torch.isfinite(w_ref.detach()).all()


def test_uncoalesced_sparse_gradient_summing_to_inf_is_caught():
    """Two finite values at one index sum to inf when the optimizer coalesces: torch (which coalesces FP16 sparse
    gradients only) steps into inf; ours coalesces before the check and skips."""
    def sparse_grad():
        return torch.sparse_coo_tensor([[0, 0]], [BIG, BIG], (3,))  # uncoalesced: index 0 twice
    results = {}
    for name, s in [("ours", DynamicLossScaler(init_scale=1.0)), ("torch", torch.amp.GradScaler("cpu", 1.0))]:
        w = param([1.0, 2.0, 3.0])
        opt = torch.optim.SGD([w], lr=1.0)
        s.scale(torch.ones(()))
        w.grad = sparse_grad()
        s.step(opt)
        s.update()
        results[name] = w.detach().clone()
    assert torch.equal(results["ours"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.isinf(results["torch"][0])


def test_no_inf_reaches_the_optimizer_randomised(unscale_path):
    """Random scales 2**k (k in [-40, 40], also non-powers of two) and gradients up to the fp32 top: a step
    runs exactly when every g / S (the fp32 rounding of the exact float64 product) is finite, and then the
    optimizer sees exactly those values."""
    rng = np.random.default_rng(0)
    seen = {"skip": 0, "step": 0, "overflow_on_unscale": 0}
    for trial in range(150):
        scale = float(np.float32(2.0 ** rng.integers(-40, 41) * (1.0 if trial % 3 else rng.uniform(0.5, 2.0))))
        s = DynamicLossScaler(init_scale=scale, growth_interval=1000)
        g = np.float32(rng.choice([1.0, 1e30, 3e38], size=4) * rng.uniform(-1, 1, size=4))
        if rng.random() < 0.1:
            g[rng.integers(4)] = np.nan
        w = param([0.0] * 4)
        seen_by_opt = []

        class Recorder(torch.optim.SGD):
            def step(self, closure=None):
                seen_by_opt.append(w.grad.clone())
                return super().step(closure)
        opt = Recorder([w], lr=0.0)
        one_step(s, opt, w, torch.from_numpy(g))
        inv = float(torch.tensor(scale).double().reciprocal().float())
        with np.errstate(over="ignore", invalid="ignore"):
            exact = np.float32(g.astype(np.float64) * inv)  # one rounding of the exact product
        should_skip = not np.isfinite(exact).all()
        seen["overflow_on_unscale"] += should_skip and np.isfinite(g).all()
        assert s.last_step_skipped == should_skip, (trial, scale, g)
        if should_skip:
            seen["skip"] += 1
            assert not seen_by_opt
        else:
            seen["step"] += 1
            assert torch.equal(seen_by_opt[0], torch.from_numpy(exact))
    assert min(seen.values()) > 5  # all three kinds of case occurred


def test_common_path_is_one_fused_pass_and_the_second_check_only_below_one(monkeypatch):
    calls = {"fused": 0, "check": 0}
    fused, check = torch._amp_foreach_non_finite_check_and_unscale_, scaling.check.has_inf_or_nan

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", count("fused", fused))
    monkeypatch.setattr(scaling.check, "has_inf_or_nan", count("check", check))
    with kernels_switch.flags(enabled=True):      # the kernel, whatever MPCOURSE_FUSED says
        s, w = DynamicLossScaler(init_scale=4.0, backoff_factor=0.125), param([1.0])
    opt = torch.optim.SGD([w], lr=1.0)
    one_step(s, opt, w, [1.0])
    assert calls == {"fused": 1, "check": 0}  # S >= 1: 1/S <= 1 cannot overflow, one pass
    one_step(s, opt, w, [float("inf")])       # backoff to 0.5: from now on unscaling may overflow
    calls.update(fused=0, check=0)
    one_step(s, opt, w, [1.0])
    assert calls == {"fused": 0, "check": 1} and s.get_scale() == 0.5


# ----------------------------------------------------------------------------------------------------------
# load_state_dict validates exactly as the constructor does
# ----------------------------------------------------------------------------------------------------------
BAD = [  # (state_dict key, bad value, constructor keyword or None)
    ("scale", 0.0, "init_scale"), ("scale", float("nan"), "init_scale"), ("scale", -1.0, "init_scale"),
    ("scale", float("inf"), "init_scale"), ("scale", 1e-40, "init_scale"), ("scale", "65536", "init_scale"),
    ("growth_factor", 1.0, "growth_factor"), ("growth_factor", 0.5, "growth_factor"),
    ("growth_factor", float("nan"), "growth_factor"), ("growth_factor", float("inf"), "growth_factor"),
    ("backoff_factor", 0.0, "backoff_factor"), ("backoff_factor", 1.0, "backoff_factor"),
    ("backoff_factor", -0.5, "backoff_factor"), ("growth_interval", 0, "growth_interval"),
    ("growth_interval", -3, "growth_interval"), ("growth_interval", 2.5, "growth_interval"),
    ("hysteresis", 0, "hysteresis"), ("consecutive_hysteresis", "yes", "consecutive_hysteresis"),
    ("min_scale", 2.0 ** 20, "min_scale"), ("max_scale", 1.0, "max_scale"), ("min_scale", 0.0, "min_scale"),
    ("_growth_tracker", -1, None), ("_growth_tracker", 7, None), ("_hysteresis_tracker", 0, None),
    ("_hysteresis_tracker", 4, None), ("skipped_steps", -1, None),
]


def trained_scaler():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=7, hysteresis=3)
    w = param([1.0])
    opt = torch.optim.SGD([w], lr=1.0)
    for g in [1.0, float("inf"), 1.0]:
        one_step(s, opt, w, [g])
    return s


@pytest.mark.parametrize("key, value, ctor_kw", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_load_state_dict_validates_as_the_constructor(key, value, ctor_kw):
    if ctor_kw is not None:
        with pytest.raises((ValueError, TypeError), match=ctor_kw.lstrip("_")):
            DynamicLossScaler(**{ctor_kw: value})
    s = trained_scaler()
    before = s.state_dict()
    bad = {**before, key: value}
    with pytest.raises((ValueError, TypeError), match=key.lstrip("_") if key != "scale" else "scale"):
        s.load_state_dict(bad)
    assert s.state_dict() == before  # unchanged, also the live tensors
    assert s._scale.item() == before["scale"] and s._growth_tracker.item() == before["_growth_tracker"]


def test_load_state_dict_refuses_wrong_keys_and_types():
    s = trained_scaler()
    before = s.state_dict()
    with pytest.raises(ValueError, match="missing keys \\['growth_factor'\\]"):
        s.load_state_dict({k: v for k, v in before.items() if k != "growth_factor"})
    with pytest.raises(ValueError, match="unknown keys \\['scael'\\]"):
        s.load_state_dict({**before, "scael": 2.0})
    with pytest.raises(TypeError, match="state_dict"):
        s.load_state_dict([("scale", 2.0)])
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    assert s.state_dict() == before
    # torch.amp.GradScaler (the oracle for what a valid checkpoint is) loads a scale of 0 without complaint
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict({**torch.amp.GradScaler("cpu").state_dict(), "scale": 0.0})
    assert ref.get_scale() == 0.0


@pytest.mark.parametrize("value", [0.0, float("nan"), -2.0, float("inf"), 1e-45, True])
def test_static_scaler_load_state_dict_validates_as_the_constructor(value):
    with pytest.raises((ValueError, TypeError), match="scale"):
        StaticLossScaler(value)
    s = StaticLossScaler(8.0)
    s.scale(torch.ones(()))
    with pytest.raises((ValueError, TypeError), match="scale"):
        s.load_state_dict({"scale": value, "skipped_steps": 0})
    with pytest.raises((ValueError, TypeError)):
        s.load_state_dict({"scale": 4.0, "skipped_steps": -1})
    assert s.state_dict() == {"scale": 8.0, "skipped_steps": 0} and s._scale.item() == 8.0


def test_setters_and_new_scale_validate_too():
    s = DynamicLossScaler()
    s.scale(torch.ones(()))
    for setter, bad in [(s.set_growth_factor, 1.0), (s.set_backoff_factor, 1.5), (s.set_growth_interval, 0)]:
        with pytest.raises(ValueError):
            setter(bad)
    for bad in [0.0, math.nan, -1.0, torch.tensor([1.0, 2.0]), torch.tensor(1.0, requires_grad=True)]:
        with pytest.raises((ValueError, TypeError)):
            s.update(new_scale=bad)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(), s.get_scale()) == (
        2.0, 0.5, 2000, 65536.0)
