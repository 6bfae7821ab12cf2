"""Quantized training as Transformer Engine and torchao define it, small enough to read (lessons 07, 08 and 10).

The rules, one plain function each (no kernel, no fast path, no learner's hook):
* ``tensor``: per-tensor scaled casts (``compute_amax``, ``compute_scale``, lesson 07's ``quantize``, ``to_float8``
  (the same cast as a ``Float8Tensor``), ``quantize_current``, ``Float8Tensor``).
* ``delayed``: the delayed-scaling update (``amax_and_scale_update``, ``DelayedScalingState``).
* ``scaled``: ``ScaledTensor``, scales of any granularity; ``blockwise``: ``quantize_fp32_scaled``,
  ``block_quantize`` (tensorwise, rowwise, 1x128, 128x128); ``mx``: ``mx_shared_exponent``, ``quantize_mx``;
  ``nvfp4``: ``two_level_scales`` (lesson 09's ``nvfp4_scales``), ``quantize_nvfp4``; ``hadamard``: NVFP4's random
  Hadamard transform.
Their kernels, each equal bit for bit to the rule it names: the modules of ``kernels/`` (torch fast paths by concern,
and numba's compiled passes, ``kernels.loops``). No rule imports them.
Configuration and the engine:
* ``recipe``: ``QuantizationRecipe`` (TE's ``Recipe``), ``Format``, ``DelayedScaling``, ``Float8CurrentScaling`` (TE's fields and defaults).
* ``block_recipes``: ``BlockRecipe``: ``Float8RowwiseScaling`` (torchao rowwise), ``Float8BlockScaling``,
  ``MXFP8BlockScaling``, ``NVFP4BlockScaling`` (TE's names and defaults); ``PerDirectionBlockScaling``: one of
  them for the forward GEMM, another for the backward GEMMs.
* ``backend``: ``Backend``, every step of the quantizers and GEMMs by name, the rules (``RULES``) or the kernels
  (``KERNELS``); ``choose(kernels)`` is the one place the choice is made.
* ``engine``: builds the quantizers of a recipe, a layer and a role, each running the learner's function where the
  recipe carries one, else its backend's step.
The layers and GEMMs:
* ``gemm``: one FP8 GEMM through ``torch._scaled_mm`` with its layout/shape/device rules.
* ``region``: the FP8 region, TE's ``autocast`` (older spelling ``fp8_autocast``), and when delayed
  scales update (plus the amax all-reduce).
* ``linear``: ``QuantizedLinear`` (alias ``Float8Linear``, torchao's name), ``convert_to_float8_training`` and
  torchao's ``Float8LinearConfig``.
* ``fp8_weights``: ``Float8WeightLinear``, a layer storing its weight only in FP8 with the FP32 master in the
  optimizer (TE ``quantized_model_init``), and ``convert_to_fp8_weights``.
* ``block_gemm``: block-scaled GEMMs via ``F.scaled_mm`` or an exact emulation; an accumulator model.
* ``block_linear``: the autograd function of a linear layer under the block recipes.
* ``module_filter``: which linears convert (``module_filter_fn`` rules): edge blocks high, torchao's small-GEMM rule.

Sources: Micikevicius et al. 2022 (arXiv 2209.05433); NVIDIA/TransformerEngine
``common/recipe/__init__.py``, ``pytorch/quantization.py``, ``common/recipe/delayed_scaling.cu``;
pytorch/ao ``torchao/float8``.
"""
from .region import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from .layers.gemm import check_fp8_gemm_supported, fp8_gemm, fp8_gemm_support_error
from .layers.linear import Float8Linear, Float8LinearConfig, QuantizedLinear, convert_to_float8_training
from .layers.fp8_weights import Float8WeightLinear, convert_to_fp8_weights
from .recipe import (ROLES, CurrentScaling, DelayedScaling, Float8CurrentScaling, Format, QuantizationRecipe, Recipe,
                     fp8_format_for)
from .rules.delayed import DelayedScalingState, amax_and_scale_update
from .layers.block_gemm import accumulator_model_gemm, emulated_gemm, scaled_gemm
from .block_recipes import (BLOCK_RECIPES, token_multiple, BlockRecipe, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling, PerDirectionBlockScaling)
from .rules.scaled import ScaledTensor
from .rules.blockwise import block_quantize, quantize_fp32_scaled
from .rules.mx import mx_shared_exponent, quantize_mx
from .rules.nvfp4 import quantize_nvfp4, two_level_scales
from .engine import quantizers
from .layers.module_filter import (all_of, block_containers, block_index, check_filter, edge_blocks_filter, is_small_gemm,
                            small_gemm_filter, split_by_filter)
from .rules.tensor import (FP8_DTYPES, FP32_MAX, Float8Tensor, compute_amax, compute_scale, fp8_dtype, fp8_format_name,
                     fp8_max, quantize, quantize_current, round_down_to_power_of_2, to_float8)

__all__ = [
    "FP8_DTYPES", "FP32_MAX", "Float8Tensor", "compute_amax", "compute_scale", "fp8_dtype", "fp8_format_name",
    "fp8_max", "quantize", "quantize_current", "to_float8", "round_down_to_power_of_2",
    "Recipe", "QuantizationRecipe", "BlockRecipe", "quantizers", "block_quantize", "two_level_scales",
    "Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "DelayedScalingState",
    "amax_and_scale_update", "fp8_format_for", "ROLES",
    "fp8_gemm", "check_fp8_gemm_supported", "fp8_gemm_support_error",
    "autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled",
    "QuantizedLinear", "Float8Linear", "Float8LinearConfig", "convert_to_float8_training", "Float8WeightLinear", "convert_to_fp8_weights",
    "ScaledTensor", "quantize_fp32_scaled", "quantize_mx", "quantize_nvfp4", "mx_shared_exponent",
    "scaled_gemm", "emulated_gemm", "accumulator_model_gemm",
    "Float8RowwiseScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "BLOCK_RECIPES", "token_multiple",
    "PerDirectionBlockScaling",
    "all_of", "block_containers", "block_index", "check_filter", "edge_blocks_filter", "is_small_gemm",
    "small_gemm_filter", "split_by_filter",
]
