"""The FP8 and block-scaling seams: a learner's lesson 07/08/10 functions plugged into the recipe objects give the
library's quantized tensors and delayed-scaling states bit for bit; planted bugs stop with one ``SeamError`` line
naming the function (``mpcourse.core.seams``). The library's own path is the oracle, run side by side."""
from pathlib import Path

import pytest
import torch

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling,
                                 NVFP4BlockScaling)
from mpcourse.core.quant.recipe import DelayedScalingState
from mpcourse.core.quant.tensor import quantize, quantize_current
from mpcourse.core.seams import SeamError
from mpcourse.experiment.learner import load_functions

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fns():
    out = {}
    for nb in ("07_fp8_formats_and_scaling", "08_delayed_scaling", "10_finer_grained_scaling"):
        out.update(load_functions(ROOT / "solutions" / f"{nb}.ipynb"))
    return out


def _x(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])     # columns over six decades
    x[0, :3] = torch.tensor([0.0, 1e-30, 5e3])
    return x


def _same_scaled(a, b):
    assert a.block == b.block and a.elem_format == b.elem_format
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv.float(), b.scale_inv.float())
    assert (a.tensor_scale_inv is None) == (b.tensor_scale_inv is None)
    if a.tensor_scale_inv is not None:
        assert torch.equal(a.tensor_scale_inv, b.tensor_scale_inv)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_lesson_07_compute_scale_and_quantize_give_the_librarys_cast(fns, fmt):
    x = _x((8, 32))
    lib = quantize_current(x, fmt)
    mine = quantize_current(x, fmt, compute_scale_fn=fns["compute_scale"], quantize_fn=fns["quantize"])
    assert torch.equal(lib.data.view(torch.uint8), mine.data.view(torch.uint8))
    assert torch.equal(lib.scale_inv, mine.scale_inv)
    zero = quantize_current(torch.zeros(4, 4), fmt, compute_scale_fn=fns["compute_scale"])
    assert float(zero.scale_inv) == 1.0                                   # amax 0: scale 1, as the library
    s = torch.tensor(3.0)
    assert torch.equal(quantize(x, fmt, s).data.view(torch.uint8),
                       quantize(x, fmt, s, quantize_fn=fns["quantize"]).data.view(torch.uint8))


def test_lesson_08_update_follows_the_library_state_through_zero_inf_and_nan(fns):
    recipe, mine = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, update_fn=fns["update"])
    lib_state, my_state = DelayedScalingState(4), DelayedScalingState(4)
    seen = []
    for amax in (3.0, 0.0, 700.0, float("inf"), 1e-40, float("nan"), 2.0, 0.5, 0.25, 0.125, 9.0):
        for state, r in ((lib_state, recipe), (my_state, mine)):
            state.record(torch.tensor(amax))
            state.update(448.0, r)
        assert torch.equal(lib_state.amax_history.nan_to_num(-1), my_state.amax_history.nan_to_num(-1))
        assert torch.equal(lib_state.scale, my_state.scale)
        seen.append(float(lib_state.scale))
    assert len(set(seen)) >= 4                                            # the scale moved: the test can fail
    with pytest.raises(ValueError, match="update_fn"):
        DelayedScaling(update_fn=fns["update"], amax_compute_algo=lambda h: h.max())


ROLE_AXES = [("input", 1, False), ("weight", 1, False), ("grad_output", 1, False), ("weight", 0, False),
             ("grad_output", 0, True), ("input", 0, True)]


@pytest.mark.parametrize("role,axis,wgrad", ROLE_AXES)
@pytest.mark.parametrize("kind", ["fp8-block", "mxfp8-floor", "nvfp4"])
def test_lesson_10_functions_give_the_librarys_blocks_for_every_role_and_axis(fns, kind, role, axis, wgrad):
    lib, mine = {
        "fp8-block": (Float8BlockScaling(), Float8BlockScaling(block_quantize_fn=fns["block_quantize"])),
        "mxfp8-floor": (MXFP8BlockScaling(scale_rule="floor"),
                        MXFP8BlockScaling(scale_rule="floor", mx_shared_exponent_fn=fns["mx_shared_exponent"])),
        "nvfp4": (NVFP4BlockScaling(disable_stochastic_rounding=True),
                  NVFP4BlockScaling(disable_stochastic_rounding=True, nvfp4_scales_fn=fns["nvfp4_scales"])),
    }[kind]
    x = _x((128, 256), seed=axis)
    _same_scaled(lib.quantize(role, x, axis, wgrad), mine.quantize(role, x, axis, wgrad))


def test_the_block_seams_refuse_recipes_whose_rule_is_not_the_lessons(fns):
    with pytest.raises(ValueError, match="power_2_scales"):
        Float8BlockScaling(power_2_scales=False, block_quantize_fn=fns["block_quantize"])
    with pytest.raises(ValueError, match="floor"):
        MXFP8BlockScaling(mx_shared_exponent_fn=fns["mx_shared_exponent"])       # default rule: rceil


def _f32_quantize(x, scale, fp8_max):
    return (x * scale).clamp(-fp8_max, fp8_max)                           # forgot the cast


def _nan_scale(amax, fp8_max, margin=0):
    return fp8_max / amax                                                 # amax 0 -> inf, no edge rules


def _no_tuple(history, scale, amax, fp8_max, margin=0, algo="max"):
    return scale


def _one_scale(x, block):
    return x.to(torch.float8_e4m3fn), torch.ones(())


def _float_exponents(amax, elem):
    return torch.log2(amax).floor() - 8


def _min_not_max(x):
    M, K = x.shape
    t = x.abs().amin() / 2688.0                                           # amin: 0 for a tensor holding a 0
    return t, (x.reshape(M, K // 16, 16).abs().amax(2) / 6 / t).to(torch.float8_e4m3fn)   # a zero block: 0 / 0


def _with_zero_block(shape):
    x = _x(shape)
    x[1, :16] = 0.0
    return x


@pytest.mark.parametrize("call,words", [
    (lambda: quantize_current(_x((4, 32)), "e4m3", quantize_fn=_f32_quantize),
     "quantize returned the FP8 data of dtype torch.float32"),
    (lambda: quantize_current(torch.zeros(4, 4), "e4m3", compute_scale_fn=_nan_scale), "compute_scale returned the scale inf"),
    (lambda: (DelayedScalingState(2).update(448.0, DelayedScaling(amax_history_len=2, update_fn=_no_tuple))),
     "update returned Tensor, expected a tuple"),
    (lambda: Float8BlockScaling(block_quantize_fn=_one_scale).quantize("input", _x((128, 128)), 1),
     "block_quantize returned scale_inv of shape ()"),
    (lambda: MXFP8BlockScaling(scale_rule="floor", mx_shared_exponent_fn=_float_exponents).quantize("input", _x((4, 64)), 1),
     "mx_shared_exponent returned the exponents of dtype torch.float32"),
    (lambda: NVFP4BlockScaling(nvfp4_scales_fn=_min_not_max).quantize("input", _with_zero_block((16, 32)), 1),
     "nvfp4_scales returned NaN block scales"),
])
def test_a_broken_function_stops_with_one_line_naming_it(call, words):
    with pytest.raises(SeamError) as e:
        call()
    assert words in str(e.value) and "\n" not in str(e.value)
