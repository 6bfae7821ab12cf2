"""The MX rule (OCP MX v1.0 section 6.3; lesson 09's ``mx_shared_exponent``): a block of 32 elements shares one
E8M0 scale 2^k, and each element is ``saturate(x / 2^k)`` in the element format.

The kernel of ``quantize_mx`` is ``fastpath.quantize_mx`` (its RCEIL scale from ``fastpath.rceil_scale_inv``, numba's
one pass in ``fused`` where it applies), equal bit for bit (``tests/test_quant_fused.py``, ``test_quant_fastpath.py``);
``engine`` chooses between them.
"""
from __future__ import annotations

import torch

from ..formats import FORMATS
from .scaled import ELEMENT_FORMATS, ScaledTensor, block_amax, block_view, cast_elements, expand, resolve_block

MX_SCALE_RULES = ("floor", "rceil")
#: what a block whose scale is 2^-127 (k = -127: amax 0 or below about 2^-118) divides its elements by: torchao's
#: ``to_mx`` divides by 2^-126 under FLOOR (the smallest normal FP32) and by 1 under RCEIL (TE's ``exp2f_rcp``
#: returns 1 for the biased exponent 0), so such a block's elements flush to zero there; 2^k everywhere else.
MX_MIN_SCALE_DIVISOR = {"floor": 2.0 ** -126, "rceil": 1.0}


def mx_element_format(elem: str):
    """``FORMATS[elem]`` for an MX element format; ValueError naming the ones there are otherwise."""
    if elem not in ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {ELEMENT_FORMATS}, got {elem!r}")
    return FORMATS[elem]


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


def quantize_mx(x: torch.Tensor, block=(1, 32), elem: str = "e4m3", rule: str = "floor") -> ScaledTensor:
    """MX quantization: each block of 32 shares the E8M0 scale 2^k (``mx_shared_exponent``); elements are
    ``saturate(x / 2^k)`` cast to ``elem`` (round to nearest even). x: (M, K); block (1, 32) or (32, 1).
    The edges (lesson 09 states them; torchao's ``to_mx`` agrees): an all-zero block gets k = -127 and zero
    elements; a tiny block whose k clamps to -127 divides by ``MX_MIN_SCALE_DIVISOR[rule]``; an inf in a block
    takes k from inf's exponent field and saturates to the element max; a NaN in a block makes its scale NaN
    (0xFF) and every element of the block NaN (E4M3/E5M2; torchao's FLOOR path writes x / inf into those
    elements instead, which dequantize to NaN just the same)."""
    mx_element_format(elem)
    b = resolve_block(x.shape, block)
    amax = block_amax(x, b)                                    # (M/r, K/c) fp32
    return encode_mx(x, b, elem, amax, mx_shared_exponent(amax, elem, rule), rule)


def encode_mx(x: torch.Tensor, block: tuple[int, int], elem: str, amax: torch.Tensor, k: torch.Tensor,
              rule: str = "floor") -> ScaledTensor:
    """The ScaledTensor of x (M, K) in ``elem`` with the shared exponents k (M/r, K/c) of a resolved ``block``."""
    scale_inv = torch.exp2(k.double()).float()   # 2^k, exact in fp32 (2^-127 is an fp32 subnormal)
    # x / 2^k as the OCP spec writes it, except where k = -127: there torchao's divisor (MX_MIN_SCALE_DIVISOR)
    divisor = torch.where(k == -127, MX_MIN_SCALE_DIVISOR[rule], scale_inv)
    # a block holding a NaN: NaN scale (E8M0 0xFF) and NaN elements, under either rule (OCP MX v1.0 6.3)
    nan = torch.isnan(amax)
    scale_inv, divisor = torch.where(nan, float("nan"), scale_inv), torch.where(nan, float("nan"), divisor)
    y = block_view(x.float(), block) / expand(divisor, block)
    data = cast_elements(y, elem).reshape(x.shape)
    return ScaledTensor(data, scale_inv.to(torch.float8_e8m0fnu), block, elem, None, x.dtype)
