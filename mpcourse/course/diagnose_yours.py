"""Lesson 12's last cell: train the GPT in settings whose cause is known, then diagnose the fresh logs twice.

``diagnose_yours(globals(), ["underflow", "healthy"])`` trains the course's GPT briefly (the size and length
of every exercise's last cell, ``mpcourse.course.yours.YOURS_CONFIG``) in each named setting of
``SETTINGS``, with the ablations' one run (``mpcourse.experiment.ablations.common.run_one``: the log of
loss, skipped steps, loss scale, gradient amax and zero fraction per step) and the FP32 run of the same
setting as its ``reference_loss``; then it reads every log with the grader's rule
(``mpcourse.course.grading.diagnosis.reference_diagnose``) and with the learner's ``diagnose``, and prints
both verdict rows and one line: identical, where they first differ, or why there is no row of yours
(not implemented yet, it raised, it returned something that is not a cause)::

    the course's GPT (2 layers, width 64), 20 steps of 8 x 32 characters, seed 0; [yours]: with your diagnose
    run                  fp16-master x 2**-12   fp16-dynamic
    -------------------  ---------------------  ------------
    planted              gradient_underflow     healthy
    library's rule       gradient_underflow     healthy
    diagnose [yours]     gradient_underflow     healthy
    diagnose [yours]: identical to the library's rule on 2 fresh runs

The settings (``SETTINGS``): ``underflow``, ablation (i) of lesson 11 at this size: ``fp16-master`` with
the loss multiplied by 2**-12 before the backward (AdamW's eps and the clipping threshold scaled with it,
so that in FP32 the multiplier changes nothing); ``healthy``: ``fp16-dynamic`` on the plain loss; ``overflow``:
``fp16-master`` on the loss times 2**17 (a summed loss: the gradients pass FP16's max and nothing skips them);
``optimizer``: ``fp16-pure`` (Adam's FP16 state makes the weights NaN); ``scale``: a static loss scale of 2**24
(every step skipped); ``spike``: ``fp8-delayed`` hit by an amax spike on step 12
(``mpcourse.experiment.ablations.failures.plant_amax_spike``: the activations entering ``attn.qkv`` and ``mlp.fc``
256 times larger on that step, the weights their GEMMs read 256 times smaller, exact in FP32); two healthy
controls of it: ``fp8``, ``fp8-delayed`` without the spike, and ``spike-current``, ``fp8-current`` with the same
spike (current scaling takes each step's own amax: nothing clamps). ``forward_overflow``, the grader's one
synthetic-only cause, has no setting: the course's 20-step CPU runs do not show it. Every log also records
``weight_amax`` (after each step, ``mpcourse.experiment.ablations.common.weight_probe``) and ``fp8_saturated``
(read after the backward, ``failures.SaturationCounter``: None where the run has no delayed-scaling FP8 cast).
Each setting's ``reference_loss`` is FP32 on the same loss multiplier and with the same plant. The training runs
do not depend on the learner (only the reading does), so they are made once per process;
``python -m mpcourse.course.diagnose_yours`` stores every setting over ``SEEDS`` (0, 1, 2), with the FP32
references as healthy runs, as the grader's real cases (``RUNS_FILE``), in a few minutes on a CPU.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.core.learner_table import learner_functions
from mpcourse.experiment.ablations.common import run_one, weight_probe
from mpcourse.experiment.ablations.failures import (OVERFLOW_MULTIPLIER, FP16StaticTooHigh, SaturationCounter,
                                                    plant_amax_spike)
from mpcourse.experiment.ablations.underflow import LOSS_MULTIPLIER, scaled_loss_trainer
from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.course.yours import YOURS_CONFIG, _default_corpus

from .grading.diagnosis import CAUSES, RUNS_FILE, log_of, reference_diagnose


@dataclass(frozen=True)
class Setting:
    """One run with a known cause: ``recipe`` trained with the loss times ``multiplier`` (eps and clipping
    scaled with it), hit by an amax spike if ``spike`` (``failures.plant_amax_spike``), its row label ``label``,
    the ``cause`` it was built to show."""

    recipe: str
    multiplier: float
    label: str
    cause: str
    spike: bool = False


SETTINGS = {
    "underflow": Setting("fp16-master", LOSS_MULTIPLIER, "fp16-master x 2**-12", "gradient_underflow"),
    "healthy": Setting("fp16-dynamic", 1.0, "fp16-dynamic", "healthy"),
    "overflow": Setting("fp16-master", OVERFLOW_MULTIPLIER, "fp16-master x 2**17", "gradient_overflow"),
    "optimizer": Setting("fp16-pure", 1.0, "fp16-pure", "optimizer_state"),
    "scale": Setting("fp16-static-2**24", 1.0, "fp16-static 2**24", "scale_too_high"),
    "spike": Setting("fp8-delayed", 1.0, "fp8-delayed, spike at step 12", "fp8_amax_spike", spike=True),
    "fp8": Setting("fp8-delayed", 1.0, "fp8-delayed", "healthy"),
    "spike-current": Setting("fp8-current", 1.0, "fp8-current, spike at step 12", "healthy", spike=True),
}
NAME = "diagnose"

_logs: dict = {}                  # (setting, cfg) -> its log; the runs do not depend on the learner


def _recipe(name: str):
    return FP16StaticTooHigh if name == FP16StaticTooHigh.name else get_recipe(name)


def _run(recipe: str, multiplier: float, cfg, spike: bool = False) -> dict:
    """One logged run (``run_one`` with the saturated fraction after the backward and the weights' amax after each
    step) of ``recipe`` on the loss times ``multiplier``, eps and the clipping threshold scaled with it, hit by the
    amax spike if ``spike``; single-threaded, tensor-core emulation on."""
    base = cfg.optim
    tcfg = replace(cfg, optim=replace(base, eps=base.eps * multiplier, grad_clip=base.grad_clip * multiplier))
    box = {}

    def make(model, optim):
        r = _recipe(recipe)(model, optim)
        if spike:
            plant_amax_spike(r.model)
        box["saturation"] = SaturationCounter(r)
        return r

    kw = dict(corpus=_default_corpus(), trainer_cls=scaled_loss_trainer(multiplier), model_cfg=cfg.model,
              probe=lambda r: box["saturation"](r), step_probe=weight_probe)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                           # the same bits whatever the machine
        with tensor_cores(True):
            return run_one(recipe, make, tcfg, **kw)
    finally:
        torch.set_num_threads(threads)


def fresh_log(setting: str, cfg=None) -> dict:
    """The log of setting ``setting`` (a key of ``SETTINGS``), trained now (once per process and ``cfg``), with
    the final train loss of FP32 on the same loss multiplier and plant as its ``reference_loss``."""
    cfg = cfg or YOURS_CONFIG
    key = (setting, repr(cfg))
    if key not in _logs:
        s = SETTINGS[setting]
        ref = reference_run(s.multiplier, cfg, s.spike)
        _logs[key] = log_of(_run(s.recipe, s.multiplier, cfg, s.spike), ref["final_train_loss"])
    return _logs[key]


def reference_run(multiplier: float, cfg=None, spike: bool = False) -> dict:
    """The FP32 run on the loss times ``multiplier``, hit by the amax spike if ``spike`` (the reference of the
    settings with that multiplier and plant; the plant changes no bit of an FP32 run)."""
    cfg = cfg or YOURS_CONFIG
    key = ("fp32", multiplier, spike, repr(cfg))
    if key not in _logs:
        _logs[key] = _run("fp32", multiplier, cfg, spike)
    return _logs[key]


@dataclass
class Diagnoses:
    """The verdicts on the fresh runs: ``planted`` (what each run was built to show), ``library`` (the grader's
    rule), ``yours`` (the learner's ``diagnose``; None when there is none), ``message`` (why not)."""

    labels: list[str]
    planted: list[str]
    library: list[str]
    yours: list[str] | None
    message: str | None = None
    recipe: str = NAME
    used: tuple[str, ...] = (NAME,)

    @property
    def difference(self) -> str | None:
        if self.yours is None:
            return None
        for label, a, b in zip(self.labels, self.library, self.yours):
            if a != b:
                return f"first at {label}, you said {b!r} (library {a!r})"
        return None

    @property
    def identical(self) -> bool:
        return self.yours is not None and self.difference is None

    def verdict(self) -> str:
        if self.yours is None:
            return f"{NAME} [yours]: {self.message}"
        diff = self.difference
        if diff is None:
            return f"{NAME} [yours]: identical to the library's rule on {len(self.labels)} fresh runs"
        return f"{NAME} [yours]: differs from the library's: {diff}"


def _read_all(fn: Callable, logs: Sequence[dict]) -> tuple[list[str] | None, str | None]:
    out = []
    for log in logs:
        try:
            got = fn(json.loads(json.dumps(log)))          # a fresh copy: the function may not mutate ours
        except NotImplementedError:
            return None, f"your {NAME} is not implemented yet (it raises NotImplementedError)"
        except Exception as e:                             # the learner's code: one line, no traceback
            first = str(e).splitlines()[0] if str(e) else ""
            return None, f"your {NAME} raised {type(e).__name__}: {first}"
        if got not in CAUSES:
            return None, f"your {NAME} returned {got!r}; return one of {', '.join(CAUSES)}"
        out.append(got)
    return out, None


def format_rows(d: Diagnoses) -> str:
    rows = [["run", *d.labels], None, ["planted", *d.planted], ["library's rule", *d.library]]
    if d.yours is not None:
        rows.append([f"{NAME} [yours]", *d.yours])
    widths = [max(len(r[i]) for r in rows if r is not None) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r if r is not None else ["-" * w for w in widths], widths)).rstrip()
             for r in rows]
    return "\n".join(lines + [d.verdict()])


