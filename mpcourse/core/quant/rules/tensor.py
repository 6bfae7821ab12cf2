"""Per-tensor scaled casts to FP8: amax -> scale -> saturate(x * scale) -> E4M3 / E5M2.

FP8 has too little range for raw activations or gradients (E4M3: 448 down to 2^-9, 18 binades;
E5M2: 57344 down to 2^-16), so every tensor gets its own FP32 *scale* that maps its largest
magnitude (its *amax*) onto the format's largest finite value (Micikevicius et al. 2022, "FP8
Formats for Deep Learning", arXiv 2209.05433, section 3):

    scale   = fp8_max / amax / 2**margin          # fp32, shape ()
    data    = fp8( saturate(x * scale) )          # the FP8 payload
    x_back  = float32(data) * scale_inv           # scale_inv = 1 / scale, what GEMMs consume

The rules for degenerate amaxes are Transformer Engine's (``transformer_engine/pytorch/quantization.py``
``_default_sf_compute``; ``common/recipe/recipe_common.cuh`` ``compute_scale_from_amax``):

* amax 0, inf or NaN: no usable information, keep the previous scale (delayed scaling) or use 1.0
  (current scaling, as TE's ``Float8CurrentScaling`` does). So an all-zero tensor quantizes to zeros
  and dequantizes to zeros, never NaN.
* a tiny amax (say 1e-40) makes fp8_max / amax overflow FP32: the scale is capped at the largest
  FP32 (3.4028235e38), as TE does. (TE's current-scaling kernel caps at the *input* dtype's max;
  for BF16 inputs that is 3.39e38 instead. The difference only shows for amax below ~1.3e-36.)
  Below that amax (FP32 subnormals included) the scale cannot grow with 1 / amax: the tensor lands
  lower in the FP8 range (amax 1e-40 maps to 0.034, near the bottom of E4M3's normals) and values
  below about 2^-10 / FP32 max = 2^-138 round to zero; ``scale_inv`` = 1 / FP32 max is the FP32
  subnormal 2^-128 (rounded; with power-of-two scales the scale is 2^127, its inverse exactly
  2^-127). Every element still decodes to within half an FP8 step (at its scaled position) of
  itself, and nothing is NaN (tests/core/quant/test_quant_tiny_amax.py checks every boundary against an
  ml_dtypes transcription of this rule).
* at the top of FP32 an element within half an FP8 step of 2^128 / scale rounds up to a code whose
  decoded product float32(code) * scale_inv is past FP32 max: it decodes to inf (e.g. power-of-two
  E4M3 scales for amax = FP32 max: scale 2^-120, x * 2^-120 rounds to 256, 256 * 2^120 = 2^128), as in
  TE and torchao; an inf input saturates to +-fp8_max and decodes finite (``saturate`` below).

Saturation is explicit here and never left to the torch version: torch 2.13's CPU cast saturates
E4M3 (even inf -> 448) but not E5M2 (61440 -> inf), and older versions saturated neither.
``to_float8(..., saturate=True)`` (the default, TE's and torchao's behaviour; lesson 07's ``quantize``) clamps to
[-fp8_max, fp8_max] first, so +-inf becomes +-fp8_max. ``saturate=False`` gives the OCP
non-saturating conversion (what ``ml_dtypes`` does): a value that rounds past fp8_max becomes NaN
in E4M3 (it has no inf) and +-inf in E5M2. NaN stays NaN in both modes, so a NaN in a tensor
shows up in the GEMM output instead of being hidden.

The rules here (``compute_amax``, ``compute_scale``, lesson 07's ``quantize``, ``to_float8``, ``quantize_current``)
are plain torch; their kernels are ``kernels.per_tensor.compute_amax`` and ``per_tensor.to_float8`` (numba's pass in ``kernels.fp8_passes``),
equal bit for bit (``tests/core/quant/kernels/test_quant_fused.py``), chosen by ``engine``.

The per-tensor FP8 GEMM on a CPU has its rules here too: ``fp8_to_float32`` (the upcast times a scale) and
``scaled_mm`` (what ``torch._scaled_mm`` computes on a CPU, measured on torch 2.13: both operands upcast and
dequantized, made row-major, one FP32 GEMM, one rounding); their kernels are ``kernels.upcast.fp8_to_float32`` and
``upcast.cpu_scaled_mm``, chosen by ``engine`` for ``layers.gemm``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...formats import FORMATS

# The two OCP FP8 formats and the torch dtypes that hold them (facts from mpcourse.core.formats). E4M3 is the
# "fn" variant (finite, single NaN pattern S.1111.111, max 448); E5M2 is IEEE-like (inf, NaNs, max 57344).
FP8_DTYPES = {name: FORMATS[name].torch_dtype for name in ("e4m3", "e5m2")}
FP32_TINY = FORMATS["fp32"].min_normal  # smallest normal FP32, 2**-126
FP32_MAX = FORMATS["fp32"].max  # 3.4028234663852886e38


def fp8_format_name(fp8_format) -> str:
    """Normalise a format spec to ``"e4m3"`` or ``"e5m2"``.

    Accepts the strings ``"e4m3"``/``"e4m3fn"``/``"e5m2"`` (any case), the torch dtypes
    ``torch.float8_e4m3fn``/``torch.float8_e5m2``, or any object with a ``name`` attribute naming one
    of them (``mpcourse.core.quant.Format.E4M3``, a ``mpcourse.core.formats`` description).
    Raises ValueError for HYBRID (it names two formats: pick the forward or backward one).
    """
    if isinstance(fp8_format, torch.dtype):
        for name, dtype in FP8_DTYPES.items():
            if dtype == fp8_format:
                return name
        raise ValueError(f"{fp8_format} is not an FP8 dtype: use torch.float8_e4m3fn or torch.float8_e5m2")
    name = fp8_format if isinstance(fp8_format, str) else getattr(fp8_format, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"fp8_format must be 'e4m3', 'e5m2', an FP8 torch dtype or a Format, got {fp8_format!r}")
    name = name.lower()
    if name == "hybrid":
        raise ValueError("Format.HYBRID names two formats (E4M3 forward, E5M2 backward): quantize one tensor "
                         "with Format.HYBRID.fwd or Format.HYBRID.bwd, or pass 'e4m3' / 'e5m2'")
    name = {"e4m3fn": "e4m3"}.get(name, name)
    if name not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 format {fp8_format!r}: use 'e4m3' or 'e5m2'")
    return name


def fp8_dtype(fp8_format) -> torch.dtype:
    """The torch dtype holding ``fp8_format`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``)."""
    return FP8_DTYPES[fp8_format_name(fp8_format)]


def fp8_max(fp8_format) -> float:
    """Largest finite value: 448.0 for E4M3, 57344.0 for E5M2 (``mpcourse.core.formats``)."""
    return FORMATS[fp8_format_name(fp8_format)].max


_fp8_max_of = fp8_max  # compute_scale's argument is also called fp8_max


def _overflow_threshold(fp8_format) -> tuple[float, bool]:
    """(midpoint between fp8_max and the next binade step, whether that tie rounds up).

    Under round-to-nearest-even a value overflows when it is above the midpoint, or on it and
    fp8_max's last mantissa bit is odd (the tie goes to the even neighbour above).
    E4M3: 448 = 1.110b x 2^8, next step 480, midpoint 464, 448 is even -> 464 -> 448, 465 overflows.
    E5M2: 57344 = 1.11b x 2^15, next step 65536, midpoint 61440, 57344 is odd -> 61440 overflows.
    """
    f = FORMATS[fp8_format_name(fp8_format)]
    top = f.max
    ulp = 2.0 ** (math.floor(math.log2(top)) - f.mantissa_bits)  # spacing in the top binade
    return top + ulp / 2, int(top / ulp) % 2 == 1


@dataclass
class Float8Tensor:
    """FP8 data plus the FP32 inverse scale that turns it back into real values.

    Fields:
      data:       (...) torch.float8_e4m3fn or torch.float8_e5m2, the scaled values.
      scale_inv:  () float32, ``1 / scale``; ``dequantize()`` is ``float32(data) * scale_inv``.
                  This is the number ``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b``.
      orig_dtype: the dtype the tensor had before quantization (the default for ``dequantize``).

    A plain container (not a tensor subclass, unlike torchao's ``Float8TrainingTensor``) so that
    every FP8 step in this library is visible in the code that uses it.

    Gradients: ``data`` never carries autograd history (an FP8 gradient would be rounded to FP8).
    When ``quantize`` gets an input that requires grad, it keeps it in ``source``, and
    ``dequantize()`` passes the gradient straight through to it unchanged: the backward of
    ``quantize(x).dequantize()`` is the identity, saturated elements included, as in torchao
    (``torchao/float8/float8_training_tensor.py``: ``_ToFloat8ConstrFunc`` and ``_FromFloat8ConstrFunc``
    both return the incoming gradient).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    orig_dtype: torch.dtype = torch.float32
    source: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.data.dtype not in FP8_DTYPES.values():
            raise TypeError(f"Float8Tensor.data must be float8_e4m3fn or float8_e5m2, got {self.data.dtype}")
        if self.scale_inv.dtype != torch.float32 or self.scale_inv.numel() != 1:
            raise TypeError("Float8Tensor.scale_inv must be a float32 tensor with one element, "
                            f"got {self.scale_inv.dtype} of shape {tuple(self.scale_inv.shape)}")
        self.scale_inv = self.scale_inv.reshape(())

    @property
    def fp8_format(self) -> str:
        return fp8_format_name(self.data.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> "Float8Tensor":
        """Transposed *view* of a 2-D tensor (no copy: a row-major tensor becomes column-major)."""
        return Float8Tensor(self.data.t(), self.scale_inv, self.orig_dtype,
                            None if self.source is None else self.source.t())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``float32(data) * scale_inv``, rounded to ``dtype`` (default: ``orig_dtype``).

        Differentiable with respect to the tensor that was quantized (``source``): straight-through.
        """
        x = self.data.float() * self.scale_inv  # (...) fp32; exact when scale_inv is a power of two
        x = x.to(self.orig_dtype if dtype is None else dtype)
        if self.source is not None and torch.is_grad_enabled():
            x = _StraightThrough.apply(self.source, x)
        return x


class _StraightThrough(torch.autograd.Function):
    """Forward: the dequantized value. Backward: the gradient, unchanged, to the quantized source."""

    @staticmethod
    def forward(ctx, source, value):
        ctx.source_dtype = source.dtype
        return value.view_as(value)  # a new tensor object carrying this node

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.source_dtype), None


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 tensor of shape () (exact in any float dtype; NaN if x holds a NaN; 0 if empty)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Keep sign and exponent bits of a positive fp32 scale, drop the mantissa (TE's power-of-two scales,
    ``recipe_common.cuh``; torchao's ``round_scales_to_power_of_2``): 89.6 -> 64, FP32 max -> 2**127."""
    bits = scale.float().contiguous().view(torch.int32) & 0x7F800000  # positive scale: sign bit is 0
    return bits.view(torch.float32)


def compute_scale(amax, fp8_max: float | str, margin: int = 0, prev_scale=None,
                  power_2_scale: bool = False) -> torch.Tensor:
    """Scale that maps ``amax`` to ``fp8_max / 2**margin``: ``(fp8_max / amax) / 2**margin`` in FP32.

    Args:
      amax:        float or float32 tensor (any shape; each element is handled on its own).
      fp8_max:     448.0 (E4M3) or 57344.0 (E5M2), or a format name resolved with ``fp8_max()``.
      margin:      int, extra power-of-two headroom (TE ``DelayedScaling.margin``).
      prev_scale:  scale to keep where amax is 0, inf or NaN; None means 1.0 (current scaling).
      power_2_scale: round the result down to a power of two (TE ``use_power_2_scales``).
    Returns: float32 tensor shaped like ``amax``, always finite and > 0 when prev_scale is.
    Where fp8_max / amax overflows FP32 (amax < ~1.3e-36 for E4M3) the scale is FP32 max; where it
    underflows (a huge ``margin``) it is the smallest normal FP32, never 0 (mpcourse's policy: a zero
    scale would turn every value into 0 and its inverse into inf).
    Source: TE ``transformer_engine/pytorch/quantization.py`` ``_default_sf_compute``.
    """
    if not isinstance(fp8_max, (int, float)):
        fp8_max = _fp8_max_of(fp8_max)
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(f"margin must be an int (a power-of-two exponent), got {margin!r}")
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if prev_scale is None:
        prev = torch.ones_like(amax)
    else:
        prev = torch.as_tensor(prev_scale, dtype=torch.float32).to(amax.device)
    # Tensor / tensor: one correctly rounded fp32 division, as in TE's CUDA kernels (__fdiv_rn). A Python number
    # over a tensor (TE's unfused PyTorch path) is evaluated by torch as reciprocal-then-multiply: up to 1 ulp off.
    scale = (torch.full_like(amax, fp8_max) / amax) / (2.0 ** margin)  # / 2**margin: exact unless subnormal
    usable = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(usable, scale, prev)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where(usable & (scale < FP32_TINY), torch.full_like(scale, FP32_TINY), scale)
    if power_2_scale:
        scale = round_down_to_power_of_2(scale)
    return scale


def _as_scale(scale, device: torch.device) -> torch.Tensor:
    """Scale as a float32 tensor of shape (); rejects non-positive or non-finite values it can see cheaply."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"per-tensor scaling takes one scale, got shape {tuple(scale.shape)}")
        s = scale.reshape(()).to(device=device, dtype=torch.float32)
        check = s.device.type == "cpu"  # on a GPU this check would cost a host sync per cast
    else:
        s, check = torch.tensor(float(scale), dtype=torch.float32, device=device), True
    if check and not (math.isfinite(float(s)) and float(s) > 0):
        raise ValueError(f"scale must be finite and > 0, got {float(s)}: compute it with compute_scale()")
    return s


def cast_arguments(x: torch.Tensor, fp8_format, scale) -> tuple:
    """(format name, torch dtype, fp8_max, scale as a float32 () tensor, the autograd source or None) of a
    per-tensor cast; TypeError for a non-float or FP8 ``x``, ValueError for a bad format or scale."""
    if not x.is_floating_point() or x.dtype in FP8_DTYPES.values():
        raise TypeError(f"quantize takes a float32/bfloat16/float16 tensor, got {x.dtype}: "
                        "dequantize() an FP8 tensor first")
    name = fp8_format_name(fp8_format)
    source = x if (x.requires_grad and torch.is_grad_enabled()) else None
    return name, FP8_DTYPES[name], fp8_max(name), _as_scale(scale, x.device), source


def quantize(x: torch.Tensor, scale, fp8_max: float) -> torch.Tensor:
    """Lesson 07's cast: ``fp8(saturate(float32(x) * scale))``, the float8 tensor of x's shape (E4M3 for fp8_max
    448, E5M2 for 57344), rounded to nearest even; NaN stays NaN, +-inf becomes +-fp8_max. ``scale``: a float
    or a float32 tensor that broadcasts. ``to_float8`` is the same cast with its checks, as a ``Float8Tensor``."""
    dtypes = {FORMATS[name].max: dtype for name, dtype in FP8_DTYPES.items()}
    if float(fp8_max) not in dtypes:
        raise ValueError(f"fp8_max must be 448.0 (E4M3) or 57344.0 (E5M2), got {fp8_max!r}")
    y = x.detach().float() * torch.as_tensor(scale, dtype=torch.float32, device=x.device)   # one fp32 rounding
    return y.clamp(-fp8_max, fp8_max).to(dtypes[float(fp8_max)])   # clamped (NaN passes), then the cast only rounds


def to_float8(x: torch.Tensor, fp8_format, scale, saturate: bool = True) -> Float8Tensor:
    """Cast ``x`` to FP8 with a per-tensor scale: ``data = fp8(saturate(float32(x) * scale))`` (``quantize``).

    Args:
      x:          (...) float32, bfloat16 or float16 (float64 is accepted and first rounded to fp32).
      fp8_format: "e4m3" / "e5m2", an FP8 torch dtype, or ``Format.E4M3`` / ``Format.E5M2``.
      scale:      float or float32 tensor with one element, finite and > 0 (see ``compute_scale``).
      saturate:   True (default, as TE and torchao): values beyond fp8_max, and +-inf, become
                  +-fp8_max. False: OCP non-saturating conversion, overflow -> NaN (E4M3) / +-inf (E5M2).
    Returns: ``Float8Tensor`` with ``data`` of x's shape and ``scale_inv = 1 / scale`` (fp32, shape ()).
    NaN in x stays NaN in ``data`` (both formats have a NaN). Rounding is round-to-nearest-even.
    Gradient: ``to_float8(x).dequantize()`` is straight-through (identity backward), see ``Float8Tensor``.
    Raises TypeError for non-float inputs, ValueError for a bad format or scale.
    """
    name, dtype, top, scale, source = cast_arguments(x, fp8_format, scale)
    if saturate:
        return Float8Tensor(quantize(x, scale.detach(), top), scale.reciprocal(), x.dtype, source)
    y = x.detach().float() * scale.detach()  # (...) fp32; rounded once, in fp32, as TE's cast kernels do
    midpoint, tie_rounds_up = _overflow_threshold(name)
    overflow = (y.abs() >= midpoint) if tie_rounds_up else (y.abs() > midpoint)  # +-inf included
    if name == "e4m3":  # no inf in E4M3: overflow is NaN
        special = torch.full_like(y, float("nan"))
    else:
        special = torch.copysign(torch.full_like(y, float("inf")), y)
    # Every value is now in range (or NaN / an E5M2 inf, which are representable): the cast below only
    # rounds, so its overflow behaviour, which differs between torch versions, never matters.
    data = torch.where(overflow, special, y.clamp(-top, top)).to(dtype)  # no autograd through FP8 (straight-through)
    return Float8Tensor(data, scale.reciprocal(), x.dtype, source)


def apply_amax_epsilon(amax: torch.Tensor, amax_epsilon: float) -> torch.Tensor:
    """``max(amax, amax_epsilon)`` where amax_epsilon > 0 (TE's ``amax_epsilon``; a NaN amax stays NaN)."""
    if amax_epsilon > 0:
        amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)  # NaN compares False
    return amax


def quantize_current(x: torch.Tensor, fp8_format, margin: int = 0, power_2_scale: bool = False,
                     amax_epsilon: float = 0.0) -> Float8Tensor:
    """Current ("just-in-time") scaling: scale from this tensor's own amax, then ``to_float8``.

    ``scale = fp8_max / max(amax, amax_epsilon) / 2**margin``; amax 0, inf or NaN gives scale 1.0, so an
    all-zero tensor gives zeros (TE ``Float8CurrentScaling``, ``recipe_common.cuh``; torchao tensorwise
    scaling instead clamps amax to >= 1e-12 first, ``torchao/float8/float8_utils.py``).
    Args as in ``to_float8`` and ``compute_scale``. Returns a ``Float8Tensor``.
    """
    amax = apply_amax_epsilon(compute_amax(x), amax_epsilon)
    scale = compute_scale(amax, fp8_max(fp8_format), margin, None, power_2_scale)
    return to_float8(x, fp8_format, scale)


def fp8_to_float32(data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32(data), times ``scale`` (a float32 tensor of one element) if given: each element one FP32 product.
    data: (...) float8_e4m3fn or float8_e5m2; the result keeps data's shape (and its strides, where dense)."""
    x = data.float()
    return x if scale is None else x * scale.reshape(()).float()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype)`` as a CPU computes it (per-tensor scales; measured
    on torch 2.13): each operand made row-major, upcast and multiplied by its scale in FP32, one FP32 GEMM, one
    rounding to ``out_dtype``. a: (M, K) float8, b: (K, N) float8 (any layout); scales: float32, one element.
    Returns (M, N) ``out_dtype``. (The layout matters: for small shapes the FP32 GEMM's bits depend on it.)"""
    out = fp8_to_float32(a.contiguous(), scale_a) @ fp8_to_float32(b.contiguous(), scale_b)   # (M, N) fp32
    return out if out_dtype == torch.float32 else out.to(out_dtype)
