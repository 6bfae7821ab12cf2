"""A scaled tensor of any granularity: low-precision data plus one scale per block, and its quantizers.

One container for every scaling the field uses (2-D tensors (M, K); a block of ``(rows, cols)`` elements
shares one scale, ``-1`` meaning the whole dimension):

    granularity             block        data       scales                        source
    tensorwise              (-1, -1)     E4M3/E5M2  () FP32                       TE DelayedScaling / current
    rowwise / colwise       (1, -1)      E4M3/E5M2  (M, 1) / (1, K) FP32, pow2    torchao ``rowwise``
    1x128 tiles             (1, 128)     E4M3       (M, K/128) FP32, pow2         DeepSeek-V3 3.3.1, TE Float8BlockScaling
    128x128 blocks          (128, 128)   E4M3       (M/128, K/128) FP32, pow2     same (weights)
    MX                      (1, 32)      E4M3 ...   (M, K/32) E8M0                OCP MX v1.0 section 6.3
    NVFP4                   (1, 16)      E2M1       (M, K/16) E4M3 + () FP32      NVIDIA NVFP4 (arXiv 2509.25149)

``scale_inv`` is always the *dequantization* multiplier, stored in its own format: float32 for FP8 scaling,
``torch.float8_e8m0fnu`` for MX, ``torch.float8_e4m3fn`` for NVFP4 (times ``tensor_scale_inv``, FP32)::

    dequantize = float32(data) * float32(scale_inv)[block]  (* tensor_scale_inv for NVFP4)

FP4 and FP6 values are held one per byte in a ``torch.float8_e4m3fn`` container: every E2M1, E2M3 and E3M2
value is exactly an E4M3 value (packing two FP4 values per byte is a storage detail this course leaves out;
``bits_per_element`` counts the real width). Padding rule: none. A dimension that a block does not divide
raises ValueError naming the block; the course's GPT has widths and token counts that are multiples of 128.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import FORMATS, round_to
from ..seams import check_exponents, check_nvfp4_scales
from . import fused
from .fastpath import fp8_blocks_to_float32, fp8_to_float32, pow2_scale, rceil_scale_inv, round_e2m1, saturating_cast
from .tensor import FP8_DTYPES, compute_scale, fp8_format_name

ELEMENT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
_CONTAINER = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e3m2": torch.float8_e4m3fn,
              "e2m3": torch.float8_e4m3fn, "e2m1": torch.float8_e4m3fn}
SCALE_BITS = {"fp32": 32, "e8m0": 8, "e4m3": 8}


def resolve_block(shape, block) -> tuple[int, int]:
    """The block (rows, cols) for a 2-D ``shape``, -1 replaced by the dimension; ValueError if it does not divide."""
    if len(shape) != 2:
        raise ValueError(f"block scaling takes 2-D (M, K) tensors, got shape {tuple(shape)}: reshape to (-1, K) first")
    rows, cols = (shape[0] if block[0] == -1 else block[0]), (shape[1] if block[1] == -1 else block[1])
    if rows < 1 or cols < 1 or shape[0] % max(rows, 1) or shape[1] % max(cols, 1):
        raise ValueError(f"a {block[0]}x{block[1]} block does not divide shape {tuple(shape)}: pad the dimension "
                         f"to a multiple of the block (no padding is done here) or use a coarser granularity "
                         "(rowwise and tensorwise take any shape)")
    return rows, cols


def block_view(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(M, K) -> (M/r, r, K/c, c) view (x must be contiguous or a transpose of a contiguous tensor)."""
    (M, K), (r, c) = x.shape, block
    return x.reshape(M // r, r, K // c, c)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| of each block: (M/r, K/c) float32 (NaN propagates)."""
    if fused.usable(x):
        return fused.block_amax(x, resolve_block(x.shape, block))    # the same maxima, one compiled pass
    a = x.detach().float().abs()
    if block == (1, 16) and a.is_contiguous() and a.device.type == "cpu":
        # The same maxima (a max is exact in any order, NaN propagates in both): torch's CPU reduction over a
        # 16-wide innermost dimension is slow, its 1-D max pooling with kernel = stride = 16 is not.
        # (tests/test_quant_fastpath.py checks it against the reduction below.)
        M, K = a.shape
        return F.max_pool1d(a.reshape(M, 1, K), 16, 16).reshape(M, K // 16)
    return block_view(a, block).amax(dim=(1, 3))


def expand(s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(M/r, K/c) -> (M/r, 1, K/c, 1), to broadcast over ``block_view``."""
    return s[:, None, :, None]


def block_multiplier(scale_inv: torch.Tensor, tensor_scale_inv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(M/r, K/c) float32 dequantization multiplier of each block: float32(scale_inv) (times the FP32
    ``tensor_scale_inv``, NVFP4's second level)."""
    s = scale_inv.float()
    return s if tensor_scale_inv is None else s * tensor_scale_inv


@dataclass
class ScaledTensor:
    """Low-precision ``data`` (M, K) plus one scale per ``block`` (see the module docstring).

    Fields: data (M, K) float8 container; scale_inv (M/r, K/c) float32 / float8_e8m0fnu / float8_e4m3fn;
    block (r, c) resolved; elem_format ("e4m3", "e5m2", "e2m1", ...); tensor_scale_inv () float32 or None
    (NVFP4's second level); orig_dtype (the dtype before quantization); dequantized: None, or the float32
    ``dequantize()`` kept by a quantizer called with ``keep_fp32=True`` (the emulated GEMM's operand, computed
    once with the quantization: ``dequantize_fp32``). It is not an init field, so ``dataclasses.replace`` starts
    without it; a ScaledTensor's fields are not to be reassigned once it holds one (the copy would go stale).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    elem_format: str
    tensor_scale_inv: Optional[torch.Tensor] = None
    orig_dtype: torch.dtype = torch.float32
    dequantized: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def scale_format(self) -> str:
        return {torch.float32: "fp32", torch.float8_e8m0fnu: "e8m0", torch.float8_e4m3fn: "e4m3"}[self.scale_inv.dtype]

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, scales included (MXFP8: 8 + 8/32 = 8.25; NVFP4: 4 + 8/16 = 4.5, plus the
        tensor scale's 32 bits over the whole tensor)."""
        n = self.data.numel()
        bits = FORMATS[self.elem_format].bits * n + SCALE_BITS[self.scale_format] * self.scale_inv.numel()
        if self.tensor_scale_inv is not None:
            bits += 32
        return bits / n

    def block_scale_inv(self) -> torch.Tensor:
        """(M/r, K/c) float32 multiplier of each block (NVFP4: the E4M3 scale times the FP32 tensor scale)."""
        return block_multiplier(self.scale_inv, self.tensor_scale_inv)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if (dtype or self.orig_dtype) == torch.float32 and self.data.dtype == torch.float8_e4m3fn \
                and self.data.is_contiguous() and fused.usable(self.data, torch.float8_e4m3fn):
            return fused.dequantize_fp8(self.data, self.block, self.block_scale_inv())    # the same bits, one pass
        # float32(data) (``fastpath.fp8_to_float32``: torch's cast, through FP16 bits) times each block's multiplier
        x = block_view(fp8_to_float32(self.data), self.block) * expand(self.block_scale_inv(), self.block)  # fp32
        return x.reshape(self.shape).to(self.orig_dtype if dtype is None else dtype)

    def dequantize_fp32(self) -> torch.Tensor:
        """``dequantize(torch.float32)``: the copy kept at quantization when there is one (the same bits, from
        ``fastpath.fp8_blocks_to_float32``), else computed now. Read it, do not write it: it may be that copy."""
        return self.dequantize(torch.float32) if self.dequantized is None else self.dequantized

    def t(self) -> "ScaledTensor":
        """The transpose (K, M): a view of the data, the block and the scale grid transposed."""
        out = ScaledTensor(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]), self.elem_format,
                           self.tensor_scale_inv, self.orig_dtype)
        out.dequantized = None if self.dequantized is None else self.dequantized.t()
        return out


def _keep(data: torch.Tensor, scale_inv: torch.Tensor, block, elem: str, tensor_scale_inv, orig_dtype,
          y: torch.Tensor, keep_fp32: bool, amax: Optional[torch.Tensor] = None) -> ScaledTensor:
    """The ScaledTensor of a quantizer; with keep_fp32 also its float32 dequantization, written into the
    quantizer's scratch ``y`` (the scaled copy the cast read, no longer needed). ``amax``: the block amaxes, for
    quantizers whose data holds a NaN code only where a block holds a NaN (FP32-scaled FP8, MX)."""
    st = ScaledTensor(data, scale_inv, block, elem, tensor_scale_inv, orig_dtype)
    if keep_fp32 and data.dim() == 2 and data.is_contiguous() and y.is_contiguous():
        nan_free = amax is not None and not bool(torch.isnan(amax).any())
        st.dequantized = fp8_blocks_to_float32(data, st.block_scale_inv(), st.block, y, nan_free)
    return st


def _fused(x: torch.Tensor) -> bool:
    """Whether a quantizer takes ``fused``'s compiled pass for x: a contiguous 2-D float32 CPU tensor (the
    layer's operands; its copy keeps x's layout, as ``_keep``'s does)."""
    return fused.usable(x) and x.is_contiguous()


def _kept(st: ScaledTensor, dequantized: torch.Tensor) -> ScaledTensor:
    """st holding its float32 dequantization (from ``fused.quantize_fp8`` / ``quantize_e2m1``)."""
    st.dequantized = dequantized
    return st


def _cast_elements(y: torch.Tensor, elem: str, rounding: str = "nearest",
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Saturating cast of fp32 ``y`` to ``elem``, returned in its float8 container (NaN stays NaN where it can).
    ``y`` is a scratch tensor of the caller's: the FP8 formats may clamp it in place."""
    top = FORMATS[elem].max
    if elem in FP8_DTYPES and rounding == "nearest":
        # in range: the cast only rounds (to nearest even); y is the caller's fresh product, clamped in place
        return saturating_cast(y, FP8_DTYPES[elem], top)
    if elem == "e2m1" and rounding in ("nearest", "stochastic"):
        # the rule below, bit for bit, in a few int32/FP32 passes (tests/test_quant_fastpath.py)
        return round_e2m1(y.contiguous(), rounding, generator).to(_CONTAINER[elem])
    return round_to(y, elem, rounding=rounding, saturate=True, generator=generator).to(_CONTAINER[elem])


def quantize_fp32_scaled(x: torch.Tensor, block, fp8_format="e4m3", *, margin: int = 0, power_2_scale: bool = False,
                         amax_epsilon: float = 0.0, compute_scale_fn=None,
                         keep_fp32: bool = False) -> ScaledTensor:
    """FP8 with one FP32 scale per block, each from its own amax: ``scale = fp8_max / amax / 2**margin``.

    x: (M, K) float32/bfloat16/float16. block: e.g. (-1, -1) tensorwise, (1, -1) rowwise, (1, 128), (128, 128).
    Zero, inf or NaN block amax gives scale 1.0 (TE's current-scaling rule, ``compute_scale``); power_2_scale
    rounds each scale down to a power of two (TE Float8BlockScaling's default, torchao rowwise).
    compute_scale_fn: a learner's ``compute_scale(amax, fp8_max, margin)`` in place of the library's.
    keep_fp32: also keep the float32 dequantization (``ScaledTensor.dequantized``), for an emulated GEMM.
    """
    name = fp8_format_name(fp8_format)
    b = resolve_block(x.shape, block)
    amax = block_amax(x, b)                                   # (M/r, K/c) fp32
    if amax_epsilon > 0:
        amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    top = FORMATS[name].max
    if compute_scale_fn is not None:
        scale = torch.as_tensor(compute_scale_fn(amax, top, margin), dtype=torch.float32)
        if power_2_scale:
            from .tensor import round_down_to_power_of_2
            scale = round_down_to_power_of_2(scale)
    elif power_2_scale and margin == 0:
        scale = pow2_scale(amax, top)                         # compute_scale's bits in fewer ops (fastpath)
    else:
        scale = compute_scale(amax, top, margin, None, power_2_scale)
    if keep_fp32 and name == "e4m3" and _fused(x):
        # the two lines below and _keep's FP32 copy, in one compiled pass (the same bits: tests/test_quant_fused.py)
        scale_inv = scale.reciprocal()
        data, dq = fused.quantize_fp8(x, b, scale, False, scale_inv)
        return _kept(ScaledTensor(data, scale_inv, b, name, None, x.dtype), dq)
    y = block_view(x.float(), b) * expand(scale, b)           # (M/r, r, K/c, c) fp32, one rounding
    data = _cast_elements(y, name).reshape(x.shape)
    # a learner's scale may be anything: then the data is searched for NaN codes
    return _keep(data, scale.reciprocal(), b, name, None, x.dtype, y, keep_fp32, amax if compute_scale_fn is None else None)


# ------------------------------------------------------------------------------------------------ MX (E8M0)
MX_SCALE_RULES = ("floor", "rceil")


def _mx_element_format(elem: str):
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
      the smallest power of two with amax / 2^k <= elem max: nothing saturates.
    floor(log2(amax)) is read from the FP32 exponent field (exact). amax 0 gives k = -127 (torchao's floor
    path reads the zero exponent field the same way); NaN amax is handled by the caller.
    """
    fmt = _mx_element_format(elem)
    a = amax.float()
    if rule == "floor":
        e32 = (a.view(torch.int32) >> 23) & 0xFF               # FP32 exponent field (int32; the sign dropped)
        k = e32 - (127 + fmt.emax)
    elif rule == "rceil":
        descale = a / fmt.max                                  # fp32 division, as torchao's fallback
        # ceil(log2(d)) exactly from the bits: exponent, +1 if any mantissa bit is set (normals)
        bits = descale.view(torch.int32)
        e32, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        k = torch.where(e32 > 0, e32 - 127 + (mant > 0).int(), torch.full_like(e32, -127))
        k = torch.where(descale > 0, k, torch.full_like(k, -127))
    else:
        raise ValueError(f"E8M0 scale rule must be one of {MX_SCALE_RULES}, got {rule!r}")
    return k.clamp(-127, 127).long()


def quantize_mx(x: torch.Tensor, block=(1, 32), elem: str = "e4m3", rule: str = "floor",
                exponent_fn=None, keep_fp32: bool = False) -> ScaledTensor:
    """MX quantization: each block of 32 shares the E8M0 scale 2^k (``mx_shared_exponent``); elements are
    ``saturate(x / 2^k)`` cast to ``elem`` (round to nearest even). x: (M, K); block (1, 32) or (32, 1).
    A NaN in a block makes its scale NaN (0xFF) and its elements NaN (E4M3/E5M2) as in torchao.
    exponent_fn: a learner's ``mx_shared_exponent(amax (n,), elem) -> k (n,)`` (lesson 10, the floor rule) in
    place of the library's, checked by ``mpcourse.core.seams.check_exponents``. keep_fp32: as in
    ``quantize_fp32_scaled``."""
    fmt = _mx_element_format(elem)
    b = resolve_block(x.shape, block)
    amax = block_amax(x, b)                                    # (M/r, K/c) fp32
    if exponent_fn is None and rule == "rceil":
        scale_inv = rceil_scale_inv(amax, fmt.max)             # 2^k of the rule below without the int64 k (fastpath)
    else:
        if exponent_fn is None:
            k = mx_shared_exponent(amax, elem, rule)
        else:
            flat = amax.flatten()                              # (n,) as the lesson's signature takes it
            k = check_exponents("mx_shared_exponent", flat, exponent_fn(flat.clone(), elem)).reshape(amax.shape)
        scale_inv = torch.exp2(k.double()).float()   # 2^k, exact in fp32 (2^-127 is an fp32 subnormal)
    scale_inv = torch.where(torch.isnan(amax), float("nan"), scale_inv)
    # x / 2^k and x * 2^-k are the same exact operation (a power of two) unless the result is subnormal;
    # divide, as the OCP spec writes it. (torchao divides by max(2^k, 2^-126), a workaround for compilers
    # that flush subnormals; the two differ only for blocks with amax below about 2^-118.)
    if keep_fp32 and elem == "e4m3" and _fused(x):
        # the two lines below and _keep's FP32 copy, in one compiled pass (the same bits: tests/test_quant_fused.py)
        e8m0 = scale_inv.to(torch.float8_e8m0fnu)
        data, dq = fused.quantize_fp8(x, b, scale_inv, True, block_multiplier(e8m0))
        return _kept(ScaledTensor(data, e8m0, b, elem, None, x.dtype), dq)
    y = block_view(x.float(), b) / expand(scale_inv, b)
    data = _cast_elements(y, elem).reshape(x.shape)
    return _keep(data, scale_inv.to(torch.float8_e8m0fnu), b, elem, None, x.dtype, y, keep_fp32, amax)


# ------------------------------------------------------------------------------------------------ NVFP4
E4M3_MAX, E2M1_MAX = FORMATS["e4m3"].max, FORMATS["e2m1"].max


def nvfp4_tensor_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The FP32 per-tensor decode scale: amax / (448 * 6), so the largest block scale maps near E4M3's max."""
    return amax.float() / (E4M3_MAX * E2M1_MAX)


def nvfp4_scales_from(scales_fn, x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(t () fp32, s (M/r, K/c) e4m3) for ``block`` from a learner's lesson 10 ``nvfp4_scales(x)``, which scales
    1x16 blocks along rows: (16, 1) blocks are the rows of x^T; a 16x16 block's scale is the largest of its 16
    row scales (each step, amax / 6 / t, the clamp and the E4M3 rounding, is monotone, so the max commutes)."""
    if block == (16, 1):
        t, s = check_nvfp4_scales("nvfp4_scales", x.t(), scales_fn(x.t().contiguous()))
        return t, s.t()
    t, s = check_nvfp4_scales("nvfp4_scales", x, scales_fn(x))      # s: (M, K/16)
    if block == (16, 16):
        M, K = x.shape
        s = s.float().reshape(M // 16, 16, K // 16).amax(dim=1).to(torch.float8_e4m3fn)   # exact: E4M3 values
    elif block != (1, 16):
        raise ValueError(f"nvfp4_scales takes 1x16, 16x1 or 16x16 blocks, got {block}")
    return t, s


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                   scales_fn=None, keep_fp32: bool = False) -> ScaledTensor:
    """NVFP4: E2M1 data, an E4M3 decode scale per 16 elements and one FP32 decode scale per tensor.

    Two-level rule (torchao ``nvfp4_quantize`` with a per-tensor scale; TE's NVFP4 recipe):
        t   = amax(x) / (448 * 6)                        FP32, per tensor (``tensor_scale_inv``)
        s_b = e4m3(clamp(amax_b / 6 / t, 2^-6, 448))     E4M3, per block (``scale_inv``; 2^-6 as torchao)
        q   = e2m1(saturate(x * ((1 / t) / float32(s_b))))
        x  ~= float32(q) * (float32(s_b) * t)
    block: (1, 16), (16, 1) or (16, 16) (2-D weight blocks). rounding: "nearest" or "stochastic" (gradients).
    An all-zero tensor gets t = 0 and is stored as zeros with t = 0 (dequantizes to zeros, no NaN).
    scales_fn: a learner's ``nvfp4_scales(x) -> (t, s)`` (lesson 10) in place of the two scale lines below
    (``nvfp4_scales_from``); not with ``tensor_amax``. keep_fp32: as in ``quantize_fp32_scaled``.
    """
    b = resolve_block(x.shape, block)
    if scales_fn is not None:
        if tensor_amax is not None:
            raise ValueError("scales_fn computes the tensor scale from x itself: drop tensor_amax")
        t, s = nvfp4_scales_from(scales_fn, x.detach().float(), b)
        safe_t = torch.where(t > 0, t, torch.ones_like(t))
    else:
        amax_b = block_amax(x, b)                                # (M/r, K/c) fp32
        # max |x| is the largest block max (exact, NaN propagates): no second pass over x
        amax_t = (amax_b.amax() if tensor_amax is None else tensor_amax.float()).reshape(())
        t = nvfp4_tensor_scale_inv(amax_t)
        safe_t = torch.where(t > 0, t, torch.ones_like(t))
        s = ((amax_b / E2M1_MAX) / safe_t).clamp(FORMATS["e4m3"].min_normal, E4M3_MAX).to(torch.float8_e4m3fn)
    recip = (1.0 / safe_t) / s.float()                          # (M/r, K/c) fp32
    if keep_fp32 and rounding in ("nearest", "stochastic") and _fused(x):
        # the three lines below and _keep's FP32 copy, in one compiled pass, from the rule's own random draws
        draws = None if rounding == "nearest" else torch.randint(0, 2 ** 62, x.shape, generator=generator)
        data, dq = fused.quantize_e2m1(x, b, recip, block_multiplier(s, t), draws)
        return _kept(ScaledTensor(data, s, b, "e2m1", t, x.dtype), dq)
    y = block_view(x.float(), b) * expand(recip, b)
    data = _cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return _keep(data, s, b, "e2m1", t, x.dtype, y, keep_fp32)