def diagnose_yours(namespace: Mapping[str, object], settings: Sequence[str], *, cfg=None,
                   echo: Callable[[str], object] | None = print) -> list[Diagnoses]:
    """Train each of ``settings`` (keys of ``SETTINGS``), diagnose the logs with the library's rule and with
    ``namespace["diagnose"]``, print both rows and a verdict; returns ``[Diagnoses]`` (one, for all settings).

    Raises ValueError for an empty list or a string, KeyError for an unknown setting (naming the known ones).
    Nothing the learner's ``diagnose`` does raises: that is the ``message``.
    """
    if isinstance(settings, str) or not settings:
        raise ValueError(f"settings must be a non-empty list, e.g. {list(SETTINGS)}, got {settings!r}")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise KeyError(f"unknown setting {unknown[0]!r}; choose from {', '.join(SETTINGS)}")
    cfg = cfg or YOURS_CONFIG
    logs = [fresh_log(s, cfg) for s in settings]
    fn = learner_functions(namespace, (NAME,)).get(NAME)   # the learner's (the table's filter), or None
    library = [reference_diagnose(log) for log in logs]
    if not callable(fn):
        yours, message = None, f"this notebook defines no function {NAME}(log)"
    else:
        yours, message = _read_all(fn, logs)
    d = Diagnoses([SETTINGS[s].label for s in settings], [SETTINGS[s].cause for s in settings], library, yours,
                  message)
    if echo is not None:
        m = cfg.model
        echo(f"the course's GPT ({m.n_layer} layers, width {m.n_embd}), {cfg.steps} steps of {cfg.batch_size} x "
             f"{m.block_size} characters, seed {cfg.seed}; [yours]: with your {NAME}\n" + format_rows(d))
    return [d]


