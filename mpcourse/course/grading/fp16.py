"""Graders for lesson 01 (why FP16 breaks): what the cast to FP16 does to a value, and when an update is lost.

* ``check_fp16_fate(fn)``: ``fn(x)`` classifies each float32 value by what FP16 makes of it: ``ZERO`` (flushed, or
  already 0), ``SUBNORMAL`` (kept with fewer significant bits), ``NORMAL``, ``OVERFLOW`` (becomes inf). This is the
  arithmetic behind Micikevicius et al. 2018, "Mixed Precision Training", section 3.2 and Figure 3 (gradients
  below 2**-24 become zero in FP16).
* ``check_is_update_lost(fn)``: ``fn(w, dw)`` says, per element, whether adding a nonzero FP16 update ``dw`` to an
  FP16 weight ``w`` leaves ``w`` unchanged ("swamping", section 3.1: lost when |w| / |dw| exceeds about 2048).

Oracle: PyTorch's own FP16 cast (``x.to(torch.float16)``) and FP16 addition (``w + dw`` on float16 tensors, one
correctly rounded result), never ``mpcourse``. Cases: every FP16 value, every midpoint between neighbours (ties),
the float32 values just beside each midpoint, the overflow edge and random values over 60 binades (fixed seed).
"""
from __future__ import annotations

import torch

from ...core.formats import FORMATS
from . import GradingError, _hex32, call, verdict

ZERO, SUBNORMAL, NORMAL, OVERFLOW = 0, 1, 2, 3
FATES = ("ZERO", "SUBNORMAL", "NORMAL", "OVERFLOW")
_MIN_NORMAL = FORMATS["fp16"].min_normal   # 2**-14, FP16's smallest normal


def fate_oracle(x: torch.Tensor) -> torch.Tensor:
    """(N,) int64 fate codes of float32 ``x``, read off torch's own cast to FP16."""
    r = x.to(torch.float16)
    out = torch.full(x.shape, NORMAL, dtype=torch.int64)
    out[r == 0] = ZERO
    out[(r != 0) & (r.abs() < _MIN_NORMAL)] = SUBNORMAL
    out[r.isinf()] = OVERFLOW
    return out


def fate_cases(n_random: int = 20_000, seed: int = 0) -> torch.Tensor:
    """(N,) finite float32 inputs for ``check_fp16_fate``, deterministic."""
    bits = torch.arange(2**16, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16).float()
    finite = values[values.isfinite()].unique()                            # sorted, one zero
    mids = ((finite[:-1].double() + finite[1:].double()) / 2).float()      # exact in float32
    top = 65504.0 + 16.0                                                   # max + half a step: rounds to inf
    mids = torch.cat([mids, torch.tensor([top, -top])])
    near = torch.cat([torch.nextafter(mids, torch.full_like(mids, float("inf"))),
                      torch.nextafter(mids, torch.full_like(mids, float("-inf")))])
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, 3.4028235e38, -3.4028235e38, 1e5, -1e5])
    g = torch.Generator().manual_seed(seed)
    exps = torch.rand(n_random, generator=g, dtype=torch.float64) * 60 - 40          # 2**-40 .. 2**20
    signs = torch.where(torch.rand(n_random, generator=g) < 0.5, -1.0, 1.0).double()
    random = (signs * torch.exp2(exps)).float()
    return torch.cat([finite, mids, near, special, random])


def _fate_hint(x: float, want: int, got: int) -> str:
    a = abs(x)
    if want == SUBNORMAL and got == ZERO and a < 2.0**-24:
        return ("values above half the smallest subnormal (2**-25) round UP to 2**-24; only |x| <= 2**-25 becomes 0 "
                "(the tie at exactly 2**-25 goes to the even neighbour, 0).")
    if want == ZERO and got == SUBNORMAL:
        return "|x| <= 2**-25 rounds to 0 (2**-25 itself is a tie between 0 and 2**-24: ties go to the even one, 0)."
    if want == NORMAL and got == SUBNORMAL:
        return ("a value just below 2**-14 can round UP to 2**-14, the smallest normal: decide on the rounded value, "
                "not on x.")
    if want == NORMAL and got == OVERFLOW:
        return ("FP16's max is 65504, but anything below 65520 (max + half a step) rounds DOWN to 65504; only "
                "|x| >= 65520 becomes inf.")
    if want == OVERFLOW and got == NORMAL:
        return "|x| >= 65520 (65504 + half a step) rounds to inf in FP16 (the tie at 65520 goes to even: inf)."
    return "classify the value FP16 rounds x to (round to nearest, ties to even), not x itself; use |x| (signs!)."


