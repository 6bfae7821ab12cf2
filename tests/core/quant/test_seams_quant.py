"""The FP8 and block-scaling seams: a learner's lesson 07/08/10 functions handed to the engine give the
library's quantized tensors and delayed-scaling states bit for bit; planted bugs stop with one ``SeamError`` line
naming the function (``mpcourse.core.seams``). The library's own path is the oracle, run side by side."""

import pytest
import torch

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling,
                                 NVFP4BlockScaling)
from mpcourse.core.quant.engine import learner_cast, quantizers
from mpcourse.core.quant.rules.tensor import quantize_current, to_float8
from mpcourse.core.seams import SeamError
from learner_fixtures import fp8_solution_functions



@pytest.fixture(scope="module")
def fns():
    return fp8_solution_functions()


def _x(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])     # columns over six decades
    x[0, :3] = torch.tensor([0.0, 1e-30, 5e3])
    return x


def _quantizer(recipe, role="input", functions=None):
    """The engine's quantizer of ``role`` under ``recipe`` with the learner's ``functions``."""
    return quantizers(recipe.with_functions(functions))[role]


def _state(recipe, functions=None):
    return _quantizer(recipe, "input", functions).state


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
    recipe = CurrentScaling(fp8_format=Format.E4M3 if fmt == "e4m3" else Format.HYBRID)
    role = "input" if fmt == "e4m3" else "grad_output"
    lib = quantize_current(x, fmt)
    mine = _quantizer(recipe, role, {"compute_scale": fns["compute_scale"], "quantize": fns["quantize"]})(x, True)
    assert torch.equal(lib.data.view(torch.uint8), mine.data.view(torch.uint8))
    assert torch.equal(lib.scale_inv, mine.scale_inv)
    zero = _quantizer(recipe, role, {"compute_scale": fns["compute_scale"]})(torch.zeros(4, 4), True)
    assert float(zero.scale_inv) == 1.0                                   # amax 0: scale 1, as the library
    s = torch.tensor(3.0)
    assert torch.equal(to_float8(x, fmt, s).data.view(torch.uint8),
                       learner_cast(fns["quantize"])(x, fmt, s).data.view(torch.uint8))


def test_lesson_08_update_follows_the_library_state_through_zero_inf_and_nan(fns):
    recipe = DelayedScaling(amax_history_len=4)
    lib_state, my_state = _state(recipe), _state(recipe, {"update": fns["update"]})
    seen = []
    for amax in (3.0, 0.0, 700.0, float("inf"), 1e-40, float("nan"), 2.0, 0.5, 0.25, 0.125, 9.0):
        for state in (lib_state, my_state):
            state.record(torch.tensor(amax))
            state.update(448.0, recipe)
        assert torch.equal(lib_state.amax_history.nan_to_num(-1), my_state.amax_history.nan_to_num(-1))
        assert torch.equal(lib_state.scale, my_state.scale)
        seen.append(float(lib_state.scale))
    assert len(set(seen)) >= 4                                            # the scale moved: the test can fail
    with pytest.raises(ValueError, match="update is lesson 08's update"):
        DelayedScaling(amax_compute_algo=lambda h: h.max(), functions={"update": fns["update"]})


ROLE_AXES = [("input", 1, False), ("weight", 1, False), ("grad_output", 1, False), ("weight", 0, False),
             ("grad_output", 0, True), ("input", 0, True)]


@pytest.mark.parametrize("role,axis,wgrad", ROLE_AXES)
@pytest.mark.parametrize("kind", ["fp8-block", "mxfp8-floor", "nvfp4"])
def test_lesson_10_functions_give_the_librarys_blocks_for_every_role_and_axis(fns, kind, role, axis, wgrad):
    recipe, name = {
        "fp8-block": (Float8BlockScaling(), "block_quantize"),
        "mxfp8-floor": (MXFP8BlockScaling(scale_rule="floor"), "mx_shared_exponent"),
        "nvfp4": (NVFP4BlockScaling(disable_stochastic_rounding=True), "nvfp4_scales"),
    }[kind]
    x = _x((128, 256), seed=axis)
    lib, mine = _quantizer(recipe, role), _quantizer(recipe, role, {name: fns[name]})
    _same_scaled(lib(x, axis, wgrad), mine(x, axis, wgrad))


def test_the_block_seams_refuse_recipes_whose_rule_is_not_the_lessons(fns):
    with pytest.raises(ValueError, match="power_2_scales"):
        Float8BlockScaling(power_2_scales=False, functions={"block_quantize": fns["block_quantize"]})
    with pytest.raises(ValueError, match="floor"):
        MXFP8BlockScaling(functions={"mx_shared_exponent": fns["mx_shared_exponent"]})   # rceil
    with pytest.raises(ValueError, match="cannot use update: it takes compute_scale, quantize"):
        CurrentScaling().with_functions({"update": fns["update"]})


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
    (lambda: _quantizer(CurrentScaling(), "input", {"quantize": _f32_quantize})(_x((4, 32)), True),
     "quantize returned the FP8 data of dtype torch.float32"),
    (lambda: _quantizer(CurrentScaling(), "input", {"compute_scale": _nan_scale})(torch.zeros(4, 4), True),
     "compute_scale returned the scale inf"),
    (lambda: _state(DelayedScaling(amax_history_len=2), {"update": _no_tuple}).update(448.0, DelayedScaling(amax_history_len=2)),
     "update returned Tensor, expected a tuple"),
    (lambda: _quantizer(Float8BlockScaling(), "input", {"block_quantize": _one_scale})(_x((128, 128)), 1),
     "block_quantize returned scale_inv of shape ()"),
    (lambda: _quantizer(MXFP8BlockScaling(scale_rule="floor"), "input", {"mx_shared_exponent": _float_exponents})(
        _x((4, 64)), 1),
     "mx_shared_exponent returned the exponents of dtype torch.float32"),
    (lambda: _quantizer(NVFP4BlockScaling(), "input", {"nvfp4_scales": _min_not_max})(_with_zero_block((16, 32)), 1),
     "nvfp4_scales returned NaN block scales"),
])
def test_a_broken_function_stops_with_one_line_naming_it(call, words):
    with pytest.raises(SeamError) as e:
        call()
    assert words in str(e.value) and "\n" not in str(e.value)
