"""Grader for lesson 12 (the capstone): diagnose what went wrong in a training run from its log.

``check_diagnose(fn)``: ``fn(log) -> str`` names the cause of a run from ``CAUSES``. A log is a dict:

    loss               [float | None]  training loss per step (None: inf/NaN; the run stops at the first)
    skipped            [bool]          the loss scaler skipped the step (inf/NaN gradients)
    loss_scale         [float | None]  the scale in force (None: the recipe has no loss scaler)
    grad_amax          [float | None]  max |gradient| after the backward, before unscaling (None: inf/NaN)
    grad_zero_fraction [float]         fraction of gradient elements exactly 0
    final_train_loss   float | None    the final evaluation (None where the run diverged)
    reference_loss     float           the FP32 run's final train loss on the same setting

The causes, and the symptom each leaves in the log (the lesson derives them from the ablations):

    healthy             finite throughout, within a few % of the reference, few skipped steps
    gradient_underflow  finite, but ends clearly above the reference, and a large share of the gradient
                        elements are exactly zero: they flushed to zero in FP16 (ablation i)
    gradient_overflow   inf/NaN gradients on a step the optimizer was *not* told to skip (no loss scaler),
                        then the loss becomes inf/NaN: the inf went into the weights
    optimizer_state     the loss becomes inf/NaN right after a step whose loss and gradients were finite:
                        the update itself made the weights inf/NaN (Adam's FP16 state, ablation ii)
    scale_too_high      a loss-scaled run that skips most of its steps (every scaled gradient overflows),
                        so the weights barely move and the loss stays where it started

Cases: the logs of the real runs stored with this module (``diagnosis_runs.json``, extracted from the
ablations' results by ``python -m mpcourse.course.grading.diagnosis notebooks/data/11``), and synthetic logs
drawn from a fixed seed to the same patterns, far from every threshold a sensible diagnosis would use
(gaps of 0-1.5% vs 8-30%, zero fractions under 1% vs over 30%, skipped shares under 5% vs over 80%), with
the distractors a real log has: a few skipped steps and a scale backing off in healthy dynamic runs,
inf gradients on those skipped steps, noise in the loss.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from . import GradingError, call, verdict

CAUSES = ("healthy", "gradient_underflow", "gradient_overflow", "optimizer_state", "scale_too_high")
RUNS_FILE = Path(__file__).with_name("diagnosis_runs.json")


def _curve(rng, n, start, final, noise=0.03):
    return [final + (start - final) * math.exp(-t / (n / 4)) + rng.uniform(-noise, noise) for t in range(n)]


def _base(rng, n, scaled):
    ref = rng.uniform(2.3, 2.7)
    return ref, {"skipped": [False] * n, "loss_scale": [2.0 ** 16 if scaled else None] * n,
                 "grad_amax": [rng.uniform(0.05, 0.6) for _ in range(n)],
                 "grad_zero_fraction": [round(rng.uniform(0.0, 0.004), 6) for _ in range(n)], "reference_loss": ref}


UNDERFLOW_GAP = 0.04              # "clearly above the reference": final train loss > 1.04 x reference
UNDERFLOW_ZEROS = 0.10            # "many exact-zero gradient elements": mean grad_zero_fraction > 10%


def reference_diagnose(log: dict) -> str:
    """The grader's own rule (the exercise's order of checks): the cause of a run from its log, one of CAUSES.

    1. a loss-scaled run that skipped more than half of its steps: ``scale_too_high``; 2. a non-finite loss
    at step k: ``gradient_overflow`` if an earlier step had a non-finite gradient that was not skipped, else
    ``optimizer_state``; 3. a finite run ending more than ``UNDERFLOW_GAP`` above the reference with a mean
    zero fraction over ``UNDERFLOW_ZEROS``: ``gradient_underflow``; 4. ``healthy``.
    """
    n = len(log["loss"])
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > n / 2:
        return "scale_too_high"
    first_bad = next((k for k, v in enumerate(log["loss"]) if v is None), None)
    if first_bad is not None:
        unskipped_inf = any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(first_bad))
        return "gradient_overflow" if unskipped_inf else "optimizer_state"
    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > UNDERFLOW_GAP and sum(log["grad_zero_fraction"]) / n > UNDERFLOW_ZEROS:
        return "gradient_underflow"
    return "healthy"


def synthetic_log(cause: str, rng: random.Random) -> dict:
    """One log showing ``cause`` (see the module docstring), drawn from ``rng``."""
    n = rng.randint(30, 80)
    scaled = rng.random() < 0.5
    ref, log = _base(rng, n, scaled)
    start = rng.uniform(4.4, 4.7)
    if cause == "healthy":
        final = ref * (1 + rng.uniform(-0.015, 0.015))
        log["loss"] = _curve(rng, n, start, final)
        if scaled:                                        # a dynamic scaler: 0-2 skips, each halving the scale
            s = 2.0 ** 16
            for k in sorted(rng.sample(range(5, n), rng.randint(0, 2))):
                log["skipped"][k], log["grad_amax"][k] = True, None
                for j in range(k + 1, n):
                    log["loss_scale"][j] = s / 2
                s /= 2
        log["final_train_loss"] = final
    elif cause == "gradient_underflow":
        final = ref * (1 + rng.uniform(0.08, 0.3))
        log["loss"] = _curve(rng, n, start, final)
        log["loss_scale"] = [None] * n
        log["grad_amax"] = [rng.uniform(1e-5, 1e-3) for _ in range(n)]
        log["grad_zero_fraction"] = [round(rng.uniform(0.3, 0.95), 6) for _ in range(n)]
        log["final_train_loss"] = final
    elif cause in ("gradient_overflow", "optimizer_state"):
        k = rng.randint(2, n - 3) if cause == "gradient_overflow" else rng.randint(1, 6)
        loss = _curve(rng, n, start, ref)[:k + 1]
        log.update({key: v[:k + 1] for key, v in log.items() if isinstance(v, list)})
        log["loss_scale"] = [None] * (k + 1)
        if cause == "gradient_overflow":
            j = k - 1                                     # the gradients overflowed one step before
            log["grad_amax"][j] = None
            for later in range(j + 1, k + 1):
                log["grad_amax"][later] = None
        else:
            log["grad_amax"][k] = None                    # the NaN weights' own gradients
        loss[k] = None
        log["loss"], log["final_train_loss"] = loss, None
    elif cause == "scale_too_high":
        log["loss_scale"] = [2.0 ** rng.randint(22, 28)] * n
        skips = set(rng.sample(range(n), int(n * rng.uniform(0.85, 1.0))))
        log["skipped"] = [i in skips for i in range(n)]
        log["grad_amax"] = [None if i in skips else rng.uniform(1e3, 6e4) for i in range(n)]
        log["loss"] = [start + rng.uniform(-0.05, 0.05) for _ in range(n)]
        log["final_train_loss"] = start
    else:
        raise ValueError(f"unknown cause {cause!r}; choose from {CAUSES}")
    return log


def synthetic_cases(per_cause: int = 8, seed: int = 0) -> list[tuple[str, dict, str]]:
    rng = random.Random(seed)
    return [(f"synthetic {c} #{i}", synthetic_log(c, rng), c) for c in CAUSES for i in range(per_cause)]


def real_cases() -> list[tuple[str, dict, str]]:
    """The stored real runs: (name, log, cause)."""
    if not RUNS_FILE.exists():
        return []
    return [(r["name"], r["log"], r["cause"]) for r in json.loads(RUNS_FILE.read_text())["runs"]]


def _hint(want: str) -> str:
    return {
        "healthy": "a finite run near the reference with a few skipped steps is dynamic scaling doing its job",
        "gradient_underflow": "compare the final loss with reference_loss, and look at grad_zero_fraction",
        "gradient_overflow": "find the first step with a non-finite gradient that was NOT skipped, before the "
                             "loss became non-finite",
        "optimizer_state": "the step before the first non-finite loss had finite loss and finite gradients",
        "scale_too_high": "count the skipped steps of a run that has a loss_scale",
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
            raise GradingError(
                f"FAIL {name}: {case_name} is {want!r}, you said {got!r}.\n"
                f"  {n} steps, {bad} non-finite losses, {sum(log['skipped'])} skipped, "
                f"loss scale {'none' if log['loss_scale'][0] is None else log['loss_scale'][-1]}, "
                f"final {log['final_train_loss']} vs reference {log['reference_loss']:.3f}\n"
                f"  hint: {_hint(want)}")
    n_real = len(real_cases())
    verdict(name, f"{len(cases)} runs diagnosed correctly ({n_real} real runs of the ablations, "
                  f"{len(cases) - n_real} synthetic), {len(CAUSES)} causes")


# -- the real runs: extracted from the ablations' stored results ------------------------------------------------
PLANTED = {  # (ablation, run label, loss multiplier or None) -> the cause that run was built to show
    ("underflow", "fp16-master", 2.0 ** -12): "gradient_underflow",
    ("optimizer-state", "fp16-pure", None): "optimizer_state",
    ("optimizer-state", "fp32-master-fp16-state", None): "optimizer_state",
    ("failures", "fp16-master x 2**17", None): "gradient_overflow",
    ("failures", "fp16-static 2**24", None): "scale_too_high",
}
REAL_ABLATIONS = ("underflow", "optimizer-state", "failures", "fp8-format")


def log_of(run: dict, reference_loss: float) -> dict:
    """The log the exercise reads, from one run of an ablation's JSON (``mpcourse.experiment.ablations``)."""
    h = run["history"]
    return {"loss": [r["loss"] for r in h], "skipped": [r["skipped"] for r in h],
            "loss_scale": [r["loss_scale"] for r in h], "grad_amax": [r["grad_amax"] for r in h],
            "grad_zero_fraction": [r["grad_zero_fraction"] for r in h],
            "final_train_loss": run["final_train_loss"], "reference_loss": reference_loss}


