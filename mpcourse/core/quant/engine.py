"""The one place that builds quantizers: for a recipe, a layer and a tensor role (TE's ``RecipeState.create``).

``quantizers(recipe, layer_key, device, functions)`` returns ``{role: quantizer}`` for "input", "weight" and
"grad_output"; ``Float8Linear`` calls ``quantizers[role](...)`` and never asks which recipe it holds. Each step of
a quantizer is bound once, here, at construction, to one of three functions:

* the learner's function, when ``functions`` names one (the exercise's function name: ``compute_scale``,
  ``quantize``, ``update``, ``block_quantize``, ``mx_shared_exponent``, ``nvfp4_scales``; ``OVERRIDABLE``
  says which a recipe takes), wrapped so ``mpcourse.core.learner_table.returned`` checks what it returns;
* a kernel (``fastpath``, which hands CPU tensors to ``fused``'s compiled passes) where kernels are on: the
  same bits as the rule, faster (``tests/core/quant/kernels/test_quant_fastpath.py``, ``tests/core/quant/kernels/test_quant_fused.py``);
* the library's rule (``tensor``, ``delayed``, ``blockwise``, ``mx``, ``nvfp4``, ``hadamard``): with
  ``MPCOURSE_FUSED=0`` every step is the rule.

The quantizers:

* ``CurrentQuantizer``: amax -> ``compute_scale`` -> cast (TE ``Float8CurrentScalingQuantizer``), no state.
* ``DelayedQuantizer``: the cast with the scale of earlier steps, then records this tensor's amax and schedules
  the delayed-scaling update (``region.schedule_update``); holds the role's ``DelayedScalingState``.
* ``BlockQuantizer``: a finer-grained recipe's quantizer along an axis (``block_recipes``); a block recipe's dict
  also holds the backward GEMMs' quantizers of x and W ("wgrad_input", "dgrad_weight"), which a
  ``PerDirectionBlockScaling`` takes from its backward recipe.

``per_tensor`` says which autograd function the layer runs: per-tensor copies (``Float8Tensor``, one per
tensor, reused by the backward GEMMs through ``torch._scaled_mm``) or ``ScaledTensor`` copies re-quantized
along each GEMM's contraction dimension (``block_linear``).
"""
from __future__ import annotations

import os
from typing import Callable, Mapping, Optional

import torch

from ..learner_table import check_overrides, exercise_names, returned
from .rules import blockwise, hadamard, mx, nvfp4, tensor
from .kernels import fastpath
from .block_recipes import (BlockRecipe, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling, block_for, direction_recipe)
from .rules.delayed import DelayedScalingState
from .recipe import ROLES, CurrentScaling, DelayedScaling, Recipe, check_recipe, fp8_format_for, recipe_names
from .region import schedule_update
from .rules.scaled import ScaledTensor, block_amax, check_floating, resolve_block
from .rules.tensor import Float8Tensor, fp8_max

#: the learner's functions each recipe takes (names from ``mpcourse.core.learner_table``: lessons 07, 08 and 09);
#: a TrainingRecipe built on one of these recipes states its own from this (``mpcourse.experiment.recipes.fp8``)
OVERRIDABLE = {CurrentScaling: exercise_names("compute_scale", "quantize"),
               DelayedScaling: exercise_names("quantize", "update"), Float8RowwiseScaling: (),
               Float8BlockScaling: exercise_names("block_quantize"),
               MXFP8BlockScaling: exercise_names("mx_shared_exponent"),
               NVFP4BlockScaling: exercise_names("nvfp4_scales")}


def kernels_on() -> bool:
    """Whether quantizers built now bind kernels (``MPCOURSE_FUSED=0``: the rules)."""
    return os.environ.get("MPCOURSE_FUSED", "1") != "0"


