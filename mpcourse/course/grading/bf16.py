"""Graders for lesson 06 (BF16 training): stochastic rounding to BF16 and a Kahan-compensated BF16 update.

Oracles, none of them ``mpcourse.core.bf16``: torch's BF16 cast and ``torch.nextafter`` give the two BF16
neighbours of every input; the binomial distribution gives the mean and spread of stochastic rounding
(Gupta et al. 2015: round up with probability (x - lo) / (hi - lo)); an FP64 sum of the same FP32 updates is
the exact value a compensated update must track (Zamirai et al. 2020, "Revisiting BFloat16 Training",
Algorithm 2), and the classic case: ten +1e-3 updates of a BF16 weight 1.0 give 1.0078125 with about 0.0021875
held in the compensation.

Statistics. The case 1 + 1e-3 (10,000 draws) must land within 3 sigma of 1.001. Six further values
are checked with 100,000 draws at 4 sigma, so a correct implementation fails by chance with probability
below 1e-3 in all; the planted wrong ones (always down, probability 0.5, round to nearest) miss by tens of
sigma. NaN payloads (0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF: the ones a bit-level add carries into +inf, -0 or
+0) must stay NaN, checked on 256 copies each so the wrong carry is met deterministically. The generator
must drive the draws: the same seed gives the same bits whatever the global RNG did in between, and
another seed gives other bits.

Kahan. The update is exact step by step: after every step w and comp must equal, bit for bit, the textbook
recurrence in torch's own arithmetic (``_KAHAN_HINT``), over four fixed sequences.
"""
from __future__ import annotations

import math

import torch

from . import GradingError, call, verdict
from .formats import rounding_cases

_SR_HINT = ("add a uniform random integer in [0, 2**16) to the FP32 bits (x.view(torch.int32)), clear the low "
            "16 bits (& -65536), view as float32 and cast to bfloat16; keep NaN as it is")
_KAHAN_HINT = ("y = update + comp; new = bf16(w + y); comp = bf16(y - (new - w)); w = new, all in place "
               "(w.copy_, comp.copy_). comp holds what the weight still owes, so w + comp tracks the exact sum "
               "(Kahan's textbook c is its negative)")


def _neighbours(x: torch.Tensor):
    """(lo, hi): BF16 neighbours of float32 x from torch's cast and nextafter; lo == hi when representable."""
    rn = x.to(torch.bfloat16)
    up = torch.nextafter(rn, torch.full_like(rn, math.inf)).float()
    down = torch.nextafter(rn, torch.full_like(rn, -math.inf)).float()
    rn = rn.float()
    other = torch.where(x > rn, up, down)
    other = torch.where((x == rn) | x.isnan() | x.isinf(), rn, other)
    return torch.minimum(rn, other), torch.maximum(rn, other)


NAN_PAYLOADS = (0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFF800001)   # FP32 bit patterns of NaNs


def nan_payloads(copies: int = 256) -> torch.Tensor:
    """(len(NAN_PAYLOADS) * copies,) float32 NaNs whose low bits carry into inf/0 under a rounding add."""
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in NAN_PAYLOADS], dtype=torch.int32)
    return bits.repeat_interleave(copies).view(torch.float32)


def _nan_fail(name, x, got):
    bits = int(x.view(torch.int32)) & 0xFFFFFFFF
    raise GradingError(
        f"FAIL {name}: the NaN with bit pattern 0x{bits:08X} came back as {float(got)!r}. Adding random low "
        f"bits to a NaN's bits can carry into the exponent or the sign (inf, -0, +0).\n"
        f"  hint: return NaN inputs unchanged (torch.where(x.isnan(), x, rounded)). {_SR_HINT}")


def _rounded(name, fn, x, generator) -> torch.Tensor:
    got = call(name, fn, x.clone(), generator)
    if not isinstance(got, torch.Tensor):
        raise GradingError(f"FAIL {name}: expected a torch.Tensor back, got {type(got).__name__}.")
    if got.shape != x.shape:
        raise GradingError(f"FAIL {name}: expected shape {tuple(x.shape)}, got {tuple(got.shape)}.")
    if got.dtype not in (torch.bfloat16, torch.float32):
        raise GradingError(f"FAIL {name}: return a torch.bfloat16 tensor, got dtype {got.dtype}.")
    return got.float()


# value, roundings, sigmas: the first is the lesson's case (10,000 draws, 3 sigma), six more at 4 sigma
UNBIASED_CASES = [(1 + 1e-3, 10_000, 3.0), (-1 - 3e-3, 100_000, 4.0), (0.1, 100_000, 4.0), (257.5, 100_000, 4.0),
                  (1.00390625, 100_000, 4.0), (3e-39, 100_000, 4.0), (12345.678, 100_000, 4.0)]


