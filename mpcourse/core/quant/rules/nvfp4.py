"""The NVFP4 rule (NVIDIA, "Pretraining LLMs with NVFP4", arXiv 2509.25149; torchao ``nvfp4_quantize`` with a
per-tensor scale; ``two_level_scales`` is what lesson 09's exercise ``nvfp4_scales`` computes): E2M1 data, an E4M3
decode scale per 16 elements, one FP32 decode scale per tensor.

Edges (``quantize_nvfp4`` states them): the course keeps the tensor decode scale t a normal FP32 (at least 2^-126),
so that every block whose scale lands in E4M3's normal range decodes within the format's error, however small the
tensor, and flushes whole the blocks two such scales cannot represent; no finite input becomes NaN. torchao 0.18 does
not: below amax ~ 5e-34 its (1 / t) / s overflows FP32 for a block scale s at E4M3's floor 2^-6, and an all-zero
block there becomes 0 * inf = NaN (``edges="torchao"`` keeps that, bit for bit). Transformer Engine caps its encode
scale 2688 / amax and each block's encode multiplier at FP32 max instead (``common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4``, ``compute_scaling_coefficient``): no NaN, but a block whose multiplier
the cap cuts decodes smaller than it is.

The kernel of ``quantize_nvfp4`` is ``kernels.nvfp4_quant.quantize_nvfp4`` (the E2M1 rounding in ``kernels.e2m1.round_e2m1``, numba's
one pass in ``kernels.nvfp4_passes`` where it applies, from the rule's own random draws), equal bit for bit
(``tests/core/quant/kernels/test_quant_fused.py``, ``test_quant_fastpath.py``); ``engine`` chooses between them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...formats import FORMATS
from .tensor import compute_amax
from .scaled import ScaledTensor, block_amax, block_view, cast_elements, check_edges, expand, resolve_block

E4M3_MAX, E2M1_MAX = FORMATS["e4m3"].max, FORMATS["e2m1"].max
#: the smallest tensor decode scale t of the course's rule (amax > 0): FP32's smallest normal 2^-126, so that t is
#: never a subnormal (which holds fewer than 24 significant bits, 0 below amax ~ 2e-42, and whose 1 / t overflows)
NVFP4_MIN_TENSOR_SCALE_INV = 2.0 ** -126
#: below this t (amax < 448 * 6 * 2^-121, about 1.0e-33) an encode multiplier 1 / (s t) can pass FP32's max (up to
#: 2^132 at t = 2^-126, s = 2^-6): there the rule scales x by ``NVFP4_ENCODE_PRESHIFT`` first and the multipliers by
#: its inverse (both exact), and flushes whole the blocks whose scale falls below E4M3's smallest normal
NVFP4_TINY_TENSOR_SCALE_INV = 2.0 ** -121
NVFP4_ENCODE_PRESHIFT = 2.0 ** 6
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
    positive amax below 448 * 6 * 2^-126 (about 3.2e-35), ``NVFP4_MIN_TENSOR_SCALE_INV`` = 2^-126 (``edges="torchao"``:
    the quotient, even where it is subnormal or 0). Zero stays 0, inf and NaN stay inf and NaN."""
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


def two_level_scales(x: torch.Tensor, block=(1, 16), tensor_amax: Optional[torch.Tensor] = None, edges: str = "course"):
    """NVFP4's two scale levels, (t () float32, s (M/r, K/c) float8_e4m3fn) for x (M, K) (lesson 09's exercise
    ``nvfp4_scales(x)`` computes them for 1x16 blocks).

        t   = amax(x) / (448 * 6)                        FP32, per tensor (``nvfp4_tensor_scale_inv``: >= 2^-126)
        s_b = e4m3(clamp(amax_b / 6 / t, 2^-6, 448))     E4M3, per block (2^-6 as torchao)
        s_b = 0  where t < 2^-121 and amax_b / 6 / t < 2^-6   (``edges="course"``: the block is flushed whole)
    An all-zero tensor (t = 0) divides by 1 instead. ``tensor_amax``: the tensor's amax, if known.
    ``quantize_nvfp4`` says why the floor and the flush.
    """
    amax_b = block_amax(x, resolve_block(x.shape, check_nvfp4_block(block)))     # (M/r, K/c) fp32
    # max |x| is the largest block max (exact, NaN propagates): no second pass over x
    amax_t = given_tensor_amax(tensor_amax, amax_b)
    t = nvfp4_tensor_scale_inv(amax_t, edges)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    v = (amax_b / E2M1_MAX) / safe_t                          # (M/r, K/c) fp32, the scale each block asks for
    s = v.clamp(FORMATS["e4m3"].min_normal, E4M3_MAX)
    if edges == "course":
        s = torch.where(tiny_tensor(t) & (v < FORMATS["e4m3"].min_normal), 0.0, s)     # flushed whole
    return t, s.to(torch.float8_e4m3fn)


def tiny_tensor(t: torch.Tensor) -> torch.Tensor:
    """() bool: is t (the course's) below ``NVFP4_TINY_TENSOR_SCALE_INV``, where the encode pre-shifts x and flushes
    the blocks E4M3's normal scales cannot reach? (t 0, inf or NaN: False.)"""
    return (t > 0) & (t < NVFP4_TINY_TENSOR_SCALE_INV)


