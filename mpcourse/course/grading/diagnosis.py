"""Grader for lesson 12 (the capstone): diagnose what went wrong in a training run from its log.

``check_diagnose(fn)``: ``fn(log) -> str`` names the cause of a run from ``CAUSES``. A log is a dict:

    loss               [float | None]  training loss per step (None: inf/NaN; the run stops at the first)
    skipped            [bool]          the loss scaler skipped the step (inf/NaN gradients)
    loss_scale         [float | None]  the scale in force (None: the recipe has no loss scaler)
    grad_amax          [float | None]  max |gradient| after the backward, before unscaling (None: inf/NaN)
    grad_zero_fraction [float]         fraction of gradient elements exactly 0
    weight_amax        [float | None]  max |weight| the optimizer holds (the FP32 master where there is one),
                                       after the step (None: inf/NaN)
    fp8_saturated      [float | None]  fraction of the elements cast to FP8 that were clamped at the format's
                                       max on that step (None: the run casts nothing to FP8 by delayed scaling)
    final_train_loss   float | None    the final evaluation (None where the run diverged)
    reference_loss     float           the FP32 run's final train loss on the same setting

The causes, and what each leaves in the log (the lesson walks through them):

    healthy             no numerical failure shows: finite throughout; a few skipped steps with a scale backing
                        off are dynamic scaling working; exact zeros alone (an embedding's unused rows) or a
                        gap alone (a learning rate, the data) are not a precision failure
    gradient_underflow  finite, but ends clearly above the reference AND a large share of the gradient elements
                        are exactly zero: they flushed to zero in FP16
    gradient_overflow   inf/NaN gradients on a step the optimizer was *not* told to skip, then the loss becomes
                        inf/NaN: the inf went into the weights
    optimizer_state     the update itself made the weights inf/NaN from finite gradients (Adam's FP16 state),
                        then the loss follows
    scale_too_high      a loss-scaled run that skips most of its steps (every scaled gradient overflows), so the
                        weights barely move and the loss stays where it started
    forward_overflow    the loss becomes inf/NaN while every gradient and every weight before it was finite: the
                        forward pass itself overflowed (FP16 activations past 65504)
    fp8_amax_spike      delayed scaling's scale comes from past amaxes: a tensor whose amax jumps is clamped at
                        the FP8 max on that step (a large saturated fraction), and the loss jumps with it

Cases: real runs (``diagnosis_runs.json``: the settings of ``mpcourse.course.diagnose_yours`` over two seeds,
trained by ``python -m mpcourse.course.diagnose_yours``), and synthetic logs drawn from a fixed seed to the
same patterns, far from every threshold a sensible diagnosis would use (gaps of 0-1.5% vs 8-30%, zero fractions
under 1% vs over 30%, skipped shares under 5% vs over 80%, saturated fractions under 0.05% vs over 5%), with the
distractors a real log has: skipped steps and a falling scale in healthy dynamic runs, inf gradients on those
skipped steps, noise in the loss; and three distractor kinds (``DISTRACTORS``): a healthy run with many exact
zeros, a run worse than its reference with no exact zeros, a scaled run that skips an overflow and later dies of
its optimizer state. ``forward_overflow`` and ``fp8_amax_spike`` are synthetic only, labelled so: the course's
short CPU runs have no forward overflow (its GPT's activations stay far under 65504 in 20 steps), and its
delayed-scaling recipe does not log a saturated fraction.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from . import GradingError, call, verdict

CAUSES = ("healthy", "gradient_underflow", "gradient_overflow", "optimizer_state", "scale_too_high",
          "forward_overflow", "fp8_amax_spike")
SYNTHETIC_ONLY = ("forward_overflow", "fp8_amax_spike")
DISTRACTORS = {"zeros_but_healthy": "healthy", "gap_without_zeros": "healthy",
               "skip_then_optimizer_state": "optimizer_state"}
RUNS_FILE = Path(__file__).with_name("diagnosis_runs.json")


def _curve(rng, n, start, final, noise=0.03):
    return [final + (start - final) * math.exp(-t / (n / 4)) + rng.uniform(-noise, noise) for t in range(n)]


def _base(rng, n, scaled, fp8=False):
    ref = rng.uniform(2.3, 2.7)
    w0 = rng.uniform(0.8, 1.2)
    return ref, {"skipped": [False] * n, "loss_scale": [2.0 ** 16 if scaled else None] * n,
                 "grad_amax": [rng.uniform(0.05, 0.6) for _ in range(n)],
                 "grad_zero_fraction": [round(rng.uniform(0.0, 0.004), 6) for _ in range(n)],
                 "weight_amax": [w0 * (1 + 0.002 * t) for t in range(n)],
                 "fp8_saturated": [round(rng.uniform(0.0, 5e-4), 7) if fp8 else None for _ in range(n)],
                 "reference_loss": ref}


UNDERFLOW_GAP = 0.04              # "clearly above the reference": final train loss > 1.04 x reference
UNDERFLOW_ZEROS = 0.10            # "many exact-zero gradient elements": mean grad_zero_fraction > 10%
SATURATED = 0.01                  # "a large saturated fraction": more than 1% of the FP8 elements on one step


def reference_diagnose(log: dict) -> str:
    """The grader's own rule: the cause of a run from its log, one of CAUSES.

    1. a loss-scaled run that skipped more than half of its steps: ``scale_too_high``; 2. a non-finite loss
    at step k: ``gradient_overflow`` if an earlier step had a non-finite gradient that was not skipped, else
    ``optimizer_state`` if an earlier step left non-finite weights, else ``forward_overflow``; 3. a step whose
    FP8 saturated fraction exceeds ``SATURATED``: ``fp8_amax_spike``; 4. a finite run ending more than
    ``UNDERFLOW_GAP`` above the reference with a mean zero fraction over ``UNDERFLOW_ZEROS``:
    ``gradient_underflow``; 5. ``healthy``.
    """
    n = len(log["loss"])
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > n / 2:
        return "scale_too_high"
    first_bad = next((k for k, v in enumerate(log["loss"]) if v is None), None)
    if first_bad is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(first_bad)):
            return "gradient_overflow"
        if any(log["weight_amax"][j] is None for j in range(first_bad)):
            return "optimizer_state"
        return "forward_overflow"
    if max((s for s in log["fp8_saturated"] if s is not None), default=0.0) > SATURATED:
        return "fp8_amax_spike"
    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > UNDERFLOW_GAP and sum(log["grad_zero_fraction"]) / n > UNDERFLOW_ZEROS:
        return "gradient_underflow"
    return "healthy"


def _cut(log: dict, k: int) -> None:
    """Keep steps 0..k (the run stopped at its first non-finite loss, step k)."""
    log.update({key: v[:k + 1] for key, v in log.items() if isinstance(v, list)})


def synthetic_log(cause: str, rng: random.Random) -> dict:
    """One log showing ``cause`` (see the module docstring) or distractor (a key of ``DISTRACTORS``), from ``rng``."""
    n = rng.randint(30, 80)
    scaled = rng.random() < 0.5
    fp8 = cause in ("healthy", "fp8_amax_spike") and not scaled and rng.random() < 0.5 or cause == "fp8_amax_spike"
    ref, log = _base(rng, n, scaled and cause != "fp8_amax_spike", fp8)
    start = rng.uniform(4.4, 4.7)
    if cause in ("healthy", "zeros_but_healthy"):
        final = ref * (1 + rng.uniform(-0.015, 0.015))
        log["loss"] = _curve(rng, n, start, final)
        if scaled:                                        # a dynamic scaler: 0-2 skips, each halving the scale
            s = 2.0 ** 16
            for k in sorted(rng.sample(range(5, n), rng.randint(0, 2))):
                log["skipped"][k], log["grad_amax"][k] = True, None
                for j in range(k + 1, n):
                    log["loss_scale"][j] = s / 2
                s /= 2
        if cause == "zeros_but_healthy":                  # e.g. the embedding rows of tokens not in the batch
            log["grad_zero_fraction"] = [round(rng.uniform(0.3, 0.7), 6) for _ in range(n)]
        log["final_train_loss"] = final
    elif cause == "gap_without_zeros":                    # worse than FP32 for a reason that is not precision
        final = ref * (1 + rng.uniform(0.08, 0.3))
        log["loss"] = _curve(rng, n, start, final)
        log["final_train_loss"] = final
    elif cause == "gradient_underflow":
        final = ref * (1 + rng.uniform(0.08, 0.3))
        log["loss"] = _curve(rng, n, start, final)
        log["loss_scale"] = [None] * n
        log["grad_amax"] = [rng.uniform(1e-5, 1e-3) for _ in range(n)]
        log["grad_zero_fraction"] = [round(rng.uniform(0.3, 0.95), 6) for _ in range(n)]
        log["final_train_loss"] = final
    elif cause in ("gradient_overflow", "optimizer_state", "forward_overflow", "skip_then_optimizer_state"):
        k = rng.randint(2, n - 3) if cause != "optimizer_state" else rng.randint(1, 6)
        loss = _curve(rng, n, start, ref)[:k + 1]
        _cut(log, k)
        if cause != "skip_then_optimizer_state":
            log["loss_scale"] = [None] * (k + 1)
        else:                                             # one overflow skipped (scale halved) long before
            j = rng.randint(0, k - 2)
            log["skipped"][j], log["grad_amax"][j] = True, None
            log["loss_scale"] = [2.0 ** 16 if i <= j else 2.0 ** 15 for i in range(k + 1)]
        if cause == "gradient_overflow":
            j = k - 1                                     # the gradients overflowed one step before
            for later in range(j, k + 1):
                log["grad_amax"][later], log["weight_amax"][later] = None, None
        elif cause in ("optimizer_state", "skip_then_optimizer_state"):
            log["weight_amax"][k - 1] = log["weight_amax"][k] = None   # the update broke finite weights
            log["grad_amax"][k] = None                    # the NaN weights' own gradients
        else:                                             # forward_overflow: weights and gradients finite
            log["grad_amax"][k] = None                    # the inf loss's own backward
        loss[k] = None
        log["loss"], log["final_train_loss"] = loss, None
    elif cause == "scale_too_high":
        log["loss_scale"] = [2.0 ** rng.randint(22, 28)] * n
        skips = set(rng.sample(range(n), int(n * rng.uniform(0.85, 1.0))))
        log["skipped"] = [i in skips for i in range(n)]
        log["grad_amax"] = [None if i in skips else rng.uniform(1e3, 6e4) for i in range(n)]
        log["loss"] = [start + rng.uniform(-0.05, 0.05) for _ in range(n)]
        log["final_train_loss"] = start
    elif cause == "fp8_amax_spike":
        final = ref * (1 + rng.uniform(-0.01, 0.2))
        log["loss"] = _curve(rng, n, start, final)
        k = rng.randint(n // 3, n - 5)                    # the amax jumps at step k; the history catches up after
        log["fp8_saturated"][k] = round(rng.uniform(0.05, 0.6), 6)
        log["loss"][k] += rng.uniform(0.8, 2.0)
        log["final_train_loss"] = final
    else:
        raise ValueError(f"unknown cause {cause!r}; choose from {CAUSES + tuple(DISTRACTORS)}")
    return log


def synthetic_cases(per_cause: int = 8, seed: int = 0) -> list[tuple[str, dict, str]]:
    """(name, log, cause): ``per_cause`` logs of every cause, then ``per_cause`` of every distractor kind."""
    rng = random.Random(seed)
    return ([(f"synthetic {c} #{i}", synthetic_log(c, rng), c) for c in CAUSES for i in range(per_cause)]
            + [(f"synthetic distractor {d} #{i}", synthetic_log(d, rng), c) for d, c in DISTRACTORS.items()
               for i in range(per_cause)])


def real_cases() -> list[tuple[str, dict, str]]:
    """The stored real runs: (name, log, cause)."""
    if not RUNS_FILE.exists():
        return []
    return [(r["name"], r["log"], r["cause"]) for r in json.loads(RUNS_FILE.read_text())["runs"]]


def _mean_zeros(log: dict) -> float:
    return sum(log["grad_zero_fraction"]) / len(log["loss"])


def _hint(want: str, got: str, log: dict) -> str:
    """What the learner's rule missed: the (right, said) pair names the fault; else what ``want`` looks like."""
    if want == "healthy" and got == "gradient_underflow":
        if _mean_zeros(log) > UNDERFLOW_ZEROS:
            return ("many exact zeros alone are not underflow (unused embedding rows are exact zeros in any "
                    "precision): this run ends near its reference_loss; underflow needs both symptoms")
        return ("a final loss above the reference alone is not underflow: this run's gradients hold almost no "
                "exact zeros; underflow needs both symptoms")
    if want == "healthy" and got == "scale_too_high":
        return ("a scale that backed off a few times is dynamic scaling doing its job: count the skipped steps, "
                "do not read the scale's fall")
    if want == "healthy" and got == "fp8_amax_spike":
        return "a tiny saturated fraction is delayed scaling's usual lag; a spike clamps a large share on one step"
    if want == "optimizer_state" and got == "gradient_overflow":
        return ("an inf gradient on a SKIPPED step never reached the weights: only a non-finite gradient that was "
                "not skipped is overflow; then look at weight_amax")
    if want == "optimizer_state" and got == "forward_overflow":
        return "look at weight_amax before the first non-finite loss: the update made the weights non-finite"
    if want == "forward_overflow" and got in ("optimizer_state", "gradient_overflow"):
        return ("the weights (weight_amax) and the gradients stayed finite on every step before the loss broke, "
                "and only the broken step's own backward is non-finite: the forward itself overflowed")
    if want == "gradient_overflow" and got == "optimizer_state":
        return ("find the first step with a non-finite gradient that was NOT skipped, before the loss became "
                "non-finite: the inf went into the weights, which is why weight_amax is non-finite too")
    return {
        "healthy": "a finite run: read every symptom before naming a cause; none of them shows here",
        "gradient_underflow": "compare the final loss with reference_loss, and look at grad_zero_fraction",
        "gradient_overflow": "find the first step with a non-finite gradient that was NOT skipped, before the "
                             "loss became non-finite",
        "optimizer_state": "the step before the first non-finite loss had finite gradients but left non-finite "
                           "weights (weight_amax)",
        "scale_too_high": "count the skipped steps of a run that has a loss_scale",
        "forward_overflow": "gradients and weights finite before the first non-finite loss: the forward overflowed",
        "fp8_amax_spike": "look at fp8_saturated: on one step a large share of the FP8 elements was clamped",
    }[want]


