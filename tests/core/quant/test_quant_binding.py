"""One backend, chosen once and passed, runs every step, the GEMMs' included: with kernels off no kernel runs, with
them on the same bits come out.

* ``engine.QUANTIZERS``: every quantized recipe class has its quantizer class; the quantizers ``engine.quantizers``
  builds are of that class (a ``PerDirectionBlockScaling``'s, its direction recipes'), all holding the one backend
  ``backend.choose`` gave (``RULES`` or ``KERNELS``).
* ``backend.RULES`` and ``backend.KERNELS``: each step by name, the rule in ``rules/``, the kernel in ``kernels/``
  naming its rule in its docstring.
* A training step (forward, backward, optimizer step, twice) of a small model under every quantized recipe, FP8
  weights included, built with kernels off (``kernels_switch.flags(enabled=False)``, what ``MPCOURSE_FUSED=0``
  binds) calls no function defined in ``mpcourse/core/quant/kernels/`` (watched with ``sys.setprofile``: every
  Python call, however the caller got hold of the function, and the compiled passes are only reached through
  the Python wrappers of ``fp8_passes`` and ``nvfp4_passes``); built with kernels on it calls them, in the forward and in the backward, and gives
  the same bits.
* The public GEMMs (``fp8_gemm``, ``scaled_gemm``, ``emulated_gemm``) follow the switch too.
"""
import contextlib
import inspect
import sys
import threading
from pathlib import Path

import pytest
import torch

import mpcourse.core.quant as quant
from mpcourse.core import kernels_switch
import dataclasses

from mpcourse.core.quant import backend, engine
from mpcourse.core.quant.block_recipes import direction_recipe
from mpcourse.core.quant.kernels import jit

KERNELS_DIR = str(Path(jit.__file__).resolve().parent)
RULES_DIR = str(Path(quant.__file__).resolve().parent / "rules")