def rule_refusal(recipe: Recipe, name: str) -> Optional[str]:
    """Why the learner's ``name``, which ``recipe``'s class takes, cannot follow this ``recipe``'s fields (the
    lesson's rule is one setting of them), or None: ``check_overrides``' ``refuse``."""
    if name == "update" and (callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo):
        return ("update is lesson 08's update (amax_compute_algo 'max' or 'most_recent', the library's scale "
                "rule): drop the callable amax_compute_algo / scaling_factor_compute_algo")
    if name == "block_quantize" and not (recipe.power_2_scales and recipe.amax_epsilon == 0.0):
        return ("block_quantize is lesson 09's rule (power-of-two scales, no amax epsilon): keep "
                "power_2_scales=True and amax_epsilon=0.0")
    if name == "mx_shared_exponent" and recipe.scale_rule != "floor":
        return "mx_shared_exponent is lesson 09's floor rule: use it with scale_rule='floor' (the mxfp8-floor recipe)"
    return None


def quantizers(recipe: Recipe, layer_key: str = "", device=None,
               functions: Optional[Mapping[str, Callable]] = None) -> dict:
    """{role: quantizer} for one layer under ``recipe``, with the learner's ``functions`` in place of the library's
    (``layer_key`` names the layer in the amax all-reduce; ``device``: where delayed scaling's state lives).
    ``functions`` are checked here (``learner_table.check_overrides``: the names ``OVERRIDABLE`` gives the recipe's
    class, their signatures, ``rule_refusal``): ``OverrideRefused``, a ValueError, naming the fix."""
    if recipe is None:
        raise TypeError(f"recipe must be one of {recipe_names()}, got None")
    check_recipe(recipe, "recipe")
    functions = check_overrides(functions, OVERRIDABLE.get(type(recipe), ()), type(recipe).__name__,
                                refuse=lambda name: rule_refusal(recipe, name),
                                takers=lambda name: [c.__name__ for c, names in OVERRIDABLE.items() if name in names])
    if isinstance(recipe, DelayedScaling):
        return {role: DelayedQuantizer(recipe, role, layer_key, device, functions) for role in ROLES}
    if isinstance(recipe, CurrentScaling):
        return {role: CurrentQuantizer(recipe, role, functions) for role in ROLES}
    return block_quantizers(recipe, functions)


#: the backward GEMMs' own quantizers of x and W (a block recipe's dict holds them beside ROLES')
BACKWARD_COPIES = {"wgrad_input": ("input", 0), "dgrad_weight": ("weight", 0)}


def block_quantizers(recipe: BlockRecipe, functions: Optional[dict] = None) -> dict:
    """{role: BlockQuantizer} of a block recipe, plus "wgrad_input" (x as the weight-gradient GEMM reads it) and
    "dgrad_weight" (W as the input-gradient GEMM reads it); each from ``direction_recipe``: a single-format
    recipe's are all its own, a ``PerDirectionBlockScaling``'s forward roles (x, W) take its forward recipe and
    dy and the backward copies its backward recipe."""
    q = {role: BlockQuantizer(direction_recipe(recipe, role, 1), role, functions) for role in ROLES}
    for key, (role, axis) in BACKWARD_COPIES.items():
        q[key] = BlockQuantizer(direction_recipe(recipe, role, axis), role, functions)
    return q


# ------------------------------------------------------------------------------------------------ per tensor
def learner_cast(fn: Callable) -> Callable:
    """``tensor.to_float8``'s signature around a learner's lesson 07 ``quantize(x, scale, fp8_max)`` (saturating)."""
    def cast(x: torch.Tensor, fp8_format, scale) -> Float8Tensor:
        name, dtype, top, s, source = tensor.cast_arguments(x, fp8_format, scale)
        data = returned("quantize", x, fn(x.detach().float(), s.detach(), top), dtype)
        return Float8Tensor(data, s.reciprocal(), x.dtype, source)
    return cast


def bind_cast(functions: dict) -> Callable:
    if "quantize" in functions:
        return learner_cast(functions["quantize"])
    return fastpath.to_float8 if kernels_on() else tensor.to_float8


def bind_amax() -> Callable:
    return fastpath.compute_amax if kernels_on() else tensor.compute_amax


