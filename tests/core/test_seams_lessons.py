"""The library rules a learner's lesson 02 and 03 functions replace, and their seams: ``choose_loss_scale``
(against exact rational arithmetic), ``unscale_grads_`` (against torch.amp.GradScaler), the scalers'
``unscale_grads_=``, ``MasterWeights(make_master=)`` and ``MasterWeights.step_with(master_step)`` (against the
library's fused path, bit for bit) and the checks that turn a wrong return value into one ``SeamError``."""
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcourse.core.master import MasterWeights, cast_model, make_master, master_step
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler, choose_loss_scale, unscale_grads_
from mpcourse.core.seams import SeamError, returned_flag


def _largest_power(g: float, fmt_max: float, margin: int) -> float:
    """max 2**k with 2**k * g * 2**margin <= fmt_max, in exact rationals (k searched over every FP32-ish exponent)."""
    ok = [k for k in range(-300, 300) if Fraction(2) ** k * Fraction(g) * 2**margin <= Fraction(fmt_max)]
    return math.ldexp(1.0, max(ok))


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False), st.integers(0, 8),
       st.sampled_from([65504.0, 57344.0, 448.0, 3.4028234663852886e38]))
def test_choose_loss_scale_is_the_largest_power_of_two_that_fits(g, margin, fmt_max):
    assert choose_loss_scale(g, fmt_max, margin) == _largest_power(g, fmt_max, margin)


def test_choose_loss_scale_at_the_boundary_and_for_bad_input():
    assert choose_loss_scale(65504.0) == 1.0 and choose_loss_scale(65504.0 * (1 + 2**-20)) == 0.5
    assert choose_loss_scale(2.7, 65504.0, 2) == 2.0**12              # fp16-static's scale
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="grad_abs_max"):
            choose_loss_scale(bad)
    with pytest.raises(ValueError, match="margin"):
        choose_loss_scale(1.0, margin=-1)


def test_fp16_static_chooses_its_scale_with_the_rule():
    from mpcourse.experiment.recipes import fp16

    assert fp16.STATIC_LOSS_SCALE == _largest_power(fp16.STATIC_GRAD_ABS_MAX, 65504.0, fp16.STATIC_MARGIN) == 4096


@pytest.mark.parametrize("scale", [2.0**12, 3.0, 0.7])
@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_unscale_grads_equals_torch_gradscaler(scale, bad):
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(torch.randn(5, 7))
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt = torch.optim.SGD([p], lr=0.1)
    torch_scaler.scale((p * w).sum()).backward()
    scaled = p.grad.clone()
    if bad:
        p.grad[1, 2] = float(bad)
        scaled[1, 2] = float(bad)
    torch_scaler.unscale_(opt)
    torch_found = bool(sum(v.item() for v in torch_scaler._found_inf_per_device(opt).values()))
    mine = [scaled]
    assert unscale_grads_(mine, scale) == torch_found == bool(bad)
    assert torch.equal(mine[0].nan_to_num(), p.grad.nan_to_num())


