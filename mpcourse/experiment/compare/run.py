"""The compare job: every recipe trained on every seed, here or in worker processes (``pool``), then the table
printed (``report``) and the folder written (``outputs``). A run that fails, or Ctrl-C, stops only what had not
finished: the finished rows are written and the others named.

Read top-down: what a job is given (``Execution``: how it runs; ``Measurement``: what it measures besides the
loss), what it has so far (``_Tally``), the steps (train in the workers, train here, report, write), then
``run_compare``, the job itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

from ..gpt.data import Corpus
from ..training.train import RunResult, TrainConfig, train, train_inspected
from .learner_rows import learner_verdicts, train_with_learner
from .outputs import OUT_FILES, PARTIAL_FILES, write_outputs
from .peaks import settle_peaks
from .report import format_seed_table, format_table, seed_summary


class CompareFailed(RuntimeError):
    """Some runs of a compare job failed; the finished ones are in ``results.json`` (``failed`` names the others).
    When none finished nothing was written (an earlier ``results.json`` in the folder is kept as it was).

    Attributes:
        failed: ``[{"recipe", "seed", "error"}]``, one per failed run, in the order of the job.
        results: the rows that finished.
    """

    def __init__(self, failed: list[dict], results: list[RunResult]):
        self.failed, self.results = failed, results
        super().__init__("; ".join(f"{f['recipe']} (seed {f['seed']}): {f['error']}" for f in failed))


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C during a compare job: the rows that finished are in ``results.json`` (its ``failed`` names the runs
    that did not finish, ``interrupted`` is true), or in ``results.partial.json`` beside an earlier run's
    ``results.json``, which stays as it was; nothing was written when none had finished.

    A ``KeyboardInterrupt``, so a caller that does not know it still stops. Attributes as ``CompareFailed``'s, and
    ``path``: the results file written (None: none).
    """

    def __init__(self, failed: list[dict], results: list[RunResult], path: Path | None = None):
        self.failed, self.results, self.path = failed, results, path
        super().__init__(f"interrupted: {len(results)} finished run(s) kept, {len(failed)} not finished")


INTERRUPTED = "interrupted before it finished"


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a compare job runs. ``jobs`` > 1: the library's rows train in that many worker processes
    (``mpcourse.experiment.compare.pool``), the learner's rows afterwards in this process; every run, wherever it
    trains, uses ``TRAINING_THREADS`` intra-op threads (``mpcourse.experiment.training.threads``), so a row's bits
    do not depend on ``jobs``. ``progress``: show the progress bars; ``echo``: where the table and the lines under
    it go."""

    jobs: int = 1
    progress: bool = True
    echo: Callable[[str], object] = print


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What a compare job measures besides the loss. ``peak_flops``: the machine's peaks for the %peak column, by
    GEMM dtype key (``speed.cpu_peaks`` / ``gpu_peaks``: each row against its dtype's, ``speed.peak_key``), or one
    number for every row; ``remeasure_peak(key)``: measures a peak again when a row beat it (the better one counts;
    a row still above it prints ``100.0*``, see ``format_table``). ``inspect_every=N``: the numerics inspector on
    the first seed's runs, writing ``inspect-RECIPE.json`` and ``inspect-RECIPE.png`` per recipe (layer x step:
    fraction of the output gradients that are FP16 subnormals; in an FP16 run the ones that underflowed are already
    zeros, counted in ``zeros``). ``autoswitch`` (e.g. "underflow=0.05"): every run of the library's rows moves a
    quantized layer to high precision once its tensors pass the threshold (``Trainer.switching``)."""

    peak_flops: float | Mapping[str, float] | None = None
    remeasure_peak: Callable[[str], float | None] | None = None
    inspect_every: int = 0
    autoswitch: str | None = None


@dataclasses.dataclass(frozen=True)
class _Job:
    """What ``run_compare`` was asked: every recipe on every seed, written to ``out``."""

    recipes: list[str]
    corpus: Corpus
    cfg: TrainConfig
    out: Path
    seeds: list[int]
    learner: dict | None
    execution: Execution
    measurement: Measurement

    def cfg_for(self, seed: int) -> TrainConfig:
        return dataclasses.replace(self.cfg, seed=seed)

    def inspect_every(self, seed: int) -> int:
        """The inspector's interval for a run on ``seed`` (0: not inspected): only the first seed's runs."""
        return self.measurement.inspect_every if seed == self.seeds[0] else 0


@dataclasses.dataclass
class _Tally:
    """What a job has so far: the rows the workers finished (``pooled``), the finished rows per seed (``runs``, in
    the job's order), the failed runs and why, the learner's refusals per recipe, and whether Ctrl-C stopped it."""

    pooled: dict[tuple[int, str], RunResult] = dataclasses.field(default_factory=dict)
    runs: dict[int, list[RunResult]] = dataclasses.field(default_factory=dict)
    failed: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)
    messages: dict[str, str] = dataclasses.field(default_factory=dict)
    interrupted: bool = False

    def flat(self) -> list[tuple[int, RunResult]]:
        """Every finished row with its seed, seed by seed."""
        return [(s, r) for s, rs in self.runs.items() for r in rs]


