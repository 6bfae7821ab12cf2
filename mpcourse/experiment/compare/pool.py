"""``mpcourse compare --jobs N``: train the recipes in N worker processes at once, one intra-op thread each.

A small GPT's step does not keep two cores busy: on a 2-core CPU two 1-thread processes train about 1.45x as
many steps per second as one 2-thread process (measured with ``benchmarks/bench_block_recipes.py``). So the
job runs each (recipe, seed) in a pool of ``jobs`` processes (``concurrent.futures.ProcessPoolExecutor``,
spawned, not forked: a forked child of a process that already ran OpenMP threads can hang), one per core
(``default_jobs``), each worker on ``TRAINING_THREADS`` (one) intra-op thread. What a run computes does not
depend on which worker runs it or when: every run seeds its own model, batches and torch's global generator
(``Trainer``), and every run, in a worker or in the parent, trains on the same thread count
(``mpcourse.experiment.training.threads``: the reduction order of a GEMM follows the thread count), so a row's bits do
not depend on ``--jobs`` or on the other recipes of the job. tok/s is one worker's speed on one thread while
the other workers run too.

Order: the runs start longest first (``STEP_COST``, each recipe's step time over the FP32 step, measured with
``benchmarks/bench_block_recipes.py`` on a 2-core AVX2 CPU; a scheduling hint only, so a stale number costs
time, never a result): started last, the slowest run (``nvfp4``, about 7 FP32 steps a step) would train alone
while the other workers sit idle. The results come back in the order of the tasks.

Progress: the workers report every step through a queue and the parent draws one bar over all steps
(per-process bars would overwrite each other); a run that diverges stops early and its steps not run are
counted as done, so a finished job's bar ends at 100%. A worker that raises ends the job with ``WorkerError``,
naming the run and carrying the worker's message; with ``failures=`` the other runs go on and the failed one is
named there (``mpcourse compare`` keeps every finished row).

Interruption: Ctrl-C or a failed run terminates the runs in flight instead of waiting for them, and each worker
watches its parent and exits when the parent is gone (a parent killed outright runs no clean-up of its own), so
stopping a job leaves no training process behind. The runs that had come back are kept (``finished=``), and
``mpcourse compare`` writes them.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from ..gpt.data import Corpus
from ..training.threads import TRAINING_THREADS
from ..training.train import RunResult, TrainConfig


# step time over the FP32 step (benchmarks/bench_block_recipes.py, one interleaved 1-thread run, after the FP8 and
# tensor-core emulation fast paths); others (the emulated BF16/FP16 recipes): 1.3
STEP_COST = {"fp32": 1.0, "nvfp4": 5.1, "fp8-rowwise": 2.5, "mxfp8": 2.4, "mxfp8-floor": 2.4, "fp8-block": 2.3,
             "fp8-current": 1.9, "fp8-delayed": 1.8, "fp8-delayed-fp8-weights": 1.8}


def start_order(tasks: list["Task"]) -> list[int]:
    """Indices of ``tasks``, the longest expected run first (steps x ``STEP_COST``); ties keep their order."""
    return sorted(range(len(tasks)), key=lambda i: -tasks[i].cfg.steps * STEP_COST.get(tasks[i].name, 1.3))


class WorkerError(RuntimeError):
    """A run failed in a worker process; the message names the run and repeats the worker's error."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


def default_jobs(n_runs: int, cores: Optional[int] = None) -> tuple[int, int]:
    """(jobs, threads per job) for ``n_runs`` runs: one single-threaded worker per core, at most one per run
    (e.g. 8 cores, 3 runs: 3 workers x 1 thread). The cores left over stay idle: a run's bits depend on its
    thread count, so every run trains on ``TRAINING_THREADS`` (``mpcourse.experiment.training.threads``)."""
    cores = usable_cores() if cores is None else cores
    jobs = max(1, min(cores, n_runs))
    return jobs, TRAINING_THREADS


@dataclass(frozen=True)
class Task:
    """One run: recipe ``name`` under ``cfg`` (its seed included); ``inspect_every`` > 0 also writes the
    numerics inspector's files into ``out``; ``autoswitch``: a spec such as "underflow=0.05" (``Trainer.switching``)."""

    name: str
    cfg: TrainConfig
    inspect_every: int = 0
    out: Optional[Path] = None
    autoswitch: Optional[str] = None


