"""Step time of each emulated low-precision recipe over the FP32 step, on the course's GPT (default config).

Times ``--steps`` training steps (after ``--warmup`` untimed ones) of ``mpcourse.experiment.train.Trainer``
per recipe, interleaving the recipes round by round so that a busy machine slows them alike, and prints the
median step time of each and its ratio to ``fp32``. On a CPU the FP8 / MX / NVFP4 GEMMs are emulated
(``F.scaled_mm`` upcasts to FP32 for tensorwise and rowwise; the block kinds dequantize, then one FP32 GEMM),
so the ratio is the cost of the emulation's extra passes (amax, scale, cast, dequantize per operand and per
GEMM), not a GPU speed-up. A number for one machine in one run: re-run it where you need it.

    python benchmarks/bench_block_recipes.py
    python benchmarks/bench_block_recipes.py --recipes fp32,fp8-current,mxfp8 --steps 20

Measured (2-core AMD EPYC, AVX2, no BF16/FP16 units, torch 2.13 CPU; shared with other jobs, load ~5, so
read the ratios as +-15%), after the fast paths of ``mpcourse.core.quant.fastpath`` and the Trainer dropping
the emulation's dispatch mode for runs with no low-precision matmul (fp32 and FP8 rows)::

    python benchmarks/bench_block_recipes.py --recipes fp32,torch-amp-bf16,bf16-autocast,bf16-pure,\
        fp16-dynamic,fp8-current,fp8-delayed,fp8-rowwise,fp8-block,mxfp8,nvfp4 --steps 3 --warmup 1 --threads 1

            recipe   step ms  x fp32   (3 steps, median; threads 1)
              fp32     158.7    1.00
    torch-amp-bf16     220.2    1.39
     bf16-autocast     232.2    1.46
         bf16-pure     257.3    1.62
      fp16-dynamic     236.1    1.49
       fp8-current     322.1    2.03
       fp8-delayed     314.3    1.98
       fp8-rowwise     401.9    2.53
         fp8-block     352.1    2.22
             mxfp8     372.3    2.35
             nvfp4    1096.1    6.91

Before (same machine, quiet, 2 threads, FP32 step 125.9 ms with the dispatch mode on): fp8-current 2.41,
fp8-delayed 2.52, fp8-rowwise 3.50, fp8-block 2.86, mxfp8 3.13, nvfp4 11.06. The 1.5x target for FP8 and MX
steps is not met yet.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpcourse.experiment.data import load_corpus
from mpcourse.experiment.train import TrainConfig, Trainer

DEFAULT = "fp32,fp8-current,fp8-delayed,fp8-rowwise,fp8-block,mxfp8,nvfp4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    if "fp32" not in names:
        names.insert(0, "fp32")
    corpus = load_corpus()
    cfg = TrainConfig(steps=args.warmup + args.steps + 1, eval_interval=10 ** 9)   # no evaluation in the timed steps
    trainers = {n: Trainer(n, corpus, cfg) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for n, tr in trainers.items():
            t0 = time.perf_counter()
            tr.train_step()
            if i >= args.warmup:
                times[n].append(time.perf_counter() - t0)
    base = statistics.median(times["fp32"])
    print(f"{'recipe':>14}  {'step ms':>8}  {'x fp32':>6}   ({args.steps} steps, median; threads {torch.get_num_threads()})")
    for n in names:
        t = statistics.median(times[n])
        print(f"{n:>14}  {t * 1e3:8.1f}  {t / base:6.2f}")


if __name__ == "__main__":
    main()
