"""Training runs a lesson shows but does not train itself: each is too long for the one-minute budget of a
notebook on a 2-core CPU, so a repo command trains it once and the lesson loads what it wrote.

    python -m mpcourse.course.stored_runs NAME [--steps N] [--recipes a,b] [--out DIR]

writes ``DIR/NAME.json`` (default ``DIR``: the lesson's folder under ``notebooks/data/``), the object
``mpcourse compare`` writes as ``results.json`` (``mpcourse.experiment.compare.outputs.results_payload``: config,
environment, one ``RunResult`` per recipe with its per-step history), plus the command that produced it and
the thread count. NAME is one of ``RUNS``:

    bf16-recipes   lesson 06: fp32 and the five BF16 recipes, 120 steps of a 2-layer GPT at lr 3e-4
    moe-router     lesson 13: the MoE GPT (4 experts, top-2) with its router in FP32 and in BF16, 60 steps of a
                   2-layer, width-128 model (each step's tokens per expert; the BF16 router's flipped decisions)

The lesson prints the command next to the numbers. ``tests/course/test_stored_runs.py`` re-runs the command on a
short setting and checks its first steps against the stored ones (the warm-up's learning rate does not
depend on the run's length, so a short run's first steps are the long run's).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StoredRun:
    """One stored run: its recipes and training settings (``TrainConfig`` fields; the model a ``GPTConfig``)."""

    lesson: str
    recipes: tuple[str, ...]
    steps: int
    batch_size: int
    eval_interval: int
    eval_batches: int
    lr: float
    model: dict
    threads: int = 2            # what the lesson's kernel uses (torch.set_num_threads(2))

    def train_config(self, steps: int | None = None):
        from mpcourse.experiment.gpt.model import GPTConfig
        from mpcourse.experiment.recipes import OptimConfig
        from mpcourse.experiment.training.train import TrainConfig

        return TrainConfig(steps=steps or self.steps, batch_size=self.batch_size, eval_interval=self.eval_interval,
                           eval_batches=self.eval_batches, optim=OptimConfig(lr=self.lr),
                           model=GPTConfig(**self.model))


RUNS = {
    "bf16-recipes": StoredRun(
        lesson="06", recipes=("fp32", "bf16-autocast", "bf16-master", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan"),
        steps=120, batch_size=16, eval_interval=40, eval_batches=4, lr=3e-4,
        model=dict(n_layer=2, n_embd=64, block_size=32)),
    "moe-router": StoredRun(
        lesson="13", recipes=("moe-fp32", "moe-bf16-router"),
        steps=60, batch_size=8, eval_interval=30, eval_batches=2, lr=3e-3,
        model=dict(n_layer=2, n_embd=128, block_size=64)),
}


def default_path(name: str) -> Path:
    """Where lesson ``RUNS[name].lesson`` loads run ``name`` from: ``notebooks/data/LESSON/NAME.json``."""
    return ROOT / "notebooks" / "data" / RUNS[name].lesson / f"{name}.json"


def produce(name: str, steps: int | None = None, recipes: tuple[str, ...] | None = None) -> dict:
    """Train run ``name`` (``steps``/``recipes`` shorten it) on ``threads`` threads with tensor-core emulation on,
    as the lesson's kernel runs (emulation is left on auto after); the strict-JSON payload."""
    from mpcourse.core import emulation
    from mpcourse.experiment.compare.outputs import results_payload
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.training.train import train

    spec = RUNS[name]
    recipes = tuple(recipes or spec.recipes)
    unknown = [r for r in recipes if r not in spec.recipes]
    if unknown:
        raise ValueError(f"{name} stores the recipes {', '.join(spec.recipes)}; not {', '.join(unknown)}")
    corpus = load_corpus()
    cfg = spec.train_config(steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    emulation.set_emulation(True)
    command = f"python -m mpcourse.course.stored_runs {name}"
    if steps:
        command += f" --steps {steps}"
    if recipes != spec.recipes:
        command += f" --recipes {','.join(recipes)}"
    extra = {"stored_run": name, "lesson": spec.lesson, "command": command, "threads": spec.threads,
             "eval_interval": spec.eval_interval, "eval_batches": spec.eval_batches}
    try:
        results = [train(r, corpus, cfg, progress=False) for r in recipes]
        return results_payload(results, corpus, cfg, extra)   # its environment says emulation was on: it was
    finally:
        emulation.set_emulation(None)                     # back to auto (MPCOURSE_EMULATE, else the CPU's units)
        torch.set_num_threads(threads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.course.stored_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(RUNS))
    p.add_argument("--steps", type=int, default=None, help="train this many steps instead (a check, not the lesson's run)")
    p.add_argument("--recipes", default=None, help="comma-separated subset of the run's recipes")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the lesson's notebooks/data/NN)")
    a = p.parse_args(argv)
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps must be a positive integer, got {a.steps}")
    recipes = tuple(a.recipes.split(",")) if a.recipes else None
    t0 = time.perf_counter()
    try:
        payload = produce(a.name, a.steps, recipes)
    except ValueError as e:
        p.error(str(e))
    path = default_path(a.name) if a.out is None else a.out / f"{a.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path.name} ({len(payload['results'])} runs, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
