"""``mpcourse compare --nproc N --parallel ddp|fsdp|ep``: every recipe trained data-parallel over N processes (ep:
the MoE recipes with their experts split over the processes, ``expert_parallel``).

The global batch equals the single-process one: every rank draws the same batch of ``batch_size`` sequences
(the same seeded generator as ``Trainer``) and trains on its slice of ``batch_size / N`` rows, so the
gradient, once averaged over the ranks, is that of the whole batch and the losses are comparable with the
single-process table (up to the order of the additions: see ``tests/experiment/parallel/test_distributed.py`` for the measured
tolerance). The reported loss of a step is the mean over the ranks of their slice means, the whole batch's.
Evaluation runs on every rank on the full evaluation batches (the same as single-process).

Launch: ``run_distributed_compare`` spawns N gloo processes on this machine (rendezvous through a file in a
fresh temporary directory, ``rendezvous``), or, under ``torchrun --nproc-per-node N -m mpcourse compare ...``, runs as the
rank torchrun started (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment). Rank 0
prints the table and writes the files. Failure: a rank that raises ends; the launcher (this module's
``spawn`` or torchrun's agent) sees it exit and terminates the others at once, and the error names that
rank and its message; under ``spawn`` the rows rank 0 had finished are kept (it writes them to a file as it
goes) and written with the failed recipe named; the process groups' ``timeout`` (default 120 s) bounds any
collective that would wait for a rank that is gone. Parallel modes and what they do to each recipe: ``mpcourse.experiment.parallel.data_parallel``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import socket
import sys
import tempfile
import time
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .launcher import launched_by_torchrun
from .data_parallel import PARALLEL_MODES, REDUCE_DTYPES, overridable, shard_recipe, unsupported, wrap_ddp
from ..training.train import Trainer, TrainConfig

DEFAULT_TIMEOUT_S = 120.0


class RankFailed(RuntimeError):
    """A rank of a distributed job raised; ``rank`` and the rank's ``message`` (its exception's last line); from
    ``run_distributed_compare``'s spawned ranks also the rows that had finished (``results``, written) and the
    recipes that did not (``failed``)."""

    def __init__(self, rank: int, message: str, traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.message, self.traceback = rank, message, traceback
        self.results: list = []        # the rows rank 0 had finished (``run_distributed_compare`` fills them in)
        self.failed: list = []         # ``[{"recipe", "seed", "error"}]``: the recipes that did not finish


class DataParallelTrainer(Trainer):
    """``Trainer`` for one rank of a data-parallel job (torch.distributed must be initialized).

    Args (beyond ``Trainer``'s):
        parallel: "ddp", "fsdp" (``mpcourse.experiment.parallel.data_parallel``) or "ep" (the MoE recipes' experts
            split over the ranks, ``mpcourse.experiment.parallel.expert_parallel``).
        reduce_dtype: dtype gradients are reduced in (None: DDP reduces in the gradients' dtype; FSDP2 in FP32
            for the master-weights recipes, in the parameters' dtype otherwise).
        dispatch, timeout_s: under "ep", the dispatch mode (``core.experts.dispatch``) and the experts' process
            group's timeout.
    Raises ValueError if ``cfg.batch_size`` is not a multiple of the world size, or the recipe cannot run
    under ``parallel``.
    """

    def __init__(self, recipe, corpus, cfg: TrainConfig, parallel: str = "ddp",
                 reduce_dtype: torch.dtype | None = None, fp8_all_gather: bool = False, dispatch: str = "fp8",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if not dist.is_initialized():
            raise RuntimeError("DataParallelTrainer needs torch.distributed initialized (run it through "
                               "mpcourse compare --nproc N or torchrun)")
        name = recipe if isinstance(recipe, str) else recipe.name
        why = unsupported(name, parallel)
        if why:
            raise ValueError(f"recipe {name!r} cannot run under --parallel {parallel}: {why}")
        if fp8_all_gather and parallel != "fsdp":
            raise ValueError("--fp8-all-gather needs --parallel fsdp (DDP gathers no parameters)")
        self.parallel, self.reduce_dtype, self.fp8_all_gather = parallel, reduce_dtype, fp8_all_gather
        self.dispatch, self.timeout_s = dispatch, timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {self.world} ranks: each rank "
                             f"trains on batch_size / nproc sequences; pick a multiple of {self.world}")
        super().__init__(recipe, corpus, cfg)

    def build_recipe(self, recipe_cls, model):
        if self.parallel == "ep":
            from .expert_parallel import expert_parallel_recipe
            recipe, self.wrapped = expert_parallel_recipe(self, recipe_cls, model)
        elif self.parallel == "ddp":
            recipe = recipe_cls(model, self.cfg.optim)
            self.wrapped = wrap_ddp(recipe.model, self.reduce_dtype)    # grads all-reduced in backward
            master = getattr(recipe, "master", None)
            if master is not None:    # DDP's init broadcast wrote the (identical) params: not a model-only load
                master._record_versions()
        else:
            recipe = shard_recipe(recipe_cls, model, self.cfg.optim, self.reduce_dtype, self.fp8_all_gather)
            self.wrapped = recipe.model                                  # the sharded module itself
        return recipe

    def forward_loss(self, x, y):
        b = x.shape[0] // self.world                                     # rows per rank
        rows = slice(self.rank * b, (self.rank + 1) * b)
        return self.wrapped(x[rows], y[rows])[1]                         # fp32 (), mean over this rank's rows

    def loss_value(self, loss):
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)                                               # sum of the slice means
        return float(t) / self.world                                     # the whole batch's mean

    def all_gather_bytes(self) -> dict | None:
        """FSDP2: bytes this rank sent into all-gathers per training step (``parallel.AllGatherLog.per_step``)."""
        log = getattr(self.recipe, "all_gather_log", None)
        return None if log is None else log.per_step(len(self.history))

    def dispatch_bytes(self) -> list | None:
        """``--parallel ep``: every rank's all-to-all bytes per training step (a collective); None otherwise."""
        if self.parallel != "ep":
            return None
        from .expert_parallel import gather_dispatch_bytes
        return gather_dispatch_bytes(self.dispatch_log, len(self.history), self.group)

    def save(self, path) -> Path:
        """Write a ``torch.distributed.checkpoint`` directory at ``path`` (every rank, between steps): sharded
        state under FSDP2, the scaler's and FP8 state included (``mpcourse.experiment.parallel.dist_checkpoint``).
        Not for a ``fp8_all_gather`` run (its weights are tensor subclasses; never saved): ValueError."""
        if self.fp8_all_gather:
            raise ValueError("checkpoints of an --fp8-all-gather run are not supported: train without the flag "
                             "(the same losses, bit for bit) to save")
        from . import dist_checkpoint
        return dist_checkpoint.save(self, path)

    def load(self, path) -> "DataParallelTrainer":
        """Resume from ``save``'s directory, bit for bit, on the same number of ranks, mode and recipe
        (anything else: ``CheckpointError`` naming the mismatch, before anything is read)."""
        from . import dist_checkpoint
        return dist_checkpoint.load(self, path)


@dataclass
class Job:
    """What every rank runs: the recipes, the corpus, the config and where rank 0 writes."""

    recipes: list
    corpus: object
    cfg: TrainConfig
    out: Path
    parallel: str = "ddp"
    reduce_dtype: str | None = None
    fp8_all_gather: bool = False       # --fp8-all-gather: the FP8 layers' weights all-gathered in FP8 (fsdp only)
    progress: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    fail_rank: int | None = None       # testing: this rank raises at the start of a recipe (a failing rank) ...
    fail_recipe: str | None = None     # ... of this one (None: the first)
    rows_file: str | None = None       # rank 0 keeps its finished rows here as it goes (``kept_rows``)
    learner_notebooks: tuple = ()      # --with: every rank loads these notebooks' functions (learner.load_functions)
    learner_sources: dict = field(default_factory=dict)   # or name -> source of a learner's function
    quiet: bool = False                # rank 0 neither prints nor writes (train_yours reads the results)
    messages: list = field(default_factory=list)          # filled by run_rank: one line per failed [yours] row
    all_gather_bytes: dict = field(default_factory=dict)  # filled by run_rank: row -> AllGatherLog.per_step (fsdp)
    dispatch: str = "fp8"              # --dispatch: the experts' all-to-all wires under --parallel ep
    dispatch_bytes: dict = field(default_factory=dict)    # filled by run_rank: row -> each rank's bytes (ep)


def all_gather_lines(gathered: dict) -> list[str]:
    """One line per FSDP2 row: the bytes this rank sent into all-gathers per training step, measured, and the
    same elements as an FP32 and a BF16 all-gather (``parallel.AllGatherLog.per_step``)."""
    lines = []
    for name, b in gathered.items():
        extra = f" + {b['amax_all_reduce']:,.0f} B amax all-reduce" if b["amax_all_reduce"] else ""
        lines.append(f"{name}: all-gather per rank per step {b['sent']:,.0f} B sent ({'+'.join(b['dtypes'])}){extra}; "
                     f"the same parameters as FP32 {b['fp32']:,.0f} B, as BF16 {b['bf16']:,.0f} B")
    return lines


def load_learner(job: Job) -> dict:
    """What ``job``'s notebooks, then its sources, define, loaded in this process (each rank loads them: a
    notebook's functions cannot be pickled); ``_run_yours`` takes a recipe's from it."""
    from ..learner import functions_from_sources, load_functions

    functions = {}
    for nb in job.learner_notebooks:
        functions.update(load_functions(nb))
    functions.update(functions_from_sources(job.learner_sources))
    return functions


def _run_yours(job: Job, name: str, functions: dict, reduce_dtype, rank: int):
    """The row ``NAME [yours]`` under ``job.parallel`` with the learner's functions, or None after a line in
    ``job.messages``. Every rank calls the functions at the same points, so a failing one fails on every rank."""
    from mpcourse.core.learner_table import OverrideError, OverrideRefused, learner_functions
    from mpcourse.core.seams import SeamError
    from ..compare.learner_rows import yours
    from ..recipes import get_recipe

    recipe = get_recipe(name)
    mine = learner_functions(functions, overridable(recipe, job.parallel))
    if not mine:
        return None
    try:
        trainer = DataParallelTrainer(recipe.with_functions(mine), job.corpus, job.cfg, job.parallel, reduce_dtype,
                                      fp8_all_gather=job.fp8_all_gather)
        trainer.name = yours(name)
        trainer.run(progress=job.progress and rank == 0)
        job.all_gather_bytes[trainer.name] = trainer.all_gather_bytes()
        return trainer.result()
    except (OverrideRefused, OverrideError, SeamError) as e:
        job.messages.append(f"{yours(name)}: {e}")
    return None


def run_rank(job: Job) -> list | None:
    """One rank's part of a compare job (the process group is initialized). Rank 0 prints the table, writes
    ``results.json`` and ``loss_curves.png`` and returns the results; other ranks return None. With
    ``job.rows_file``, rank 0 keeps its finished rows there as it goes (``kept_rows``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reduce_dtype = REDUCE_DTYPES[job.reduce_dtype] if job.reduce_dtype else None
    results, not_run = [], {}
    functions = load_learner(job) if (job.learner_notebooks or job.learner_sources) else {}
    for name in job.recipes:
        why = unsupported(name, job.parallel)
        if why:
            not_run[name] = why
            continue
        if rank == 0:
            _keep_rows(job, results, not_run, name)
        trainer = DataParallelTrainer(name, job.corpus, job.cfg, job.parallel, reduce_dtype,
                                      fp8_all_gather=job.fp8_all_gather, dispatch=job.dispatch,
                                      timeout_s=job.timeout_s)
        if job.fail_rank == rank and job.fail_recipe in (None, name):
            raise RuntimeError(f"planted failure on rank {rank} (fail_rank={rank}) at time {time.time():.3f}")
        trainer.run(progress=job.progress and rank == 0)
        results.append(trainer.result())
        job.all_gather_bytes[name] = trainer.all_gather_bytes()
        if job.parallel == "ep":
            job.dispatch_bytes[name] = trainer.dispatch_bytes()
        mine = _run_yours(job, name, functions, reduce_dtype, rank) if functions else None
        if mine is not None:
            results.append(mine)
    if rank != 0:
        return None
    _keep_rows(job, results, not_run, None)
    if not job.quiet:
        report_rows(job, results, not_run, world)
    return results


def report_rows(job: Job, results: list, not_run: dict, world: int, failed: list | None = None) -> None:
    """Print the table of ``results`` (``RunResult``), the recipes not run and why, the all-gather and ``[yours]``
    lines, and write ``results.json`` and ``loss_curves.png`` into ``job.out`` (nothing when no row finished);
    ``failed``: ``[{"recipe", "seed", "error"}]``, the runs that did not finish, as ``mpcourse compare`` names them."""
    from ..compare.outputs import write_outputs
    from ..compare.report import format_table

    print(format_table(results))
    for name, why in not_run.items():
        print(f"{name}: not run under --parallel {job.parallel}: {why}")
    gathered = {n: b for n, b in job.all_gather_bytes.items() if b is not None}
    for line in all_gather_lines(gathered):
        print(line)
    if job.parallel == "ep":
        from .expert_parallel import dispatch_lines
        print("\n".join(dispatch_lines(job.dispatch, job.dispatch_bytes)))
    for line in job.messages:
        print(line)
    for f in failed or []:
        print(f"FAILED {f['recipe']} (seed {f['seed']}): {f['error']}")
    if not results:                                  # every recipe asked for was refused: nothing to write or plot
        return
    extra = {"parallel": {"mode": job.parallel, "nproc": world, "reduce_dtype": job.reduce_dtype,
                          "bytes_per_param": "per rank", "not_run": not_run, "fp8_all_gather": job.fp8_all_gather,
                          "all_gather_bytes_per_rank_per_step": gathered},
             "failed": list(failed or [])}
    if job.parallel == "ep":
        extra["parallel"].update(dispatch=job.dispatch, dispatch_bytes_per_rank_per_step=job.dispatch_bytes)
    write_outputs(results, job.corpus, job.cfg, job.out, extra=extra)


def _keep_rows(job: Job, results: list, not_run: dict, current: str | None) -> None:
    """Rank 0: write what ``kept_rows`` reads back into ``job.rows_file`` (nothing without one): the finished rows,
    the recipes not run, the lines said so far and the recipe now training (None: every one is done)."""
    if not job.rows_file:
        return
    kept = {"results": [r.to_dict() for r in results], "not_run": dict(not_run), "current": current,
            "messages": list(job.messages), "all_gather_bytes": dict(job.all_gather_bytes),
            "dispatch_bytes": dict(job.dispatch_bytes)}
    torch.save(kept, job.rows_file + ".tmp")
    os.replace(job.rows_file + ".tmp", job.rows_file)          # whole or not at all, if the rank is killed


def kept_rows(path: str) -> dict | None:
    """What rank 0 kept in ``path`` (``_keep_rows``), the rows as ``RunResult``; None if it kept nothing."""
    from ..training.train import RunResult

    if not os.path.exists(path):
        return None
    kept = torch.load(path, weights_only=False)
    kept["results"] = [RunResult(**d) for d in kept["results"]]
    return kept


def free_port() -> int:
    """A TCP port on the loopback interface that is free now, and may be taken by another process before anyone
    binds it (the port is released on return): do not use it for a rendezvous, use ``rendezvous`` instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The process groups' timeout for ranks spawned on one machine by the course, its tests and its demos: a
#: loaded machine (a test suite beside other jobs) can start the ranks' Python tens of seconds apart.
RANK_TIMEOUT_S = 300.0


def rendezvous(directory: str) -> str:
    """The ``init_method`` for ranks spawned on this machine: ``file://`` + a new file in ``directory`` (a
    fresh temporary directory the caller removes after the ranks end).

    Why not TCP on a free port: a port found free (``free_port``) is released before rank 0's store binds it,
    and another process (a parallel test run, another job) can take it in between; its ranks then fail to
    bind, or connect to the other job's store. A file that no other job knows cannot be taken
    (torch.distributed's ``FileStore``: the ranks meet through the file, no port and no server)."""
    return "file://" + os.path.join(os.path.abspath(directory), f"rendezvous-{uuid.uuid4().hex}")


def init_ranks(rank: int, world_size: int, init_method: str, timeout_s: float = RANK_TIMEOUT_S,
               threads: int | None = None) -> None:
    """``dist.init_process_group("gloo", ...)`` for a rank started by ``spawn`` (``init_method`` from
    ``rendezvous``); ``threads``: torch's intra-op threads of this rank (None: leave them)."""
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def close_ranks() -> None:
    """End a rank's process group cleanly, on the path where the rank succeeded: wait for every rank (a
    barrier, so no rank tears its connections down while another still talks to it), drop the references
    to the group that cycles may keep (a DDP/FSDP module, a loss scaler), then ``destroy_process_group``.

    Not on the error path: a rank that raised must exit at once (``spawn`` then ends the others); a barrier
    there would wait for ranks that are waiting in another collective. A rank that ends without it leaves
    gloo's threads to the interpreter's shutdown, which can abort the process ("terminate called without an
    active exception", SIGABRT)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def ranks(rank: int, world_size: int, init_method: str, timeout_s: float = RANK_TIMEOUT_S,
          threads: int | None = None):
    """``with ranks(rank, world, init_method): ...``: ``init_ranks`` on entry; ``close_ranks`` when the body
    ends normally, nothing when it raises (the error propagates and the rank exits)."""
    init_ranks(rank, world_size, init_method, timeout_s, threads)
    yield
    close_ranks()


def _threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def _spawned_rank(rank: int, nproc: int, init_method: str, job: Job, result_dir: str) -> None:
    init_ranks(rank, nproc, init_method, job.timeout_s, threads=_threads_per_rank(nproc))
    results = run_rank(job)   # on an exception: no close_ranks, which would wait for the other ranks
    if results is not None:
        torch.save([r.to_dict() for r in results], os.path.join(result_dir, "results.pt"))
        with open(os.path.join(result_dir, "messages.json"), "w") as f:
            json.dump(job.messages, f)
    close_ranks()


def _start_method() -> str:
    """"forkserver" where the platform has it: the ranks fork from one server process that imported torch once,
    so a job's ranks start in about a second instead of each importing torch anew (as "spawn" does: several
    seconds per rank on a 2-core CPU). Like "spawn", each rank starts clean (no state of this process, no
    threads), and ``fn`` must be importable."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"                                     # Windows
    multiprocessing.set_forkserver_preload(["torch", __name__])   # takes effect when the server first starts
    return "forkserver"


def spawn(fn, nproc: int, args: tuple = (), *, poll_s: float = 0.2) -> None:
    """Run ``fn(rank, *args)`` in ``nproc`` fresh processes (see ``_start_method``; ``fn`` must be importable)
    and wait.

    The first rank to fail makes the others be terminated within ``poll_s`` seconds
    (``torch.multiprocessing``'s process context), and raises ``RankFailed`` with that rank's message.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nproc, join=False, start_method=_start_method())
    try:
        while not ctx.join(timeout=poll_s):
            pass
    except mp.ProcessRaisedException as e:
        tb = str(e)
        last = [line for line in tb.strip().splitlines() if line.strip()][-1]
        raise RankFailed(e.error_index, last, tb) from None
    except mp.ProcessExitedException as e:
        raise RankFailed(e.error_index, f"exited with code {e.exit_code}" if e.exit_code is not None
                         else f"killed by signal {e.signal_name}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def run_distributed_compare(job: Job, nproc: int) -> list | None:
    """Run ``job`` over ``nproc`` ranks: spawned here, or as this process's rank under torchrun (then
    ``nproc`` must equal ``WORLD_SIZE``). Returns rank 0's results (``RunResult`` dicts), None on other ranks;
    rank 0's ``job.messages`` (failed ``[yours]`` rows) are copied into ``job.messages`` here.
    Raises RankFailed when a rank fails, ValueError for a bad mode."""
    if job.parallel not in PARALLEL_MODES:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, got {job.parallel!r}")
    if job.reduce_dtype is not None and job.reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"--reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got {job.reduce_dtype!r}")
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (1, world):
            raise ValueError(f"--nproc {nproc} but torchrun started {world} processes: drop --nproc under torchrun "
                             "or make them equal")
        torch.set_num_threads(_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job.timeout_s))
        try:
            results = run_rank(job)
            return None if results is None else [r.to_dict() for r in results]
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as d:
        kept = dataclasses.replace(job, rows_file=os.path.join(d, "rows.pt"))     # job's lists, shared
        try:
            spawn(_spawned_rank, nproc, (nproc, rendezvous(d), kept, d))
        except RankFailed as e:
            _write_what_finished(kept, e, nproc)
            raise
        path, messages = os.path.join(d, "results.pt"), os.path.join(d, "messages.json")
        if os.path.exists(messages):
            with open(messages) as f:
                job.messages[:] = json.load(f)
        return torch.load(path, weights_only=False) if os.path.exists(path) else []


def _write_what_finished(job: Job, e: RankFailed, nproc: int) -> None:
    """After a rank failed: the rows rank 0 had finished (``kept_rows``) go into ``e.results`` and, unless
    ``job.quiet``, into the table and ``results.json`` (``report_rows``), whose ``failed`` names the recipe that was
    training and those never started; nothing is written when no row had finished."""
    kept = kept_rows(job.rows_file) if job.rows_file else None
    if not kept or not kept["results"]:
        return
    job.messages[:] = kept["messages"]
    job.all_gather_bytes.update(kept["all_gather_bytes"])
    job.dispatch_bytes.update(kept["dispatch_bytes"])
    e.results = kept["results"]
    done = {r.recipe for r in e.results} | set(kept["not_run"])
    left = [n for n in job.recipes if n not in done]
    e.failed = [{"recipe": n, "seed": job.cfg.seed,
                 "error": f"rank {e.rank} failed: {e.message}" if n == kept["current"] else
                 f"not run: the job stopped when rank {e.rank} failed"} for n in left]
    if not job.quiet:
        report_rows(job, e.results, kept["not_run"], nproc, e.failed)


def is_rank_zero() -> bool:
    """True unless this process is a non-zero rank started by torchrun (for printing once)."""
    return int(os.environ.get("RANK", "0")) == 0 if launched_by_torchrun() else True


__all__ = ["DataParallelTrainer", "Job", "RankFailed", "run_distributed_compare", "run_rank", "spawn",
           "is_rank_zero", "launched_by_torchrun", "DEFAULT_TIMEOUT_S", "RANK_TIMEOUT_S", "rendezvous",
           "init_ranks", "close_ranks", "ranks"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m mpcourse compare --nproc N --parallel ddp|fsdp")
