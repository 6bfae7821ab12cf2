"""E2M1 rounding in torch: ``round_e2m1``, equal bit for bit to ``formats.round_to(y, "e2m1", saturate=True)``.

For nearest and stochastic rounding, with int32 arithmetic and without the general formats' many 64-bit passes.
The stochastic path draws the same random integers as the rule (``torch.randint(0, 2**62, ...)``), so a seeded run
gives the same bits, and reads each as two 32-bit words (no 64-bit arithmetic). It is the kernel of the E2M1 step
wherever the compiled pass (``nvfp4_passes``) does not run (no numba, no kept FP32 copy, another layout); checked
by ``tests/core/quant/kernels/test_quant_fastpath.py`` on every code point and on random tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...formats import FORMATS

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
    raise ImportError("mpcourse.core.quant.kernels.e2m1 reads int64 as (low, high) int32 words: a little-endian machine")


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


