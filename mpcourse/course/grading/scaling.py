"""Graders for lessons 03 (static loss scaling) and 04 (dynamic loss scaling).

Oracles, none of them ``mpcourse.core.scaling``:

* ``check_choose_loss_scale``: exact rational arithmetic (``fractions.Fraction``): the largest power of
  two ``S`` with ``S * grad_abs_max * 2**margin <= fmt_max``, found by exact comparisons; on float32 and
  float64 inputs, float64 ones one ulp either side of a power-of-two boundary included.
* ``check_unscale_grads``: PyTorch's fused kernel ``torch._amp_foreach_non_finite_check_and_unscale_``,
  the one ``torch.amp.GradScaler.unscale_`` runs, with GradScaler's
  ``inv_scale = scale.double().reciprocal().float()`` (torch/amp/grad_scaler.py).
* ``check_update_scale``: ``torch.amp.GradScaler("cpu")`` itself, driven over fixed seeded overflow
  patterns; its ``get_scale()`` and ``state_dict()["_growth_tracker"]`` after every ``update()``.

Sources: Micikevicius et al. 2018, "Mixed Precision Training" (ICLR 2018), section 3.2;
torch/amp/grad_scaler.py and ATen's AmpGradScalerKernels (``_amp_update_scale_``).
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import torch

from ...core.formats import FORMATS
from . import GradingError, call, same_bits, verdict

FP32_MAX = FORMATS["fp32"].max   # 3.4028234663852886e38


# ----------------------------------------------------------------------------------------------------------
# Lesson 03: choose_loss_scale
# ----------------------------------------------------------------------------------------------------------
def exact_loss_scale(grad_abs_max: float, fmt_max: float = 65504.0, margin: int = 0) -> float:
    """Oracle: the largest power of two S (any integer exponent) with S * grad_abs_max * 2**margin <= fmt_max,
    by exact rational comparisons (no logarithms, no rounding)."""
    g, top = Fraction(grad_abs_max) * Fraction(2) ** margin, Fraction(fmt_max)
    s = Fraction(1)
    while s * g > top:
        s /= 2
    while 2 * s * g <= top:
        s *= 2
    return float(s)


def boundary_cases() -> list[tuple[float, float, int]]:
    """float64 inputs at power-of-two boundaries: g = fmt_max / 2**(k+margin) exactly (S = 2**k fits with
    equality) and its float64 neighbours one ulp above (S = 2**(k-1)) and below (S = 2**k). The neighbours are
    not float32 values: a function that rounds its input to float32 (or trusts log2 near an integer) lands
    on the boundary itself and returns the wrong power of two."""
    out = []
    for fmt_max, k, margin in ((65504.0, 17, 0), (65504.0, 0, 0), (65504.0, -3, 2), (448.0, 5, 1),
                               (57344.0, 30, 0), (65504.0, 40, 3)):
        b = fmt_max / 2.0 ** (k + margin)                               # exact in float64
        out += [(b, fmt_max, margin), (math.nextafter(b, math.inf), fmt_max, margin),
                (math.nextafter(b, 0.0), fmt_max, margin)]
    return out


def choose_cases(n_random: int = 300, seed: int = 0) -> list[tuple[float, float, int]]:
    """(grad_abs_max, fmt_max, margin) cases: hand-picked edges, float64 power-of-two boundaries
    (``boundary_cases``), then seeded log-uniform ones, alternately float32 values and full float64 values;
    ``n_random`` cases in all after the hand-picked ones."""
    cases = [
        (0.428, 65504.0, 0),                  # a GPT's first weight gradients: S = 2**17
        (1.0, 65504.0, 0),                    # 2**16 * 1 = 65536 > 65504: S = 2**15
        (65504.0 / 65536, 65504.0, 0),        # S * max == 65504 exactly: allowed (65504 is finite)
        (0.5, 65504.0, 0),
        (2.0 ** -10, 65504.0, 0),             # a power of two
        (1e-8, 65504.0, 0),
        (3.0, 65504.0, 3),                    # margin: keep 2**3 of headroom
        (65504.0, 65504.0, 0),                # already at the top: S = 1
        (1e5, 65504.0, 0),                    # FP16 gradients overflow already: S < 1
        (12.5, 448.0, 0),                     # FP8 E4M3's max (lesson 07)
        (12.5, 57344.0, 1),                   # FP8 E5M2's max
        (7e-3, 65504.0, 2),
    ]
    edges = boundary_cases()
    cases += edges
    n = n_random - len(edges)
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(n, generator=g, dtype=torch.float64) * 60 - 40          # log2|g| in [-40, 20)
    fmts = torch.randint(3, (n,), generator=g).tolist()
    margins = torch.randint(5, (n,), generator=g).tolist()
    for i, (lg, f, m) in enumerate(zip(logs.tolist(), fmts, margins)):
        v = 2.0 ** lg                                                   # float64, 53 significant bits
        if i % 2 == 0:
            v = float(torch.tensor(v, dtype=torch.float32))             # a float32 value (a recorded max)
        cases.append((v, (65504.0, 448.0, 57344.0)[f], m))
    return cases


def check_choose_loss_scale(fn) -> None:
    """Grade ``fn(grad_abs_max, fmt_max=65504.0, margin=0) -> float``: the largest power of two S with
    ``S * grad_abs_max * 2**margin <= fmt_max``; ValueError for a max|g| that is 0, negative, inf or NaN."""
    name = "choose_loss_scale"
    cases = choose_cases()
    for i, (gmax, fmt_max, margin) in enumerate(cases):
        want = exact_loss_scale(gmax, fmt_max, margin)
        got = call(name, fn, gmax, fmt_max=fmt_max, margin=margin)
        try:
            got_f = float(got)
        except (TypeError, ValueError):
            raise GradingError(f"FAIL {name}: return a Python float, got {type(got).__name__} "
                               f"for grad_abs_max={gmax!r}.") from None
        if got_f == want:
            continue
        frac = math.frexp(got_f)[0] if got_f > 0 and math.isfinite(got_f) else None
        if frac != 0.5:
            why = "is not a power of two: use S = 2**k for an integer k (scaling by 2**k is exact)"
        elif got_f == 2 * want:
            why = (f"is one power of two too large: {got_f!r} * {gmax!r} * 2**{margin} = "
                   f"{got_f * gmax * 2 ** margin!r} > fmt_max={fmt_max!r}, so the largest gradient would overflow")
        elif got_f == want / 2:
            why = (f"is one power of two too small: {want!r} * {gmax!r} * 2**{margin} = "
                   f"{want * gmax * 2 ** margin!r} <= fmt_max={fmt_max!r} still fits (equality is allowed: "
                   "fmt_max itself is finite)")
        else:
            why = f"is off by a factor 2**{math.log2(got_f / want):+.0f}"
        raise GradingError(
            f"FAIL {name}: case {i + 1} of {len(cases)}: grad_abs_max={gmax!r}, fmt_max={fmt_max!r}, "
            f"margin={margin}\n  expected {want!r} (= 2**{int(math.log2(want))}), got {got!r}: it {why}.\n"
            "  hint: k = floor(log2(fmt_max / (grad_abs_max * 2**margin))); floating-point log2 can land just "
            "below an integer, so check S * grad_abs_max * 2**margin <= fmt_max and 2S * ... > fmt_max.")
    for bad in (0.0, -1.0, math.inf, math.nan):
        try:
            got = call(name, fn, bad)
        except GradingError:
            raise
        except ValueError:
            continue
        except Exception as e:  # noqa: BLE001  (a learner's function may raise anything)
            raise GradingError(f"FAIL {name}: grad_abs_max={bad!r} should raise ValueError, it raised "
                               f"{type(e).__name__}: {e}") from None
        raise GradingError(
            f"FAIL {name}: grad_abs_max={bad!r} should raise ValueError (with a message naming the problem), "
            f"got {got!r}.\n  hint: a max of 0 means no gradient to measure; inf/NaN means the gradients "
            "already overflow at S = 1: no power of two is meaningful.")
    verdict(name, f"{len(cases)} cases equal the exact largest power of two (fp16, e4m3, e5m2 maxima, "
                  "margins 0-4); 0, negative, inf and NaN raise ValueError")


# ----------------------------------------------------------------------------------------------------------
# Lesson 03: unscale_grads_
# ----------------------------------------------------------------------------------------------------------
def _grad_set(seed: int, special=None) -> list[torch.Tensor]:
    """Three FP32 gradient tensors of different shapes and magnitudes (incl. FP32 subnormals), seeded."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 8, generator=g) * 2.0 ** 16                       # (4, 8) fp32, a scaled gradient
    b = torch.randn(16, generator=g) * 1e-3                              # (16,) fp32
    c = torch.randn(2, 3, 5, generator=g) * 2.0 ** 30                    # (2, 3, 5) fp32, large
    b[:3] = torch.tensor([1e-40, -3e-39, 0.0])                           # fp32 subnormals and a zero
    if special is not None:
        c.view(-1)[7] = special
    return [a, b, c]


