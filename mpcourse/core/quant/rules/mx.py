"""The MX rule (OCP MX v1.0 section 6.3; lesson 09's ``mx_shared_exponent``): a block of 32 elements shares one
E8M0 scale 2^k, and each element is ``saturate(x / 2^k)`` in the element format.

Edges (``quantize_mx`` states them): the course divides by 2^k for every k, as the OCP spec writes it, 2^-127 (an
FP32 subnormal, E8M0's smallest value) included, so a block whose exponent clamps at -127 still decodes to within
its element format's error of itself. torchao 0.18's ``to_mx`` divides by 2^-126 there under FLOOR and by 1 under
RCEIL (so does Transformer Engine's MXFP8 quantizer: its ``exp2f_rcp`` returns 1 for the biased exponent 0), which
halves such a block or flushes it to zeros; ``edges="torchao"`` keeps that, bit for bit.

The kernel of ``quantize_mx`` is ``kernels.blocks.quantize_mx`` (its RCEIL scale from ``blocks.rceil_scale_inv``, numba's
one pass in ``kernels.fp8_passes`` where it applies), equal bit for bit (``tests/core/quant/kernels/test_quant_fused.py``, ``test_quant_fastpath.py``);
``engine`` chooses between them.
"""
from __future__ import annotations

import torch

from ...formats import FORMATS
from .scaled import (ELEMENT_FORMATS, ScaledTensor, block_amax, block_view, cast_elements, check_edges, expand,
                     resolve_block)

MX_SCALE_RULES = ("floor", "rceil")
#: OCP MX v1.0 section 5: 32 consecutive elements share one scale, along a row (1, 32) or a column (32, 1)
MX_BLOCKS = ((1, 32), (32, 1))
#: under ``edges="torchao"``, what a block whose scale is 2^-127 (k = -127: amax 0 or below about 2^-118) divides its
#: elements by: torchao's ``to_mx`` divides by 2^-126 under FLOOR (the smallest normal FP32: its source says 2^-127
#: "would be more correct" but Triton flushes FP32 subnormals, pytorch/pytorch#125557) and by 1 under RCEIL (TE's
#: ``exp2f_rcp`` returns 1 for the biased exponent 0), so such a block is halved or flushed to zeros there.
MX_MIN_SCALE_DIVISOR = {"floor": 2.0 ** -126, "rceil": 1.0}


def mx_element_format(elem: str):
    """``FORMATS[elem]`` for an MX element format; ValueError naming the ones there are otherwise."""
    if elem not in ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {ELEMENT_FORMATS}, got {elem!r}")
    return FORMATS[elem]


def check_mx_block(block) -> tuple[int, int]:
    """``block`` as a tuple if it is one of ``MX_BLOCKS``; ValueError naming them otherwise (a (2, 32) block would
    share one scale among 64 elements under MX's name)."""
    b = tuple(block) if isinstance(block, (tuple, list)) else block
    if b not in MX_BLOCKS or any(isinstance(n, bool) for n in b):
        raise ValueError(f"MX blocks are (1, 32) or (32, 1) (OCP MX v1.0: 32 elements share a scale along one "
                         f"dimension), got {b!r}")
    return b


def mx_shared_exponent(amax: torch.Tensor, elem: str, rule: str = "floor") -> torch.Tensor:
    """Unbiased shared exponent k of each block (the scale is 2^k), int64, clamped to E8M0's [-127, 127].

    floor (OCP MX v1.0 section 6.3): k = floor(log2(amax)) - emax_elem, emax_elem = floor(log2(elem max))
      (8 for E4M3, 15 for E5M2, 2 for E2M1/E2M3, 4 for E3M2). The block max can then land above the element
      max (up to 2x) and saturate: [448]*31 + [1000] in E4M3 gives 2^(9-8) = 2, 1000/2 = 500 -> 448.
    rceil (torchao ``ScaleCalculationMode.RCEIL``, cuBLAS' block quantization): k = ceil(log2(amax / elem max)),
      the smallest power of two with amax / 2^k <= elem max: nothing saturates. A subnormal amax / elem max
      above 2^-127 gives k = -126 (its exact ceil), at or below it -127.
    floor(log2(amax)) is read from the FP32 exponent field (exact). amax 0 gives k = -127 (torchao's floor
    path reads the zero exponent field the same way); NaN amax is handled by the caller.
    """
    fmt = mx_element_format(elem)
    a = amax.float()
    if rule == "floor":
        e32 = (a.view(torch.int32) >> 23) & 0xFF               # FP32 exponent field (int32; the sign dropped)
        k = e32 - (127 + fmt.emax)
    elif rule == "rceil":
        descale = a / fmt.max                                  # fp32 division, as torchao's fallback
        # ceil(log2(d)) exactly from the bits: exponent, +1 if any mantissa bit is set (normals)
        bits = descale.view(torch.int32)
        e32, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        k = torch.where(e32 > 0, e32 - 127 + (mant > 0).int(), torch.where(bits > 0x400000, -126, -127))
        k = torch.where(descale > 0, k, torch.full_like(k, -127))
    else:
        raise ValueError(f"E8M0 scale rule must be one of {MX_SCALE_RULES}, got {rule!r}")
    return k.clamp(-127, 127).long()