_progress: Optional[mp.Queue] = None


def _exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Run in a worker's daemon thread: end the worker once its parent is gone (killed, even by SIGKILL, which
    runs no clean-up in the parent), so an interrupted ``mpcourse compare`` leaves no training process behind."""
    import time

    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


def _init_worker(threads: int, progress, parent_pid: Optional[int] = None) -> None:
    global _progress
    import threading

    import torch

    torch.set_num_threads(threads)
    _progress = progress
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _run_task(task: Task, corpus: Corpus) -> RunResult:
    from ..training.train import Trainer, train_inspected

    def tick(_trainer):
        if _progress is not None:
            _progress.put(1)

    if task.inspect_every:
        return train_inspected(task.name, corpus, task.cfg, task.out, task.inspect_every, False, on_step=tick,
                               autoswitch=task.autoswitch)
    return Trainer(task.name, corpus, task.cfg, autoswitch=task.autoswitch).run(on_step=tick).result()


def run_pool(tasks: list[Task], corpus: Corpus, jobs: int, threads: int = TRAINING_THREADS, *, progress: bool = True,
             failures: Optional[dict[int, str]] = None,
             finished: Optional[dict[int, RunResult]] = None) -> list[Optional[RunResult]]:
    """Run ``tasks`` in ``jobs`` spawned workers of ``threads`` threads each (default ``TRAINING_THREADS``, the
    count every training run uses: ``mpcourse.experiment.training.threads``); results in the order of ``tasks``.

    A run that fails raises ``WorkerError`` (the other runs are cancelled); with ``failures`` (a dict) the
    other runs go on instead, the failed task's index maps to ``"ExceptionType: message"`` there, and its
    result is None. ``finished`` (a dict), filled as the runs come back (task index -> result), still holds them
    when the job stops early (Ctrl-C raises ``KeyboardInterrupt`` out of here after the runs in flight are
    stopped): ``mpcourse compare`` keeps those rows."""
    ctx = mp.get_context("spawn")
    ticks = ctx.Queue()
    results: dict[int, RunResult] = finished if finished is not None else {}
    bar = tqdm(total=sum(t.cfg.steps for t in tasks), disable=not progress, dynamic_ncols=True,
               desc=f"{len(tasks)} runs, {jobs} jobs x {threads} threads")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads, ticks, os.getpid())) as pool:
        futures = {pool.submit(_run_task, tasks[i], corpus): i for i in start_order(tasks)}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(ticks, bar)
                for f in done:
                    i = futures[f]
                    try:
                        results[i] = f.result()
                    except Exception as e:   # the worker's exception, re-raised here by the executor
                        if failures is None:
                            raise WorkerError(f"{tasks[i].name} (seed {tasks[i].cfg.seed}) failed in a worker: "
                                              f"{type(e).__name__}: {e}") from e
                        failures[i] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        bar.write(f"{tasks[i].name:>16} FAILED: {failures[i]}")
                        continue
                    # a run that diverged stops early: its steps not run are counted as done, so the bar
                    # ends at 100% (the run is finished; the table says where it diverged)
                    bar.update(max(0, tasks[i].cfg.steps - results[i].steps_run))
                    bar.write(f"{tasks[i].name:>16} done: val {results[i].final_val_loss:.3f}")
            _drain(ticks, bar)
            bar.update(bar.total - bar.n)   # every run is over: ticks still in the queue's pipe count as done
        except BaseException:
            # Ctrl-C or a failed run: cancel what has not started and stop the runs in flight now, rather than
            # wait for them (leaving the ``with`` block waits for every running task)
            for f in pending:
                f.cancel()
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            raise
        finally:
            _drain(ticks, bar)
            bar.close()
    return [results.get(i) for i in range(len(tasks))]


def _drain(ticks, bar) -> None:
    n = 0
    while True:
        try:
            n += ticks.get_nowait()
        except queue_mod.Empty:
            break
    n = min(n, bar.total - bar.n)       # a late tick of a run already counted in full never passes 100%
    if n > 0:
        bar.update(n)