class CurrentQuantizer:
    """Current per-tensor scaling of one role (TE ``Float8CurrentScalingQuantizer``): ``tensor.quantize_current``."""

    per_tensor = True
    state = None

    def __init__(self, recipe: CurrentScaling, role: str, functions: Optional[dict] = None):
        functions = functions or {}
        self.recipe, self.fmt = recipe, fp8_format_for(recipe, role)
        self.amax, self.cast = bind_amax(), bind_cast(functions)
        fn, p2 = functions.get("compute_scale"), recipe.use_power_2_scales
        if fn is None:
            self.scale = lambda amax, top: tensor.compute_scale(amax, top, 0, None, p2)
        else:
            def scale(amax, top):
                s = returned("compute_scale", amax, fn(amax, top, 0))
                return tensor.round_down_to_power_of_2(s) if p2 else s
            self.scale = scale

    def __call__(self, x: torch.Tensor, record: bool) -> Float8Tensor:
        check_floating(x)
        amax = tensor.apply_amax_epsilon(self.amax(x), self.recipe.amax_epsilon)
        return self.cast(x, self.fmt, self.scale(amax, fp8_max(self.fmt)))


def learner_update(fn: Callable) -> Callable:
    """``delayed.library_update``'s signature around a learner's lesson 08 ``update(history, scale, amax, fp8_max,
    margin, algo) -> (history, scale)``: row 0 of the history already holds this step's amax (recorded)."""
    def rule(history: torch.Tensor, scale: torch.Tensor, top: float, recipe: DelayedScaling):
        return returned("update", history, fn(history.clone(), scale.clone(), history[0].clone(), top,
                                              recipe.margin, recipe.amax_compute_algo))
    return rule


class DelayedQuantizer:
    """Delayed per-tensor scaling of one role (TE ``Float8Quantizer`` with its amax history)."""

    per_tensor = True

    def __init__(self, recipe: DelayedScaling, role: str, key: str, device=None, functions: Optional[dict] = None):
        functions = functions or {}
        self.recipe, self.fmt = recipe, fp8_format_for(recipe, role)
        update = functions.get("update")
        self.state = DelayedScalingState(recipe.amax_history_len, device,
                                         None if update is None else learner_update(update))
        self.amax, self.cast = bind_amax(), bind_cast(functions)
        # The key lets the amax all-reduce check that every rank ran the same layers in the same order.
        self.key = f"{key}.{role}:{self.fmt}"

    def __call__(self, x: torch.Tensor, record: bool) -> Float8Tensor:
        check_floating(x)
        x8 = self.cast(x, self.fmt, self.state.scale)  # earlier steps' scale
        if record:
            self.state.record(self.amax(x))
            schedule_update(self.state, fp8_max(self.fmt), self.recipe, key=self.key)
        return x8


