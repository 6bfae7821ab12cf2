"""Number formats: FP32, TF32, FP16, BF16, FP8 (E4M3, E5M2), the MX element and scale formats
(FP6 E2M3 / E3M2, FP4 E2M1, E8M0), their bit fields, and rounding. The one source of format facts.

Every function here works on the *bits* of FP32 values with integer arithmetic; none calls torch's
own cast to the target format, because that cast is what lesson 00 explains (and what the tests
compare against, with ml_dtypes as a second oracle).

Sources: IEEE 754-2019 (bit layout, round-to-nearest-even, gradual underflow); Micikevicius et al.
2022, "FP8 Formats for Deep Learning" (arXiv 2209.05433) and the OCP 8-bit FP spec for E4M3/E5M2
(E4M3 is `e4m3fn`: no inf, NaN = S.1111.111, max 448); `torch.finfo` and `ml_dtypes` for the
numbers. OCP Microscaling Formats (MX) v1.0 spec, section 5, for E8M0 (unsigned, 8 exponent bits, bias
127, values 2^-127 .. 2^127, 0xFF = NaN, no zero, no inf), FP6 E2M3 (max 7.5), FP6 E3M2 (max 28) and
FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf, no NaN); `ml_dtypes` (float8_e8m0fnu,
float6_e2m3fn, float6_e3m2fn, float4_e2m1fn) is the oracle. TF32 is not a storage type: it is the FP32 range with FP16's 10 mantissa bits, read by
tensor cores from FP32 inputs. PyTorch's notes (docs/source/notes/numerical_accuracy.rst) say
"only the first 10 bits of the input mantissa are read" (truncation: use rounding="toward_zero");
TensorFlow's docs say the inputs are "rounded ... to 10 bits", and PTX has both `cvt.rna.tf32.f32`
(ties away) and, on sm_90, `cvt.rn.tf32.f32` (ties to even). Here "tf32" rounds to nearest even.

Policies (where implementations disagree):
- Overflow, saturate=False: to +-inf where the format has inf; E4M3 has none, so to NaN (what
  ml_dtypes and the OCP spec's non-saturating mode do).
- saturate=True: every finite overflow AND +-inf go to +-max; this is what torch 2.13's CPU
  `.to(torch.float8_e4m3fn)` does, what torchao's clamp before the cast does, and CUDA's
  `__NV_SATFINITE`. NaN stays NaN always.
- FP6 / FP4 have neither inf nor NaN: overflow and +-inf saturate to +-max whatever `saturate`
  says (there is nothing else to encode; the OCP MX spec's conversion saturates; ml_dtypes does
  this). A NaN input stays NaN in `round_to`'s float32 result (it is not hidden), and `encode`
  refuses it (ValueError): there is no NaN bit pattern.
- E8M0 has no sign, no zero, no subnormals: zero, negative values, NaN and (saturate=False)
  values that round past 2^127 give NaN (0xFF); positive values below 2^-127 give 2^-127, the
  smallest value (ml_dtypes; torch 2.13's `.to(torch.float8_e8m0fnu)` also maps 0 to 2^-127). A
  tie between two powers of two (1.5 * 2^k) goes up. FP32 subnormals in (2^-127, 2^-126) round
  to the nearer of the two by value: up from 1.5 * 2^-127 on, as ml_dtypes >= 0.7 does. torch
  2.13's cast and ml_dtypes < 0.7 round that whole interval up (they apply the normal-number
  rule to the mantissa field, whose leading bit is not the implicit 1 there).
- Inputs: float32 tensors; narrower float dtypes (fp16, bf16, fp8) are upcast first, exactly.
  float64 is refused (its cast to fp32 already rounds once). Denormals must not be flushed
  (torch's default, torch.set_flush_denormal(False)).

The rule of rounding is `round_to(x, fmt, rounding=..., saturate=..., generator=...)` (lesson 00), plain integer
arithmetic on the bits with no kernel and no fast path. Faster casts that equal it bit for bit for one format
live beside the quantizers in `mpcourse.core.quant` (E2M1 and the FP8 casts), which this module never imports.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

__all__ = ["NumberFormat", "FORMATS", "get_format", "round_to", "Decoded", "decode", "encode",
           "from_bits", "all_values", "neighbours", "ulp"]


@dataclass(frozen=True)
class NumberFormat:
    """A binary floating-point format: an optional sign bit, `exponent_bits`, `mantissa_bits`
    (stored, no hidden bit). Values are Python floats; `torch_dtype` is None where torch has no
    one-element-per-byte storage dtype (tf32, FP6, FP4: torch's FP4 is packed two to a byte).

    `nan` says which bit patterns are NaN: "ieee" (exponent all ones, mantissa != 0; all ones with
    mantissa 0 is inf), "all_ones" (exponent and mantissa all ones, either sign: e4m3, e8m0) or
    "none" (fp6, fp4). `max` is the spec's largest finite value (not derived from a formula).
    E8M0 is unsigned and has no zero and no subnormals: its smallest value 2^-127 is code 0."""
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float            # largest finite value, from the spec
    min_normal: float     # smallest positive normal, torch.finfo(...).smallest_normal
    min_subnormal: float  # smallest positive value (= min_normal where there are no subnormals)
    eps: float            # 2**-mantissa_bits, the gap between 1.0 and the next value
    has_inf: bool
    torch_dtype: torch.dtype | None
    bits: int             # total width, sign bit (if any) + exponent_bits + mantissa_bits
    nan_encoding: str     # which bit patterns are NaN, in words
    signed: bool = True
    nan: str = "ieee"     # "ieee", "all_ones" or "none" (see the class docstring)
    has_zero: bool = True
    has_subnormals: bool = True

    @property
    def has_nan(self) -> bool:
        return self.nan != "none"

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest binade, floor(log2(max)): 8 for e4m3, 15 for e5m2, 2 for e2m1
        (OCP MX v1.0's emax_elem, from which the MX shared exponent is taken)."""
        return math.frexp(self.max)[1] - 1

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest binade: 1 - bias (-bias for e8m0, whose code 0 is 2^-127)."""
        return 1 - self.bias if self.has_subnormals else -self.bias

    def __repr__(self) -> str:
        return (f"NumberFormat({self.name}: {'' if self.signed else 'unsigned '}E{self.exponent_bits}M"
                f"{self.mantissa_bits}, bias {self.bias}, max {self.max:g}, min_normal "
                f"{self.min_normal:g}, min_subnormal {self.min_subnormal:g}, eps {self.eps:g}, "
                f"inf {self.has_inf}, nan {self.nan})")


def _make(name: str, e: int, m: int, has_inf: bool, dtype, nan: str, max_: float | None = None,
          nan_kind: str | None = None) -> NumberFormat:
    bias = 2 ** (e - 1) - 1
    if max_ is None:   # IEEE: the all-ones exponent is reserved for inf/NaN
        max_ = math.ldexp(2 - 2.0 ** -m, 2 ** e - 2 - bias)
    kind = nan_kind or ("ieee" if has_inf else "all_ones")
    return NumberFormat(name, e, m, bias, max_, math.ldexp(1.0, 1 - bias), math.ldexp(1.0, 1 - bias - m),
                  2.0 ** -m, has_inf, dtype, 1 + e + m, nan, nan=kind)


_IEEE_NAN = "exponent all ones, mantissa != 0"
FORMATS: dict[str, NumberFormat] = {
    "fp32": _make("fp32", 8, 23, True, torch.float32, _IEEE_NAN),
    "tf32": _make("tf32", 8, 10, True, None, _IEEE_NAN),
    "fp16": _make("fp16", 5, 10, True, torch.float16, _IEEE_NAN),
    "bf16": _make("bf16", 8, 7, True, torch.bfloat16, _IEEE_NAN),
    # OCP 8-bit FP spec: e4m3fn keeps the all-ones exponent for normals; only S.1111.111 is NaN.
    "e4m3": _make("e4m3", 4, 3, False, torch.float8_e4m3fn, "S.1111.111 only (0x7F, 0xFF)", 448.0),
    "e5m2": _make("e5m2", 5, 2, True, torch.float8_e5m2, _IEEE_NAN),
    # OCP MX v1.0, section 5.3: element formats with neither inf nor NaN; maxima from the spec's table.
    "e3m2": _make("e3m2", 3, 2, False, None, "none", 28.0, "none"),
    "e2m3": _make("e2m3", 2, 3, False, None, "none", 7.5, "none"),
    "e2m1": _make("e2m1", 2, 1, False, None, "none", 6.0, "none"),
    # OCP MX v1.0, section 5.4: the shared scale. Unsigned, 2^(code - 127), 0xFF = NaN.
    "e8m0": NumberFormat("e8m0", 8, 0, 127, 2.0 ** 127, 2.0 ** -127, 2.0 ** -127, 1.0, False,
                   torch.float8_e8m0fnu, 8, "0xFF only", signed=False, nan="all_ones", has_zero=False,
                   has_subnormals=False),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "tensorfloat32": "tf32", "float16": "fp16",
            "half": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "e4m3fn": "e4m3",
            "float8_e5m2": "e5m2", "float8_e8m0fnu": "e8m0", "e8m0fnu": "e8m0", "fp4": "e2m1",
            "float4_e2m1fn": "e2m1", "e2m1fn": "e2m1", "float6_e2m3fn": "e2m3", "e2m3fn": "e2m3",
            "float6_e3m2fn": "e3m2", "e3m2fn": "e3m2", "fp4_e2m1": "e2m1", "fp6_e2m3": "e2m3",
            "fp6_e3m2": "e3m2"}
_BY_DTYPE = {f.torch_dtype: f for f in FORMATS.values() if f.torch_dtype is not None}
_ROUNDINGS = ("nearest", "stochastic", "toward_zero")


def get_format(fmt) -> NumberFormat:
    """Resolve `fmt` (a NumberFormat, a name such as "bf16"/"bfloat16"/"E4M3", or a torch dtype).

    Raises ValueError naming the valid formats for an unknown name or dtype, TypeError otherwise."""
    if isinstance(fmt, NumberFormat):
        return fmt
    valid = ", ".join(FORMATS)
    if isinstance(fmt, torch.dtype):
        if fmt in _BY_DTYPE:
            return _BY_DTYPE[fmt]
        raise ValueError(f"no format for {fmt}; valid: {valid} or their torch dtypes")
    if isinstance(fmt, str):
        key = fmt.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"unknown format {fmt!r}; valid names: {valid}")
    raise TypeError(f"fmt must be a format name ({valid}), a NumberFormat or a torch dtype, got {fmt!r}")


def _f32_bits(v: float) -> int:
    """The FP32 bit pattern of a Python float that is exactly representable in FP32."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _pow2_f64(k: torch.Tensor) -> torch.Tensor:
    """2.0**k as float64, built from bits (exponent field k + 1023), exact for -1022 <= k <= 1023."""
    return ((k + 1023) << 52).view(torch.float64)


def _as_float32(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}; "
                        "wrap it: torch.tensor(x, dtype=torch.float32)")
    if x.dtype == torch.float32:
        return x
    if x.dtype.is_floating_point and x.dtype.itemsize < 4:
        return x.float()   # every fp16/bf16/fp8 value is an fp32 value: this upcast is exact
    hint = " (a float64 -> float32 cast rounds once already)" if x.dtype == torch.float64 else ""
    raise TypeError(f"expected a float32 tensor, got {x.dtype}; call .float() first{hint}")