def check_diagnose(fn) -> None:
    name = "diagnose"
    cases = real_cases() + synthetic_cases()
    for case_name, log, want in cases:
        got = call(name, fn, json.loads(json.dumps(log)))          # a fresh copy: the function may not mutate ours
        if got not in CAUSES:
            raise GradingError(f"FAIL {name}: on {case_name} it returned {got!r}; return one of {CAUSES}")
        if got != want:
            n, bad = len(log["loss"]), sum(v is None for v in log["loss"])
            sat = [v for v in log["fp8_saturated"] if v is not None]
            raise GradingError(
                f"FAIL {name}: {case_name} is {want!r}, you said {got!r}.\n"
                f"  {n} steps, {bad} non-finite losses, {sum(log['skipped'])} skipped, "
                f"loss scale {'none' if log['loss_scale'][0] is None else log['loss_scale'][-1]}, "
                f"final {log['final_train_loss']} vs reference {log['reference_loss']:.3f}, "
                f"mean zero fraction {_mean_zeros(log):.1%}, "
                f"{sum(v is None for v in log['weight_amax'])} steps with non-finite weights, "
                f"FP8 saturated max {'none' if not sat else f'{max(sat):.2%}'}\n"
                f"  hint: {_hint(want, got, log)}")
    n_real = len(real_cases())
    verdict(name, f"{len(cases)} runs diagnosed correctly ({n_real} real runs, {len(cases) - n_real} synthetic), "
                  f"{len(CAUSES)} causes")


# -- the real runs' logs (trained and stored by ``python -m mpcourse.course.diagnose_yours``) ------------------


def log_of(run: dict, reference_loss: float) -> dict:
    """The log the exercise reads, from one run of ``mpcourse.experiment.ablations.common.run_one`` with ``weight_probe``."""
    h = run["history"]
    return {"loss": [r["loss"] for r in h], "skipped": [r["skipped"] for r in h],
            "loss_scale": [r["loss_scale"] for r in h], "grad_amax": [r["grad_amax"] for r in h],
            "grad_zero_fraction": [r["grad_zero_fraction"] for r in h],
            "weight_amax": [r["weight_amax"] for r in h], "fp8_saturated": [r.get("fp8_saturated") for r in h],
            "final_train_loss": run["final_train_loss"], "reference_loss": reference_loss}
