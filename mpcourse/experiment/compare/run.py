"""The compare job: every recipe trained on every seed, here or in worker processes (``pool``), then the table
printed (``report``) and the folder written (``outputs``). A run that fails, or Ctrl-C, stops only what had not
finished: the finished rows are written and the others named.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from ..gpt.data import Corpus
from ..training.train import RunResult, TrainConfig, train, train_inspected
from .learner_rows import learner_verdicts, train_with_learner
from .outputs import write_outputs
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
    that did not finish, ``interrupted`` is true); nothing was written when none had finished.

    A ``KeyboardInterrupt``, so a caller that does not know it still stops. Attributes as ``CompareFailed``'s.
    """

    def __init__(self, failed: list[dict], results: list[RunResult]):
        self.failed, self.results = failed, results
        super().__init__(f"interrupted: {len(results)} finished run(s) kept, {len(failed)} not finished")


INTERRUPTED = "interrupted before it finished"


def _error_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run_compare(recipes: list[str], corpus: Corpus, cfg: TrainConfig, out: Path, *,
                progress: bool = True, echo=print, seeds: list[int] | None = None,
                peak_flops: float | Mapping[str, float] | None = None, inspect_every: int = 0,
                learner: dict | None = None, jobs: int = 1, threads: int | None = None,
                remeasure_peak=None, autoswitch: str | None = None) -> list[RunResult]:
    """Train every recipe in ``recipes`` on ``corpus`` (once per seed in ``seeds``; default: ``cfg.seed``); print
    the table; write JSON and plot to ``out``. ``peak_flops``: the machine's peaks for the %peak column, by GEMM
    dtype key (``speed.cpu_peaks`` / ``gpu_peaks``: each row against its dtype's, ``speed.peak_key``), or one
    number for every row; ``remeasure_peak(key)``: measures a peak again when a row beat it (the better one counts;
    a row still above it prints ``100.0*``, see ``format_table``).
    ``inspect_every=N`` runs the numerics inspector on the first seed's runs and writes, per recipe,
    ``inspect-RECIPE.json`` and ``inspect-RECIPE.png`` (layer x step: fraction of the output gradients that are
    FP16 subnormals; in an FP16 run the ones that underflowed are already zeros, counted in ``zeros``), and the
    figures ``train_inspected`` names. ``autoswitch`` (e.g. "underflow=0.05"): every run of the library's rows
    moves a quantized layer to high precision once its tensors pass the threshold (``Trainer.switching``).
    ``learner``: functions loaded from exercise notebooks (``mpcourse.experiment.learner``); each recipe
    that accepts some of them gets a second row, ``"name [yours]"``, trained with them (every seed), and one
    verdict line under the table (``learner_verdicts``).
    ``jobs`` > 1: the library's rows train in that many worker processes (``mpcourse.experiment.compare.pool``); the
    learner's rows train afterwards in this process. Every run, wherever it trains, uses ``TRAINING_THREADS``
    intra-op threads (``mpcourse.experiment.training.threads``): a row's bits do not depend on ``jobs``, on the other
    recipes of the job or on the process. ``threads`` is accepted for old callers and must be that count.

    A run that fails does not stop the others: the table and ``results.json`` hold every finished row,
    ``results.json``'s ``failed`` names each failed run and why, and ``CompareFailed`` is raised after the
    files are written. Ctrl-C (``KeyboardInterrupt``, in this process or while workers train) stops the job the
    same way: the finished rows are written, the others named in ``failed`` as interrupted, and
    ``CompareInterrupted`` is raised. When no run finished nothing is written (``out`` keeps what it held).
    """
    from ..training.threads import TRAINING_THREADS, training_threads

    if threads not in (None, TRAINING_THREADS):
        raise ValueError(f"threads={threads}: every training run uses {TRAINING_THREADS} intra-op thread(s) "
                         "(mpcourse.experiment.training.threads); drop the argument")
    seeds = list(seeds) if seeds else [cfg.seed]
    pooled: dict[tuple[int, str], RunResult] = {}
    failed: dict[tuple[int, str], str] = {}
    interrupted = False
    if jobs > 1:
        from .pool import Task, run_pool
        if inspect_every:
            out.mkdir(parents=True, exist_ok=True)           # the workers' inspector files go there
        tasks = [Task(name, dataclasses.replace(cfg, seed=seed), inspect_every if seed == seeds[0] else 0, out,
                      autoswitch) for seed in seeds for name in recipes]
        errors: dict[int, str] = {}
        finished: dict[int, RunResult] = {}
        try:
            run_pool(tasks, corpus, jobs, TRAINING_THREADS, progress=progress, failures=errors, finished=finished)
        except KeyboardInterrupt:                # keep what the workers finished: written below
            interrupted = True
        for i, t in enumerate(tasks):
            if i in finished:
                pooled[t.cfg.seed, t.name] = finished[i]
            elif i in errors:
                failed[t.cfg.seed, t.name] = errors[i]
    runs: dict[int, list[RunResult]] = {}
    messages: dict[str, str] = {}
    with training_threads():
        for seed in seeds:
            if interrupted:
                runs[seed] = [pooled[seed, n] for n in recipes if (seed, n) in pooled]
                continue
            scfg = dataclasses.replace(cfg, seed=seed)
            rows = runs[seed] = []
            try:
                for name in recipes:
                    if (seed, name) in failed:
                        continue
                    try:
                        if (seed, name) in pooled:
                            rows.append(pooled[seed, name])
                        elif inspect_every and seed == seeds[0]:
                            out.mkdir(parents=True, exist_ok=True)
                            rows.append(train_inspected(name, corpus, scfg, out, inspect_every, progress,
                                                        autoswitch=autoswitch))
                        else:
                            rows.append(train(name, corpus, scfg, progress=progress, autoswitch=autoswitch))
                    except Exception as e:          # keep the other rows: this one is named in results.json
                        failed[seed, name] = _error_line(e)
                        continue
                    if learner:
                        said: list[str] = []
                        mine = train_with_learner(name, corpus, scfg, learner, progress=progress, echo=said.append)
                        if mine is not None:
                            rows.append(mine)
                        elif said:
                            messages.setdefault(name, said[0])
            except KeyboardInterrupt:               # Ctrl-C: keep the finished rows, name the others
                interrupted = True
    done = {(s, r.recipe) for s, rs in runs.items() for r in rs}
    failures = [{"recipe": name, "seed": seed, "error": failed[seed, name]}
                for seed in seeds for name in recipes if (seed, name) in failed]
    failures += [{"recipe": name, "seed": seed, "error": INTERRUPTED} for seed in seeds for name in recipes
                 if interrupted and (seed, name) not in failed and (seed, name) not in done]
    flat = [(s, r) for s, rs in runs.items() for r in rs]
    peaks = dict(peak_flops) if isinstance(peak_flops, Mapping) else peak_flops
    row_peak = settle_peaks(flat, peaks, cfg, remeasure_peak)
    if len(seeds) == 1:
        echo(format_table(runs.get(seeds[0], []), peak_flops=row_peak))
    else:
        echo(format_seed_table(runs, row_peak))
    if learner:
        for line in learner_verdicts(runs, recipes, messages):
            echo(line)
    for f in failures:
        said = "NOT FINISHED" if f["error"] == INTERRUPTED else "FAILED"
        echo(f"{said} {f['recipe']} (seed {f['seed']}): {f['error']}")
    results = [r for _, r in flat]
    if results:                      # nothing finished: write nothing, so an earlier run's files stay as they were
        extra = {"seeds": seeds, "peak_flops": peaks, "row_peak_flops": row_peak, "jobs": jobs,
                 "threads": TRAINING_THREADS, "failed": failures, "interrupted": interrupted}
        if len(seeds) > 1:
            extra["seed_summary"] = seed_summary(runs)
        write_outputs(results, corpus, cfg, out, extra=extra, seeds=[s for s, _ in flat],
                      plot_results=runs.get(seeds[0]) or results)
    if interrupted:
        raise CompareInterrupted(failures, results)
    if failures:
        raise CompareFailed(failures, results)
    return results