def _reference(runs: list[dict], run: dict) -> float:
    """The final train loss of the FP32 run with the same seed and loss multiplier (over 2**17: fp32 x 2**17)."""
    m = run.get("loss_multiplier")
    for r in runs:
        if r["label"].split(" ")[0] == "fp32" and r["seed"] == run["seed"] and r.get("loss_multiplier") == m:
            return r["final_train_loss"]
    raise KeyError(f"no fp32 run for seed {run['seed']} and multiplier {m}")


def build_runs(folder) -> list[dict]:
    """Every run of the ablations in ``folder`` with its planted cause (``healthy`` unless ``PLANTED``)."""
    out = []
    for ablation in REAL_ABLATIONS:
        runs = json.loads((Path(folder) / f"{ablation}.json").read_text())["runs"]
        for r in runs:
            m = r.get("loss_multiplier")
            cause = PLANTED.get((ablation, r["label"], m if ablation == "underflow" else None), "healthy")
            tag = f" x {m:g}" if ablation == "underflow" else ""
            out.append({"name": f"{ablation}: {r['label']}{tag} (seed {r['seed']})", "cause": cause,
                        "log": log_of(r, _reference(runs, r))})
    return out


if __name__ == "__main__":
    import sys

    folder = sys.argv[1] if len(sys.argv) > 1 else "notebooks/data/11"
    runs = build_runs(folder)
    RUNS_FILE.write_text(json.dumps({"source": f"python -m mpcourse.course.grading.diagnosis {folder}",
                                     "runs": runs}, allow_nan=False) + "\n")
    print(f"wrote {RUNS_FILE.name}: {len(runs)} runs")