def quantize_mx(x: torch.Tensor, block=(1, 32), elem: str = "e4m3", rule: str = "floor",
                edges: str = "course") -> ScaledTensor:
    """MX quantization: each block of 32 shares the E8M0 scale 2^k (``mx_shared_exponent``); elements are
    ``saturate(x / 2^k)`` cast to ``elem`` (round to nearest even). x: (M, K); block (1, 32) or (32, 1).

    The edges (lesson 09 states them):
    * an all-zero block gets k = -127 and zero elements; no finite input gives a NaN.
    * a tiny block whose k is -127, E8M0's smallest (FLOOR: amax below 2^(emax_elem - 126), 2^-118 for E4M3; RCEIL:
      amax / elem max at or below 2^-127; below those the exponent the rule asks for clamps) divides by 2^-127, the
      OCP rule: every element decodes to within half an element
      step (in units of 2^-127) of itself, e.g. a block of 2^-130 to itself exactly (2^-130 / 2^-127 = 1/8 in E4M3).
      Smaller magnitudes than E8M0 x the element format can hold (below half of 2^-127 times the element format's
      smallest subnormal: 2^-137 for E4M3) round to zero, as any value below a format's range does.
      ``edges="torchao"`` divides by ``MX_MIN_SCALE_DIVISOR[rule]`` there instead (torchao 0.18's ``to_mx``; TE's
      RCEIL): FLOOR halves such a block (2^-130 decodes to 2^-131), RCEIL flushes it to zeros.
    * an inf in a block takes k from inf's exponent field (FLOOR: k = 128 - emax_elem) or the clamp at 127 (RCEIL)
      and saturates to the element max, which decodes to +-inf again (max * 2^k is past FP32 max in every element
      format), while the block's finite elements round at that scale (to zero, mostly); a NaN in a block makes its scale NaN (0xFF) and every element of the block
      NaN (E4M3/E5M2; torchao's FLOOR path writes x / inf into those elements instead, which dequantize to NaN
      just the same).
    * at the top of FP32 an element that rounds up to 2^128 / 2^k (e.g. FP32 max under RCEIL in E4M3: k = 120,
      x / 2^120 rounds to 256) decodes to inf, the FP32 product 256 * 2^120 (as in torchao and the spec).
    """
    mx_element_format(elem)
    check_edges(edges)
    b = resolve_block(x.shape, check_mx_block(block))
    amax = block_amax(x, b)                                    # (M/r, K/c) fp32
    return encode_mx(x, b, elem, amax, mx_shared_exponent(amax, elem, rule), rule, edges)


def mx_divisor(scale_inv: torch.Tensor, rule: str = "floor", edges: str = "course") -> torch.Tensor:
    """What each block's elements are divided by, (M/r, K/c) float32, from its scale 2^k (float32): 2^k itself (OCP
    MX v1.0 6.3), or with ``edges="torchao"`` torchao's ``MX_MIN_SCALE_DIVISOR[rule]`` where k = -127."""
    check_edges(edges)
    if edges == "course":
        return scale_inv
    return torch.where(scale_inv == 2.0 ** -127, MX_MIN_SCALE_DIVISOR[rule], scale_inv)


def encode_mx(x: torch.Tensor, block: tuple[int, int], elem: str, amax: torch.Tensor, k: torch.Tensor,
              rule: str = "floor", edges: str = "course") -> ScaledTensor:
    """The ScaledTensor of x (M, K) in ``elem`` with the shared exponents k (M/r, K/c) of a resolved ``block``."""
    check_mx_block(block)
    scale_inv = torch.exp2(k.double()).float()   # 2^k, exact in fp32 (2^-127 is an fp32 subnormal)
    divisor = mx_divisor(scale_inv, rule, edges)               # x / 2^k as the OCP spec writes it
    # a block holding a NaN: NaN scale (E8M0 0xFF) and NaN elements, under either rule (OCP MX v1.0 6.3)
    nan = torch.isnan(amax)
    scale_inv, divisor = torch.where(nan, float("nan"), scale_inv), torch.where(nan, float("nan"), divisor)
    y = block_view(x.float(), block) / expand(divisor, block)
    data = cast_elements(y, elem).reshape(x.shape)
    return ScaledTensor(data, scale_inv.to(torch.float8_e8m0fnu), block, elem, None, x.dtype)