def _unscale_oracle(grads, scale: float):
    out = [t.clone() for t in grads]
    found_inf = torch.zeros(())                                          # fp32 ()
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()   # GradScaler's rule
    torch._amp_foreach_non_finite_check_and_unscale_(out, found_inf, inv_scale)
    return out, bool(found_inf.item())


# what, seed of the gradient set, the special value planted in it (None: all finite), scale
UNSCALE_CASES = [("finite gradients, scale 2**16", 0, None, 2.0 ** 16),
                 ("finite gradients, scale 2**-3", 1, None, 2.0 ** -3),
                 ("one +inf", 2, math.inf, 2.0 ** 16),
                 ("one -inf", 3, -math.inf, 1024.0),
                 ("one NaN", 4, math.nan, 2.0 ** 16),
                 ("finite gradients, scale 3000 (not a power of two)", 5, None, 3000.0),
                 ("finite gradients, scale 1000 (not a power of two)", 6, None, 1000.0)]


def check_unscale_grads(fn) -> None:
    """Grade ``fn(grads: list of fp32 tensors, scale: float) -> bool``: grads multiplied in place by
    ``inv_scale = float32(1/scale)``, returns True if any element is inf or NaN; FP16/BF16 gradients raise
    ValueError and are left untouched. Oracle: ``torch._amp_foreach_non_finite_check_and_unscale_`` (the kernel
    of torch.amp.GradScaler.unscale_), bit for bit."""
    name = "unscale_grads_"
    for what, seed, special, scale in UNSCALE_CASES:
        _check_unscale_case(name, fn, what, _grad_set(seed, special), scale)
    for dtype in (torch.float16, torch.bfloat16):
        _check_refuses(name, fn, dtype)
    verdict(name, f"{len(UNSCALE_CASES)} gradient sets unscaled bit for bit as torch.amp.GradScaler (inf, -inf, "
                  "NaN detected); fp16 and bf16 gradients refused")