@contextlib.contextmanager
def kernel_calls():
    """The names of the functions defined under ``quant/kernels/`` called inside the block (this thread and any
    thread started in it)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(KERNELS_DIR):
            seen.append(frame.f_code.co_name)

    old = sys.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(old)
        threading.setprofile(None)


def test_the_watch_sees_a_kernel_call_and_ignores_a_rule_call():
    x = torch.randn(64, 64)
    with kernel_calls() as seen:
        quant.compute_amax(x)                                     # the rule
    assert seen == []
    with kernel_calls() as seen:
        backend.KERNELS.amax(x)                                  # its kernel, reached through the backend
    assert "compute_amax" in seen


# ------------------------------------------------------------------------------------------------ the table
QUANTIZED = [quant.DelayedScaling, quant.CurrentScaling, quant.Float8RowwiseScaling, quant.Float8BlockScaling,
             quant.MXFP8BlockScaling, quant.NVFP4BlockScaling, quant.PerDirectionBlockScaling]


STEPS = [f.name for f in dataclasses.fields(backend.Backend) if f.name != "kernels"]


def test_every_quantized_recipe_class_has_a_quantizer_class_and_no_other_class_does():
    assert set(engine.QUANTIZERS) == set(QUANTIZED)
    with pytest.raises(TypeError, match="recipe must be one of"):
        engine.quantizer_class(quant.BlockRecipe())


@pytest.mark.parametrize("cls", QUANTIZED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kernels", [True, False])
def test_quantizers_are_their_recipes_class_and_hold_the_one_backend(cls, kernels):
    recipe = cls(amax_history_len=4) if cls is quant.DelayedScaling else cls()
    q = engine.quantizers(recipe, kernels=kernels)
    for key, quantizer in q.items():
        role, axis = engine.BACKWARD_COPIES.get(key, (key, 1))
        r = direction_recipe(recipe, role, axis) if isinstance(recipe, quant.BlockRecipe) else recipe
        assert type(quantizer) is engine.quantizer_class(r) and quantizer.recipe == r, key
        assert quantizer.backend is (backend.KERNELS if kernels else backend.RULES), key


def test_the_backend_is_chosen_in_one_place():
    assert backend.choose(True) is backend.KERNELS and backend.choose(False) is backend.RULES
    with kernels_switch.flags(enabled=False):
        assert backend.choose() is backend.RULES
    with kernels_switch.flags(enabled=True):
        assert backend.choose() is backend.KERNELS
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.KERNELS.amax = None


def test_quantizer_classes_bear_transformer_engines_names():
    names = {cls.__name__: q.__name__ for cls, q in engine.QUANTIZERS.items()}
    assert names["DelayedScaling"] == "Float8Quantizer"
    assert names["CurrentScaling"] == "Float8CurrentScalingQuantizer"
    assert names["Float8BlockScaling"] == "Float8BlockQuantizer"
    assert names["MXFP8BlockScaling"] == "MXFP8Quantizer" and names["NVFP4BlockScaling"] == "NVFP4Quantizer"
    with pytest.raises(TypeError, match="direction_recipe"):
        engine.quantizer(quant.PerDirectionBlockScaling(), "input")


@pytest.mark.parametrize("step", STEPS)
def test_each_step_is_a_rule_and_a_kernel_that_names_it(step):
    rule, kernel = getattr(backend.RULES, step), getattr(backend.KERNELS, step)
    assert inspect.getsourcefile(rule).startswith(RULES_DIR), f"{step}: rule {rule.__qualname__} is not in rules/"
    assert inspect.getsourcefile(kernel).startswith(KERNELS_DIR), f"{step}: kernel {kernel.__qualname__}"
    name = f"{rule.__module__.rpartition('.')[2]}.{rule.__qualname__}"    # e.g. tensor.scaled_mm
    if name.startswith("scaled.ScaledTensor."):
        name = name.removeprefix("scaled.")
    assert name in (kernel.__doc__ or ""), f"{step}: {kernel.__qualname__}'s docstring does not name {name}"


# ------------------------------------------------------------------------------------------------ a training step
RECIPES = {
    "fp8-delayed": quant.DelayedScaling(amax_history_len=4),
    "fp8-current": quant.Float8CurrentScaling(),
    "fp8-current-p2": quant.Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3),
    "fp8-rowwise": quant.Float8RowwiseScaling(),
    "fp8-block": quant.Float8BlockScaling(),
    "mxfp8": quant.MXFP8BlockScaling(),
    "mxfp8-floor-hybrid": quant.MXFP8BlockScaling(scale_rule="floor", fp8_format=quant.Format.HYBRID),
    "nvfp4": quant.NVFP4BlockScaling(),
    "nvfp4-1d": quant.NVFP4BlockScaling(disable_2d_quantization=True),
    "mxfp8-fwd-nvfp4-bwd": quant.PerDirectionBlockScaling(),
    "per-direction-dequantized": quant.PerDirectionBlockScaling(backward_operand="dequantized"),
}
FP8_WEIGHTS = ["fp8-delayed", "fp8-current"]


def _train(recipe, kernels: bool, fp8_weights: bool = False):
    """Two steps of a two-layer model built with ``kernels``: (the bits of every output, gradient and updated
    parameter, the kernels called in the forwards, the kernels called in the backwards)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    with kernels_switch.flags(enabled=kernels):
        quant.convert_to_float8_training(model, recipe=recipe)
        params = list(model.parameters())
        if fp8_weights:
            masters = quant.convert_to_fp8_weights(model)
            params = [p for p in model.parameters() if p.requires_grad] + list(masters.values())
    assert all(m.quantizers["input"].backend.kernels is kernels for m in model if hasattr(m, "quantizers"))
    opt = torch.optim.SGD(params, lr=0.1)
    bits, forward_calls, backward_calls = [], [], []
    for step in range(2):
        x = torch.randn(128, 128, requires_grad=True)
        with kernel_calls() as seen:
            y = model(x)
        forward_calls += seen
        with kernel_calls() as seen:
            y.float().square().mean().backward()
        backward_calls += seen
        opt.step()
        if fp8_weights:
            for m in model:
                if hasattr(m, "cast_master_to_weight_"):
                    m.cast_master_to_weight_()
        bits += [y, x.grad] + [p.grad for p in params] + [p.detach().clone() for p in params]
        opt.zero_grad()
    return [b.detach().float().view(torch.int32) for b in bits], forward_calls, backward_calls


