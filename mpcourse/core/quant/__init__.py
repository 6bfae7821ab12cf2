"""FP8 training as Transformer Engine defines it, small enough to read (lessons 07 and 08).

* ``tensor``: per-tensor scaled casts (``quantize``, ``compute_scale``, ``Float8Tensor``).
* ``recipe``: ``Format``, ``DelayedScaling``, ``CurrentScaling`` and the delayed-scaling update.
* ``gemm``: one FP8 GEMM through ``torch._scaled_mm`` with its layout/shape/device rules.
* ``region``: the FP8 region, TE's ``autocast`` (older spelling ``fp8_autocast``), and when delayed
  scales update (plus the amax all-reduce).
* ``linear``: ``Float8Linear``, ``convert_to_float8_training`` and torchao's ``Float8LinearConfig``.
* ``fp8_weights``: ``Float8WeightLinear``, a layer storing its weight only in FP8 with the FP32 master in the
  optimizer (TE ``quantized_model_init``), and ``convert_to_fp8_weights``.
* ``scaled``: ``ScaledTensor``, scales of any granularity (tensorwise, rowwise, 1x128, 128x128, MX, NVFP4).
* ``block_recipes``: ``Float8RowwiseScaling`` (torchao rowwise), ``Float8BlockScaling``, ``MXFP8BlockScaling``,
  ``NVFP4BlockScaling`` (TE's names and defaults), each building a quantizer per role and axis.
* ``block_gemm``: block-scaled GEMMs via ``F.scaled_mm`` or an exact emulation; an accumulator model.
* ``block_linear``: the autograd function of a linear layer under those recipes.

Sources: Micikevicius et al. 2022 (arXiv 2209.05433); NVIDIA/TransformerEngine
``common/recipe/__init__.py``, ``pytorch/quantization.py``, ``common/recipe/delayed_scaling.cu``;
pytorch/ao ``torchao/float8``.
"""
from .region import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from .gemm import check_fp8_gemm_supported, fp8_gemm, fp8_gemm_support_error
from .linear import Float8Linear, Float8LinearConfig, convert_to_float8_training
from .fp8_weights import Float8WeightLinear, convert_to_fp8_weights
from .recipe import (ROLES, CurrentScaling, DelayedScaling, DelayedScalingState, Float8CurrentScaling, Format,
                     amax_and_scale_update, fp8_format_for)
from .block_gemm import accumulator_model_gemm, emulated_gemm, scaled_gemm
from .block_recipes import (BLOCK_RECIPES, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling)
from .scaled import ScaledTensor, mx_shared_exponent, quantize_fp32_scaled, quantize_mx, quantize_nvfp4
from .tensor import (FP8_DTYPES, FP32_MAX, Float8Tensor, compute_amax, compute_scale, fp8_dtype, fp8_format_name,
                     fp8_max, quantize, quantize_current, round_down_to_power_of_2)

__all__ = [
    "FP8_DTYPES", "FP32_MAX", "Float8Tensor", "compute_amax", "compute_scale", "fp8_dtype", "fp8_format_name",
    "fp8_max", "quantize", "quantize_current", "round_down_to_power_of_2",
    "Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "DelayedScalingState",
    "amax_and_scale_update", "fp8_format_for", "ROLES",
    "fp8_gemm", "check_fp8_gemm_supported", "fp8_gemm_support_error",
    "autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled",
    "Float8Linear", "Float8LinearConfig", "convert_to_float8_training", "Float8WeightLinear", "convert_to_fp8_weights",
    "ScaledTensor", "quantize_fp32_scaled", "quantize_mx", "quantize_nvfp4", "mx_shared_exponent",
    "scaled_gemm", "emulated_gemm", "accumulator_model_gemm",
    "Float8RowwiseScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "BLOCK_RECIPES",
]
