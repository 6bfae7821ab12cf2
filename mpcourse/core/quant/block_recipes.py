"""Finer-grained scaling recipes with Transformer Engine's names, fields and defaults, plus torchao's rowwise.

Configuration only, as TE's recipes are: ``engine`` builds the quantizer of each tensor role ("input", "weight",
"grad_output") from a recipe, and quantizes along an axis: a ``ScaledTensor`` whose blocks run along dimension
``axis`` of the 2-D tensor x, the GEMM's contraction dimension; ``block_for(recipe, role, axis)`` names that block.
The rules are ``blockwise.quantize_fp32_scaled``, ``mx.quantize_mx``, ``nvfp4.quantize_nvfp4`` and ``hadamard.rht``.
A linear layer y = x W^T needs (TE re-quantizes each copy from the high-precision tensor, never one FP8 copy from
another):

    forward  y  = x  @ W^T    x along K (axis 1), W (N, K) along K (axis 1)
    dgrad    dx = dy @ W      dy along N (axis 1), W along N (axis 0)
    wgrad    dW = dy^T @ x    dy along M (axis 0), x along M (axis 0)

So a 1x128 forward tile of x becomes a 128x1 tile for the weight gradient; 2-D blocks (128x128 weights,
16x16 NVFP4 weights) are the same in both directions, so forward and backward see the same weight values.
``PerDirectionBlockScaling`` gives the forward GEMM one of these recipes and the two backward GEMMs another
(``direction_recipe`` says which quantizes what), the backward copies of W and x quantized from the
high-precision tensors or from the forward's dequantized copies (``backward_operand``).

Sources: NVIDIA/TransformerEngine ``transformer_engine/common/recipe/__init__.py`` (``Float8BlockScaling``,
``MXFP8BlockScaling``, ``NVFP4BlockScaling``) and ``docs/features/low_precision_training/``; DeepSeek-V3
technical report (arXiv 2412.19437) section 3.3; OCP MX v1.0; NVIDIA, "Pretraining LLMs with NVFP4"
(arXiv 2509.25149); pytorch/ao ``torchao/float8/config.py`` (``Float8LinearRecipeName.ROWWISE``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..learner_table import exercise_names
from .recipe import ROLES, Format, Recipe


def check_role_axis(role: str, axis: int) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1 (the contraction dimension of a 2-D tensor), got {axis!r}")


class BlockRecipe(Recipe):
    """Base of the finer-grained recipes: scales per block, re-quantized along each GEMM's contraction dimension."""


def _along(axis: int, n: int) -> tuple[int, int]:
    """A 1-D block of n elements along ``axis``: (1, n) for axis 1, (n, 1) for axis 0."""
    return (1, n) if axis == 1 else (n, 1)


@dataclass(frozen=True)
class Float8RowwiseScaling(BlockRecipe):
    """torchao's ``rowwise`` recipe: E4M3 for every tensor, one power-of-two FP32 scale per row of the left
    GEMM operand and per column of the right one (``Float8LinearConfig.from_recipe_name("rowwise")``:
    ``ScalingGranularity.AXISWISE``, ``round_scales_to_power_of_2=True``, E4M3 grads)."""

    #: lesson 13's padding of the experts' token groups and their weight-gradient scales (the MoE layer reads them)
    TAKES = exercise_names("pad_token_groups", "unpad_token_groups", "group_scales")

    fp8_format: Format = Format.E4M3
    round_scales_to_power_of_2: bool = True

    def __post_init__(self):
        if self.fp8_format is not Format.E4M3:
            raise ValueError("torchao's rowwise recipe uses E4M3 for every tensor: fp8_format=Format.E4M3")
        super().__post_init__()

    def refusal(self, name: str) -> Optional[str]:
        if name == "group_scales" and not self.round_scales_to_power_of_2:
            return "group_scales is lesson 13's power-of-two rule: keep round_scales_to_power_of_2=True"
        return None

def check_flags(recipe, names) -> None:
    """TypeError unless each field in ``names`` is a bool: a string "False" or a 0/1 would switch a technique on or
    off by its truth value, not by what it says."""
    for name in names:
        if not isinstance(getattr(recipe, name), bool):
            raise TypeError(f"{type(recipe).__name__}.{name} must be True or False, got {getattr(recipe, name)!r}")


