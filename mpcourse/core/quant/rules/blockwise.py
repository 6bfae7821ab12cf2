"""The rule of FP8 with one FP32 scale per block (lesson 09's ``block_quantize``): tensorwise, rowwise (torchao),
1x128 tiles and 128x128 blocks (DeepSeek-V3 section 3.3, TE ``Float8BlockScaling``).

Per block of ``block = (rows, cols)`` elements (``-1``: the whole dimension):

    amax  = max |x| over the block                      (M/r, K/c) FP32
    scale = fp8_max / amax / 2**margin                  ``tensor.compute_scale``: amax 0, inf or NaN -> 1.0;
                                                        FP32 max where the division overflows (amax below
                                                        ~1.3e-36 for E4M3: TE's cap, no NaN);
                                                        power_2_scale rounds it down to a power of two
    data  = fp8(saturate(x * scale))                    ``scale_inv = 1 / scale`` is what GEMMs read

The kernel of ``quantize_fp32_scaled`` is ``kernels.blocks.quantize_fp32_scaled`` (numba's one pass in ``kernels.fp8_passes`` where it
applies), equal bit for bit (``tests/core/quant/kernels/test_quant_fused.py``); ``engine`` chooses between them.
"""
from __future__ import annotations

import torch

from ...formats import FORMATS
from .scaled import ScaledTensor, block_amax, block_view, cast_elements, expand, resolve_block
from .tensor import apply_amax_epsilon, compute_scale, fp8_format_name


def quantize_fp32_scaled(x: torch.Tensor, block, fp8_format="e4m3", *, margin: int = 0, power_2_scale: bool = False,
                         amax_epsilon: float = 0.0) -> ScaledTensor:
    """FP8 with one FP32 scale per block, each from its own amax: ``scale = fp8_max / amax / 2**margin``.

    x: (M, K) float32/bfloat16/float16. block: e.g. (-1, -1) tensorwise, (1, -1) rowwise, (1, 128), (128, 128).
    Zero, inf or NaN block amax gives scale 1.0 (TE's current-scaling rule, ``compute_scale``); power_2_scale
    rounds each scale down to a power of two (TE Float8BlockScaling's default, torchao rowwise).
    """
    name = fp8_format_name(fp8_format)
    b = resolve_block(x.shape, block)
    amax = apply_amax_epsilon(block_amax(x, b), amax_epsilon)     # (M/r, K/c) fp32
    scale = compute_scale(amax, FORMATS[name].max, margin, None, power_2_scale)
    return encode_fp32_scaled(x, b, name, scale)


def encode_fp32_scaled(x: torch.Tensor, block: tuple[int, int], fp8_format: str, scale: torch.Tensor) -> ScaledTensor:
    """The ScaledTensor of x (M, K) cast to ``fp8_format`` with the scales (M/r, K/c) of a resolved ``block``."""
    y = block_view(x.float(), block) * expand(scale, block)      # (M/r, r, K/c, c) fp32, one rounding
    data = cast_elements(y, fp8_format).reshape(x.shape)
    return ScaledTensor(data, scale.reciprocal(), block, fp8_format, None, x.dtype)


def block_quantize(x: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Lesson 09's block quantizer: (data float8_e4m3fn (M, K), scale_inv float32 (M/rows, K/cols)), E4M3 with a
    power-of-two scale per block (TE ``Float8BlockScaling``'s defaults)."""
    q = quantize_fp32_scaled(x, block, "e4m3", power_2_scale=True)
    return q.data, q.scale_inv
