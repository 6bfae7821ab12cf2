"""Fused fast paths for the emulated low-precision steps on a CPU, each equal bit for bit to the rule it replaces.

The rules stay where they are written for reading (``formats.round_to``, ``ScaledTensor.dequantize``,
``torch._scaled_mm``); what is here computes the same bits in fewer passes over memory, and
``tests/core/quant/kernels/test_quant_fastpath.py`` checks each against its rule on every code point and on random tensors
(NaN, inf, signed zeros and ties included). Measured with ``benchmarks/bench_block_recipes.py``.

* ``fp8_to_float32(data, scale=None)``: upcast of a float8 tensor (E4M3 / E5M2 containers, so E2M1 data too).
  torch's CPU cast from float8 converts element by element (about as slow as a 128-wide FP32 GEMM
  over the same tensor); reading each code as the top bits of an FP16 number and upcasting that (one
  vectorized pass) is the same cast, about 3x faster than the gather from a 256-entry table it replaced
  (1024 x 512 E4M3, 1 thread). With a per-tensor ``scale`` the dequantization multiply is folded in:
  each element is the one FP32 product it was before.
* ``fp8_blocks_to_float32(data, block_mult, block, out)``: ``ScaledTensor.dequantize``'s rule to float32 for
  block-scaled data (the same upcast, 2^8 folded into each block's multiplier), written into a buffer the
  quantizer no longer needs; the block quantizers call it when asked to keep the FP32 copy an emulated GEMM
  reads (``keep_fp32``), so the layer's CPU path upcasts each operand once, at quantization.
* ``pow2_scale(amax, fp8_max)`` and ``rceil_scale_inv(amax, elem_max)``: ``tensor.compute_scale`` with power-of-two
  scales and 2^k of MX's RCEIL exponent (``scaled.mx_shared_exponent``), read from the bits of one division in a
  few ops on the scale grid.
* ``saturating_cast(y, dtype, top)``: the quantizers' clamp-then-cast, without the clamp where torch's own cast
  saturates (``E4M3_CAST_SATURATES``: E4M3 in torch 2.13, checked at import on both sides of 448, inf and NaN).
* ``cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)``: what ``torch._scaled_mm`` computes on a CPU
  (upcast both operands, multiply by their scales, make them row-major, one FP32 GEMM, one rounding to
  ``out_dtype``; measured on torch 2.13), with the fast upcast.
* ``round_e2m1(y, rounding, generator)``: ``round_to(y, "e2m1", saturate=True)`` for nearest and
  stochastic rounding, with int32 arithmetic and without the general formats' many 64-bit passes.
  The stochastic path draws the same random integers as the rule (``torch.randint(0, 2**62, ...)``), so a
  seeded run gives the same bits, and reads each as two 32-bit words (no 64-bit arithmetic).

numba or torch, chosen once: ``COMPILED``, set at import from the library's switch
(``mpcourse.core.kernels_switch.ENABLED``) and whether numba imports (``fused.AVAILABLE``). Where it is True,
``fp8_to_float32``, ``pow2_scale``, ``rceil_scale_inv``, ``compute_amax``, ``to_float8``, ``block_amax``,
``dequantize`` and the block quantizers hand CPU tensors to the compiled kernels of ``fused`` (one pass, the same
bits; ``tests/core/quant/kernels/test_quant_fused.py``); otherwise the torch bodies here run, and stay tested against
their rules. What is still decided per call is about the input, not the machine (``_takes``): whether the compiled
pass can read this tensor (a non-empty 2-D CPU tensor of its dtype; contiguous for the quantizers' one pass) and
whether ``torch.compile`` is tracing the call (it cannot trace into a compiled call: there the torch bodies run).

The kernels of the quantization rules, each named after the rule it equals (``tests/core/quant/test_quant_layout.py`` runs
every recipe's quantizers both ways): ``compute_amax`` (one ``aminmax`` pass), ``to_float8``, ``block_amax`` (max
pooling for 1x16 blocks), ``quantize_fp32_scaled``, ``quantize_mx``, ``quantize_nvfp4`` and their ``encode_*``
steps (the FP32 copy kept with the quantization; NVFP4's scale levels and multipliers in ``nvfp4_block_scales``,
one compiled pass, and its stochastic draws made inside ``fused``'s kernel from the generator's state),
``dequantize`` and ``rht`` (one batched matmul with a cached matrix). ``quant.backend.KERNELS`` holds each of them,
``RULES`` its rule; no layer imports this module.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...formats import FORMATS
from ...kernels_switch import ENABLED
from ..rules import blockwise, hadamard, mx, nvfp4, scaled, tensor
from . import fused
from ..rules.scaled import CONTAINER, ScaledTensor, block_multiplier, block_view, check_edges, expand, resolve_block

#: whether fused's compiled passes run at all: chosen once, here, at import (the switch on and numba imported)
COMPILED: bool = ENABLED and fused.AVAILABLE
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


def _takes(x: torch.Tensor, dtype: torch.dtype = torch.float32, dims: Optional[int] = 2) -> bool:
    """Whether fused's compiled pass takes ``x`` in this call: ``COMPILED`` (the machine's half, fixed at import),
    then the input's half, asked per call: a non-empty CPU tensor of ``dtype`` with ``dims`` dimensions (None: any
    number), outside ``torch.compile``'s tracing (which cannot trace a compiled call: the torch body is traced)."""
    return (COMPILED and x.device.type == "cpu" and x.dtype == dtype and x.numel() > 0
            and (dims is None or x.dim() == dims) and not _is_compiling())