@dataclass(frozen=True)
class Float8BlockScaling(BlockRecipe):
    """DeepSeek-V3-style block scaling (TE ``Float8BlockScaling``): E4M3 for every tensor, 1x128 tiles for
    activations and gradients, 128x128 blocks for weights, power-of-two FP32 scales.

    Fields (TE's names and defaults): fp8_format=Format.E4M3; x_block_scaling_dim=1; w_block_scaling_dim=2;
    grad_block_scaling_dim=1; power_2_scales=True (TE: unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1);
    amax_epsilon=0.0; fp8_dpa=False; fp8_mha=False. TE refuses a 2-D x 2-D GEMM (x and w both 2-D) and FP8
    attention; so does this class. Every dimension a block runs along must be a multiple of 128.
    A learner's lesson 09 ``block_quantize`` rides in ``functions`` (only with power_2_scales=True, amax_epsilon=0.0);
    lesson 13's ``pad_token_groups`` and ``unpad_token_groups`` too (the MoE layer pads its experts' groups with them).
    """

    TAKES = exercise_names("block_quantize", "pad_token_groups", "unpad_token_groups")   # lessons 09 and 13

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scales: bool = True
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    block_len: int = 128

    def __post_init__(self):
        if self.fp8_format is not Format.E4M3:
            raise ValueError("Float8BlockScaling uses E4M3 for every tensor (fine blocks make E5M2's range "
                             "unnecessary): fp8_format=Format.E4M3")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if type(getattr(self, name)) is not int or getattr(self, name) not in (1, 2):    # not True, not 2.0
                raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128 blocks), got {getattr(self, name)!r}")
        check_flags(self, ("power_2_scales", "fp8_dpa", "fp8_mha"))
        if self.x_block_scaling_dim == 2 and self.w_block_scaling_dim == 2:
            raise ValueError("2D by 2D block scaling GEMMs are not supported (as in Transformer Engine): "
                             "use x_block_scaling_dim=1")
        if self.grad_block_scaling_dim == 2 and self.w_block_scaling_dim == 2:
            raise ValueError("2D by 2D block scaling GEMMs (grad x weight) are not supported: "
                             "use grad_block_scaling_dim=1")
        if not isinstance(self.block_len, int) or isinstance(self.block_len, bool) or self.block_len < 1:
            raise ValueError(f"block_len must be a positive int (128: DeepSeek-V3's and TE's tiles), got {self.block_len!r}")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("FP8 attention is not supported with Float8BlockScaling (as in Transformer Engine): "
                             "keep fp8_dpa=False and fp8_mha=False")
        super().__post_init__()

    def refusal(self, name: str) -> Optional[str]:
        if name == "block_quantize" and not (self.power_2_scales and self.amax_epsilon == 0.0):
            return ("block_quantize is lesson 09's rule (power-of-two scales, no amax epsilon): keep "
                    "power_2_scales=True and amax_epsilon=0.0")
        return None

@dataclass(frozen=True)
class MXFP8BlockScaling(BlockRecipe):
    """MXFP8 (TE ``MXFP8BlockScaling``, OCP MX v1.0): 32 consecutive elements along the contraction dimension
    share one E8M0 (power-of-two) scale; rowwise and columnwise copies are each quantized from the
    high-precision tensor.

    Fields: margin=0 (TE's field; MX scales have no margin: a nonzero value raises); fp8_format=Format.E4M3
    (HYBRID: E5M2 gradients); scale_rule="rceil": the shared exponent is rounded *up*
    (k = ceil(log2(amax / elem_max)), torchao ``ScaleCalculationMode.RCEIL``, what TE's and cuBLAS' MXFP8
    quantizers compute), so no block max ever exceeds the element max. "floor" is the OCP spec's rule
    (k = floor(log2 amax) - emax_elem), under which a block max up to 2x the element max saturates.
    A learner's lesson 09 ``mx_shared_exponent`` (the floor rule) rides in ``functions`` (only with scale_rule="floor").
    """

    TAKES = exercise_names("mx_shared_exponent", "pad_token_groups", "unpad_token_groups")   # lessons 09 and 13

    margin: int = 0
    fp8_format: Format = Format.E4M3
    scale_rule: str = "rceil"
    block_len: int = 32

    def __post_init__(self):
        if self.margin != 0:
            raise ValueError("MXFP8 scales are powers of two from each block's amax: margin must be 0")
        if self.fp8_format is Format.E5M2:
            raise ValueError("Pure E5M2 training is not supported: use Format.E4M3 or Format.HYBRID")
        if self.scale_rule not in ("rceil", "floor"):
            raise ValueError(f"scale_rule must be 'rceil' or 'floor', got {self.scale_rule!r}")
        if type(self.block_len) is not int or self.block_len != 32:                 # not 32.0, not True
            raise ValueError(f"MX blocks are 32 elements by the OCP MX v1.0 spec: block_len must be 32, got {self.block_len!r}")
        super().__post_init__()

    def refusal(self, name: str) -> Optional[str]:
        if name == "mx_shared_exponent" and self.scale_rule != "floor":
            return "mx_shared_exponent is lesson 09's floor rule: use it with scale_rule='floor' (the mxfp8-floor recipe)"
        return None

