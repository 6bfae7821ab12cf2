"""The one place that builds quantizers: for a recipe, a layer and a tensor role (TE's ``RecipeState.create``).

``quantizers(recipe, layer_key, device, kernels)`` returns ``{role: quantizer}`` for "input", "weight"
and "grad_output"; ``QuantizedLinear`` calls ``quantizers[role](...)`` and never asks which recipe it holds. Each
quantizer runs, for each of its steps, one of:

* the learner's function, when the recipe carries one (``recipe.functions``, checked where the recipe was made; the
  exercise's function name: ``compute_scale``, ``quantize``, ``update``, ``block_quantize``, ``mx_shared_exponent``,
  ``nvfp4_scales``; the recipe's class ``TAKES`` says which), its result checked by
  ``mpcourse.core.learner_table.returned``;
* else the step of its ``backend`` (``backend.Backend``: the library's rules, or the kernels that equal them bit for
  bit), chosen once per layer (``backend.choose(kernels)``: ``kernels`` if given, else the library's switch) and
  held as ``quantizer.backend``; the layers hand it to their GEMMs (``fp8_gemm(..., backend=)``).

``QUANTIZERS`` gives each recipe class its quantizer class, one per scaling kind as Transformer Engine has::

    recipe class              quantizer class                 steps of the backend it runs
    DelayedScaling            Float8Quantizer                 amax, cast; its GEMMs scaled_mm, fp8_to_float32
    CurrentScaling            Float8CurrentScalingQuantizer   amax, cast; its GEMMs scaled_mm, fp8_to_float32
    Float8RowwiseScaling      Float8RowwiseQuantizer          quantize_fp32_scaled; its GEMMs dequantize
    Float8BlockScaling        Float8BlockQuantizer            quantize_fp32_scaled; its GEMMs dequantize
    MXFP8BlockScaling         MXFP8Quantizer                  quantize_mx, block_amax, encode_mx; dequantize
    NVFP4BlockScaling         NVFP4Quantizer                  quantize_nvfp4, encode_nvfp4, rht; dequantize
    PerDirectionBlockScaling  (its direction recipes')        dequantize

The quantizers:

* ``Float8CurrentScalingQuantizer``: amax -> ``compute_scale`` -> cast (TE's class of that name), no state.
* ``Float8Quantizer``: delayed scaling (TE's class of that name with its amax history): the cast with the scale of
  earlier steps, then records this tensor's amax and schedules the update (``region.schedule_update``); holds the
  role's ``DelayedScalingState``.
* ``BlockQuantizer`` and its classes ``Float8BlockQuantizer`` (FP32 block scales; ``Float8RowwiseQuantizer``:
  torchao's rowwise), ``MXFP8Quantizer`` and ``NVFP4Quantizer``: a finer-grained recipe's quantizer along an axis
  (``block_recipes``: the blocks, computed once per quantizer); a block recipe's dict also holds the backward GEMMs'
  quantizers of x and W ("wgrad_input", "dgrad_weight"), which a ``PerDirectionBlockScaling`` takes from its
  backward recipe (``direction_recipe``).

``per_tensor`` says which autograd function the layer runs: per-tensor copies (``Float8Tensor``, one per
tensor, reused by the backward GEMMs through ``torch._scaled_mm``) or ``ScaledTensor`` copies re-quantized
along each GEMM's contraction dimension (``block_linear``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..learner_table import returned
from .backend import Backend, choose
from .rules import mx, tensor
from .block_recipes import (BlockRecipe, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling, PerDirectionBlockScaling, block_for, check_role_axis,
                            direction_recipe)
from .rules.delayed import DelayedScalingState
from .recipe import ROLES, CurrentScaling, DelayedScaling, Recipe, check_recipe, fp8_format_for, recipe_names
from .region import schedule_update
from .rules.scaled import ScaledTensor, check_floating, resolve_block
from .rules.tensor import Float8Tensor, fp8_max

def quantizer_class(recipe) -> type:
    """``recipe``'s quantizer class (``QUANTIZERS``; a recipe or its class, a subclass takes its base's)."""
    cls = recipe if isinstance(recipe, type) else type(recipe)
    found = next((QUANTIZERS[c] for c in cls.__mro__ if c in QUANTIZERS), None)
    if found is None:
        raise TypeError(f"recipe must be one of {recipe_names()}, got {recipe!r}")
    return found


def quantizers(recipe: Recipe, layer_key: str = "", device=None, kernels: Optional[bool] = None) -> dict:
    """{role: quantizer} for one layer under ``recipe``, with the learner's functions the recipe carries
    (``recipe.functions``) in place of the library's (``layer_key`` names the layer in the amax all-reduce;
    ``device``: where delayed scaling's state lives; ``kernels``: True binds the kernels, False the rules, None
    follows ``kernels_switch``)."""
    if recipe is None:
        raise TypeError(f"recipe must be one of {recipe_names()}, got None")
    check_recipe(recipe, "recipe")
    return quantizer_class(recipe).for_layer(recipe, layer_key, device, choose(kernels))


def quantizer(recipe: Recipe, role: str, kernels: Optional[bool] = None, layer_key: str = "", device=None):
    """One role's quantizer under a single-format ``recipe``, with the backend ``kernels`` chooses (a
    ``PerDirectionBlockScaling`` has none of its own: ``quantizers`` builds its roles' from its direction recipes)."""
    return quantizer_class(recipe)(recipe, role, choose(kernels), layer_key, device)


