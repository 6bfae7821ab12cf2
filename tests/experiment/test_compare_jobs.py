"""``mpcourse compare --jobs``: recipes trained in worker processes give the rows one process gives (same threads)."""
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.compare.pool import Task, WorkerError, default_jobs, run_pool
from mpcourse.experiment.recipes import NOT_IN_DEFAULT_RUN, default_recipes
from mpcourse.experiment.training.train import TrainConfig, Trainer

SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


@pytest.mark.parametrize("runs, cores, want", [(19, 2, (2, 1)), (1, 2, (1, 1)), (3, 8, (3, 1)), (19, 1, (1, 1))])
def test_default_jobs_one_worker_per_core_and_at_most_one_per_run(runs, cores, want):
    assert default_jobs(runs, cores) == want


def test_every_main_recipe_is_in_the_default_run():
    """The default run is the 19 rows of the published tables; the variants of a row are named beside it."""
    assert NOT_IN_DEFAULT_RUN == ("mxfp8-floor", "fp8-delayed-fp8-weights", "bf16-master-bf16-moments-sr",
                                  "fp8-moments", "int8-moments", "nvfp4-selective", "mxfp8-fwd-nvfp4-bwd",
                                  "fp8-attention", "fp8-attention-current", "moe-fp32", "moe-bf16",
                                  "moe-fp8-rowwise", "moe-fp8-block", "moe-mxfp8", "moe-bf16-router")
    assert {"fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"} <= set(default_recipes())
    assert len(default_recipes()) == 19


@pytest.mark.slow
def test_pool_rows_equal_in_process_rows_and_a_failing_worker_names_its_run():
    corpus = load_corpus()
    cfg = TrainConfig(steps=3, batch_size=2, eval_interval=2, eval_batches=1, model=SMALL)
    tasks = [Task("fp32", cfg), Task("fp8-current", dataclasses.replace(cfg, seed=1))]
    pooled = run_pool(tasks, corpus, jobs=2, threads=1, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = [Trainer(t.name, corpus, t.cfg).run().result() for t in tasks]
    finally:
        torch.set_num_threads(threads)
    for p, q in zip(pooled, local):
        assert (p.recipe, p.final_val_loss, p.final_train_loss) == (q.recipe, q.final_val_loss, q.final_train_loss)
        assert [h["loss"] for h in p.history] == [h["loss"] for h in q.history]
    # 1x128 tiles along the 2 x 16 = 32 tokens of a step: the worker's ValueError comes back, with the run's name
    bad = Task("fp8-block", dataclasses.replace(cfg, model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=128)))
    with pytest.raises(WorkerError, match=r"fp8-block \(seed 0\) failed in a worker: ValueError: .*block"):
        run_pool([bad], corpus, jobs=1, threads=1, progress=False)


def test_longest_runs_start_first_and_results_keep_the_task_order():
    from mpcourse.experiment.compare.pool import start_order
    cfg = TrainConfig(steps=10)
    tasks = [Task("fp32", cfg), Task("bf16-pure", cfg), Task("nvfp4", cfg), Task("fp8-current", cfg),
             Task("fp32", dataclasses.replace(cfg, steps=100))]
    assert start_order(tasks) == [4, 2, 3, 1, 0]          # 100 x 1.0, 10 x 5.1, 10 x 1.9, 10 x 1.3, 10 x 1.0


_LONG_JOB = """
import sys
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.compare.pool import Task, run_pool
from mpcourse.experiment.training.train import TrainConfig
cfg = TrainConfig(steps=100000, batch_size=2, eval_interval=100000, eval_batches=1,
                  model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
run_pool([Task("fp32", cfg), Task("fp32", cfg)], load_corpus(), jobs=2, progress=True)
"""


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.slow
def test_killing_the_parent_ends_its_workers():
    """SIGKILL runs no clean-up in the parent: the workers notice they are orphans and exit on their own."""
    parent = subprocess.Popen([sys.executable, "-c", _LONG_JOB], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        # both workers spawned (a worker still starting up when its parent dies checks as soon as it is up)
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            if parent.poll() is not None:
                pytest.fail(f"the job ended early (exit {parent.returncode})")
            workers = {pid for pid in _children(parent.pid) if "spawn_main" in _cmdline(pid)}
            time.sleep(0.2)
        assert len(workers) == 2, "two spawned workers"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 90          # a worker still importing torch checks once it is up
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "a worker outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
