"""FP8 training as Transformer Engine defines it, small enough to read (lessons 07 and 08).

* ``tensor``: per-tensor scaled casts (``quantize``, ``compute_scale``, ``Float8Tensor``).
* ``recipe``: ``Format``, ``DelayedScaling``, ``CurrentScaling`` and the delayed-scaling update.
* ``gemm``: one FP8 GEMM through ``torch._scaled_mm`` with its layout/shape/device rules.
* ``region``: the FP8 region, TE's ``autocast`` (older spelling ``fp8_autocast``), and when delayed
  scales update (plus the amax all-reduce).
* ``linear``: ``Float8Linear``, ``convert_to_float8_training`` and torchao's ``Float8LinearConfig``.

Sources: Micikevicius et al. 2022 (arXiv 2209.05433); NVIDIA/TransformerEngine
``common/recipe/__init__.py``, ``pytorch/quantization.py``, ``common/recipe/delayed_scaling.cu``;
pytorch/ao ``torchao/float8``.
"""
from .region import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from .gemm import check_fp8_gemm_supported, fp8_gemm, fp8_gemm_support_error
from .linear import Float8Linear, Float8LinearConfig, convert_to_float8_training
from .recipe import (ROLES, CurrentScaling, DelayedScaling, DelayedScalingState, Float8CurrentScaling, Format,
                     amax_and_scale_update, fp8_format_for)
from .tensor import (FP8_DTYPES, FP32_MAX, Float8Tensor, compute_amax, compute_scale, fp8_dtype, fp8_format_name,
                     fp8_max, quantize, quantize_current, round_down_to_power_of_2)

__all__ = [
    "FP8_DTYPES", "FP32_MAX", "Float8Tensor", "compute_amax", "compute_scale", "fp8_dtype", "fp8_format_name",
    "fp8_max", "quantize", "quantize_current", "round_down_to_power_of_2",
    "Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "DelayedScalingState",
    "amax_and_scale_update", "fp8_format_for", "ROLES",
    "fp8_gemm", "check_fp8_gemm_supported", "fp8_gemm_support_error",
    "autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled",
    "Float8Linear", "Float8LinearConfig", "convert_to_float8_training",
]