@pytest.mark.parametrize("cls", [StaticLossScaler, DynamicLossScaler])
def test_a_scaler_with_the_rule_given_takes_the_same_steps_and_skips(cls):
    runs = {}
    for who, kw in (("fused", {}), ("rule", {"unscale_grads_": unscale_grads_})):
        scaler = cls(2.0**8, **kw) if cls is StaticLossScaler else cls(init_scale=2.0**8, growth_interval=2, **kw)
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        trace = []
        for bad in (0, 1, 0, 0, 1):
            scaler.scale((p * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
            if bad:
                p.grad[0] = float("inf")
            scaler.unscale_(opt)
            trace.append(p.grad.clone())
            scaler.step(opt)
            scaler.update()
            trace += [p.detach().clone(), torch.tensor(scaler.get_scale()), torch.tensor(scaler.last_step_skipped)]
            opt.zero_grad()
        runs[who] = trace
    assert all(torch.equal(a, b) for a, b in zip(runs["fused"], runs["rule"]))
    assert sum(bool(t) for t in runs["rule"][3::4]) == 2                # the two bad steps were skipped


def test_a_wrong_found_inf_is_one_seam_error():
    scaler = StaticLossScaler(4.0, unscale_grads_=lambda grads, scale: None)
    p = torch.nn.Parameter(torch.ones(2))
    scaler.scale(p.sum()).backward()
    with pytest.raises(SeamError, match=r"unscale_grads_ returned None, expected True or False"):
        scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    assert returned_flag("f", torch.tensor(True)) is True and returned_flag("f", torch.tensor(0.0)) is False
    with pytest.raises(SeamError):
        returned_flag("f", torch.tensor([0, 1]))


def _fp16_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    return cast_model(model, torch.float16)


def test_make_master_rule_and_seam_build_the_same_masters():
    model = _fp16_params()
    params = list(model.parameters())
    mine = make_master(params)
    assert all(m.dtype == torch.float32 and m.is_leaf and m.requires_grad and torch.equal(m, p.float())
               for m, p in zip(mine, params))
    lesson = lambda ps: [p.detach().float().requires_grad_(True) for p in ps]   # noqa: E731
    a, b = MasterWeights(params, torch.optim.SGD, lr=0.1), MasterWeights(params, torch.optim.SGD, lr=0.1,
                                                                        make_master=lesson)
    assert all(torch.equal(x, y) for x, y in zip(a.master_params, b.master_params))


@pytest.mark.parametrize("fn,words", [
    (lambda ps: [p.detach().float() for p in ps], "not a leaf with requires_grad=True"),
    (lambda ps: [p.detach().double().requires_grad_() for p in ps], "torch.float64"),
    (lambda ps: [torch.zeros(p.shape, requires_grad=True) for p in ps], "values that differ"),
    (lambda ps: ps[:1], "returned 1 items, expected a list of 4"),
])
def test_a_wrong_master_copy_is_one_seam_error(fn, words):
    with pytest.raises(SeamError, match=words):
        MasterWeights(_fp16_params(), torch.optim.SGD, lr=0.1, make_master=fn)


def _train(step, loss_scale=1.0, steps=4):
    """A few steps of an FP16 model through MasterWeights; ``step(master, opt_hook)`` does the optimizer step."""
    torch.manual_seed(0)
    model = _fp16_params()
    master = MasterWeights(model, torch.optim.AdamW, lr=1e-2)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(2)).half()
    for _ in range(steps):
        (model(x).float().pow(2).mean() * loss_scale).backward()
        step(master)
        master.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + [m.detach().clone() for m in master.master_params]


def _clip(master):
    torch.nn.utils.clip_grad_norm_(master.master_params, 0.05)


def test_master_step_rule_and_seam_follow_the_fused_path_bit_for_bit():
    def fused(master):
        master.copy_grads_to_master()
        _clip(master)
        master.optimizer.step()
        master.copy_master_to_model()

    def scaled_fused(master):                          # a static scaler unscales in the fused kernel
        scaler = StaticLossScaler(2.0**10)
        scaler._lazy_init("cpu")
        master.copy_grads_to_master()
        scaler.unscale_(master.optimizer)
        _clip(master)
        scaler.step(master.optimizer)
        master.copy_master_to_model()

    ref = _train(fused)
    assert not all(torch.equal(a, b) for a, b in zip(ref, _train(lambda m: None)))      # the steps did something
    assert all(torch.equal(a, b) for a, b in zip(ref, _train(lambda m: m.step_with(master_step, 1.0, lambda: _clip(m)))))
    scaled = _train(scaled_fused, 2.0**10)
    rule = _train(lambda m: m.step_with(master_step, 2.0**10, lambda: _clip(m)), 2.0**10)
    assert all(torch.equal(a, b) for a, b in zip(scaled, rule))


def test_a_master_step_that_changes_a_model_dtype_is_one_seam_error():
    def master_step(model_params, master_params, optimizer, loss_scale):
        for p, m in zip(model_params, master_params):
            p.data = m.detach().clone()                # fp32 now: the model is no longer FP16
    model = _fp16_params()
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    model(torch.ones(1, 4).half()).sum().backward()
    with pytest.raises(SeamError, match="master_step turned model parameter 0 into torch.float32"):
        master.step_with(master_step)