# ------------------------------------------------------------------------------------------------ per tensor
class PerTensorQuantizer:
    """Base of the per-tensor quantizers: one ``Float8Tensor`` per tensor, the three roles of a layer."""

    per_tensor = True
    state = None

    def __init__(self, recipe: Recipe, role: str, backend: Backend):
        functions = recipe.functions
        self.recipe, self.fmt, self.backend = recipe, fp8_format_for(recipe, role), backend
        self.amax = backend.amax
        self.cast = learner_cast(functions["quantize"]) if "quantize" in functions else backend.cast

    @classmethod
    def for_layer(cls, recipe, layer_key: str, device, backend: Backend) -> dict:
        return {role: cls(recipe, role, backend, layer_key, device) for role in ROLES}


def learner_cast(fn: Callable) -> Callable:
    """``tensor.to_float8``'s signature around a learner's lesson 07 ``quantize(x, scale, fp8_max)`` (saturating)."""
    def cast(x: torch.Tensor, fp8_format, scale) -> Float8Tensor:
        name, dtype, top, s, source = tensor.cast_arguments(x, fp8_format, scale)
        data = returned("quantize", x, fn(x.detach().float(), s.detach(), top), dtype)
        return Float8Tensor(data, s.reciprocal(), x.dtype, source)
    return cast


class Float8CurrentScalingQuantizer(PerTensorQuantizer):
    """Current per-tensor scaling of one role (TE ``Float8CurrentScalingQuantizer``): ``tensor.quantize_current``."""

    def __init__(self, recipe: CurrentScaling, role: str, backend: Backend, key: str = "", device=None):
        super().__init__(recipe, role, backend)
        fn, p2 = recipe.functions.get("compute_scale"), recipe.use_power_2_scales
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


class Float8Quantizer(PerTensorQuantizer):
    """Delayed per-tensor scaling of one role (TE ``Float8Quantizer`` with its amax history)."""

    def __init__(self, recipe: DelayedScaling, role: str, backend: Backend, key: str = "", device=None):
        super().__init__(recipe, role, backend)
        update = recipe.functions.get("update")
        self.state = DelayedScalingState(recipe.amax_history_len, device,
                                         None if update is None else learner_update(update))
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


#: the backward GEMMs' own quantizers of x and W (a block recipe's dict holds them beside ROLES')
BACKWARD_COPIES = {"wgrad_input": ("input", 0), "dgrad_weight": ("weight", 0)}


def _kept(keep: bool) -> dict:
    """The keyword a kernel takes to keep the float32 dequantization with the quantization (a rule keeps none:
    ``keep`` is True only where kernels are bound)."""
    return {"keep_fp32": True} if keep else {}