def _error_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _rows_of(name: str, learner: dict | None, messages: dict[str, str]) -> list[str]:
    """The rows recipe ``name`` trains for a job: its own, and ``"name [yours]"`` where it takes some of the
    ``learner``'s functions and did not refuse them (``messages``)."""
    from mpcourse.core.learner_table import learner_functions
    from ..recipes import get_recipe
    from .learner_rows import yours

    takes = learner and name not in messages and learner_functions(learner, get_recipe(name).OVERRIDABLE)
    return [name, yours(name)] if takes else [name]


# ---------------------------------------------------------------------------------------------------------------
# Training: the library's rows in the workers (--jobs > 1), then whatever is left here, one seed at a time
# ---------------------------------------------------------------------------------------------------------------
def _train_in_workers(job: _Job, tally: _Tally) -> None:
    """Every library row trained in ``job.execution.jobs`` worker processes: the finished ones into
    ``tally.pooled``, the failed ones into ``tally.failed``; Ctrl-C keeps what the workers finished."""
    from ..training.threads import TRAINING_THREADS
    from .pool import Task, run_pool

    if job.measurement.inspect_every:
        job.out.mkdir(parents=True, exist_ok=True)           # the workers' inspector files go there
    tasks = [Task(name, job.cfg_for(seed), job.inspect_every(seed), job.out, job.measurement.autoswitch)
             for seed in job.seeds for name in job.recipes]
    errors: dict[int, str] = {}
    finished: dict[int, RunResult] = {}
    try:
        run_pool(tasks, job.corpus, job.execution.jobs, TRAINING_THREADS, progress=job.execution.progress,
                 failures=errors, finished=finished)
    except KeyboardInterrupt:                # keep what the workers finished: written below
        tally.interrupted = True
    for i, t in enumerate(tasks):
        if i in finished:
            tally.pooled[t.cfg.seed, t.name] = finished[i]
        elif i in errors:
            tally.failed[t.cfg.seed, t.name] = errors[i]


def _library_row(job: _Job, tally: _Tally, seed: int, name: str) -> RunResult:
    """Recipe ``name`` on ``seed``: the workers' row, else trained here (inspected on the first seed)."""
    if (seed, name) in tally.pooled:
        return tally.pooled[seed, name]
    every, progress, switch = job.inspect_every(seed), job.execution.progress, job.measurement.autoswitch
    if every:
        job.out.mkdir(parents=True, exist_ok=True)
        return train_inspected(name, job.corpus, job.cfg_for(seed), job.out, every, progress, autoswitch=switch)
    return train(name, job.corpus, job.cfg_for(seed), progress=progress, autoswitch=switch)


def _learner_row(job: _Job, tally: _Tally, seed: int, name: str) -> RunResult | None:
    """``"name [yours]"`` on ``seed``, trained with the learner's functions; None where the recipe takes none of
    them or refuses them (its first line kept in ``tally.messages``)."""
    said: list[str] = []
    mine = train_with_learner(name, job.corpus, job.cfg_for(seed), job.learner, progress=job.execution.progress,
                              echo=said.append)
    if mine is None and said:
        tally.messages.setdefault(name, said[0])
    return mine


def _train_seed(job: _Job, tally: _Tally, seed: int, rows: list[RunResult]) -> None:
    """Every recipe's rows on ``seed`` appended to ``rows`` as they finish: the library's, then the learner's. A
    run that fails is named in ``tally.failed`` and the others go on."""
    for name in job.recipes:
        if (seed, name) in tally.failed:
            continue
        try:
            rows.append(_library_row(job, tally, seed, name))
        except Exception as e:          # keep the other rows: this one is named in results.json
            tally.failed[seed, name] = _error_line(e)
            continue
        mine = _learner_row(job, tally, seed, name) if job.learner else None
        if mine is not None:
            rows.append(mine)


def _train_here(job: _Job, tally: _Tally) -> None:
    """Each seed's rows into ``tally.runs``, trained in this process where the workers did not; after Ctrl-C only
    the rows already finished."""
    from ..training.threads import training_threads

    with training_threads():
        for seed in job.seeds:
            if tally.interrupted:
                tally.runs[seed] = [tally.pooled[seed, n] for n in job.recipes if (seed, n) in tally.pooled]
                continue
            rows = tally.runs[seed] = []
            try:
                _train_seed(job, tally, seed, rows)
            except KeyboardInterrupt:               # Ctrl-C: keep the finished rows, name the others
                tally.interrupted = True