def encode_multipliers(t: torch.Tensor, s: torch.Tensor, edges: str = "course") -> tuple[torch.Tensor, torch.Tensor]:
    """(recip (M/r, K/c) float32, pre () float32): the encode is y = (x * pre) * recip, with
    recip = ((1 / t') / pre) / float32(s) (t' = t, or 1 where t is not > 0) and 0 where s is 0 (a flushed block);
    pre = ``NVFP4_ENCODE_PRESHIFT`` where t is tiny (``tiny_tensor``, ``edges="course"``), else 1. Both products by
    pre are exact, so y is (x * (1 / t')) / s's one-rounding product as if FP32 had the exponents above 2^128."""
    check_edges(edges)
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    shift = tiny_tensor(t) if edges == "course" else torch.zeros((), dtype=torch.bool, device=t.device)
    pre = torch.where(shift, NVFP4_ENCODE_PRESHIFT, 1.0).to(torch.float32)      # () fp32
    sf = s.float()
    recip = ((1.0 / safe_t) / pre) / sf                       # (M/r, K/c) fp32
    return torch.where(sf == 0, 0.0, recip), pre


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                   edges: str = "course") -> ScaledTensor:
    """NVFP4: E2M1 data, an E4M3 decode scale per 16 elements and one FP32 decode scale per tensor.

    Two-level rule (``two_level_scales``), then per element (``encode_multipliers``; pre = 1 but in tiny tensors):
        q   = e2m1(saturate((x * pre) * (((1 / t) / pre) / float32(s_b))))
        x  ~= float32(q) * (float32(s_b) * t)
    block: (1, 16), (16, 1) or (16, 16) (2-D weight blocks). rounding: "nearest" or "stochastic" (gradients).

    The edges (lesson 09 states them):
    * an all-zero tensor gets t = 0 and is stored as zeros with t = 0 (it divides by 1: dequantizes to zeros, no
      NaN; torchao's t = 0 gives NaN there, and ``edges="torchao"`` keeps the course's zeros).
    * t is never an FP32 subnormal: below amax = 448 * 6 * 2^-126 (about 3.2e-35) it is 2^-126, FP32's smallest
      normal (``NVFP4_MIN_TENSOR_SCALE_INV``). Why: a subnormal t = amax / 2688 holds fewer than 24 significant bits
      (none below amax ~ 2e-42, where it is 0) and its 1 / t overflows FP32, while with a normal t and a block scale
      in E4M3's normal range [2^-6, 448] the decode multiplier s t is at least 2^-132 and every decoded value
      q s t an FP32 number (exact at t = 2^-126; else rounded by at most 2^-17 of itself). Every block whose scale
      amax_b / 6 / t lands in that range decodes as in any tensor, however small: its largest element within E4M3's
      rounding of the scale (1/16 of it), every element within half an E2M1 step (in units of s t) of itself
      (or saturating at 6 s t where E4M3 rounded s down): amax 1e-38 and 3e-39 keep their blocks.
    * below t = 2^-121 (amax under about 1.0e-33: ``NVFP4_TINY_TENSOR_SCALE_INV``) the encode multiplier 1 / (s t)
      can pass FP32's max (2^132 at t = 2^-126, s = 2^-6): x is multiplied by 2^6 first and the multiplier divided
      by 2^6 (both exact), which gives the products the formula has with FP32's exponent range unbounded. There a
      block whose scale falls below E4M3's smallest normal (amax_b / 6 / t < 2^-6) is flushed whole: s = 0, every
      element +-0. The two scales cannot represent it: at t = 2^-126 no smaller normal t exists (every block under
      6 * 2^-132, about 1.1e-39: tensors of amax 1e-40 or 1e-45 flush entirely), and above it t is set by the
      tensor's largest block; the clamp at 2^-6 would decode such a block on a grid too coarse for it, keeping some
      of its values (rounded by up to half their size) and flushing the others.
      ``edges="torchao"`` keeps torchao 0.18's t = amax / 2688 there, unclamped, and its encode: below amax ~ 5e-34,
      (1 / t) / s overflows to inf for a block at the 2^-6 floor, so an all-zero block becomes NaN and others saturate.
    * in a tensor at or above t = 2^-121 (every tensor of amax 1.0e-33 or more), a block whose scale falls below
      E4M3's smallest normal keeps s = 2^-6 (torchao's clamp, bit for bit with torchao): it decodes in steps of
      0.5 * 2^-6 * t, smaller elements round to zero.
    * an inf makes t infinite (no infinite amax is defined): every element dequantizes to NaN, so the overflow is
      not hidden (torchao the same).
    """
    b = resolve_block(x.shape, check_nvfp4_block(block))
    t, s = two_level_scales(x, b, tensor_amax, edges)
    return encode_nvfp4(x, b, t, s, rounding, generator, edges)


def encode_nvfp4(x: torch.Tensor, block: tuple[int, int], t: torch.Tensor, s: torch.Tensor, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None, edges: str = "course") -> ScaledTensor:
    """The ScaledTensor of x (M, K) in E2M1 with the tensor scale t and the block scales s of a resolved block."""
    check_nvfp4_block(block)
    recip, pre = encode_multipliers(t, s, edges)               # (M/r, K/c) fp32, () fp32
    y = block_view(x.float() * pre, block) * expand(recip, block)       # x * pre: exact
    data = cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return ScaledTensor(data, s, block, "e2m1", t, x.dtype)
