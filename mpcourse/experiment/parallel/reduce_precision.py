"""Does reducing gradients in BF16 instead of FP32 change the losses? The same FSDP2 run twice, on N gloo ranks.

``python -m mpcourse.experiment.parallel.reduce_precision --nproc 4 --steps 40 --out notebooks/data/10/reduce-dtype-fp32-params.json``

Both runs train the ``fp32`` recipe (everything FP32, so the only difference is the reduction) under FSDP2, with
``MixedPrecisionPolicy(reduce_dtype=float32)`` and ``reduce_dtype=bfloat16`` (torch.distributed.fsdp docs):
each rank's gradient is cast to BF16 before the reduce-scatter, summed in BF16 over the ranks and cast back
onto the FP32 shard. With N ranks each element of the mean gradient carries the BF16 rounding of N summands
and their partial sums (about 2**-9 relative each), where FP32 carries 2**-24. It writes, per ``nproc`` asked
for, both loss histories (the mean over the ranks of their slice means, the whole batch's loss), their largest
per-step relative difference and the final validation losses, so the lesson reads numbers instead of
re-running a minute of training. Wall time is not recorded (it depends on the machine's load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from ..gpt.model import GPTConfig
from ..training.train import TrainConfig

MODEL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)


def _rank(rank: int, nproc: int, init_method: str, steps: int, batch_size: int, out_dir: str) -> None:
    from ..gpt.data import load_corpus
    from .distributed import DataParallelTrainer, ranks

    cfg = TrainConfig(steps=steps, batch_size=batch_size, eval_interval=steps, eval_batches=2, model=MODEL)
    with ranks(rank, nproc, init_method, threads=1):
        corpus, out = load_corpus(None), {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            t = DataParallelTrainer("fp32", corpus, cfg, "fsdp", reduce_dtype=dtype).run()
            out[name] = {"losses": [h["loss"] for h in t.history], "val": t.result().final_val_loss}
        if rank == 0:
            (Path(out_dir) / "r0.json").write_text(json.dumps(out))


def measure(nproc: int, steps: int, batch_size: int) -> dict:
    """Train both runs on ``nproc`` spawned gloo ranks; the losses and their differences."""
    from .distributed import rendezvous, spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(_rank, nproc, (nproc, rendezvous(d), steps, batch_size, d))
        out = json.loads((Path(d) / "r0.json").read_text())
    a, b = out["fp32"]["losses"], out["bf16"]["losses"]
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    return {"nproc": nproc, "steps": steps, "batch_size": batch_size, "recipe": "fp32", "parallel": "fsdp",
            "losses": {"fp32": a, "bf16": b}, "max_rel_diff": max(rel), "final_rel_diff": rel[-1],
            "first_step_differing": next((i for i, r in enumerate(rel) if r > 0), None),
            "val": {"fp32": out["fp32"]["val"], "bf16": out["bf16"]["val"]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.parallel.reduce_precision", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="rank counts to measure (default 2 4)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("notebooks/data/10/reduce-dtype-fp32-params.json"))
    args = p.parse_args(argv)
    bad = [n for n in args.nproc if n < 2 or args.batch_size % n]
    if bad:
        print(f"reduce_precision: error: --nproc {bad[0]}: needs at least 2 ranks dividing --batch-size "
              f"{args.batch_size}", file=sys.stderr)
        return 2
    runs = []
    for n in args.nproc:
        runs.append(measure(n, args.steps, args.batch_size))
        r = runs[-1]
        print(f"{n} ranks: largest per-step loss difference {r['max_rel_diff']:.2e} relative, final val "
              f"fp32 {r['val']['fp32']:.4f} bf16 {r['val']['bf16']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": "python -m mpcourse.experiment.parallel.reduce_precision " + " ".join(argv or sys.argv[1:]),
               "torch": torch.__version__, "model": vars(MODEL) if hasattr(MODEL, "__dict__") else str(MODEL),
               "runs": runs}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
