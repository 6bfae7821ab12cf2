"""Fused fast paths for the emulated low-precision steps on a CPU, each equal bit for bit to the rule it replaces.

The rules stay where they are written for reading (``formats.round_to``, ``ScaledTensor.dequantize``,
``torch._scaled_mm``); what is here computes the same bits in fewer passes over memory, and
``tests/test_quant_fastpath.py`` checks each against its rule on every code point and on random tensors
(NaN, inf, signed zeros and ties included). Measured with ``benchmarks/bench_block_recipes.py``.

* ``fp8_to_float32(data, scale=None)``: upcast of a float8 tensor (E4M3 / E5M2 containers, so E2M1 data too).
  torch's CPU cast from float8 converts element by element (about as slow as a 128-wide FP32 GEMM
  over the same tensor); reading each code as the top bits of an FP16 number and upcasting that (one
  vectorized pass) is the same cast, about 3x faster than the gather from a 256-entry table it replaced
  (1024 x 512 E4M3, 1 thread). With a per-tensor ``scale`` the dequantization multiply is folded in:
  each element is the one FP32 product it was before.
* ``cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)``: what ``torch._scaled_mm`` computes on a CPU
  (upcast both operands, multiply by their scales, make them row-major, one FP32 GEMM, one rounding to
  ``out_dtype``; measured on torch 2.13), with the fast upcast.
* ``round_e2m1(y, rounding, generator)``: ``round_to(y, "e2m1", saturate=True)`` for nearest and
  stochastic rounding, with int32 arithmetic and without the general formats' many 64-bit passes.
  The stochastic path draws the same random integers as the rule (``torch.randint(0, 2**62, ...)``), so a
  seeded run gives the same bits, and reads each as two 32-bit words (no 64-bit arithmetic).

Fast paths that live next to their rule (same tests): ``tensor.compute_amax`` (one ``aminmax`` pass),
``scaled.block_amax`` for 1x16 blocks (max pooling), ``quantize_nvfp4``'s tensor amax (the largest block amax),
``NVFP4BlockScaling.rht`` (one batched matmul with a cached matrix), and ``gemm.fp8_linear_backward_gemms`` on
a CPU (each FP8 operand upcast once, without the layout copies a GPU needs).
"""
from __future__ import annotations

from typing import Optional

import torch

def fp8_to_float32(data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``data.float()`` (times ``scale``, a one-element float32 tensor, if given), same shape and strides
    for a contiguous tensor or the transpose of one; other layouts come back contiguous. Non-CPU tensors
    take the plain rule.

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
    codes = data.view(torch.int8).to(torch.int16)                           # (...) int16, sign-extended: bit 15
    if data.dtype == torch.float8_e5m2:
        out = codes.bitwise_left_shift_(8).view(torch.float16).float()      # (...) fp32: the value
        factor = None
    else:
        out = codes.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16).float()   # value * 2^-8
        factor = 256.0
    if scale is not None:
        scale = scale.reshape(()).float()
        folded = scale if factor is None else scale * factor                # () fp32, exact if finite
        if torch.isfinite(folded) or not torch.isfinite(scale):
            out.mul_(folded)
        else:
            out.mul_(factor).mul_(scale)
    elif factor is not None:
        out.mul_(factor)
    if data.dtype == torch.float8_e4m3fn:
        b = data.view(torch.uint8)                                          # NaN codes: 0x7F and 0xFF
        if int(b.max()) == 0xFF or int(data.view(torch.int8).max()) == 0x7F:
            out[(b & 0x7F) == 0x7F] = float("nan")
    return out


def cpu_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype)`` on a CPU for per-tensor scales:
    ``(float32(a) * scale_a) @ (float32(b) * scale_b)`` in FP32, rounded once to ``out_dtype``.
    a: (M, K) float8, b: (K, N) float8 (any of the layouts ``_scaled_mm`` takes)."""
    # _scaled_mm makes both FP32 operands row-major before its GEMM (for small shapes the layout changes the
    # bits); so does this, on the 1-byte codes, before the upcast
    out = torch.mm(fp8_to_float32(a.contiguous(), scale_a), fp8_to_float32(b.contiguous(), scale_b))   # (M, N) fp32
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ------------------------------------------------------------------------------------------------ E2M1
E2M1_MAX = 6.0


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
    raise ImportError("mpcourse.core.quant.fastpath reads int64 as (low, high) int32 words: a little-endian machine")


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