# ------------------------------------------------------------------------------------------------ block scaling
def nvfp4_scales_from(fn: Callable, x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(t () fp32, s (M/r, K/c) e4m3) for ``block`` from a learner's lesson 09 ``nvfp4_scales(x)``, which scales
    1x16 blocks along rows: (16, 1) blocks are the rows of x^T; a 16x16 block's scale is the largest of its 16
    row scales (each step, amax / 6 / t, the clamp and the E4M3 rounding, is monotone, so the max commutes)."""
    if block == (16, 1):
        t, s = returned("nvfp4_scales", x.t(), fn(x.t().contiguous()))
        return t, s.t()
    t, s = returned("nvfp4_scales", x, fn(x))      # s: (M, K/16)
    if block == (16, 16):
        M, K = x.shape
        s = s.float().reshape(M // 16, 16, K // 16).amax(dim=1).to(torch.float8_e4m3fn)   # exact: E4M3 values
    elif block != (1, 16):
        raise ValueError(f"nvfp4_scales takes 1x16, 16x1 or 16x16 blocks, got {block}")
    return t, s


class BlockQuantizer:
    """A finer-grained recipe's quantizer of one role; ``axis`` picks the contraction dimension.

    On a CPU every block-scaled GEMM is emulated (``block_gemm.scaled_gemm``), which reads each operand in
    float32: with kernels on, the quantizer keeps that copy, computed with the quantization (``keep_fp32``)."""

    per_tensor = False
    state = None

    def __init__(self, recipe: BlockRecipe, role: str, functions: Optional[dict] = None):
        functions = functions or {}
        self.recipe, self.role, self.kernels = recipe, role, kernels_on()
        if isinstance(recipe, Float8RowwiseScaling):
            self.encode = self._fp32_scaled(recipe.round_scales_to_power_of_2, 0.0)
        elif isinstance(recipe, Float8BlockScaling):
            fn = functions.get("block_quantize")
            self.encode = self._fp32_scaled(recipe.power_2_scales, recipe.amax_epsilon) if fn is None \
                else self._learner_block_quantize(fn)
        elif isinstance(recipe, MXFP8BlockScaling):
            elem = recipe.fp8_format.bwd if role == "grad_output" else recipe.fp8_format.fwd
            self.encode = self._mx(elem, recipe.scale_rule, functions.get("mx_shared_exponent"))
        else:
            rounding = "stochastic" if role == "grad_output" and not recipe.disable_stochastic_rounding else "nearest"
            self.encode = self._nvfp4(rounding, functions.get("nvfp4_scales"))
            self.rht = None if recipe.disable_rht or role == "weight" else (fastpath.rht if self.kernels else hadamard.rht)

    def __call__(self, x: torch.Tensor, axis: int, wgrad: bool = False,
                 keep_fp32: Optional[bool] = None) -> ScaledTensor:
        """x (M, K) quantized in blocks along ``axis`` (``wgrad``: for the weight-gradient GEMM); ``keep_fp32``:
        keep the float32 dequantization (None: on a CPU with kernels on; the rules never keep one)."""
        check_floating(x)
        block = block_for(self.recipe, self.role, axis)
        if wgrad and getattr(self, "rht", None) is not None:
            x = self.rht(x, self.recipe.rht_seed)
        keep = x.device.type == "cpu" if keep_fp32 is None else keep_fp32
        return self.encode(x, block, self.kernels and keep)

    def _fp32_scaled(self, p2: bool, eps: float) -> Callable:
        if self.kernels:
            return lambda x, block, keep: fastpath.quantize_fp32_scaled(x, block, "e4m3", power_2_scale=p2,
                                                                        amax_epsilon=eps, keep_fp32=keep)
        return lambda x, block, keep: blockwise.quantize_fp32_scaled(x, block, "e4m3", power_2_scale=p2,
                                                                     amax_epsilon=eps)

    @staticmethod
    def _learner_block_quantize(fn: Callable) -> Callable:
        def encode(x, block, keep):
            xf = x.detach().float()
            data, scale_inv = returned("block_quantize", xf, block, fn(xf, block), torch.float8_e4m3fn)
            return ScaledTensor(data, scale_inv, block, "e4m3", None, x.dtype)
        return encode

    def _mx(self, elem: str, rule: str, fn: Optional[Callable]) -> Callable:
        if fn is None:
            if self.kernels:
                return lambda x, block, keep: fastpath.quantize_mx(x, block, elem, rule, keep_fp32=keep)
            return lambda x, block, keep: mx.quantize_mx(x, block, elem, rule)

        def encode(x, block, keep):
            mx.mx_element_format(elem)
            b = resolve_block(x.shape, block)
            amax = (fastpath.block_amax if self.kernels else block_amax)(x, b)       # (M/r, K/c) fp32
            flat = amax.flatten()                              # (n,) as the lesson's signature takes it
            k = returned("mx_shared_exponent", flat, fn(flat.clone(), elem)).reshape(amax.shape)
            if self.kernels:
                return fastpath.encode_mx(x, b, elem, amax, torch.exp2(k.double()).float(), keep)
            return mx.encode_mx(x, b, elem, amax, k)
        return encode

    def _nvfp4(self, rounding: str, fn: Optional[Callable]) -> Callable:
        if fn is None:
            if self.kernels:
                return lambda x, block, keep: fastpath.quantize_nvfp4(x, block, rounding=rounding, keep_fp32=keep)
            return lambda x, block, keep: nvfp4.quantize_nvfp4(x, block, rounding=rounding)

        def encode(x, block, keep):
            b = resolve_block(x.shape, block)
            t, s = nvfp4_scales_from(fn, x.detach().float(), b)
            if self.kernels:
                return fastpath.encode_nvfp4(x, b, t, s, rounding, None, keep)
            return nvfp4.encode_nvfp4(x, b, t, s, rounding)
        return encode