def _round_magnitude(a: torch.Tensor, f: NumberFormat, mode: str, generator) -> torch.Tensor:
    """Round |x| to `f` in bit arithmetic. a: int64 tensor of FP32 bit patterns of |x| (sign bit
    clear, not NaN; inf is fine). Returns int64 FP32 bit patterns of the rounded magnitude, which
    may exceed f.max (the caller applies the overflow policy)."""
    if f.mantissa_bits == 23:
        return a
    # |x| = sig * 2**(e - 150) with a 24-bit integer significand `sig` (hidden 1 included).
    # FP32 subnormals have exponent field 0, no hidden 1, and the same scale as field 1.
    e32 = a >> 23
    sig = (a & 0x7FFFFF) | ((e32 > 0).long() << 23)
    e = e32.clamp(min=1)
    # How many low bits of sig the target cannot hold. Normally 23 - m. Below the target's
    # min_normal the target's step is fixed at min_subnormal = 2**q (gradual underflow), so
    # more bits go: as many as it takes for the step of sig's last kept bit to be 2**q.
    q = 1 - f.bias - f.mantissa_bits
    drop = (q + 150 - e).clamp(min=23 - f.mantissa_bits, max=62)
    one = torch.ones_like(sig)
    if mode == "nearest":
        # Round to nearest, ties to even: add just under half a step (2**(drop-1) - 1), plus 1
        # more when the last kept bit is odd, then truncate. Above half always carries; exactly
        # half carries only from an odd kept value, which makes it even. (For bf16 this is the
        # well-known `bits + 0x7FFF + ((bits >> 16) & 1)`, then clear the low 16 bits.)
        inc = (one << (drop - 1)) - 1 + ((sig >> drop) & 1)
    elif mode == "stochastic":
        # Add a uniform random integer in [0, 2**drop), then truncate: a carry happens with
        # probability (dropped bits) / 2**drop = distance to the lower-magnitude neighbour / gap.
        # (Exact for drop <= 62, i.e. |x| >= 2**-39 * min_subnormal; below that the round-up
        # probability, under 2**-38, is sig / 2**62.)
        r = torch.randint(0, 2 ** 62, a.shape, generator=generator, device=a.device)
        inc = r & ((one << drop) - 1)
    elif mode == "toward_zero":
        inc = torch.zeros_like(sig)
    else:  # "away_from_zero", used by neighbours()
        inc = (one << drop) - 1
    n = (sig + inc) >> drop   # the kept significand; may carry to 2**(24 - drop)
    # Put the kept bits back where they were: FP32 bits = ((e - 1) << 23) + sig, and a carry out
    # of the significand simply adds 1 to the exponent field, i.e. renormalizes for free.
    # When drop >= 24 even the hidden 1 was dropped (|x| < min_subnormal): n is 0 or 1 and
    # means n * min_subnormal, so build that directly.
    kept = ((e - 1) << 23) + (n << drop)
    return torch.where(drop < 24, kept, n * _f32_bits(f.min_subnormal))