def fp8_to_float32(data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tensor.fp8_to_float32(data, scale)``, bit for bit: ``data.float()`` (times ``scale``, a one-element float32
    tensor, if given), same shape and strides for a contiguous tensor or the transpose of one; other layouts come
    back contiguous. Non-CPU tensors take the plain rule.

    Each code is read as the top bits of an FP16 number, whose upcast to FP32 is one vectorized pass (F16C):
      E5M2 (s eeeee mm) is FP16's top byte, inf and NaN included: FP16 bits = code << 8.
      E4M3 (s eeee mmm): FP16 bits s 0eeee mmm 0000000 (the code shifted left by 7, bit 14 cleared) hold 2^-8
        times the E4M3 value, normals and subnormals alike (both formats' bias differs by 8, and an E4M3
        subnormal lands on an FP16 subnormal); times 2^8 (exact) gives the value. E4M3 has no inf; its NaN codes
        (S.1111.111) would read as +-1.875, so they are set to NaN where present.
    With ``scale`` the product float32(code) * scale is rounded once, as in the rule: the 2^8 is folded into the
    scale (exact, unless 2^8 * scale overflows, when the two are applied one after the other).
    """
    if data.device.type != "cpu":
        return data.float() if scale is None else data.float() * scale
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        return fp8_to_float32(data.t(), scale).t()
    data = data.contiguous()
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"fp8_to_float32 takes float8_e4m3fn or float8_e5m2 data, got {data.dtype}")
    if _takes(data, data.dtype, None) and data.dim() >= 1:    # the same products in one compiled pass
        d2 = data.reshape(-1, data.shape[-1])                                     # (M, K) codes
        m = torch.ones(1, 1) if scale is None else scale.reshape(1, 1).float()
        return fused.dequantize_fp8(d2, tuple(d2.shape), m).reshape(data.shape)
    out = torch.empty(data.shape, dtype=torch.float32, device=data.device)
    return _upcast_into(data, out, None if scale is None else scale.reshape(()).float())


def _upcast_into(data: torch.Tensor, out: torch.Tensor, m: Optional[torch.Tensor], nan_free: bool = False):
    """out (contiguous float32 of data's shape) := float32(code) * m for contiguous float8 ``data`` (m broadcasts
    over out; None: 1), read through FP16 bits (see ``fp8_to_float32``), each element rounded once as in the rule.

    E4M3's FP16 reading is 2^-8 times the value: the 2^8 is folded into m, exact unless it overflows; where some
    |m| >= 2^119 (or is inf) the two are applied one after the other, as in the rule. E4M3's NaN codes would read
    as +-1.875 * 2^-8: they are set to NaN first, unless ``nan_free`` (the caller knows there is none)."""
    codes = data.view(torch.int8).to(torch.int16)                           # (...) int16, sign-extended: bit 15
    if data.dtype == torch.float8_e5m2:
        out.copy_(codes.bitwise_left_shift_(8).view(torch.float16))         # the value
        factor = 1.0
    else:
        out.copy_(codes.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16))   # value * 2^-8
        factor = 256.0
        b = data.view(torch.uint8)                                          # NaN codes: 0x7F and 0xFF
        if not nan_free and b.numel() and (int(b.max()) == 0xFF or int(data.view(torch.int8).max()) == 0x7F):
            out[(b & 0x7F) == 0x7F] = float("nan")
    if m is None:
        if factor != 1.0:
            out.mul_(factor)
    elif factor != 1.0 and bool((m.abs() >= 2.0 ** 119).any()):
        out.mul_(factor).mul_(m)
    else:
        out.mul_(m * factor if factor != 1.0 else m)
    return out


def fp8_blocks_to_float32(data: torch.Tensor, block_mult: torch.Tensor, block: tuple[int, int],
                          out: Optional[torch.Tensor] = None, nan_free: bool = False) -> torch.Tensor:
    """``ScaledTensor.dequantize(torch.float32)``'s rule, bit for bit, in fewer passes: float32(data) times the
    multiplier of each (r, c) block, for contiguous float8 ``data`` (M, K) and ``block_mult`` (M/r, K/c) float32.

    The codes are read through FP16 bits as in ``fp8_to_float32``, written into ``out`` (a contiguous float32
    (M, K) buffer the caller no longer needs, e.g. the quantizer's scaled copy, so nothing new is allocated),
    and the E4M3 path's 2^8 is folded into the block multipliers (``_upcast_into``: float32(code) * m is the one
    product it was). NaN codes are set to NaN first, as the rule does; ``nan_free=True`` (the caller knows there
    is none: every block amax was a number) skips that search. Returns out, shaped (M, K).
    """
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not data.is_contiguous() or data.dim() != 2:
        raise TypeError("fp8_blocks_to_float32 takes contiguous 2-D float8_e4m3fn or float8_e5m2 data, got "
                        f"{data.dtype} of shape {tuple(data.shape)}")
    M, K = data.shape
    r, c = block
    out = torch.empty(M, K, dtype=torch.float32, device=data.device) if out is None else out.view(M, K)
    m = block_mult.float()[:, None, :, None]                                # (M/r, 1, K/c, 1) fp32
    (gm, gk) = scaled.grid((M, K), block)
    blocks = (gm, r, gk, c)                                        # each block times its multiplier
    _upcast_into(data.view(blocks), out.view(blocks), m, nan_free)
    return out


def saturating_cast(y: torch.Tensor, dtype: torch.dtype, top: float) -> torch.Tensor:
    """``y.clamp_(-top, top).to(dtype)``: the quantizers' saturating cast of their float32 scratch ``y`` (clamped in
    place), without the clamp where torch's own cast saturates by itself (E4M3 on a CPU, ``E4M3_CAST_SATURATES``),
    which changes no bit."""
    if dtype == torch.float8_e4m3fn and E4M3_CAST_SATURATES and y.device.type == "cpu":
        return y.to(dtype)
    return y.clamp_(-top, top).to(dtype)


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``tensor.compute_scale(amax, fp8_max, margin=0, power_2_scale=True)`` bit for bit, in fewer small ops.

    amax: float32 tensor (any shape, >= 0 or NaN). The rule's cases, read from the bits of s = fp8_max / amax (the
    same division): a usable amax (finite, > 0) keeps s's exponent bits (2^floor(log2 s)); s = inf (a tiny
    amax) becomes FP32 max in the rule, whose power of two is 2^127; s never falls below the smallest normal
    (fp8_max / FP32 max > 2^-126); amax 0, inf or NaN gives 1.0.
    """
    if _takes(amax, torch.float32, None):
        return fused.pow2_scale(amax, fp8_max)                                 # the same bits, one compiled pass
    s = torch.full_like(amax, fp8_max) / amax                                  # as the rule divides
    p = (s.view(torch.int32) & 0x7F800000).clamp_(max=0x7F000000).view(torch.float32)   # 2^floor(log2 s)
    return torch.where((amax > 0) & (amax < float("inf")), p, 1.0)


