"""The NVFP4 rule (NVIDIA, "Pretraining LLMs with NVFP4", arXiv 2509.25149; torchao ``nvfp4_quantize`` with a
per-tensor scale; lesson 09's ``nvfp4_scales``): E2M1 data, an E4M3 decode scale per 16 elements, one FP32 decode
scale per tensor.

The kernel of ``quantize_nvfp4`` is ``fastpath.quantize_nvfp4`` (the E2M1 rounding in ``fastpath.round_e2m1``, numba's
one pass in ``fused`` where it applies, from the rule's own random draws), equal bit for bit
(``tests/test_quant_fused.py``, ``test_quant_fastpath.py``); ``engine`` chooses between them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import FORMATS
from .tensor import compute_amax
from .scaled import ScaledTensor, block_amax, block_view, cast_elements, expand, resolve_block

E4M3_MAX, E2M1_MAX = FORMATS["e4m3"].max, FORMATS["e2m1"].max


def nvfp4_tensor_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The FP32 per-tensor decode scale: amax / (448 * 6), so the largest block scale maps near E4M3's max."""
    return amax.float() / (E4M3_MAX * E2M1_MAX)


def nvfp4_scales(x: torch.Tensor, block=(1, 16), tensor_amax: Optional[torch.Tensor] = None):
    """Lesson 09's two scale levels: (t () float32, s (M/r, K/c) float8_e4m3fn) for x (M, K).

        t   = amax(x) / (448 * 6)                        FP32, per tensor (``tensor_scale_inv``)
        s_b = e4m3(clamp(amax_b / 6 / t, 2^-6, 448))     E4M3, per block (2^-6 as torchao)
    An all-zero tensor (t = 0) divides by 1 instead. ``tensor_amax``: the tensor's amax, if known.
    """
    amax_b = block_amax(x, resolve_block(x.shape, block))     # (M/r, K/c) fp32
    # max |x| is the largest block max (exact, NaN propagates): no second pass over x
    amax_t = (compute_amax(amax_b) if tensor_amax is None else tensor_amax.float()).reshape(())
    t = nvfp4_tensor_scale_inv(amax_t)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    s = ((amax_b / E2M1_MAX) / safe_t).clamp(FORMATS["e4m3"].min_normal, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None) -> ScaledTensor:
    """NVFP4: E2M1 data, an E4M3 decode scale per 16 elements and one FP32 decode scale per tensor.

    Two-level rule (``nvfp4_scales``), then per element:
        q   = e2m1(saturate(x * ((1 / t) / float32(s_b))))
        x  ~= float32(q) * (float32(s_b) * t)
    block: (1, 16), (16, 1) or (16, 16) (2-D weight blocks). rounding: "nearest" or "stochastic" (gradients).
    An all-zero tensor gets t = 0 and is stored as zeros with t = 0 (dequantizes to zeros, no NaN).
    """
    b = resolve_block(x.shape, block)
    t, s = nvfp4_scales(x, b, tensor_amax)
    return encode_nvfp4(x, b, t, s, rounding, generator)


def encode_nvfp4(x: torch.Tensor, block: tuple[int, int], t: torch.Tensor, s: torch.Tensor, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None) -> ScaledTensor:
    """The ScaledTensor of x (M, K) in E2M1 with the tensor scale t and the block scales s of a resolved block."""
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    recip = (1.0 / safe_t) / s.float()                          # (M/r, K/c) fp32
    y = block_view(x.float(), block) * expand(recip, block)
    data = cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return ScaledTensor(data, s, block, "e2m1", t, x.dtype)