@pytest.mark.parametrize("name, fp8_weights", [(n, False) for n in RECIPES] + [(n, True) for n in FP8_WEIGHTS],
                         ids=lambda v: v if isinstance(v, str) else ("fp8-weights" if v else "float8-linear"))
def test_with_kernels_off_a_training_step_calls_no_kernel_and_with_them_on_the_same_bits(name, fp8_weights):
    rule_bits, rule_fwd, rule_bwd = _train(RECIPES[name], kernels=False, fp8_weights=fp8_weights)
    assert rule_fwd == [] and rule_bwd == [], f"kernels called with kernels off: {sorted(set(rule_fwd + rule_bwd))}"
    kernel_bits, kernel_fwd, kernel_bwd = _train(RECIPES[name], kernels=True, fp8_weights=fp8_weights)
    assert kernel_fwd and kernel_bwd                  # the watch sees the kernels, in the backward too
    assert len(rule_bits) == len(kernel_bits)
    for i, (a, b) in enumerate(zip(rule_bits, kernel_bits)):
        assert torch.equal(a, b), f"{name}: tensor {i} differs between the rules and the kernels"


# ------------------------------------------------------------------------------------------------ the public GEMMs
def test_the_public_gemms_follow_the_switch():
    torch.manual_seed(3)
    a, w = torch.randn(64, 256), torch.randn(96, 256)
    outs = {}
    for kernels in (True, False):
        with kernels_switch.flags(enabled=kernels), kernel_calls() as seen:
            a8, w8 = quant.quantize_current(a, "e4m3"), quant.quantize_current(w, "e4m3")
            per_tensor = quant.fp8_gemm(a8, w8.t(), torch.float32)
            am, wm = quant.quantize_mx(a, (1, 32), "e4m3", "rceil"), quant.quantize_mx(w, (1, 32), "e4m3", "rceil")
            block = (quant.scaled_gemm(am, wm.t(), torch.bfloat16), quant.emulated_gemm(am, wm.t()))
        assert bool(seen) is kernels, sorted(set(seen))   # the operands come from the rules: only the GEMMs differ
        outs[kernels] = (per_tensor, *block)
    for x, y in zip(outs[True], outs[False]):
        assert torch.equal(x.float().view(torch.int32), y.float().view(torch.int32))


def test_the_public_gemms_take_a_backend_that_overrides_the_switch():
    """``backend=`` (what a layer passes: its quantizers') is the one used, whatever the switch says; the same bits."""
    torch.manual_seed(4)
    a, w = torch.randn(64, 256), torch.randn(96, 256)
    a8, w8 = quant.quantize_current(a, "e4m3"), quant.quantize_current(w, "e4m3")
    am, wm = quant.quantize_mx(a, (1, 32), "e4m3", "rceil"), quant.quantize_mx(w, (1, 32), "e4m3", "rceil")
    outs = {}
    for kernels in (True, False):
        chosen = backend.choose(kernels)
        with kernels_switch.flags(enabled=not kernels), kernel_calls() as seen:
            outs[kernels] = (quant.fp8_gemm(a8, w8.t(), torch.float32, backend=chosen),
                             quant.scaled_gemm(am, wm.t(), torch.bfloat16, backend=chosen),
                             quant.emulated_gemm(am, wm.t(), backend=chosen))
        assert bool(seen) is kernels, sorted(set(seen))
    for x, y in zip(outs[True], outs[False]):
        assert torch.equal(x.float().view(torch.int32), y.float().view(torch.int32))