class BlockQuantizer:
    """A finer-grained recipe's quantizer of one role; ``axis`` picks the contraction dimension. The base of one
    class per scaling kind; each says how it ``encode``s x in a block.

    On a CPU every block-scaled GEMM is emulated (``block_gemm.scaled_gemm``), which reads each operand in
    float32: with kernels bound, the quantizer keeps that copy, computed with the quantization (``keep_fp32``)."""

    per_tensor = False
    state = None
    rht = None          # NVFP4's random Hadamard transform of the weight-gradient GEMM's operands, where applied

    def __init__(self, recipe: BlockRecipe, role: str, backend: Backend, key: str = "", device=None):
        if type(self) is BlockQuantizer:
            raise TypeError(f"{type(recipe).__name__} has no quantizer of its own: each role's comes from the "
                            "recipe direction_recipe(recipe, role, axis) names")
        self.recipe, self.role, self.backend = recipe, role, backend
        self.blocks = (block_for(recipe, role, 0), block_for(recipe, role, 1))    # along axis 0, along axis 1

    @classmethod
    def for_layer(cls, recipe: BlockRecipe, layer_key: str, device, backend: Backend) -> dict:
        """{role: quantizer} of a block recipe, plus "wgrad_input" (x as the weight-gradient GEMM reads it) and
        "dgrad_weight" (W as the input-gradient GEMM reads it); each from ``direction_recipe``: a single-format
        recipe's are all its own, a ``PerDirectionBlockScaling``'s forward roles (x, W) take its forward recipe
        and dy and the backward copies its backward recipe."""
        def build(r: BlockRecipe, role: str):
            return quantizer_class(r)(r, role, backend)
        q = {role: build(direction_recipe(recipe, role, 1), role) for role in ROLES}
        for key, (role, axis) in BACKWARD_COPIES.items():
            q[key] = build(direction_recipe(recipe, role, axis), role)
        return q

    def __call__(self, x: torch.Tensor, axis: int, wgrad: bool = False,
                 keep_fp32: Optional[bool] = None) -> ScaledTensor:
        """x (M, K) quantized in blocks along ``axis`` (``wgrad``: for the weight-gradient GEMM); ``keep_fp32``:
        keep the float32 dequantization (None: on a CPU with kernels bound; the rules never keep one)."""
        check_floating(x)
        if axis not in (0, 1):
            check_role_axis(self.role, axis)
        if wgrad and self.rht is not None:
            x = self.rht(x, self.recipe.rht_seed)
        keep = x.device.type == "cpu" if keep_fp32 is None else keep_fp32
        return self.encode(x, self.blocks[axis], self.backend.kernels and keep)

    def encode(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        raise NotImplementedError


class Float8BlockQuantizer(BlockQuantizer):
    """FP32 scales per block (TE ``Float8BlockQuantizer``; ``Float8BlockScaling``): ``blockwise.quantize_fp32_scaled``
    in E4M3, or a learner's lesson 09 ``block_quantize``."""

    def __init__(self, recipe: Float8BlockScaling, role: str, backend: Backend, key: str = "", device=None):
        super().__init__(recipe, role, backend)
        self.power_2_scale, self.amax_epsilon = self.scale_fields(recipe)
        fn = recipe.functions.get("block_quantize")
        if fn is not None:
            self.encode = self._learner_block_quantize(fn)

    @staticmethod
    def scale_fields(recipe: Float8BlockScaling) -> tuple[bool, float]:
        return recipe.power_2_scales, recipe.amax_epsilon

    def encode(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        return self.backend.quantize_fp32_scaled(x, block, "e4m3", power_2_scale=self.power_2_scale,
                                                 amax_epsilon=self.amax_epsilon, **_kept(keep))

    @staticmethod
    def _learner_block_quantize(fn: Callable) -> Callable:
        def encode(x, block, keep):
            xf = x.detach().float()
            data, scale_inv = returned("block_quantize", xf, block, fn(xf, block), torch.float8_e4m3fn)
            return ScaledTensor(data, scale_inv, block, "e4m3", None, x.dtype)
        return encode


class Float8RowwiseQuantizer(Float8BlockQuantizer):
    """torchao's rowwise scaling (``Float8RowwiseScaling``): one FP32 scale per row or column, E4M3, power-of-two
    scales as the recipe says, no amax epsilon."""

    @staticmethod
    def scale_fields(recipe: Float8RowwiseScaling) -> tuple[bool, float]:
        return recipe.round_scales_to_power_of_2, 0.0


class MXFP8Quantizer(BlockQuantizer):
    """OCP MX (TE ``MXFP8Quantizer``; ``MXFP8BlockScaling``): ``mx.quantize_mx``, an E8M0 scale per 32 elements
    (E4M3 elements, E5M2 gradients under HYBRID), or the scales from a learner's lesson 09 ``mx_shared_exponent``."""

    def __init__(self, recipe: MXFP8BlockScaling, role: str, backend: Backend, key: str = "", device=None):
        super().__init__(recipe, role, backend)
        self.elem = recipe.fp8_format.bwd if role == "grad_output" else recipe.fp8_format.fwd
        self.shared_exponent = recipe.functions.get("mx_shared_exponent")
        if self.shared_exponent is not None:
            self.encode = self._learner_mx

    def encode(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        return self.backend.quantize_mx(x, block, self.elem, self.recipe.scale_rule, **_kept(keep))

    def _learner_mx(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        mx.mx_element_format(self.elem)
        b = resolve_block(x.shape, block)
        amax = self.backend.block_amax(x, b)                    # (M/r, K/c) fp32
        flat = amax.flatten()                                   # (n,) as the lesson's signature takes it
        k = returned("mx_shared_exponent", flat, self.shared_exponent(flat.clone(), self.elem))
        k = k.reshape(amax.shape)
        return self.backend.encode_mx(x, b, self.elem, amax, k, **_kept(keep))


class NVFP4Quantizer(BlockQuantizer):
    """NVFP4 (TE ``NVFP4Quantizer``; ``NVFP4BlockScaling``): ``nvfp4.quantize_nvfp4``, E2M1 with an E4M3 scale per
    16 elements and an FP32 tensor scale (gradients rounded stochastically, the weight-gradient GEMM's operands
    through the random Hadamard transform, unless the recipe turns them off), or the scales from a learner's
    lesson 09 ``nvfp4_scales``."""

    def __init__(self, recipe: NVFP4BlockScaling, role: str, backend: Backend, key: str = "", device=None):
        super().__init__(recipe, role, backend)
        stochastic = role == "grad_output" and not recipe.disable_stochastic_rounding
        self.rounding = "stochastic" if stochastic else "nearest"
        self.rht = None if recipe.disable_rht or role == "weight" else backend.rht
        self.scales = recipe.functions.get("nvfp4_scales")
        if self.scales is not None:
            self.encode = self._learner_nvfp4

    def encode(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        return self.backend.quantize_nvfp4(x, block, rounding=self.rounding, **_kept(keep))

    def _learner_nvfp4(self, x: torch.Tensor, block: tuple[int, int], keep: bool) -> ScaledTensor:
        b = resolve_block(x.shape, block)
        t, s = nvfp4_scales_from(self.scales, x.detach().float(), b)
        return self.backend.encode_nvfp4(x, b, t, s, self.rounding, None, **_kept(keep))


# ------------------------------------------------------------------------------------------------ the table
#: each recipe class's quantizer class (one per scaling kind, as Transformer Engine's ``Float8Quantizer``, ...)
QUANTIZERS: dict[type, type] = {
    DelayedScaling: Float8Quantizer,
    CurrentScaling: Float8CurrentScalingQuantizer,
    Float8RowwiseScaling: Float8RowwiseQuantizer,
    Float8BlockScaling: Float8BlockQuantizer,
    MXFP8BlockScaling: MXFP8Quantizer,
    NVFP4BlockScaling: NVFP4Quantizer,
    PerDirectionBlockScaling: BlockQuantizer,   # its roles' quantizers: its direction recipes' classes
}
