"""Grader for lesson 12 (the capstone): diagnose what went wrong in a training run from its log.

``check_diagnose(fn)``: ``fn(log) -> str`` names the cause of a run, one of ``CAUSES``. A log is a dict of lists
with one entry per step, and two numbers. Step k is index k of every list: steps count from 0, as the training
loop counts them (``mpcourse.experiment.training.train.Trainer``), and n = ``len(log["loss"])`` steps ran.

    loss               [float | None]  training loss per step (None: inf/NaN). The run stops at its first None:
                                       the step k where the loss dies is the first index with loss[k] None,
                                       which is also the last index (k = n - 1)
    skipped            [bool]          the loss scaler skipped the step (inf/NaN gradients)
    loss_scale         [float | None]  the scale in force (None on every step: the recipe has no loss scaler)
    grad_amax          [float | None]  max |gradient| after the backward, before unscaling (None: inf/NaN)
    grad_zero_fraction [float]         fraction of gradient elements exactly 0
    weight_amax        [float | None]  max |weight| the optimizer holds (the FP32 master where there is one),
                                       after the step (None: inf/NaN)
    fp8_saturated      [float | None]  fraction of the elements cast to FP8 by delayed scaling that the cast
                                       clamped at the format's max on that step (None: no such cast)
    final_train_loss   float | None    the final evaluation (None where the run died)
    reference_loss     float           the FP32 run's final train loss, same setting and same seed

The rule (``reference_diagnose``; the exercise states it), asked in this order:

    1. scale_too_high      the run has a loss scaler (loss_scale[0] is not None) and skipped MORE than half of its
                           steps: sum(skipped) > n / 2 (so every scaled gradient overflows; exactly half is not)
    2. a run that dies at step k (the first None loss): what broke on the steps BEFORE it, indices 0 .. k-1
       (step k's own backward and update see the inf/NaN loss, so they say nothing about its cause):
       gradient_overflow   some step j < k has grad_amax[j] None and skipped[j] False: an inf/NaN gradient
                           nobody skipped reached the weights
       optimizer_state     else, some step j < k has weight_amax[j] None: the update made the weights inf/NaN
                           from finite gradients (Adam's FP16 state)
       forward_overflow    else: gradients and weights finite on every step before k, the forward overflowed
    3. fp8_amax_spike      a finite run whose largest per-step fp8_saturated is MORE than ``SATURATED`` = 1%
                           (the max over the steps, not the mean: a spike is one step)
    4. gradient_underflow  a finite run whose relative gap final_train_loss / reference_loss - 1 is MORE than
                           ``UNDERFLOW_GAP`` = 4% AND whose mean zero fraction sum(grad_zero_fraction) / n is
                           MORE than ``UNDERFLOW_ZEROS`` = 10% (the mean over all n steps, not the worst step)
    5. healthy             anything else

Where the numbers come from (the stored real runs, ``diagnosis_runs.json``, printed by lesson 12):

* 4%: the seed-to-seed noise of the final loss on these runs. FP32 alone over seeds 0, 1, 2 ends at 3.190,
  3.203 and 3.424: a standard deviation of 4.0% of the mean. A gap smaller than that is what a different seed
  does. The reference is the FP32 run of the same seed, which removes that noise: every healthy real run ends
  within 0.45% of it, every underflow run 14-17% above it. The gap is relative (an absolute loss difference
  depends on the loss's size) and read from ``final_train_loss`` (the last training loss is one batch).
* 10%: the healthy real runs hold at most 0.52% exact zeros on average (FP8 runs: E5M2 gradients flush a few),
  the underflow runs 57-62%.
* 1%: delayed scaling's usual lag clamps at most 0.17% of the FP8 elements on a step (``fp8-delayed``, seeds
  0-2); the amax spike clamps 10.6-11.2% on its step.

Cases: the real runs (``diagnosis_runs.json``: the settings of ``mpcourse.course.diagnose_yours`` over seeds 0-2,
trained by ``python -m mpcourse.course.diagnose_yours``), synthetic logs drawn from a fixed seed to the same
patterns far from every threshold, three distractor kinds (``DISTRACTORS``: a healthy run with many exact zeros,
a run worse than its reference with no exact zeros, a scaled run that skips an overflow and later dies of its
optimizer state) and one of order (an FP8 run that survives an amax spike and later dies of its optimizer state),
and logs constructed next to every threshold, on both sides (``boundary_cases``: ties at exactly half the steps
skipped and exactly 1% saturated, gaps of 3.8% and 4.1% on references from 1.6 to 3.9 so that no absolute gap
can sort them, a last training loss on the other side of 4% from the final one, a run ending below its
reference, zero fractions whose mean and worst step, or mean and last step, fall on opposite sides of 10%).
``forward_overflow`` is synthetic only, labelled so: the course's GPT has no forward overflow in 20 steps (its
activations stay far under FP16's 65504).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from . import GradingError, call, verdict

CAUSES = ("healthy", "gradient_underflow", "gradient_overflow", "optimizer_state", "scale_too_high",
          "forward_overflow", "fp8_amax_spike")
SYNTHETIC_ONLY = ("forward_overflow",)
DISTRACTORS = {"zeros_but_healthy": "healthy", "gap_without_zeros": "healthy",
               "skip_then_optimizer_state": "optimizer_state", "spike_then_optimizer_state": "optimizer_state"}
RUNS_FILE = Path(__file__).with_name("diagnosis_runs.json")

SKIPPED_SHARE = 0.5               # scale_too_high: more than half of the steps skipped
UNDERFLOW_GAP = 0.04              # gradient_underflow: final_train_loss / reference_loss - 1 > 4% ...
UNDERFLOW_ZEROS = 0.10            # ... and mean grad_zero_fraction > 10%
SATURATED = 0.01                  # fp8_amax_spike: more than 1% of the FP8 elements clamped on one step


def dying_step(log: dict) -> int | None:
    """The step k (list index, from 0) of the first non-finite loss; None for a run that never died."""
    return next((k for k, v in enumerate(log["loss"]) if v is None), None)


def reference_diagnose(log: dict) -> str:
    """The grader's own rule: the cause of a run from its log, one of CAUSES (the module docstring's 1-5)."""
    n = len(log["loss"])
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > SKIPPED_SHARE * n:
        return "scale_too_high"
    k = dying_step(log)
    if k is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(k)):
            return "gradient_overflow"
        if any(log["weight_amax"][j] is None for j in range(k)):
            return "optimizer_state"
        return "forward_overflow"
    if max((s for s in log["fp8_saturated"] if s is not None), default=0.0) > SATURATED:
        return "fp8_amax_spike"
    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > UNDERFLOW_GAP and sum(log["grad_zero_fraction"]) / n > UNDERFLOW_ZEROS:
        return "gradient_underflow"
    return "healthy"


# -- synthetic logs ------------------------------------------------------------------------------------------------
def _curve(rng, n, start, final, noise=0.03):
    return [final + (start - final) * math.exp(-t / (n / 4)) + rng.uniform(-noise, noise) for t in range(n)]


def _base(rng, n, scaled, fp8=False):
    ref = rng.uniform(2.3, 2.7)
    w0 = rng.uniform(0.8, 1.2)
    return ref, {"skipped": [False] * n, "loss_scale": [2.0 ** 16 if scaled else None] * n,
                 "grad_amax": [rng.uniform(0.05, 0.6) for _ in range(n)],
                 "grad_zero_fraction": [round(rng.uniform(0.0, 0.004), 6) for _ in range(n)],
                 "weight_amax": [w0 * (1 + 0.002 * t) for t in range(n)],
                 "fp8_saturated": [round(rng.uniform(0.0, 0.002), 7) if fp8 else None for _ in range(n)],
                 "reference_loss": ref}


def _cut(log: dict, k: int) -> None:
    """Keep steps 0..k (the run stopped at its first non-finite loss, step k)."""
    log.update({key: v[:k + 1] for key, v in log.items() if isinstance(v, list)})


def synthetic_log(cause: str, rng: random.Random) -> dict:
    """One log showing ``cause`` (see the module docstring) or distractor (a key of ``DISTRACTORS``), from ``rng``."""
    n = rng.randint(30, 80)
    scaled = rng.random() < 0.5
    fp8 = (cause in ("healthy", "fp8_amax_spike") and not scaled and rng.random() < 0.5
           or cause in ("fp8_amax_spike", "spike_then_optimizer_state"))
    ref, log = _base(rng, n, scaled and cause not in ("fp8_amax_spike", "spike_then_optimizer_state"), fp8)
    start = rng.uniform(4.4, 4.7)
    if cause not in _SYNTHETIC:
        raise ValueError(f"unknown cause {cause!r}; choose from {CAUSES + tuple(DISTRACTORS)}")
    _SYNTHETIC[cause](cause, rng, log, n, start, ref, scaled)
    return log


def _healthy_run(cause, rng, log, n, start, ref, scaled) -> None:
    """``healthy`` or ``zeros_but_healthy``: near the reference; a scaled run backs off 0-2 times."""
    final = ref * (1 + rng.uniform(-0.015, 0.015))
    log["loss"] = _curve(rng, n, start, final)
    if scaled:
        _back_off(rng, log, n)
    if cause == "zeros_but_healthy":                      # e.g. an untied embedding's rows of tokens not in the batch
        log["grad_zero_fraction"] = [round(rng.uniform(0.3, 0.7), 6) for _ in range(n)]
    log["final_train_loss"] = final


def _back_off(rng, log, n) -> None:
    """A dynamic scaler: 0-2 skips, each halving the scale from the next step on."""
    s = 2.0 ** 16
    for k in sorted(rng.sample(range(5, n), rng.randint(0, 2))):
        log["skipped"][k], log["grad_amax"][k] = True, None
        for j in range(k + 1, n):
            log["loss_scale"][j] = s / 2
        s /= 2


def _gap_without_zeros_run(cause, rng, log, n, start, ref, scaled) -> None:
    """Worse than FP32 for a reason that is not precision: a gap, no exact zeros."""
    final = ref * (1 + rng.uniform(0.08, 0.3))
    log["loss"] = _curve(rng, n, start, final)
    log["final_train_loss"] = final


def _underflow_run(cause, rng, log, n, start, ref, scaled) -> None:
    """A gap above the reference and many exact zeros, tiny gradients, no loss scaler."""
    final = ref * (1 + rng.uniform(0.08, 0.3))
    log["loss"] = _curve(rng, n, start, final)
    log["loss_scale"] = [None] * n
    log["grad_amax"] = [rng.uniform(1e-5, 1e-3) for _ in range(n)]
    log["grad_zero_fraction"] = [round(rng.uniform(0.3, 0.95), 6) for _ in range(n)]
    log["final_train_loss"] = final


def _dying_run(cause, rng, log, n, start, ref, scaled) -> None:
    """A run that dies at step k of ``cause``, or of a distractor that dies of its optimizer state."""
    k = rng.randint(2, n - 3) if cause != "optimizer_state" else rng.randint(1, 6)
    if cause == "spike_then_optimizer_state":
        k = rng.randint(8, n - 3)
    loss = _curve(rng, n, start, ref)[:k + 1]
    _cut(log, k)
    if cause != "skip_then_optimizer_state":
        log["loss_scale"] = [None] * (k + 1)
    else:                                                 # one overflow skipped (scale halved) long before
        j = rng.randint(0, k - 2)
        log["skipped"][j], log["grad_amax"][j] = True, None
        log["loss_scale"] = [2.0 ** 16 if i <= j else 2.0 ** 15 for i in range(k + 1)]
    if cause == "spike_then_optimizer_state":             # an amax spike the run survived, long before it died
        log["fp8_saturated"][rng.randint(1, k - 4)] = round(rng.uniform(0.05, 0.3), 6)
    _break_at(cause, log, k)
    loss[k] = None
    log["loss"], log["final_train_loss"] = loss, None


def _break_at(cause, log, k) -> None:
    """The non-finite gradients and weights of a run that dies at step k of ``cause``."""
    # step k: the inf/NaN loss's own backward and update are non-finite whatever the cause
    log["grad_amax"][k] = log["weight_amax"][k] = None
    if cause == "gradient_overflow":
        log["grad_amax"][k - 1] = log["weight_amax"][k - 1] = None        # overflowed one step before, unskipped
    elif cause != "forward_overflow":                     # the update broke finite weights one step before
        log["weight_amax"][k - 1] = None


def _scale_too_high_run(cause, rng, log, n, start, ref, scaled) -> None:
    """A static scale so high that 85-100% of the steps overflow and are skipped; the loss never moves."""
    log["loss_scale"] = [2.0 ** rng.randint(22, 28)] * n
    skips = set(rng.sample(range(n), int(n * rng.uniform(0.85, 1.0))))
    log["skipped"] = [i in skips for i in range(n)]
    log["grad_amax"] = [None if i in skips else rng.uniform(1e3, 6e4) for i in range(n)]
    log["loss"] = [start + rng.uniform(-0.05, 0.05) for _ in range(n)]
    log["final_train_loss"] = start


def _amax_spike_run(cause, rng, log, n, start, ref, scaled) -> None:
    """A finite FP8 run whose amax jumps at one step: a large share of the elements clamped there."""
    final = ref * (1 + rng.uniform(-0.01, 0.02))
    log["loss"] = _curve(rng, n, start, final)
    k = rng.randint(n // 3, n - 5)                        # the amax jumps at step k; the scale is set by it after
    log["fp8_saturated"][k] = round(rng.uniform(0.05, 0.6), 6)
    if rng.random() < 0.5:                                # on the course's GPT the loss barely moves; it may jump
        log["loss"][k] += rng.uniform(0.3, 1.5)
    log["final_train_loss"] = final


# cause or distractor -> the function that fills a log with it: (cause, rng, log, n, start, ref, scaled) -> None
_SYNTHETIC = {"healthy": _healthy_run, "zeros_but_healthy": _healthy_run,
              "gap_without_zeros": _gap_without_zeros_run, "gradient_underflow": _underflow_run,
              **dict.fromkeys(("gradient_overflow", "optimizer_state", "forward_overflow",
                               "skip_then_optimizer_state", "spike_then_optimizer_state"), _dying_run),
              "scale_too_high": _scale_too_high_run, "fp8_amax_spike": _amax_spike_run}


def synthetic_cases(per_cause: int = 8, seed: int = 0) -> list[tuple[str, dict, str]]:
    """(name, log, cause): ``per_cause`` logs of every cause, then ``per_cause`` of every distractor kind."""
    rng = random.Random(seed)
    return ([(f"synthetic {c} #{i}", synthetic_log(c, rng), c) for c in CAUSES for i in range(per_cause)]
            + [(f"synthetic distractor {d} #{i}", synthetic_log(d, rng), c) for d, c in DISTRACTORS.items()
               for i in range(per_cause)])


# -- logs constructed next to each threshold ------------------------------------------------------------------------
def _finite_log(n: int, ref: float, final: float, zeros, *, last_loss: float | None = None, scaled: bool = False,
                skipped=(), fp8_saturated=None, seed: int = 0) -> dict:
    """A finite run of n steps ending at ``final`` against ``ref``; ``zeros``: the zero fraction of every step
    (a list of n) or one value for all; ``last_loss``: the last training loss (default: on the curve); ``scaled``:
    a dynamic scaler that halves its scale on every step of ``skipped`` and ends at 2**16."""
    rng = random.Random(seed)
    loss = _curve(rng, n, 4.5, final, noise=0.01)
    if last_loss is not None:
        loss[-1] = last_loss
    skipped = set(skipped)
    scale, loss_scale = 2.0 ** (16 + len(skipped)), []
    for t in range(n):
        loss_scale.append(scale if scaled else None)
        if t in skipped:
            scale /= 2
    return {"loss": loss, "skipped": [t in skipped for t in range(n)], "loss_scale": loss_scale,
            "grad_amax": [None if t in skipped else 0.05 + 0.5 * rng.random() for t in range(n)],
            "grad_zero_fraction": list(zeros) if isinstance(zeros, (list, tuple)) else [zeros] * n,
            "weight_amax": [1.0 + 0.002 * t for t in range(n)],
            "fp8_saturated": list(fp8_saturated) if fp8_saturated is not None else [None] * n,
            "final_train_loss": final, "reference_loss": ref}


def boundary_cases() -> list[tuple[str, dict, str]]:
    """(name, log, cause): logs next to each threshold of the rule, on both sides (see the module docstring)."""
    out = []
    for ref in (1.6, 3.9):                                # 4% of 1.6 is 0.064, of 3.9 is 0.156: no absolute gap fits
        for i, (gap, last, cause) in enumerate(((0.041, 1.01, "gradient_underflow"), (0.038, 1.08, "healthy"))):
            log = _finite_log(40, ref, ref * (1 + gap), 0.5, last_loss=ref * last, seed=i)
            out.append((f"constructed: gap {gap:+.1%} of reference {ref}, last training loss {last - 1:+.0%}, "
                        f"50% zeros", log, cause))
        log = _finite_log(40, ref, ref * 0.94, 0.5, seed=2)
        out.append((f"constructed: ends 6% below reference {ref}, 50% zeros", log, "healthy"))
    zeros_hi = [0.17] * 24 + [0.01] * 16                  # mean 10.6%, the last step 1%
    zeros_lo = [0.6] + [0.08] * 39                        # mean 9.3%, the worst step 60%
    out.append(("constructed: mean zero fraction 10.6% (last step 1%), gap +12%",
                _finite_log(40, 2.5, 2.8, zeros_hi, seed=3), "gradient_underflow"))
    out.append(("constructed: mean zero fraction 9.3% (worst step 60%), gap +12%",
                _finite_log(40, 2.5, 2.8, zeros_lo, seed=4), "healthy"))
    sat = [0.001] * 30
    out.append(("constructed: FP8 saturated exactly 1% on step 20", _finite_log(
        30, 2.5, 2.51, 0.002, fp8_saturated=sat[:20] + [0.01] + sat[21:], seed=5), "healthy"))
    out.append(("constructed: FP8 saturated 1.2% on step 20 (mean 0.14%)", _finite_log(
        30, 2.5, 2.51, 0.002, fp8_saturated=sat[:20] + [0.012] + sat[21:], seed=6), "fp8_amax_spike"))
    for n, skips, cause in ((40, 20, "healthy"), (40, 21, "scale_too_high"), (41, 20, "healthy")):
        log = _finite_log(n, 2.5, 2.52, 0.002, scaled=True, skipped=range(skips), seed=7)
        out.append((f"constructed: {skips} of {n} steps skipped", log, cause))
    return out


def real_cases() -> list[tuple[str, dict, str]]:
    """The stored real runs: (name, log, cause)."""
    if not RUNS_FILE.exists():
        return []
    return [(r["name"], r["log"], r["cause"]) for r in json.loads(RUNS_FILE.read_text())["runs"]]


def _mean_zeros(log: dict) -> float:
    return sum(log["grad_zero_fraction"]) / len(log["loss"])


def _gap(log: dict) -> float | None:
    return None if log["final_train_loss"] is None else log["final_train_loss"] / log["reference_loss"] - 1


def _before(k: int) -> str:
    return "step 0" if k == 1 else f"steps 0 to {k - 1}"


def _hint(want: str, got: str, log: dict) -> str:
    """What the learner's rule missed: the (right, said) pair and the log name the fault; else what ``want`` looks
    like."""
    for rule in (_skips_hint, _underflow_hint, _spike_hint, _death_hint):      # in this order: the first one says
        hint = rule(want, got, log)
        if hint is not None:
            return hint
    return _LOOKS_LIKE[want]


def _skips_hint(want: str, got: str, log: dict) -> str | None:
    """scale_too_high said or missed: count the skipped steps (more than half)."""
    n, skips = len(log["loss"]), sum(log["skipped"])
    if got == "scale_too_high" and want != "scale_too_high" and log["loss_scale"][0] is not None:
        if skips * 2 == n:
            return f"{skips} of {n} steps skipped is exactly half: scale_too_high needs MORE than half"
        if skips * 2 < n:
            if skips and log["loss_scale"][-1] < log["loss_scale"][0]:
                return ("a scale that backed off a few times is dynamic scaling doing its job: count the skipped "
                        "steps, do not read the scale's fall")
            return f"{skips} of {n} steps skipped is not more than half (sum(skipped) > n / 2)"
    if want == "scale_too_high":
        return f"{skips} of {n} steps skipped, with a loss scale: more than half (sum(skipped) > n / 2)"
    return None


def _underflow_hint(want: str, got: str, log: dict) -> str | None:
    """gradient_underflow said of a healthy run, or missed: both symptoms, each read the right way."""
    if want == "healthy" and got == "gradient_underflow":
        return _not_underflow_hint(log)
    if want == "gradient_underflow" and got == "healthy":
        n, gap, zeros = len(log["loss"]), _gap(log), _mean_zeros(log)
        return (f"final_train_loss / reference_loss - 1 = {gap:.2%} (more than 4%: divide by reference_loss, read "
                f"final_train_loss, not the last training loss) and the mean zero fraction over all {n} steps is "
                f"{zeros:.1%} (more than 10%; the last step alone holds {log['grad_zero_fraction'][-1]:.0%})")
    return None


def _not_underflow_hint(log: dict) -> str:
    """Why a healthy run is not gradient_underflow: which of the two symptoms it lacks."""
    n, gap, zeros = len(log["loss"]), _gap(log), _mean_zeros(log)
    worst = max(log["grad_zero_fraction"])
    if zeros > UNDERFLOW_ZEROS:
        if gap < 0:
            return (f"this run ends {-gap:.1%} BELOW its reference: only a gap above it counts "
                    "(final_train_loss / reference_loss - 1 > 0.04), not its absolute value")
        if gap > 0.02:
            return (f"the gap is relative and read from final_train_loss: final_train_loss / reference_loss "
                    f"- 1 = {gap:.1%}, not more than 4% (final - reference = "
                    f"{log['final_train_loss'] - log['reference_loss']:.3f} is an absolute difference; the "
                    f"last training loss is one batch)")
        return ("many exact zeros alone are not underflow (an untied embedding's unused rows are exact zeros "
                "in any precision): this run ends near its reference_loss; underflow needs both symptoms")
    if worst > UNDERFLOW_ZEROS:
        return (f"the zero fraction counts as its mean over all {n} steps (sum / n = {zeros:.1%}), not its "
                f"worst step ({worst:.0%})")
    if gap > UNDERFLOW_GAP:
        return ("a final loss above the reference alone is not underflow: this run's gradients hold few exact "
                "zeros; underflow needs both symptoms")
    return (f"neither symptom shows: a gap of {gap:+.2%} (not more than 4%) and a mean zero fraction of "
            f"{zeros:.2%} (not more than 10%)")


def _spike_hint(want: str, got: str, log: dict) -> str | None:
    """fp8_amax_spike said or missed: the largest step counts, more than 1%, and only in a run that survived."""
    sat = [s for s in log["fp8_saturated"] if s is not None]
    if want == "healthy" and got == "fp8_amax_spike":
        if sat and max(sat) == SATURATED:
            return "exactly 1% saturated is not a spike: fp8_amax_spike needs MORE than 1% on one step"
        return "a tiny saturated fraction is delayed scaling's usual lag; a spike clamps a large share on one step"
    if want == "fp8_amax_spike" and got == "healthy" and sat:
        return (f"read fp8_saturated: its largest step counts ({max(sat):.2%} on step "
                f"{log['fp8_saturated'].index(max(sat))}, more than 1%), not its mean over the steps "
                f"({sum(sat) / len(sat):.2%}): a spike is one step")
    k = dying_step(log)
    if k is not None and got == "fp8_amax_spike":
        return (f"this run dies at step {k}: ask what broke before it ({_before(k)}) first; an amax spike "
                "it survived did not kill it")
    return None


def _death_hint(want: str, got: str, log: dict) -> str | None:
    """The cause of a run that died confused with another: read the steps before the dying step k."""
    k = dying_step(log)
    if want == "optimizer_state" and got == "gradient_overflow":
        return ("an inf gradient on a SKIPPED step never reached the weights, and step k's own gradient (the inf "
                "loss's backward) says nothing: only a non-finite gradient that was not skipped, before step k, is "
                "overflow; then look at weight_amax")
    if want == "optimizer_state" and got == "forward_overflow":
        return (f"look at weight_amax before the first non-finite loss ({_before(k)}): the "
                "update made the weights non-finite")
    if want == "forward_overflow" and got in ("optimizer_state", "gradient_overflow"):
        return (f"the weights (weight_amax) and the gradients stayed finite on every step before the loss broke "
                f"({_before(k)}); only step {k}'s own backward and update are non-finite, as in every run "
                "that dies: the forward itself overflowed")
    if want == "gradient_overflow" and got in ("optimizer_state", "forward_overflow"):
        ends = "" if k == 1 else f", step 0 and step {k - 1} included"
        return (f"find a step with a non-finite gradient that was NOT skipped before the dying step {k} "
                f"({_before(k)}{ends}): the inf went into the weights, which is why weight_amax is non-finite too")
    return None


# the hint where no (right, said) pair names the fault: what the right cause looks like in a log
_LOOKS_LIKE = {
    "healthy": "a finite run: read every symptom before naming a cause; none of them shows here",
    "gradient_underflow": "compare the final loss with reference_loss, and look at grad_zero_fraction",
    "gradient_overflow": "find the first step with a non-finite gradient that was NOT skipped, before the "
                         "loss became non-finite",
    "optimizer_state": "the steps before the first non-finite loss had finite gradients but left non-finite "
                       "weights (weight_amax)",
    "scale_too_high": "count the skipped steps of a run that has a loss_scale",
    "forward_overflow": "gradients and weights finite before the first non-finite loss: the forward overflowed",
    "fp8_amax_spike": "look at fp8_saturated: on one step a large share of the FP8 elements was clamped",
}


def _describe(log: dict) -> str:
    n, k, gap = len(log["loss"]), dying_step(log), _gap(log)
    sat = [(s, t) for t, s in enumerate(log["fp8_saturated"]) if s is not None]
    scale = "none" if log["loss_scale"][0] is None else f"{log['loss_scale'][0]:g} -> {log['loss_scale'][-1]:g}"
    final = ("no final loss" if gap is None else
             f"final {log['final_train_loss']:.4f} vs reference {log['reference_loss']:.4f} ({gap:+.2%})")
    return (f"  {n} steps (0-{n - 1}), {'finite' if k is None else f'loss non-finite from step {k}'}, "
            f"{sum(log['skipped'])} skipped, loss scale {scale}, {final}, "
            f"zero fraction mean {_mean_zeros(log):.1%} (max {max(log['grad_zero_fraction']):.1%}), "
            f"non-finite gradients on steps {[t for t, g in enumerate(log['grad_amax']) if g is None][:6]}, "
            f"non-finite weights on steps {[t for t, w in enumerate(log['weight_amax']) if w is None][:6]}, "
            f"FP8 saturated {'none' if not sat else f'max {max(sat)[0]:.2%} on step {max(sat)[1]}'}")


def check_diagnose(fn) -> None:
    name = "diagnose"
    real, synthetic, boundary = real_cases(), synthetic_cases(), boundary_cases()
    for case_name, log, want in real + synthetic + boundary:
        got = call(name, fn, json.loads(json.dumps(log)))          # a fresh copy: the function may not mutate ours
        if got not in CAUSES:
            raise GradingError(f"FAIL {name}: on {case_name} it returned {got!r}; return one of {CAUSES}")
        if got != want:
            raise GradingError(f"FAIL {name}: {case_name} is {want!r}, you said {got!r}.\n{_describe(log)}\n"
                               f"  hint: {_hint(want, got, log)}")
    verdict(name, f"{len(real) + len(synthetic) + len(boundary)} runs diagnosed correctly ({len(real)} real runs, "
                  f"{len(synthetic)} synthetic, {len(boundary)} constructed at the thresholds), {len(CAUSES)} causes")


# -- the real runs' logs (trained and stored by ``python -m mpcourse.course.diagnose_yours``) ------------------


def log_of(run: dict, reference_loss: float) -> dict:
    """The log the exercise reads, from one run of ``mpcourse.experiment.ablations.common.run_one`` with
    ``weight_probe`` and ``failures.SaturationCounter``."""
    h = run["history"]
    return {"loss": [r["loss"] for r in h], "skipped": [r["skipped"] for r in h],
            "loss_scale": [r["loss_scale"] for r in h], "grad_amax": [r["grad_amax"] for r in h],
            "grad_zero_fraction": [r["grad_zero_fraction"] for r in h],
            "weight_amax": [r["weight_amax"] for r in h], "fp8_saturated": [r.get("fp8_saturated") for r in h],
            "final_train_loss": run["final_train_loss"], "reference_loss": reference_loss}