# -- the grader's real cases: every setting and its FP32 reference, over three seeds ----------------------------
SEEDS = (0, 1, 2)


def build_runs(seeds=SEEDS) -> list[dict]:
    """Train every setting and its FP32 reference (``healthy``; one per loss multiplier: with the spike's plant
    FP32 is the same run bit for bit) for each of ``seeds``: [{"name", "cause", "log"}] (minutes on a CPU)."""
    out = []
    for seed in seeds:
        cfg = replace(YOURS_CONFIG, seed=seed)
        for key, s in SETTINGS.items():
            out.append({"name": f"{s.label} (seed {seed})", "cause": s.cause, "log": fresh_log(key, cfg)})
        for m in dict.fromkeys(s.multiplier for s in SETTINGS.values()):
            ref = reference_run(m, cfg)
            out.append({"name": f"fp32{'' if m == 1 else f' x 2**{round(math.log2(m))}'} (seed {seed})",
                        "cause": "healthy", "log": log_of(ref, ref["final_train_loss"])})
    return out


if __name__ == "__main__":
    runs = build_runs()
    RUNS_FILE.write_text(json.dumps({"source": "python -m mpcourse.course.diagnose_yours", "runs": runs},
                                    allow_nan=False) + "\n")
    print(f"wrote {RUNS_FILE.name}: {len(runs)} runs")