def _check_unscale_case(name, fn, what: str, grads: list[torch.Tensor], scale: float) -> None:
    """One gradient set: unscaled in place bit for bit as the oracle, and found_inf right."""
    want, want_inf = _unscale_oracle(grads, scale)
    mine = [t.clone() for t in grads]
    ids = [id(t) for t in mine]
    got_inf = call(name, fn, mine, scale)
    if [id(t) for t in mine] != ids:
        raise GradingError(f"FAIL {name}: work in place on the tensors of the list (grads[i].mul_(...)); "
                           "the list itself must keep the same tensor objects.")
    for k, (w, m) in enumerate(zip(want, mine)):
        if m.dtype != torch.float32 or m.shape != w.shape:
            raise GradingError(f"FAIL {name} ({what}): grads[{k}] became {m.dtype} {tuple(m.shape)}; keep "
                               "each gradient float32 and its shape (multiply in place).")
        ok = same_bits(m, w)
        if not bool(ok.all()):
            _unscaled_value_fail(name, what, k, grads[k], w, m, ok, scale)
    try:
        got_b = bool(got_inf)
    except Exception:  # noqa: BLE001
        raise GradingError(f"FAIL {name}: return found_inf as a bool, got {type(got_inf).__name__}.") from None
    if got_inf is None or got_b != want_inf:
        raise GradingError(
            f"FAIL {name} ({what}): returned found_inf={got_inf!r}, expected {want_inf}.\n  hint: found_inf "
            "is True when any element of any gradient is inf, -inf or NaN (torch.isfinite covers all "
            "three; NaN == NaN is False, and isinf misses NaN).")