@dataclass(frozen=True)
class NVFP4BlockScaling(BlockRecipe):
    """NVFP4 (TE ``NVFP4BlockScaling``): E2M1 data, an E4M3 scale per 16 elements, one FP32 scale per tensor.

    Fields (TE's names; defaults all False = every technique on):
      disable_rht: False applies a 16x16 random Hadamard transform along M to both inputs of the
          weight-gradient GEMM (dy and x; the transform is orthogonal, so dy^T x is unchanged in exact
          arithmetic, while outliers are spread over 16 elements before the FP4 cast).
      disable_stochastic_rounding: False rounds gradients (grad_output) stochastically to E2M1; weights and
          activations round to nearest.
      disable_2d_quantization: False quantizes weights in 16x16 blocks, so forward and backward use the same
          FP4 weight; True uses 1x16 blocks along each GEMM's contraction dimension.
    Keep some layers in BF16 (NVIDIA's 12B run kept about 16% of its linear layers, arXiv 2509.25149).
    A learner's lesson 09 ``nvfp4_scales`` rides in ``functions`` (``engine.nvfp4_scales_from`` applies it to 16x1 and
    16x16 blocks too).
    """

    TAKES = exercise_names("nvfp4_scales")   # lesson 09

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: str = "e2m1"
    fp8_format: Format = Format.E4M3   # the block scales' format
    rht_seed: int = 0

    def __post_init__(self):
        check_flags(self, ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"))
        if type(self.rht_seed) is not int:
            raise TypeError(f"rht_seed must be an int (the random Hadamard transform's sign seed), got "
                            f"{self.rht_seed!r}")
        if self.fp4_format != "e2m1":
            raise ValueError(f"NVFP4's elements are E2M1 (TE fixes it): fp4_format must be 'e2m1', got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError("NVFP4's block scales are E4M3 (TE fixes it): fp8_format must be Format.E4M3, "
                             f"got {self.fp8_format!r}")
        super().__post_init__()


BACKWARD_OPERANDS = ("source", "dequantized")


@dataclass(frozen=True)
class PerDirectionBlockScaling(BlockRecipe):
    """One format for the forward GEMM, another for the two backward GEMMs (e.g. MXFP8 forward, NVFP4 backward).

    Fields:
      fwd_recipe: the block recipe of fprop's operands, x and W (``MXFP8BlockScaling()``).
      bwd_recipe: the block recipe of dgrad's and wgrad's operands, dy, W and x (``NVFP4BlockScaling()``: its RHT
          and stochastic-rounding settings apply to the backward tensors exactly as in a plain NVFP4 run).
      backward_operand: what the backward copies of W (for dgrad) and x (for wgrad) are quantized from:
          "source": the high-precision tensor, as every single-format recipe does (TE's default: "both versions
          are computed from the high precision input to avoid double quantization errors");
          "dequantized": the forward's dequantized copy, Q_bwd(dequant(Q_fwd(t))): a double quantization, what a
          backward that keeps only the forward's low-precision copy can do.
    ``direction_recipe`` says which of the two quantizes a (role, axis); ``block_for`` and the engine follow it.

    Transformer Engine states this with ``CustomRecipe(qfactory=...)`` (a quantizer per tensor role) and a
    ``backward_override`` field on its recipes (None | "high_precision" | "dequantized"; its "dequantized" hands
    the backward GEMMs the dequantized saved operands in high precision, while here that value is quantized
    again in the backward format). Source: NVIDIA/TransformerEngine ``transformer_engine/common/recipe/__init__.py``.
    """

    fwd_recipe: BlockRecipe = MXFP8BlockScaling()
    bwd_recipe: BlockRecipe = NVFP4BlockScaling()
    backward_operand: str = "source"

    def __post_init__(self):
        for name in ("fwd_recipe", "bwd_recipe"):
            r = getattr(self, name)
            if not isinstance(r, BlockRecipe) or isinstance(r, PerDirectionBlockScaling):
                raise TypeError(f"{name} must be a single-format block recipe (one of "
                                f"{', '.join(c.__name__ for c in BLOCK_RECIPES)}), got {r!r}")
        if self.backward_operand not in BACKWARD_OPERANDS:
            raise ValueError(f"backward_operand must be 'source' (re-quantize W and x from the high-precision "
                             f"tensors) or 'dequantized' (from the forward's dequantized copies), "
                             f"got {self.backward_operand!r}")
        super().__post_init__()


BLOCK_RECIPES = (Float8RowwiseScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def direction_recipe(recipe: BlockRecipe, role: str, axis: int) -> BlockRecipe:
    """The single-format recipe that quantizes ``role``'s tensor along ``axis``: x and W along axis 1 are fprop's
    operands (the forward recipe); dy (both axes), W along axis 0 (dgrad) and x along axis 0 (wgrad) are the
    backward GEMMs' (the backward recipe). A single-format recipe is its own forward and backward recipe."""
    check_role_axis(role, axis)
    if not isinstance(recipe, PerDirectionBlockScaling):
        return recipe
    return recipe.fwd_recipe if role != "grad_output" and axis == 1 else recipe.bwd_recipe


def backward_operand(recipe) -> str:
    """What ``recipe``'s backward copies of W and x are quantized from: "source" or "dequantized"."""
    return recipe.backward_operand if isinstance(recipe, PerDirectionBlockScaling) else "source"


def _rowwise_block(recipe: Float8RowwiseScaling, role: str, axis: int) -> tuple[int, int]:
    return _along(axis, -1)                         # one scale per row (axis 1) or column (axis 0)


def _fp8_block(recipe: Float8BlockScaling, role: str, axis: int) -> tuple[int, int]:
    dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
           "grad_output": recipe.grad_block_scaling_dim}[role]
    return (recipe.block_len, recipe.block_len) if dim == 2 else _along(axis, recipe.block_len)


def _mx_block(recipe: MXFP8BlockScaling, role: str, axis: int) -> tuple[int, int]:
    return _along(axis, recipe.block_len)


def _nvfp4_block(recipe: NVFP4BlockScaling, role: str, axis: int) -> tuple[int, int]:
    return (16, 16) if role == "weight" and not recipe.disable_2d_quantization else _along(axis, 16)


#: the block each single-format recipe scales a (role, axis) in, by the recipe's class (one lookup, no ladder)
BLOCKS = {Float8RowwiseScaling: _rowwise_block, Float8BlockScaling: _fp8_block, MXFP8BlockScaling: _mx_block,
          NVFP4BlockScaling: _nvfp4_block}


def block_for(recipe: BlockRecipe, role: str, axis: int) -> tuple[int, int]:
    """The block a ``recipe`` scales ``role``'s tensor in when ``axis`` is the GEMM's contraction dimension."""
    recipe = direction_recipe(recipe, role, axis)
    rule = next((BLOCKS[c] for c in type(recipe).__mro__ if c in BLOCKS), None)
    if rule is None:
        raise TypeError(f"block_for takes a block recipe ({', '.join(r.__name__ for r in BLOCK_RECIPES)}), "
                        f"got {recipe!r}")
    return rule(recipe, role, axis)


def token_multiple(recipe) -> int:
    """The number the token count M of a linear layer's input (its rows, flattened) must be a multiple of for
    ``recipe`` to train it: the weight-gradient GEMM scales x and dy in blocks along M (1: any count)."""
    if not isinstance(recipe, BlockRecipe):
        return 1
    return max(max(block_for(recipe, role, 0)[0], 1) for role in ("input", "grad_output"))