# ---------------------------------------------------------------------------------------------------------------
# After the training: the runs not finished, the table, the folder
# ---------------------------------------------------------------------------------------------------------------
def _failures(job: _Job, tally: _Tally) -> list[dict]:
    """``[{"recipe", "seed", "error"}]``: the failed runs in the job's order, then (after Ctrl-C) every row not
    finished."""
    failures = [{"recipe": name, "seed": seed, "error": tally.failed[seed, name]}
                for seed in job.seeds for name in job.recipes if (seed, name) in tally.failed]
    if tally.interrupted:
        done = {(s, r.recipe) for s, r in tally.flat()}
        failures += [{"recipe": row, "seed": seed, "error": INTERRUPTED} for seed in job.seeds for name in job.recipes
                     if (seed, name) not in tally.failed for row in _rows_of(name, job.learner, tally.messages)
                     if (seed, row) not in done]
    return failures


def _report(job: _Job, tally: _Tally, row_peak, failures: list[dict]) -> None:
    """The table (one seed, or mean +- std over seeds), the learner's verdicts, one line per run not finished."""
    echo = job.execution.echo
    if len(job.seeds) == 1:
        echo(format_table(tally.runs.get(job.seeds[0], []), peak_flops=row_peak))
    else:
        echo(format_seed_table(tally.runs, row_peak))
    if job.learner:
        for line in learner_verdicts(tally.runs, job.recipes, tally.messages):
            echo(line)
    for f in failures:
        said = "NOT FINISHED" if f["error"] == INTERRUPTED else "FAILED"
        echo(f"{said} {f['recipe']} (seed {f['seed']}): {f['error']}")


def _write(job: _Job, tally: _Tally, peaks, row_peak, failures: list[dict]) -> Path | None:
    """``results.json`` and the plot (``results.partial.json`` and ``loss_curves.partial.png`` after Ctrl-C where an
    earlier run's ``results.json`` is there); the results file, or None when no run finished (nothing written,
    so an earlier run's files stay as they were)."""
    from ..training.threads import TRAINING_THREADS

    flat = tally.flat()
    if not flat:
        return None
    extra = {"seeds": job.seeds, "peak_flops": peaks, "row_peak_flops": row_peak, "jobs": job.execution.jobs,
             "threads": TRAINING_THREADS, "failed": failures, "interrupted": tally.interrupted}
    if len(job.seeds) > 1:
        extra["seed_summary"] = seed_summary(tally.runs)
    results = [r for _, r in flat]
    beside = tally.interrupted and (job.out / OUT_FILES[0]).exists()  # keep the earlier run's files until one completes
    return write_outputs(results, job.corpus, job.cfg, job.out, extra=extra, seeds=[s for s, _ in flat],
                         plot_results=tally.runs.get(job.seeds[0]) or results,
                         files=PARTIAL_FILES if beside else OUT_FILES)


# ---------------------------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------------------------
def run_compare(recipes: list[str], corpus: Corpus, cfg: TrainConfig, out: Path, *, seeds: list[int] | None = None,
                learner: dict | None = None, execution: Execution = Execution(),
                measurement: Measurement = Measurement()) -> list[RunResult]:
    """Train every recipe in ``recipes`` on ``corpus`` (once per seed in ``seeds``; default: ``cfg.seed``); print
    the table; write JSON and plot to ``out``. ``execution``: how the job runs (worker processes, progress bars,
    where the lines go); ``measurement``: the peaks for %peak and the numerics inspector.
    ``learner``: functions loaded from exercise notebooks (``mpcourse.experiment.learner``); each recipe
    that accepts some of them gets a second row, ``"name [yours]"``, trained with them (every seed), and one
    verdict line under the table (``learner_verdicts``).

    A run that fails does not stop the others: the table and ``results.json`` hold every finished row,
    ``results.json``'s ``failed`` names each failed run and why, and ``CompareFailed`` is raised after the
    files are written. Ctrl-C (``KeyboardInterrupt``, in this process or while workers train) stops the job the
    same way: the finished rows are written, the others named in ``failed`` as interrupted, and
    ``CompareInterrupted`` is raised; where ``out`` already holds a ``results.json`` (an earlier run's), they go to
    ``results.partial.json`` and ``loss_curves.partial.png`` beside it, which stay as they were. When no run
    finished nothing is written (``out`` keeps what it held).
    """
    job = _Job(recipes, corpus, cfg, out, list(seeds) if seeds else [cfg.seed], learner, execution, measurement)
    tally = _Tally()
    if execution.jobs > 1:
        _train_in_workers(job, tally)
    _train_here(job, tally)
    failures = _failures(job, tally)
    peak_flops = measurement.peak_flops
    peaks = dict(peak_flops) if isinstance(peak_flops, Mapping) else peak_flops   # settle_peaks keeps better ones
    row_peak = settle_peaks(tally.flat(), peaks, cfg, measurement.remeasure_peak)
    _report(job, tally, row_peak, failures)
    written = _write(job, tally, peaks, row_peak, failures)
    results = [r for _, r in tally.flat()]
    if tally.interrupted:
        raise CompareInterrupted(failures, results, written)
    if failures:
        raise CompareFailed(failures, results)
    return results
