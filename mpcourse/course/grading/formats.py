"""Graders for lesson 00 (number formats): round-to-nearest-even into BF16 / FP16, and decoding bits.

Oracle: PyTorch's own casts (``x.to(torch.bfloat16).float()``, ``x.to(torch.float16).float()``) and
its bit reinterpretation (``view``), never ``mpcourse.core.formats``. The cases are every value of the
format, every midpoint between neighbours (the ties), the FP32 values just above and below each
midpoint, signed zeros, infinities, NaN, FP32 subnormals, the overflow threshold, and 20,000 random
FP32 bit patterns spread over all exponents (fixed seed).
"""
from __future__ import annotations

import torch

from . import GradingError, call, check_tensor_fn, verdict

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LAYOUT = {"fp16": (5, 10, torch.float16), "bf16": (8, 7, torch.bfloat16), "e5m2": (5, 2, torch.float8_e5m2)}


def _next_up(x: torch.Tensor) -> torch.Tensor:          # next float32 towards +inf (finite x)
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def _next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("-inf")))


def rounding_cases(fmt: str, n_random: int = 20_000, seed: int = 0) -> torch.Tensor:
    """(N,) float32 test inputs for rounding into ``fmt`` ("bf16" or "fp16"), deterministic."""
    dtype = _DTYPES[fmt]
    bits = torch.arange(2**16, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float()                                     # every value of the format
    finite = values[values.isfinite()].unique()                           # sorted, -0 and +0 merged
    # Midpoints between neighbours (exact in FP32), and the one past the largest finite value:
    # the overflow threshold, max + half a step, where rounding goes to inf.
    top = finite[-1].double()
    step = top - finite[-2].double()
    mids = ((finite[:-1].double() + finite[1:].double()) / 2).float()
    edge = torch.tensor([top + step / 2, -(top + step / 2)], dtype=torch.float64).float()
    mids = torch.cat([mids, edge])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"),
                            1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38])
    # NaN payloads whose low bits carry into the exponent or the sign under a bit-level rounding add
    # (bits + 0x7FFF + lsb): 0x7F800001 -> +inf, 0x7FFFFFFF -> -0, 0xFFFFFFFF -> +0. Always present.
    payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC00001, -0x7FFFFF], dtype=torch.int32)
    special = torch.cat([special, payloads.view(torch.float32)])
    g = torch.Generator().manual_seed(seed)
    rand_bits = torch.randint(-2**31, 2**31 - 1, (n_random,), generator=g, dtype=torch.int64)
    random = rand_bits.to(torch.int32).view(torch.float32)
    return torch.cat([values, mids, _next_up(mids), _next_down(mids), special, random])


def _describe(fmt: str):
    dtype = _DTYPES[fmt]

    def describe(x: float) -> str:
        t = torch.tensor([x])
        if not bool(t.isfinite()):
            return "not finite"
        r = t.to(dtype)                                    # the correctly rounded value
        if float(r) == x:
            return f"exactly representable in {fmt}"
        if not bool(r.isfinite()):
            return f"beyond the largest {fmt} value plus half a step: overflows to inf"
        # The other neighbour: one step further from zero if |x| > |r|, else one step closer.
        step = 1 if abs(x) > abs(float(r)) else -1
        other = (r.view(torch.int16) + step).view(dtype)
        a, b = sorted([float(r), float(other)])
        if (a + b) / 2 == x:
            return f"a tie, exactly halfway between {a!r} and {b!r}: round half to even"
        return f"between {a!r} and {b!r}"
    return describe


def _check_round(fmt: str, fn) -> None:
    cases = rounding_cases(fmt)
    expected = cases.to(_DTYPES[fmt]).float()
    check_tensor_fn(f"round_to_{fmt}", fn, cases, expected, oracle=f"torch .to(torch.{_DTYPES[fmt]})".replace("torch.torch.", "torch."),
                    describe=_describe(fmt),
                    hint=("ties go to the neighbour whose last mantissa bit is 0 (round half to even); "
                          "values past the largest finite value plus half a step become inf; NaN stays NaN; "
                          "below the smallest normal, the step stops shrinking (subnormals)."))


def check_round_bf16(fn) -> None:
    """Grade ``fn(x: float32 tensor) -> float32 tensor``: each element rounded to BF16 (nearest, ties to even)."""
    _check_round("bf16", fn)


def check_round_fp16(fn) -> None:
    """Grade ``fn(x: float32 tensor) -> float32 tensor``: each element rounded to FP16 (nearest, ties to even)."""
    _check_round("fp16", fn)


def check_decode(fn) -> None:
    """Grade ``fn(bits: int, exponent_bits: int, mantissa_bits: int) -> float``: the value an IEEE-style
    bit pattern encodes (sign, biased exponent, mantissa; subnormals; inf; NaN), over every bit
    pattern of FP16, BF16 and FP8 E5M2 (oracle: torch's ``view`` of the same bits)."""
    total = 0
    for fmt, (e_bits, m_bits, dtype) in _LAYOUT.items():
        width = 1 + e_bits + m_bits
        ints = torch.arange(2**width, dtype=torch.int32)
        raw = ints.to(torch.int16 if width == 16 else torch.uint8)
        expected = raw.view(dtype).float().tolist()
        for b, e in zip(ints.tolist(), expected):
            got = call("decode", fn, b, e_bits, m_bits)
            try:
                got = float(got)
            except (TypeError, ValueError):
                raise GradingError(f"FAIL decode: return a Python float, got {type(got).__name__} "
                                   f"for bits {b:#0{width // 4 + 2}x} ({fmt}).") from None
            same = (got == e and (got != 0 or str(got)[0] == str(e)[0])) or (got != got and e != e)
            if not same:
                pattern = format(b, f"0{width}b")
                fields = f"{pattern[0]} {pattern[1:1 + e_bits]} {pattern[1 + e_bits:]}"
                raise GradingError(
                    f"FAIL decode: {fmt} bits {fields} (sign exponent mantissa) should decode to {e!r}, "
                    f"got {got!r}.\n  hint: bias = 2**(exponent_bits-1) - 1; an all-zero exponent "
                    "means subnormal (no implicit 1, exponent 1 - bias); all-ones means inf (mantissa 0) "
                    "or NaN; the sign bit makes -0.0 too.")
            total += 1
    verdict("decode", f"{total:,} bit patterns of fp16, bf16 and e5m2 decode as torch does")