def check_stochastic_round_bf16(fn) -> None:
    """Grade ``fn(x: float32 tensor, generator: torch.Generator) -> bfloat16 tensor`` (stochastic rounding).

    1. Every result is one of the two BF16 neighbours of its input (the input itself when representable; NaN
       stays NaN, +-inf stay): every BF16 value, every tie, the FP32 values beside each tie, and 5,000 random
       FP32 values (oracle: torch casts and nextafter).
    2. Unbiased: 10,000 roundings of 1 + 1e-3 average 1.001 within 3 sigma; six more values within 4 sigma.
    Raises GradingError at the first wrong case.
    """
    name = "stochastic_round_bf16"
    inputs = _check_neighbours(name, fn)
    for k, (v, n, z) in enumerate(UNBIASED_CASES):
        _check_unbiased(name, fn, torch.full((n,), v), z, torch.Generator().manual_seed(1 + k))
    _check_nan_payloads(name, fn)
    _check_generator(name, fn)
    verdict(name, f"{inputs:,} inputs land on a BF16 neighbour (torch casts); NaN payloads stay NaN; the "
                  f"generator drives the draws; 10,000 roundings of 1 + 1e-3 "
                  f"average 1.001 within 3 sigma; {len(UNBIASED_CASES) - 1} more values unbiased within 4 sigma")


def _check_neighbours(name, fn) -> int:
    """Every graded input rounds to one of its two BF16 neighbours (NaN stays NaN). Returns how many inputs."""
    x = rounding_cases("bf16", n_random=5000)
    x = x[~(x.isfinite() & (x.abs() > 3.38e38))]                     # the overflow edge is not graded
    lo, hi = _neighbours(x)
    got = _rounded(name, fn, x, torch.Generator().manual_seed(0))
    ok = (got == lo) | (got == hi) | (got.isnan() & x.isnan())
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        if bool(x[i].isnan()):
            _nan_fail(name, x[i:i + 1], got[i])
        raise GradingError(
            f"FAIL {name}: the result must be one of the two BF16 neighbours of the input.\n"
            f"  first wrong case: input {float(x[i])!r}, neighbours {float(lo[i])!r} and {float(hi[i])!r}, "
            f"got {float(got[i])!r}\n  hint: {_SR_HINT}")
    return x.numel()


def _check_unbiased(name, fn, xs: torch.Tensor, z: float, generator: torch.Generator) -> None:
    """``xs``: (n,) float32 copies of one value; their roundings average it within ``z`` sigma (binomial)."""
    n = xs.numel()
    lo, hi = (float(t[0]) for t in _neighbours(xs[:1]))
    p = (float(xs[0]) - lo) / (hi - lo)                                # probability of rounding to hi
    r = _rounded(name, fn, xs, generator).double()
    if not bool(((r == lo) | (r == hi)).all()):
        raise GradingError(f"FAIL {name}: rounding {float(xs[0])!r} gave a value other than its neighbours "
                           f"{lo!r} and {hi!r}.\n  hint: {_SR_HINT}")
    sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
    mean, up = float(r.mean()), float((r == hi).double().mean())
    if abs(mean - float(xs[0])) > z * sigma:
        raise GradingError(
            f"FAIL {name}: biased. The mean of {n:,} roundings of {float(xs[0])!r} should be that value "
            f"within {z:g} sigma ({z * sigma:.2e}); got {mean!r}.\n"
            f"  It should round to {hi!r} with probability {p:.4f}; yours did {up:.4f} of the time.\n"
            f"  hint: round away from zero with probability (distance to the lower-magnitude neighbour) / "
            f"(gap between the neighbours), not always down, not half the time, not to nearest. {_SR_HINT}")


def _check_nan_payloads(name, fn) -> None:
    """NaNs whose low bits a rounding add would carry into inf or 0 stay NaN."""
    payloads = nan_payloads()
    got = _rounded(name, fn, payloads, torch.Generator().manual_seed(0))
    if not bool(got.isnan().all()):
        i = int((~got.isnan()).nonzero()[0])
        _nan_fail(name, payloads[i:i + 1], got[i])