def _round_e8m0(x: torch.Tensor, mode: str, saturate: bool, generator) -> torch.Tensor:
    """Round float32 x to E8M0 (a power of two 2^(code - 127), code 0..254), as float32.

    On the FP32 bits: the exponent field e32 is the candidate code, the 23 mantissa bits decide
    whether it goes up by one. For a normal x (e32 >= 1) that is x in [2^k, 2^(k+1)) with
    frac = mantissa / 2^23: nearest goes up when frac >= 1/2 (ties up), away_from_zero when
    frac > 0, stochastic with probability frac (one random integer below 2^23, exact). An FP32
    subnormal x = mant * 2^-149 (e32 = 0) lies below 2^-126, and code 0 means 2^-127 = 2^22 *
    2^-149: nearest goes up (to 2^-126) from the midpoint 1.5 * 2^-127 = 3 * 2^21 * 2^-149 on
    (ties up, as above), away_from_zero when x > 2^-127, stochastic with probability
    (x - 2^-127) / 2^-127; smaller x give 2^-127 (there is nothing below it)."""
    a = x.view(torch.int32).long() & 0x7FFFFFFF
    e32, mant = a >> 23, a & 0x7FFFFF
    half = 1 << 22
    sub = e32 == 0
    if mode == "nearest":
        up = torch.where(sub, mant >= 3 << 21, mant >= half)
    elif mode == "toward_zero":
        up = torch.zeros_like(sub)
    elif mode == "stochastic":
        r = torch.randint(0, 2 ** 23, x.shape, generator=generator, device=x.device)
        up = torch.where(sub, r < 2 * (mant - half), r < mant)   # P(up) = (x - 2^-127) / 2^-127 there
    else:  # away_from_zero
        up = torch.where(sub, mant > half, mant > 0)
    code = e32 + up.long()
    over = code > 254                                   # includes +inf (e32 = 255)
    val = _pow2_f64(code.clamp(max=254) - 127).float()  # 2^-127 is an fp32 subnormal: exact
    val = torch.where(over, 2.0 ** 127 if saturate else math.nan, val)
    return torch.where((x > 0) & ~torch.isnan(x), val, math.nan)   # zero, negative, NaN -> NaN


