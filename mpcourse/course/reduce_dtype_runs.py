"""Lesson 10's stored runs: FSDP2 reducing BF16 gradients in BF16 (``MixedPrecisionPolicy``'s default when
``reduce_dtype`` is unset: the parameters' dtype) against FP32, on 2 and 4 gloo ranks.

    python -m mpcourse.course.reduce_dtype_runs [--steps N] [--out FILE]    (stored: --steps 100)

trains the course's GPT with ``bf16-pure`` (BF16 parameters, so FSDP2's default reduce dtype is BF16) under
``--parallel fsdp`` for every (ranks, reduce dtype) pair, the global batch the same for every rank count, and
writes ``FILE`` (default ``notebooks/data/10/reduce-dtype.json``): per run the training losses and the final
validation loss, plus the command and settings. It is the same as running
``python -m mpcourse compare --recipes bf16-pure --parallel fsdp --nproc N --reduce-dtype bf16|fp32``.
Too slow for a notebook on a 2-core CPU (four spawned jobs), so lesson 10 loads the file.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "notebooks" / "data" / "10" / "reduce-dtype.json"
RANKS = (2, 4)
DTYPES = ("bf16", "fp32")
SETTINGS = dict(steps=150, batch_size=16, eval_interval=50, eval_batches=4, lr=3e-4,
                model=dict(n_layer=2, n_embd=64, block_size=32))


def produce(steps: int) -> dict:
    """Train every (ranks, reduce dtype) run of ``steps`` steps; the strict-JSON payload."""
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.parallel.distributed import Job, run_distributed_compare
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.recipes import OptimConfig
    from mpcourse.experiment.training.train import TrainConfig

    s = SETTINGS
    cfg = TrainConfig(steps=steps, batch_size=s["batch_size"], eval_interval=s["eval_interval"],
                      eval_batches=s["eval_batches"], optim=OptimConfig(lr=s["lr"]), model=GPTConfig(**s["model"]))
    corpus = load_corpus(None)
    runs = []
    for nproc in RANKS:
        for dtype in DTYPES:
            with tempfile.TemporaryDirectory() as d:
                job = Job(["bf16-pure"], corpus, cfg, Path(d), parallel="fsdp", reduce_dtype=dtype, quiet=True)
                (r,) = run_distributed_compare(job, nproc)
            runs.append({"nproc": nproc, "reduce_dtype": dtype, "losses": [h["loss"] for h in r["history"]],
                         "final_val_loss": r["final_val_loss"]})
            print(f"{nproc} ranks, reduce in {dtype}: final val {r['final_val_loss']:.4f}", file=sys.stderr)
    return {"command": f"python -m mpcourse.course.reduce_dtype_runs --steps {steps}", "recipe": "bf16-pure",
            "parallel": "fsdp", "settings": {**s, "steps": steps}, "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.course.reduce_dtype_runs", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=SETTINGS["steps"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    payload = produce(a.steps)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