def rceil_scale_inv(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """2^k as float32 for k = ``scaled.mx_shared_exponent(amax, elem, "rceil")`` (the MX RCEIL rule), bit for bit,
    without the int64 exponent: from the bits of d = amax / elem_max (the same division), 2^ceil(log2 d) is
    (bits + 0x7FFFFF) & 0x7F800000 for a positive d (a nonzero mantissa carries into the exponent; a subnormal
    d above 2^-127 carries into 2^-126), capped at 2^127 (d = inf, or a carry past it); d <= 2^-127, zero or
    negative zero gives 2^-127 as the rule's k = -127.
    NaN amax is the caller's (the rule leaves it to quantize_mx too)."""
    if _takes(amax, torch.float32, None):
        return fused.rceil_scale_inv(amax, elem_max)                           # the same bits, one compiled pass
    bits = (amax.float() / elem_max).view(torch.int32)
    up = (bits + 0x7FFFFF).bitwise_and_(0x7F800000).clamp_(max=0x7F000000)   # (...) 2^ceil(log2 d) bits
    return torch.where(bits <= 0x400000, 0x400000, up).view(torch.float32)


def _cast_saturates(dtype: torch.dtype, top: float) -> bool:
    """Whether torch's CPU cast to ``dtype`` already saturates every finite and infinite value beyond +-top (torch
    2.13 does for E4M3; older releases gave NaN): then clamping first changes no bit. Checked on the values that
    matter: top and the next FP32 above it, a dense grid up to 2 * top (the next E4M3 value, 480, and the
    midpoint, 464, included), the FP32 extremes, inf and NaN, of both signs. The quantizers use it on CPU
    tensors only."""
    t = torch.tensor(top, dtype=torch.float32)
    v = torch.cat([torch.linspace(top, 2 * top, 4097), torch.nextafter(t, t + 1)[None], t[None] * (1 + 1 / 28),
                   torch.tensor([1e30, 3.4e38, float("inf"), float("nan")])])
    v = torch.cat([v, -v])
    return torch.equal(v.to(dtype).view(torch.uint8), v.clamp(-top, top).to(dtype).view(torch.uint8))


E4M3_CAST_SATURATES = _cast_saturates(torch.float8_e4m3fn, FORMATS["e4m3"].max)


def cpu_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``tensor.scaled_mm(a, b, scale_a, scale_b, out_dtype)`` bit for bit (what ``torch._scaled_mm`` computes on a
    CPU for per-tensor scales): ``(float32(a) * scale_a) @ (float32(b) * scale_b)`` in FP32, rounded once to
    ``out_dtype``, with the fast upcast. a: (M, K) float8, b: (K, N) float8 (any of the layouts ``_scaled_mm`` takes)."""
    # _scaled_mm makes both FP32 operands row-major before its GEMM (for small shapes the layout changes the
    # bits); so does this, on the 1-byte codes, before the upcast
    out = torch.mm(fp8_to_float32(a.contiguous(), scale_a), fp8_to_float32(b.contiguous(), scale_b))   # (M, N) fp32
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ------------------------------------------------------------------------------------------------ E2M1
E2M1_MAX = FORMATS["e2m1"].max


def round_e2m1(y: torch.Tensor, rounding: str = "nearest", generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``formats.round_to(y, "e2m1", rounding=rounding, saturate=True, generator=generator)``, float32: the same
    bits, except that a NaN may carry another payload (the float8 container holds one NaN per sign).

    |y| is saturated to 6 first (the rule rounds first, then saturates: every |y| > 6 ends at 6 either way).
    E2M1's step is 0.5 below 2 (subnormals included), 1 in [2, 4), 2 in [4, 6]: Q = 2^(max(e, 127) - 128)
    for the FP32 exponent field e of |y|.
    nearest: ``(a + M) - M`` with M = Q * 2^23 is one FP32 addition, which rounds a to a multiple of Q,
      ties to even (the sum lies in [M, 2M), whose spacing is Q), and an exact subtraction.
    stochastic: the rule's integers in 32-bit arithmetic (``_stochastic_magnitude``): the significand sig (24
      bits, hidden bit in), drop = clamp(149 - max(e, 1), 22, 62) low bits to go, n = (sig + (r mod 2^drop)) >>
      drop with the rule's draw r = randint(0, 2^62); the value is n * Q (drop >= 24 leaves n in {0, 1}, Q = 0.5).
    The sign is copied back last, so -0.0 stays -0.0 and a NaN keeps its sign.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"round_e2m1 takes float32, got {y.dtype}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"round_e2m1 rounds 'nearest' or 'stochastic', got {rounding!r}")
    a = y.abs().clamp_(max=E2M1_MAX)                                # (...) fp32 in [0, 6], NaN stays NaN
    e = a.view(torch.int32) >> 23                                   # FP32 exponent field (NaN: 255)
    if rounding == "nearest":
        magic = ((e.clamp(min=127, max=129) + 22) << 23).view(torch.float32)   # 2^22, 2^23, 2^24 = Q * 2^23
        mag = (a + magic).sub_(magic)
    else:
        mag = _stochastic_magnitude(a, e, generator)
    return torch.copysign(mag, y)


_INT32_MIN = -(2 ** 31)
# The int64 draws are read as (lo, hi) int32 pairs, which is how a little-endian machine stores them: checked here.
if torch.tensor([1 + (2 << 32)], dtype=torch.int64).view(torch.int32).tolist() != [1, 2]:
    raise ImportError("mpcourse.core.quant.kernels.fastpath reads int64 as (low, high) int32 words: a little-endian machine")


def _stochastic_magnitude(a: torch.Tensor, e: torch.Tensor, generator) -> torch.Tensor:
    """a (fp32 in [0, 6] or NaN, contiguous; e its FP32 exponent field) rounded stochastically to E2M1 as the rule
    rounds it, from the rule's draw r = randint(0, 2^62): n = (sig + (r mod 2^D)) >> D, value n * Q.

    The draw is read as two int32 words, lo (bits 0-31) and hi (bits 32-61), so nothing runs in 64 bits:
      |a| >= 2^-9 (D <= 31, all but a few elements): with s = 32 - D, (r mod 2^D) + (sig mod 2^D) carries into
        bit D exactly when (lo << s) + (sig << s) carries out of 32 bits (the shifts drop the bits above D),
        i.e. when lo << s > ~(sig << s) as unsigned integers (a signed compare after flipping the top bit);
        n = (sig >> D) + carry.
      |a| < 2^-9 (D >= 32: zeros, tiny values and FP32 subnormals; done by index): sig < 2^24, so sig >> D = 0 and
        the carry needs the low D - 32 bits of hi all ones and lo + sig >= 2^32 (unsigned).
    """
    a, e = a.contiguous(), e.contiguous()
    r = torch.randint(0, 2 ** 62, a.shape, generator=generator, device=a.device)   # as the rule draws
    words = r.view(torch.int32).view(*a.shape, 2)                  # (..., 2) int32: lo, hi
    lo = words[..., 0]
    bits = a.view(torch.int32)
    s = (e - 117).clamp_(1, 10)                                    # 32 - D for D = 22 .. 31
    sig = (bits & 0x7FFFFF).bitwise_or_(0x800000)                  # 1.mant * 2^23 (e >= 1)
    carry = (lo << s).bitwise_xor_(_INT32_MIN) > (sig << s).bitwise_xor_(0x7FFFFFFF)
    n = (sig >> (32 - s)).add_(carry)                              # 0 .. 4 (times Q below)
    wide = e < 118                                                 # D >= 32
    if bool(wide.any()):
        idx = wide.view(-1).nonzero().squeeze(1)
        e1 = e.view(-1)[idx].clamp(min=1)
        sg = bits.view(-1)[idx] - ((e1 - 1) << 23)                 # sig, subnormals (e = 0) included
        d = (149 - e1).clamp_(max=62)
        m = torch.full_like(d, 0x3FFFFFFF) >> (62 - d)             # 2^(D - 32) - 1
        hi, lo_w = words[..., 1].reshape(-1)[idx], lo.reshape(-1)[idx]
        n.view(-1)[idx] = (((hi & m) == m) & ((lo_w ^ _INT32_MIN) > (sg ^ 0x7FFFFFFF))).int()
    q = ((e.clamp(min=127) - 1) << 23).view(torch.float32)         # Q: 0.5, 1 or 2
    return n.float().mul_(q).add_(a - a)                           # NaN back in (a - a is 0 elsewhere)


# ------------------------------------------------------------------------------------------------ per tensor
def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """``tensor.compute_amax(x)`` bit for bit: the compiled pass (``fused.block_amax`` over the whole tensor) for a
    contiguous float32 CPU tensor, else max |x| = max(-min x, max x) from one reading pass (``aminmax``) instead of
    abs (a written copy) then amax; the final abs turns the -0.0 of an all-zero tensor into the 0.0 that max |x|
    gives. Both are exact, NaN propagates."""
    if x.numel() == 0:
        return tensor.compute_amax(x)
    if _takes(x, torch.float32, None) and x.dim() >= 1 and x.is_contiguous():
        x2 = x.detach().reshape(-1, x.shape[-1])                               # (M, K) view
        return fused.block_amax(x2, tuple(x2.shape)).reshape(())
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(lo.neg(), hi).abs().float()


def to_float8(x: torch.Tensor, fp8_format, scale, saturate: bool = True) -> "tensor.Float8Tensor":
    """``tensor.to_float8(x, fp8_format, scale, saturate)`` bit for bit (lesson 07's ``quantize`` inside it): the saturating cast of a contiguous float32
    CPU tensor in ``fused``'s one compiled pass, other saturating casts through ``saturating_cast``; the
    non-saturating conversion is the rule's."""
    if not saturate:
        return tensor.to_float8(x, fp8_format, scale, saturate)
    name, dtype, top, scale, source = tensor.cast_arguments(x, fp8_format, scale)
    if _takes(x, torch.float32, None) and x.dim() >= 1 and x.is_contiguous():
        x2 = x.detach().reshape(-1, x.shape[-1])                                # (M, K) fp32 view
        data, _ = fused.quantize_fp8(x2, tuple(x2.shape), scale.detach().reshape(1, 1), fp8_format=name)
        return tensor.Float8Tensor(data.reshape(x.shape), scale.reciprocal(), x.dtype, source)
    y = x.detach().float() * scale.detach()
    return tensor.Float8Tensor(saturating_cast(y, dtype, top), scale.reciprocal(), x.dtype, source)


# ------------------------------------------------------------------------------------------------ block scaling
def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``scaled.block_amax(x, block)`` bit for bit: ``fused``'s compiled pass, or for 1x16 blocks of a contiguous
    CPU tensor torch's 1-D max pooling with kernel = stride = 16 (torch's CPU reduction over a 16-wide innermost
    dimension is slow; a max is exact in any order, NaN propagates in both)."""
    scaled.check_floating(x)
    if x.numel() == 0:
        return scaled.block_amax(x, block)
    if _takes(x):
        return fused.block_amax(x, resolve_block(x.shape, block))
    a = x.detach().float().abs()
    if block == (1, 16) and a.is_contiguous() and a.device.type == "cpu":
        M, K = a.shape
        return torch.nn.functional.max_pool1d(a.reshape(M, 1, K), 16, 16).reshape(M, K // 16)
    return block_view(a, block).amax(dim=(1, 3))


def dequantize(st: ScaledTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``ScaledTensor.dequantize(st, dtype)`` bit for bit: ``fused``'s one pass for contiguous E4M3 data to float32,
    else the fast upcast (``fp8_to_float32``) times each block's multiplier."""
    if (dtype or st.orig_dtype) == torch.float32 and _takes(st.data, torch.float8_e4m3fn) \
            and st.data.is_contiguous():
        return fused.dequantize_fp8(st.data, st.block, st.block_scale_inv())
    x = block_view(fp8_to_float32(st.data), st.block) * expand(st.block_scale_inv(), st.block)  # fp32
    return x.reshape(st.shape).to(st.orig_dtype if dtype is None else dtype)


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
    """Whether a quantizer takes ``fused``'s compiled pass for x (per call, about the input): ``_takes(x)`` and
    contiguous (the layer's operands; its copy keeps x's layout, as ``_keep``'s does)."""
    return _takes(x) and x.is_contiguous()


def _kept(st: ScaledTensor, dequantized: torch.Tensor) -> ScaledTensor:
    """st holding its float32 dequantization (from ``fused.quantize_fp8`` / ``quantize_e2m1``)."""
    st.dequantized = dequantized
    return st


def cast_elements(y: torch.Tensor, elem: str, rounding: str = "nearest",
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``scaled.cast_elements`` bit for bit. ``y`` is a scratch tensor of the caller's: the FP8 formats may clamp
    it in place (``saturating_cast``); E2M1 takes ``round_e2m1``'s few int32/FP32 passes."""
    if elem in tensor.FP8_DTYPES and rounding == "nearest":
        return saturating_cast(y, tensor.FP8_DTYPES[elem], FORMATS[elem].max)
    if elem == "e2m1" and rounding in ("nearest", "stochastic"):
        return round_e2m1(y.contiguous(), rounding, generator).to(CONTAINER[elem])
    return scaled.cast_elements(y, elem, rounding, generator)


def quantize_fp32_scaled(x: torch.Tensor, block, fp8_format="e4m3", *, margin: int = 0, power_2_scale: bool = False,
                         amax_epsilon: float = 0.0, keep_fp32: bool = False) -> ScaledTensor:
    """``blockwise.quantize_fp32_scaled`` bit for bit; ``keep_fp32``: also keep the float32 dequantization
    (``ScaledTensor.dequantized``), for an emulated GEMM. Power-of-two scales come from ``pow2_scale``."""
    name = tensor.fp8_format_name(fp8_format)
    b = resolve_block(x.shape, block)
    amax = tensor.apply_amax_epsilon(block_amax(x, b), amax_epsilon)       # (M/r, K/c) fp32
    top = FORMATS[name].max
    if power_2_scale and margin == 0:
        scale = pow2_scale(amax, top)                         # compute_scale's bits in fewer ops
    else:
        scale = tensor.compute_scale(amax, top, margin, None, power_2_scale)
    return encode_fp32_scaled(x, b, name, scale, keep_fp32, amax)


def encode_fp32_scaled(x: torch.Tensor, b: tuple[int, int], name: str, scale: torch.Tensor, keep_fp32: bool = False,
                       amax: Optional[torch.Tensor] = None) -> ScaledTensor:
    """``blockwise.encode_fp32_scaled`` bit for bit (``amax``: the block amaxes the scales came from, if they did:
    then no NaN code needs searching for)."""
    if keep_fp32 and name == "e4m3" and _fused(x):
        # the rule's cast and _keep's FP32 copy, in one compiled pass (the same bits: tests/core/quant/kernels/test_quant_fused.py)
        scale_inv = scale.reciprocal()
        data, dq = fused.quantize_fp8(x, b, scale, False, scale_inv)
        return _kept(ScaledTensor(data, scale_inv, b, name, None, x.dtype), dq)
    y = block_view(x.float(), b) * expand(scale, b)           # (M/r, r, K/c, c) fp32, one rounding
    data = cast_elements(y, name).reshape(x.shape)
    return _keep(data, scale.reciprocal(), b, name, None, x.dtype, y, keep_fp32, amax)


def quantize_mx(x: torch.Tensor, block=(1, 32), elem: str = "e4m3", rule: str = "floor",
                keep_fp32: bool = False, edges: str = "course") -> ScaledTensor:
    """``mx.quantize_mx`` bit for bit; the RCEIL scale from ``rceil_scale_inv`` (2^k without the int64 k)."""
    fmt = mx.mx_element_format(elem)
    check_edges(edges)
    b = resolve_block(x.shape, mx.check_mx_block(block))
    amax = block_amax(x, b)                                    # (M/r, K/c) fp32
    if rule == "rceil":
        return encode_mx(x, b, elem, amax, rceil_scale_inv(amax, fmt.max), keep_fp32, rule, edges)
    k = mx.mx_shared_exponent(amax, elem, rule)      # held until the cast is done, as the rule holds it
    return encode_mx(x, b, elem, amax, torch.exp2(k.double()).float(), keep_fp32, rule, edges)


def encode_mx(x: torch.Tensor, b: tuple[int, int], elem: str, amax: torch.Tensor, scale_inv: torch.Tensor,
              keep_fp32: bool = False, rule: str = "floor", edges: str = "course") -> ScaledTensor:
    """``mx.encode_mx`` bit for bit, from the scales 2^k (float32) instead of k (the divisor: ``mx.mx_divisor``'s,
    2^k itself unless ``edges="torchao"``)."""
    mx.check_mx_block(b)
    scale_inv = torch.where(torch.isnan(amax), float("nan"), scale_inv)
    divisor = mx.mx_divisor(scale_inv, rule, edges)
    if keep_fp32 and elem == "e4m3" and _fused(x):
        # the cast and _keep's FP32 copy, in one compiled pass (the same bits: tests/core/quant/kernels/test_quant_fused.py)
        e8m0 = scale_inv.to(torch.float8_e8m0fnu)
        data, dq = fused.quantize_fp8(x, b, divisor, True, block_multiplier(e8m0))
        return _kept(ScaledTensor(data, e8m0, b, elem, None, x.dtype), dq)
    y = block_view(x.float(), b) / expand(divisor, b)
    data = cast_elements(y, elem).reshape(x.shape)
    return _keep(data, scale_inv.to(torch.float8_e8m0fnu), b, elem, None, x.dtype, y, keep_fp32, amax)


def encode_mx_exponents(x: torch.Tensor, block: tuple[int, int], elem: str, amax: torch.Tensor, k: torch.Tensor,
                        rule: str = "floor", edges: str = "course", keep_fp32: bool = False) -> ScaledTensor:
    """``mx.encode_mx(x, block, elem, amax, k, rule, edges)`` bit for bit, from the same shared exponents k (a
    learner's ``mx_shared_exponent``): ``encode_mx`` with 2^k, exact in float32 (2^-127 is a subnormal)."""
    return encode_mx(x, block, elem, amax, torch.exp2(k.double()).float(), keep_fp32, rule, edges)


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                   keep_fp32: bool = False, edges: str = "course") -> ScaledTensor:
    """``nvfp4.quantize_nvfp4`` bit for bit (the block amaxes from ``block_amax``, both scale levels and the
    encoding multipliers from ``nvfp4_block_scales``)."""
    check_edges(edges)
    b = resolve_block(x.shape, nvfp4.check_nvfp4_block(block))
    amax_b = block_amax(x, b)                                # (M/r, K/c) fp32
    t, s, recip, mult = nvfp4_block_scales(amax_b, tensor_amax, edges)
    return _encode_nvfp4(x, b, t, s, recip, mult, _preshift(t, edges), rounding, generator, keep_fp32)


def nvfp4_block_scales(amax_b: torch.Tensor, tensor_amax=None, edges: str = "course"):
    """(t, s, recip, mult) bit for bit: ``nvfp4.nvfp4_scales``' two levels from the block amaxes (t () float32
    from ``given_tensor_amax`` and ``nvfp4_tensor_scale_inv``; s (M/r, K/c) float8_e4m3fn, 0 where the course flushes
    a block) and ``nvfp4_multipliers`` of them (``encode_nvfp4``'s). ``fused.nvfp4_scales``' one pass for non-empty
    float32 CPU amaxes."""
    if _takes(amax_b, torch.float32, None):
        given = None if tensor_amax is None else nvfp4.given_tensor_amax(tensor_amax, amax_b)
        return fused.nvfp4_scales(amax_b, given, edges == "course")         # the same bits, one compiled pass
    amax_t = nvfp4.given_tensor_amax(tensor_amax, amax_b)
    t = nvfp4.nvfp4_tensor_scale_inv(amax_t, edges)
    v = (amax_b / nvfp4.E2M1_MAX) / torch.where(t > 0, t, torch.ones_like(t))      # (M/r, K/c) fp32
    s = v.clamp(FORMATS["e4m3"].min_normal, nvfp4.E4M3_MAX)
    if edges == "course":
        s = torch.where(nvfp4.tiny_tensor(t) & (v < FORMATS["e4m3"].min_normal), 0.0, s)
    s = s.to(torch.float8_e4m3fn)
    return (t, s, *nvfp4_multipliers(t, s, edges))


def nvfp4_multipliers(t: torch.Tensor, s: torch.Tensor, edges: str = "course") -> tuple[torch.Tensor, torch.Tensor]:
    """(recip, mult), (M/r, K/c) float32 each, bit for bit: ``nvfp4.encode_multipliers``' encode multiplier
    ((1 / t') / pre) / float32(s) (t' = t, or 1 where t is not > 0; 0 where s is 0) and ``block_multiplier(s, t)`` =
    float32(s) * t, with the block scales upcast once by ``fp8_to_float32`` (torch's E4M3 upcast is element by
    element). ``_preshift`` is the pre the encode multiplies x by first."""
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    sf = fp8_to_float32(s)
    recip = ((1.0 / safe_t) / _preshift(t, edges)) / sf
    return torch.where(sf == 0, 0.0, recip), sf * t


def _preshift(t: torch.Tensor, edges: str) -> torch.Tensor:
    """``nvfp4.encode_multipliers``' pre: () float32, ``NVFP4_ENCODE_PRESHIFT`` for a tiny tensor, else 1."""
    shift = nvfp4.tiny_tensor(t) if edges == "course" else torch.zeros((), dtype=torch.bool, device=t.device)
    return torch.where(shift, nvfp4.NVFP4_ENCODE_PRESHIFT, 1.0).to(torch.float32)


def _preshifted(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """float32 x * pre (exact, a power of two); x itself where pre is 1 on the CPU (the same bits, no pass)."""
    x32 = x.float()
    if pre.device.type == "cpu" and float(pre) == 1.0:
        return x32
    return x32 * pre


def encode_nvfp4(x: torch.Tensor, b: tuple[int, int], t: torch.Tensor, s: torch.Tensor, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None, keep_fp32: bool = False,
                 edges: str = "course") -> ScaledTensor:
    """``nvfp4.encode_nvfp4`` bit for bit: ``fused``'s one pass from the rule's own random draws, or ``round_e2m1``."""
    nvfp4.check_nvfp4_block(b)
    check_edges(edges)
    return _encode_nvfp4(x, b, t, s, *nvfp4_multipliers(t, s, edges), _preshift(t, edges), rounding, generator,
                         keep_fp32)


def _encode_nvfp4(x: torch.Tensor, b: tuple[int, int], t: torch.Tensor, s: torch.Tensor, recip: torch.Tensor,
                  mult: torch.Tensor, pre: torch.Tensor, rounding: str, generator: Optional[torch.Generator],
                  keep_fp32: bool):
    """``encode_nvfp4`` with its multipliers computed (``nvfp4_multipliers``): x * pre (``_preshift``) times recip
    is the encoded value, mult the kept copy's multiplier."""
    orig_dtype, fuse = x.dtype, keep_fp32 and rounding in ("nearest", "stochastic") and _fused(x)
    x = _preshifted(x, pre)                                   # (M, K) fp32
    if fuse:
        if rounding == "nearest":
            data, dq = fused.quantize_e2m1(x, b, recip, mult, None)
        else:     # the rule's draws (torch.randint(0, 2**62)), drawn inside the kernel from the generator's state
            data, dq = fused.quantize_e2m1_drawing(x, b, recip, mult, generator)
        return _kept(ScaledTensor(data, s, b, "e2m1", t, orig_dtype), dq)
    y = block_view(x, b) * expand(recip, b)
    data = cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return _keep(data, s, b, "e2m1", t, orig_dtype, y, keep_fp32)


_RHT_MATRICES: dict = {}


def rht(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``hadamard.rht(x, seed)`` bit for bit: the rule's batched GEMM, H @ each (16, K) group, with the matrix built
    once per (seed, device) instead of at every call."""
    hadamard.check_rht_shape(x)
    key = (seed, str(x.device))
    if key not in _RHT_MATRICES:
        _RHT_MATRICES[key] = hadamard.random_hadamard(16, seed).to(x.device)
    M, K = x.shape
    return torch.matmul(_RHT_MATRICES[key], x.float().reshape(M // 16, 16, K)).reshape(M, K)