def _round(x: torch.Tensor, f: NumberFormat, mode: str, saturate: bool, generator) -> torch.Tensor:
    x = _as_float32(x)
    if not f.signed:
        return _round_e8m0(x, mode, saturate, generator)
    if not f.has_nan:
        saturate = True                          # fp6/fp4: no inf, no NaN: overflow saturates
    bits = x.view(torch.int32).long()            # same shape, int64 for headroom
    neg = bits < 0
    mag = _round_magnitude(bits & 0x7FFFFFFF, f, mode, generator)
    over = mag > _f32_bits(f.max)                # includes inf inputs
    val = mag.to(torch.int32).view(torch.float32)
    big = f.max if saturate else (math.inf if f.has_inf else math.nan)
    if mode == "toward_zero":   # IEEE: truncation never overflows a finite input past max
        over_val = torch.where(torch.isinf(x), big, f.max)
    else:
        over_val = torch.full_like(val, big)
    val = torch.where(over, over_val, val)
    val = torch.where(neg, -val, val)            # negation flips only the sign bit: -0.0 stays -0.0
    return torch.where(torch.isnan(x), x, val)   # NaN stays NaN, in every mode


def round_to(x: torch.Tensor, fmt, *, rounding: str = "nearest", saturate: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """The value of each element of `x` after a cast to `fmt`, as float32 (same shape, device).

    x: float32 tensor (fp16/bf16/fp8 tensors are upcast exactly; float64 and integers raise
    TypeError: call .float()). fmt: name, NumberFormat or torch dtype (see get_format).
    rounding: "nearest" (ties to even, IEEE default, what torch casts do), "stochastic" (rounds
    away from zero with probability |x - lower-magnitude neighbour| / gap, drawing from
    `generator`), or "toward_zero" (truncation, e.g. TF32 inputs read as "the first 10 bits").
    Gradual underflow: results below min_normal are subnormals, then +-0 keeping the sign.
    saturate=False: overflow -> +-inf (NaN for e4m3 and e8m0, which have no inf); saturate=True:
    finite overflow and +-inf -> +-fmt.max. NaN -> NaN. "fp32" returns x unchanged (up to
    saturation). fp6/fp4 always saturate (no inf, no NaN); e8m0 maps zero and negative values to
    NaN and values below 2^-127 to 2^-127 (see the module docstring).
    Stochastic rounding of a value between max and the overflow point overflows (by the same
    policy) with its round-up probability. Raises ValueError for an unknown rounding or format.
    """
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    return _round(x, get_format(fmt), rounding, saturate, generator)


def _scalar(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"expected one value, got a tensor of shape {tuple(x.shape)}")
        return _as_float32(x.reshape(()))
    return torch.tensor(float(x), dtype=torch.float32)  # a Python float is rounded to fp32 first


def encode(x, fmt):
    """Bit pattern of x rounded (to nearest, no saturation) to `fmt`.

    x: Python number or 0-d tensor -> int; a tensor with dimensions -> int64 tensor of codes.
    NaN encodes as the quiet NaN with x's sign (e4m3: S.1111.111; others: top mantissa bit set)."""
    f = get_format(fmt)
    scalar = not isinstance(x, torch.Tensor) or x.dim() == 0
    v = _round(_scalar(x) if scalar else x, f, "nearest", False, None)
    if not f.has_nan and bool(torch.isnan(v).any()):
        raise ValueError(f"{f.name} has no NaN bit pattern: remove NaNs before encoding "
                         "(round_to keeps them as float32 NaN)")
    if not f.signed:   # e8m0: code = k + 127 for 2^k, 0xFF for NaN
        k = torch.frexp(v.double())[1].long() - 1
        code = torch.where(torch.isnan(v), 0xFF, k + f.bias)
        return int(code) if scalar else code
    bits = v.view(torch.int32).long()
    a = bits & 0x7FFFFFFF
    e32, m, d = a >> 23, f.mantissa_bits, 23 - f.mantissa_bits
    sig = (a & 0x7FFFFF) | ((e32 > 0).long() << 23)
    normal = a >= _f32_bits(f.min_normal)
    field = torch.where(normal, e32 - 127 + f.bias, 0)
    # normal: the top m stored bits; subnormal: v / min_subnormal, exact since v is a multiple
    sub_shift = (1 - f.bias - m + 150 - e32.clamp(min=1)).clamp(0, 63)
    mant = torch.where(normal, (a & 0x7FFFFF) >> d, sig >> sub_shift)
    top = 2 ** f.exponent_bits - 1
    nan_mant = 2 ** m - 1 if not f.has_inf else 2 ** (m - 1)
    field = torch.where(torch.isinf(v) | torch.isnan(v), top, field)
    mant = torch.where(torch.isinf(v), 0, torch.where(torch.isnan(v), nan_mant, mant))
    code = ((bits < 0).long() << (f.bits - 1)) | (field << m) | mant
    return int(code) if scalar else code


def from_bits(bits, fmt):
    """Value of bit pattern(s) `bits` of `fmt`: int -> float; integer tensor -> float32 tensor.
    Only the low fmt.bits bits are used (so int8/int16 views and negative ints work)."""
    f = get_format(fmt)
    c = torch.as_tensor(bits).long() & ((1 << f.bits) - 1)
    if not f.signed:   # e8m0: 2^(code - 127), 0xFF = NaN
        val = torch.where(c == 0xFF, math.nan, _pow2_f64(c - f.bias).float())
        return float(val) if not isinstance(bits, torch.Tensor) else val
    m, top = f.mantissa_bits, 2 ** f.exponent_bits - 1
    field, mant = (c >> m) & top, c & (2 ** m - 1)
    sig = torch.where(field > 0, mant | (1 << m), mant)           # hidden 1 for normals
    k = field.clamp(min=1) - f.bias - m                           # value = sig * 2**k
    val = (sig.double() * _pow2_f64(k)).float()                   # exact: a value of fmt
    if f.nan == "ieee":
        val = torch.where(field == top, torch.where(mant == 0, math.inf, math.nan), val)
    elif f.nan == "all_ones":
        val = torch.where((field == top) & (mant == 2 ** m - 1), math.nan, val)
    val = torch.where((c >> (f.bits - 1)) == 1, -val, val)
    return float(val) if not isinstance(bits, torch.Tensor) else val


def all_values(fmt) -> torch.Tensor:
    """float32 tensor (2**bits,) of the value of every bit pattern, indexed by the pattern: codes
    0..2**(bits-1)-1 are positive, the rest negative; includes +-0, inf and NaNs. Formats of at
    most 19 bits (all but fp32; tf32 has 2**19 patterns). Raises ValueError for fp32."""
    f = get_format(fmt)
    if f.bits > 19:
        raise ValueError(f"{f.name} has 2**{f.bits} bit patterns; all_values takes <= 19 bits")
    return from_bits(torch.arange(2 ** f.bits), f)


@dataclass(frozen=True)
class Decoded:
    """One value's encoding in a format (see decode)."""
    fmt: str
    value: float           # the value after rounding to fmt
    sign: int              # 0 or 1
    exponent: int | None   # unbiased: field - bias (normal), 1 - bias (subnormal, zero); None: inf/NaN
    exponent_field: int    # the biased exponent bits as an int
    mantissa: int          # the stored mantissa bits as an int
    mantissa_str: str      # ... as a string of mantissa_bits characters
    kind: str              # "zero", "subnormal", "normal", "inf" or "nan"
    bit_string: str        # "sign exponent mantissa", e.g. "0 01111 0000000000"
    code: int              # the whole pattern as an int

    def __str__(self) -> str:
        if self.kind in ("inf", "nan"):
            return f"{self.fmt} {self.bit_string} = {self.value} ({self.kind})"
        if not self.mantissa_str:   # e8m0: a bare power of two
            return f"{self.fmt} {self.bit_string} = 2^{self.exponent} = {self.value!r} ({self.kind})"
        lead = "1" if self.kind == "normal" else "0"
        return (f"{self.fmt} {self.bit_string} = {'-' if self.sign else '+'}{lead}."
                f"{self.mantissa_str}b x 2^{self.exponent} = {self.value!r} ({self.kind})")


def decode(x, fmt) -> Decoded:
    """Round x (Python number or one-element tensor; a Python float goes to fp32 first) to `fmt`
    to nearest, without saturation, and split the result's encoding into its fields."""
    f = get_format(fmt)
    code = encode(_scalar(x), f)
    m, e = f.mantissa_bits, f.exponent_bits
    sign = code >> (f.bits - 1) if f.signed else 0
    field, mant = (code >> m) & (2 ** e - 1), code & (2 ** m - 1)
    value = from_bits(code, f)
    if math.isnan(value):
        kind = "nan"
    elif math.isinf(value):
        kind = "inf"
    elif field == 0 and f.has_subnormals:
        kind = "zero" if mant == 0 else "subnormal"
    else:
        kind = "normal"
    if kind in ("inf", "nan"):
        exponent = None
    else:
        exponent = max(field, 1) - f.bias if f.has_subnormals else field - f.bias
    mant_str = format(mant, f"0{m}b") if m else ""
    parts = ([str(sign)] if f.signed else []) + [f"{field:0{e}b}"] + ([mant_str] if m else [])
    return Decoded(f.name, value, sign, exponent, field, mant, mant_str, kind, " ".join(parts), code)


def neighbours(x: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the representable values of `fmt` with lo <= x <= hi (equal when x is
    representable), float32 tensors of x's shape. Beyond +-max the outer neighbour follows the
    non-saturating overflow policy (+-inf, NaN for e4m3/e8m0, +-max for fp6/fp4). NaN -> (NaN,
    NaN). e8m0 has nothing below 2^-127: for 0 < x < 2^-127 both are 2^-127."""
    f = get_format(fmt)
    tz = _round(x, f, "toward_zero", False, None)
    az = _round(x, f, "away_from_zero", False, None)
    neg = _as_float32(x) < 0
    return torch.where(neg, az, tz), torch.where(neg, tz, az)


def ulp(x: torch.Tensor, fmt) -> torch.Tensor:
    """Spacing of `fmt` at x: the gap from |round_to(x, fmt)| to the next larger magnitude (at
    fmt.max: to the next power of two). float32 tensor of x's shape; NaN for inf/NaN."""
    f = get_format(fmt)
    r = _round(x, f, "nearest", False, None)
    e32 = (r.view(torch.int32).long() & 0x7FFFFFFF) >> 23
    k = (e32 - 127).clamp(min=f.min_exponent) - f.mantissa_bits
    out = _pow2_f64(k).float()
    return torch.where(torch.isfinite(r), out, math.nan)
