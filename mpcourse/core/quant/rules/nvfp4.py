"""The NVFP4 rule (NVIDIA, "Pretraining LLMs with NVFP4", arXiv 2509.25149; torchao ``nvfp4_quantize`` with a
per-tensor scale; lesson 09's ``nvfp4_scales``): E2M1 data, an E4M3 decode scale per 16 elements, one FP32 decode
scale per tensor.

Edges (``quantize_nvfp4`` states them): the course keeps the tensor decode scale t at or above 2^-121, so that every
block's encode multiplier 1 / (s t) is a finite FP32 and no finite input becomes NaN. torchao 0.18 does not: below
amax ~ 5e-34 its (1 / t) / s overflows FP32 for a block scale s at E4M3's floor 2^-6, and an all-zero block there
becomes 0 * inf = NaN (``edges="torchao"`` keeps that, bit for bit). Transformer Engine caps its encode scale
2688 / amax and each block's encode multiplier at FP32 max instead (``common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4``, ``compute_scaling_coefficient``): no NaN, but a block whose multiplier
the cap cuts decodes smaller than it is.

The kernel of ``quantize_nvfp4`` is ``fastpath.quantize_nvfp4`` (the E2M1 rounding in ``fastpath.round_e2m1``, numba's
one pass in ``fused`` where it applies, from the rule's own random draws), equal bit for bit
(``tests/core/quant/kernels/test_quant_fused.py``, ``test_quant_fastpath.py``); ``engine`` chooses between them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...formats import FORMATS
from .tensor import compute_amax
from .scaled import ScaledTensor, block_amax, block_view, cast_elements, check_edges, expand, resolve_block

E4M3_MAX, E2M1_MAX = FORMATS["e4m3"].max, FORMATS["e2m1"].max
#: the smallest tensor decode scale t of the course's rule (amax > 0): 2^-121 = 2^-127 / 2^-6, so that with block
#: scales s >= 2^-6 (E4M3's smallest normal, where the rule clamps them) every encode multiplier (1 / t) / s is at
#: most 2^127, a finite FP32, and every decode multiplier s t at least 2^-127 (E8M0's smallest scale, for comparison)
NVFP4_MIN_TENSOR_SCALE_INV = 2.0 ** -121
#: NVIDIA's NVFP4 (arXiv 2509.25149): 16 consecutive elements share an E4M3 scale, along a row (1, 16) or a column
#: (16, 1); weights in 16 x 16 blocks (2-D quantization), so that the forward and the backward GEMM see the same values
NVFP4_BLOCKS = ((1, 16), (16, 1), (16, 16))


def check_nvfp4_block(block) -> tuple[int, int]:
    """``block`` as a tuple if it is one of ``NVFP4_BLOCKS``; ValueError naming them otherwise (another shape would
    give block scales of another granularity under NVFP4's name)."""
    b = tuple(block) if isinstance(block, (tuple, list)) else block
    if b not in NVFP4_BLOCKS or any(isinstance(n, bool) for n in b):
        raise ValueError(f"NVFP4 blocks are (1, 16), (16, 1) or (16, 16) (16 elements share an E4M3 scale; 16 x 16 "
                         f"for 2-D weight blocks), got {b!r}")
    return b


def nvfp4_tensor_scale_inv(amax: torch.Tensor, edges: str = "course") -> torch.Tensor:
    """The FP32 per-tensor decode scale: amax / (448 * 6), so the largest block scale maps near E4M3's max; for a
    positive amax below 448 * 6 * 2^-121 (about 1.0e-33), ``NVFP4_MIN_TENSOR_SCALE_INV`` (``edges="torchao"``: the
    quotient, even where it is subnormal or 0). Zero stays 0, inf and NaN stay inf and NaN."""
    check_edges(edges)
    t = amax.float() / (E4M3_MAX * E2M1_MAX)
    if edges == "course":
        t = torch.where((amax > 0) & (t < NVFP4_MIN_TENSOR_SCALE_INV), NVFP4_MIN_TENSOR_SCALE_INV, t)
    return t


def given_tensor_amax(tensor_amax, amax_b: torch.Tensor) -> torch.Tensor:
    """The tensor amax the rule uses, an FP32 tensor of shape (): max |x| from the block amaxes ``amax_b`` when
    ``tensor_amax`` is None, else ``tensor_amax`` (a number or a one-element tensor, e.g. a delayed amax; NaN passes
    as NaN). A negative one or one of several elements is a ValueError: it has no meaning as an amax, and the rule
    would otherwise store a negative tensor scale (every element decoded with its sign flipped) or fail in a reshape."""
    if tensor_amax is None:
        return compute_amax(amax_b).reshape(())
    amax = torch.as_tensor(tensor_amax, dtype=torch.float32, device=amax_b.device)
    if amax.numel() != 1:
        raise ValueError(f"tensor_amax must be one number (the tensor's max |x|), got shape {tuple(amax.shape)}")
    if bool(amax < 0):
        raise ValueError(f"tensor_amax must be >= 0 (a max of magnitudes), got {amax.item()!r}")
    return amax.reshape(())


def nvfp4_scales(x: torch.Tensor, block=(1, 16), tensor_amax: Optional[torch.Tensor] = None, edges: str = "course"):
    """Lesson 09's two scale levels: (t () float32, s (M/r, K/c) float8_e4m3fn) for x (M, K).

        t   = amax(x) / (448 * 6)                        FP32, per tensor (``nvfp4_tensor_scale_inv``: >= 2^-121)
        s_b = e4m3(clamp(amax_b / 6 / t, 2^-6, 448))     E4M3, per block (2^-6 as torchao)
    An all-zero tensor (t = 0) divides by 1 instead. ``tensor_amax``: the tensor's amax, if known.
    """
    amax_b = block_amax(x, resolve_block(x.shape, check_nvfp4_block(block)))     # (M/r, K/c) fp32
    # max |x| is the largest block max (exact, NaN propagates): no second pass over x
    amax_t = given_tensor_amax(tensor_amax, amax_b)
    t = nvfp4_tensor_scale_inv(amax_t, edges)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    s = ((amax_b / E2M1_MAX) / safe_t).clamp(FORMATS["e4m3"].min_normal, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                   edges: str = "course") -> ScaledTensor:
    """NVFP4: E2M1 data, an E4M3 decode scale per 16 elements and one FP32 decode scale per tensor.

    Two-level rule (``nvfp4_scales``), then per element:
        q   = e2m1(saturate(x * ((1 / t) / float32(s_b))))
        x  ~= float32(q) * (float32(s_b) * t)
    block: (1, 16), (16, 1) or (16, 16) (2-D weight blocks). rounding: "nearest" or "stochastic" (gradients).

    The edges (lesson 09 states them):
    * an all-zero tensor gets t = 0 and is stored as zeros with t = 0 (it divides by 1: dequantizes to zeros, no
      NaN; torchao's t = 0 gives NaN there, and ``edges="torchao"`` keeps the course's zeros).
    * a tensor of amax below 448 * 6 * 2^-121 (about 1.0e-33, FP32 subnormals included) gets t = 2^-121
      (``NVFP4_MIN_TENSOR_SCALE_INV``): its blocks' E4M3 scales land below 448, its decode multipliers s t stay at
      or above 2^-127 and every element decodes to within half an E2M1 step (in units of s t) of itself, as in any
      tensor (or saturates at 6 s t where E4M3 rounded s down); the smallest non-zero value is 0.5 * 2^-127 =
      2^-128 (as MXFP4's), smaller magnitudes round to 0 or to it.
      ``edges="torchao"`` keeps torchao 0.18's t = amax / 2688 there: below amax ~ 5e-34, (1 / t) / s overflows to
      inf for a block at the 2^-6 floor, so an all-zero block becomes NaN and others saturate.
    * a block whose scale falls below E4M3's smallest normal (amax_b / 6 / t < 2^-6) keeps s = 2^-6 (torchao's
      clamp): it decodes in steps of 0.5 * 2^-6 * t, smaller elements round to zero.
    * an inf makes t infinite (no infinite amax is defined): every element dequantizes to NaN, so the overflow is
      not hidden (torchao the same).
    """
    b = resolve_block(x.shape, check_nvfp4_block(block))
    t, s = nvfp4_scales(x, b, tensor_amax, edges)
    return encode_nvfp4(x, b, t, s, rounding, generator)


def encode_nvfp4(x: torch.Tensor, block: tuple[int, int], t: torch.Tensor, s: torch.Tensor, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None) -> ScaledTensor:
    """The ScaledTensor of x (M, K) in E2M1 with the tensor scale t and the block scales s of a resolved block."""
    check_nvfp4_block(block)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    recip = (1.0 / safe_t) / s.float()                          # (M/r, K/c) fp32
    y = block_view(x.float(), block) * expand(recip, block)
    data = cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return ScaledTensor(data, s, block, "e2m1", t, x.dtype)