def _unscaled_value_fail(name, what, k, grad, want, mine, ok, scale) -> None:
    """Raise naming the first value of ``grads[k]`` that differs from the oracle's (``ok``: where they agree)."""
    j = int((~ok).flatten().nonzero()[0])
    x = float(grad.flatten()[j])
    inv = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
    raise GradingError(
        f"FAIL {name} ({what}): {int((~ok).sum())} of {want.numel()} values of grads[{k}] differ from "
        f"torch.amp.GradScaler's unscale.\n  first wrong value: grad {x!r} with scale {scale!r}: "
        f"expected {float(want.flatten()[j])!r}, got {float(mine.flatten()[j])!r}\n  hint: multiply by "
        f"inv_scale = 1/scale rounded once to float32 ({inv!r}), as GradScaler does, rather than "
        "dividing by scale; every gradient is unscaled, also when some are inf/NaN.")


def _check_refuses(name, fn, dtype: torch.dtype) -> None:
    """Gradients of ``dtype`` (after an fp32 one) raise ValueError, and nothing was unscaled first."""
    grads = [t.to(dtype) for t in _grad_set(7)]
    grads[0] = torch.randn(4, 8) * 1000                           # an fp32 one first: check every gradient
    before = [t.clone() for t in grads]
    try:
        call(name, fn, grads, 2.0 ** 16)
    except GradingError:
        raise
    except ValueError:
        if not all(bool(same_bits(a, b).all()) for a, b in zip(grads, before)):
            raise GradingError(f"FAIL {name}: {dtype} gradients were refused, but some gradients were "
                               "modified first: check every dtype before unscaling anything.") from None
        return
    except Exception as e:  # noqa: BLE001
        raise GradingError(f"FAIL {name}: {dtype} gradients should raise ValueError, got "
                           f"{type(e).__name__}: {e}") from None
    raise GradingError(
        f"FAIL {name}: {dtype} gradients were accepted; raise ValueError naming the fix.\n  hint: unscaling "
        "must happen in FP32: an FP16 gradient divided by 2**16 underflows again (the value lesson 03 just "
        "recovered). Copy gradients to FP32 master weights first, then unscale there.")


# ----------------------------------------------------------------------------------------------------------
# Lesson 04: update_scale against torch.amp.GradScaler
# ----------------------------------------------------------------------------------------------------------
# name, init_scale, growth_factor, backoff_factor, growth_interval, steps, overflow probability, seed.
# Power-of-two factors: the FP32 scale and a Python float agree exactly (no rounding) in the range used.
UPDATE_CONFIGS = [
    ("GradScaler defaults, growth_interval 3", 2.0 ** 16, 2.0, 0.5, 3, 2000, 0.2, 0),
    ("growth 4, backoff 0.25, growth_interval 1", 2.0 ** 10, 4.0, 0.25, 1, 1000, 0.45, 1),
    ("near the FP32 top: 2**120, growth_interval 2", 2.0 ** 120, 2.0, 0.5, 2, 600, 0.05, 2),
    ("bursts below 1: 8.0, growth_interval 5", 8.0, 2.0, 0.5, 5, 1000, 0.15, 3),
]


def overflow_pattern(steps: int, p: float, seed: int) -> list[bool]:
    """Seeded found_inf pattern: True with probability p, plus a burst of 6 overflows at steps 10-15."""
    g = torch.Generator().manual_seed(1234 + seed)
    pattern = (torch.rand(steps, generator=g) < p).tolist()
    for t in range(10, min(16, steps)):
        pattern[t] = True
    return pattern