def check_fp16_fate(fn) -> None:
    """Grade ``fn(x: float32 (N,)) -> integer (N,)`` of fate codes against torch's FP16 cast.

    Raises:
        GradingError: wrong type/shape/dtype, or the first wrong value (input, expected, got, hint).
    """
    name = "fp16_fate"
    cases = fate_cases()
    want = fate_oracle(cases)
    got = call(name, fn, cases.clone())
    if not isinstance(got, torch.Tensor):
        raise GradingError(f"FAIL {name}: expected a torch.Tensor of codes back, got {type(got).__name__}.")
    if got.shape != cases.shape:
        raise GradingError(f"FAIL {name}: expected shape {tuple(cases.shape)}, got {tuple(got.shape)}. "
                           "Work elementwise and keep the input's shape.")
    if got.is_floating_point() or got.is_complex() or got.dtype == torch.bool:
        raise GradingError(f"FAIL {name}: return integer codes (ZERO=0, SUBNORMAL=1, NORMAL=2, OVERFLOW=3), "
                           f"got dtype {got.dtype}.")
    bad = (got.long() != want).nonzero().flatten()
    if len(bad) == 0:
        counts = ", ".join(f"{int((want == k).sum()):,} {FATES[k]}" for k in range(4))
        verdict(name, f"{cases.numel():,} cases agree with torch .to(torch.float16) ({counts})")
        return
    # The simplest wrong case: magnitude closest to 1 in binades.
    mag = cases[bad].abs().double().log2().abs().nan_to_num(posinf=1e9)
    i = int(bad[int(mag.argmin())])
    x, w, gv = float(cases[i]), int(want[i]), int(got[i])
    shown = FATES[gv] if 0 <= gv < 4 else str(gv)
    raise GradingError(
        f"FAIL {name}: {len(bad):,} of {cases.numel():,} cases differ from torch .to(torch.float16).\n"
        f"  first wrong case: x = {x!r} [{_hex32(x)}], which FP16 stores as {float(cases[i].half())!r}\n"
        f"  expected {FATES[w]}, got {shown}\n  hint: {_fate_hint(x, w, gv)}")


def update_cases(n_random: int = 20_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, dw): two (N,) float16 tensors of weights and updates, deterministic. Around powers of two (where the
    spacing below is half the spacing above), ordinary weights, LayerNorm gains at 1.0, exact half-spacing ties
    (both parities), ratios |w|/|dw| from 2**5 to 2**16, both signs, and dw = 0."""
    ws = torch.tensor([1.0, 1.5, 1.9990234375, 2.0, 0.0200043, 0.125, 3.0, 1000.0, 2.0**-14, 2.0**-20,
                       65504.0, 1.0009765625, 0.7998046875], dtype=torch.float16)
    ws = torch.cat([ws, -ws])
    ratios = torch.exp2(torch.arange(5.0, 16.01, 0.25))                           # |w| / |dw|
    w = ws.repeat_interleave(len(ratios) * 2)
    r = ratios.repeat(len(ws) * 2)
    s = torch.tensor([1.0, -1.0]).repeat_interleave(len(ratios)).repeat(len(ws))
    dw = (w.float() / r * s).half()
    # exact ties: dw = +- half the spacing above / below w
    wf = ws.float()
    up = (torch.nextafter(ws, torch.full_like(ws, float("inf"))).float() - wf) / 2
    down = (wf - torch.nextafter(ws, torch.full_like(ws, float("-inf"))).float()) / 2
    tw = torch.cat([ws, ws, ws, ws])
    tdw = torch.cat([up, -down, up * 1.5, -down * 1.5]).half()
    g = torch.Generator().manual_seed(seed)
    rw = (torch.randn(n_random, generator=g) * 0.05).half()
    rdw = (torch.randn(n_random, generator=g) * torch.exp2(torch.rand(n_random, generator=g) * -20 - 4)).half()
    zero = torch.zeros(3, dtype=torch.float16)
    return (torch.cat([w, tw, rw, torch.tensor([1.0, 0.0, -3.0], dtype=torch.float16)]),
            torch.cat([dw, tdw, rdw, zero]))


def lost_oracle(w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """(N,) bool: dw != 0 and the FP16 sum w + dw (torch's FP16 add) equals w."""
    return (dw != 0) & ((w + dw) == w)


def check_is_update_lost(fn) -> None:
    """Grade ``fn(w: float16 (N,), dw: float16 (N,)) -> bool (N,)`` against torch's FP16 addition.

    Raises:
        GradingError: wrong type/shape/dtype, or the first wrong case (w, dw, their ratio, w + dw, hint).
    """
    name = "is_update_lost"
    w, dw = update_cases()
    want = lost_oracle(w, dw)
    got = call(name, fn, w.clone(), dw.clone())
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
        what = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
        raise GradingError(f"FAIL {name}: return a bool tensor (True where the update is lost), got {what}.")
    if got.shape != w.shape:
        raise GradingError(f"FAIL {name}: expected shape {tuple(w.shape)}, got {tuple(got.shape)}.")
    bad = (got != want).nonzero().flatten()
    if len(bad) == 0:
        verdict(name, f"{w.numel():,} (w, dw) pairs agree with torch's FP16 addition "
                      f"({int(want.sum()):,} updates lost)")
        return
    i = int(bad[0])
    wi, di = float(w[i]), float(dw[i])
    ratio = abs(wi / di) if di else float("inf")
    hint = ("the paper's |w|/|dw| >= 2048 is a rule of thumb; what decides is round to nearest even of the exact "
            "sum w + dw: the update is lost when the sum rounds back to w. A sum exactly halfway between w and its "
            "neighbour (a tie) goes to the even one; the spacing just below a power of two is half the spacing "
            "above it.")
    if di == 0:
        hint = "dw = 0 is not a lost update (there is nothing to lose): return False there."
    raise GradingError(
        f"FAIL {name}: {len(bad):,} of {w.numel():,} cases differ from torch's FP16 addition.\n"
        f"  first wrong case: w = {wi!r}, dw = {di!r} (|w|/|dw| = {ratio:.6g}); FP16 w + dw = {float(w[i] + dw[i])!r}\n"
        f"  expected {bool(want[i])}, got {bool(got[i])}\n  hint: {hint}")