def _check_generator(name, fn) -> None:
    """The generator passed in drives the draws: same seed, same bits (whatever the global RNG did); other seed,
    other bits."""
    probe = torch.full((4096,), 1 + 1e-3)
    first = _rounded(name, fn, probe, torch.Generator().manual_seed(7))
    torch.rand(1000)                                                   # move the global RNG in between
    again = _rounded(name, fn, probe, torch.Generator().manual_seed(7))
    other = _rounded(name, fn, probe, torch.Generator().manual_seed(8))
    if not torch.equal(first, again) or torch.equal(first, other):
        raise GradingError(
            f"FAIL {name}: the draws must come from the generator passed in: the same seed must give the same "
            f"roundings (got {'the same' if torch.equal(first, again) else 'different'} ones) and another seed "
            f"other roundings (got {'the same' if torch.equal(first, other) else 'different'} ones).\n"
            f"  hint: torch.randint(0, 2**16, x.shape, generator=generator, dtype=torch.int32). {_SR_HINT}")


def _kahan_sequences():
    """(name, w0 (N,) float32 of BF16 values, updates (K, N) float32), fixed seeds."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.rand(*s, generator=g)                      # noqa: E731
    return [
        ("1000 small positive updates from 1.0", torch.ones(64), rand(1000, 64) * 1e-3),
        ("500 updates of either sign around 3.0", torch.full((64,), 3.0), (rand(500, 64) - 0.5) * 2e-3),
        ("200 updates of +3e-3 from 0.5 (crossing 1.0)", torch.full((64,), 0.5), torch.full((200, 64), 3e-3)),
        ("500 updates of +1e-3 from -2.0 (crossing -1.0)", torch.full((64,), -2.0), torch.full((500, 64), 1e-3)),
    ]


def check_kahan_add(fn) -> None:
    """Grade ``fn(w: bf16 tensor, comp: bf16 tensor, update: float32 tensor) -> None`` (in place).

    1. The classic case: ten updates of +1e-3 to w = 1.0 leave w == 1.0078125, comp ~ 0.0021875 (within 5e-5)
       and w + comp ~ 1.01 (plain BF16 addition leaves 1.0).
    2. Four fixed sequences of FP32 updates (64 weights each): after every step w and comp equal, bit for
       bit, the recurrence y = update + comp; new = bf16(w + y); comp = bf16(y - (new - w)); w = new
       (FP32 arithmetic, one rounding to BF16 each); w and comp stay bfloat16.
    Raises GradingError at the first wrong case.
    """
    name = "kahan_add_"
    w, comp = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    for _ in range(10):
        call(name, fn, w, comp, torch.tensor([1e-3]))
    if w.dtype != torch.bfloat16 or comp.dtype != torch.bfloat16:
        raise GradingError(f"FAIL {name}: update w and comp in place and keep them bfloat16 "
                           f"(got {w.dtype}, {comp.dtype}).")
    wv, cv = float(w), float(comp)
    if wv != 1.0078125 or abs(cv - 0.0021875) > 5e-5 or abs(wv + cv - 1.01) > 5e-5:
        raise GradingError(
            f"FAIL {name}: ten updates of +1e-3 to a BF16 weight 1.0 should leave w = 1.0078125 and about "
            f"0.0021875 in comp (w + comp ~ 1.01); got w = {wv!r}, comp = {cv!r}.\n  hint: {_KAHAN_HINT}")
    for what, w0, updates in _kahan_sequences():
        w, comp = w0.to(torch.bfloat16), torch.zeros(w0.shape, dtype=torch.bfloat16)
        rw, rc = w.clone(), comp.clone()                               # the oracle's state, (N,) bf16
        for k, u in enumerate(updates):
            call(name, fn, w, comp, u.clone())
            y = u + rc.float()                                         # (N,) fp32
            new = (rw.float() + y).to(torch.bfloat16)
            rc = (y - (new.float() - rw.float())).to(torch.bfloat16)
            rw = new
            if w.dtype != torch.bfloat16 or comp.dtype != torch.bfloat16:
                raise GradingError(f"FAIL {name}: w and comp must stay bfloat16 (got {w.dtype}, {comp.dtype}).")
            bad = (w.float() != rw.float()) | (comp.float() != rc.float())
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise GradingError(
                    f"FAIL {name}: {what}: after step {k + 1} (update {float(u[i])!r}) expected w = {float(rw[i])!r}, "
                    f"comp = {float(rc[i])!r}; got w = {float(w[i])!r}, comp = {float(comp[i])!r}. The compensated "
                    f"update is exact step by step: no tolerance.\n  hint: {_KAHAN_HINT}")
    verdict(name, "ten +1e-3 updates of 1.0 give 1.0078125 with ~0.0021875 held in comp; w and comp match "
                  "the compensated recurrence bit for bit at every step of 4 fixed sequences of 64 weights")