@functools.lru_cache(maxsize=None)
def gradscaler_trajectory(init_scale, growth_factor, backoff_factor, growth_interval, pattern):
    """Oracle: (scale, growth_tracker) after each update() of torch.amp.GradScaler("cpu") fed ``pattern``
    (a tuple of found_inf bools) through a one-element FP32 parameter whose gradient is inf or 1.0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval)
    w = torch.nn.Parameter(torch.zeros(1))                            # (1,) fp32
    opt = torch.optim.SGD([w], lr=0.0)
    scaler.scale(torch.ones(()))                                      # creates the scale and the tracker
    out = []
    for found_inf in pattern:
        w.grad = torch.full((1,), math.inf if found_inf else 1.0)     # (1,) fp32
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])))
    return tuple(out)


def _update_hint(prev_scale, prev_tracker, found_inf, gf, bf, gi, want, got):
    (ws, wt), (gs, gt) = want, got
    if found_inf:
        if gs != ws:
            return f"an overflow (found_inf) multiplies the scale by backoff_factor={bf}: {prev_scale!r} -> {ws!r}."
        return "an overflow resets growth_tracker to 0 (the count of consecutive clean steps starts again)."
    if prev_tracker + 1 == gi and gs != ws and ws == prev_scale:
        return (f"{prev_scale!r} * growth_factor = {prev_scale * gf!r} is not finite in FP32 (> {FP32_MAX!r}): "
                "keep the scale, but still reset growth_tracker to 0 (torch never grows the scale to inf).")
    if prev_tracker + 1 == gi and gs == prev_scale and gt == gi:
        return ("grow on the growth_interval-th consecutive clean step (when growth_tracker + 1 == "
                "growth_interval), not one step later: with growth_interval=N, N clean steps in a row grow "
                "the scale once, and the tracker goes back to 0.")
    if prev_tracker + 1 == gi:
        return (f"this is the growth_interval-th ({gi}) clean step in a row: scale *= growth_factor "
                f"({prev_scale!r} -> {ws!r}) and growth_tracker = 0.")
    return (f"a clean step that is not the growth_interval-th ({gi}) only counts: growth_tracker += 1, "
            "scale unchanged.")


def check_update_scale(fn) -> None:
    """Grade ``fn(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    -> (scale, growth_tracker)`` against torch.amp.GradScaler over fixed seeded overflow patterns; the learner's
    own outputs are fed back in, and the first step whose scale or tracker differs is reported."""
    name = "update_scale"
    total = 0
    for label, init, gf, bf, gi, steps, p, seed in UPDATE_CONFIGS:
        pattern = tuple(overflow_pattern(steps, p, seed))
        oracle = gradscaler_trajectory(init, gf, bf, gi, pattern)
        scale, tracker = init, 0
        for t, (found_inf, want) in enumerate(zip(pattern, oracle)):
            out = call(name, fn, scale, tracker, found_inf, gf, bf, gi)
            try:
                got_scale, got_tracker = out
                got = (float(got_scale), int(got_tracker))
            except (TypeError, ValueError):
                raise GradingError(f"FAIL {name}: return a pair (scale, growth_tracker), got {out!r}.") from None
            if got != want:
                history = " ".join("ovf" if f else "ok" for f in pattern[max(0, t - 9):t + 1])
                raise GradingError(
                    f"FAIL {name}: differs from torch.amp.GradScaler at step {t} of '{label}' "
                    f"(growth_factor={gf}, backoff_factor={bf}, growth_interval={gi}).\n"
                    f"  found_inf history, oldest first, this step last: {history}\n"
                    f"  before the step: scale={scale!r}, growth_tracker={tracker}; found_inf={found_inf}\n"
                    f"  expected scale={want[0]!r}, growth_tracker={want[1]}; got scale={got[0]!r}, "
                    f"growth_tracker={got[1]}\n"
                    f"  hint: {_update_hint(scale, tracker, found_inf, gf, bf, gi, want, got)}")
            scale, tracker = got
        total += steps
    verdict(name, f"scale and growth_tracker identical to torch.amp.GradScaler after every update(), "
                  f"{len(UPDATE_CONFIGS)} configurations, {total:,} steps (growth capped at 2**127, scale below 1)")
