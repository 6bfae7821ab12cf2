"""Step time of each emulated low-precision recipe over the FP32 step, on the course's GPT (default config).

Times ``--steps`` training steps (after ``--warmup`` untimed ones) of ``mpcourse.experiment.training.train.Trainer``
per recipe, interleaving the recipes round by round so that a busy machine slows them alike, and prints the
median (``--stat min``: fastest) step time of each, by wall clock or by CPU time (``--clock cpu``), and its
ratio to ``fp32``. On a CPU the FP8 / MX / NVFP4 GEMMs are emulated
(``F.scaled_mm`` upcasts to FP32 for tensorwise and rowwise; the block kinds dequantize, then one FP32 GEMM),
so the ratio is the cost of the emulation's extra passes (amax, scale, cast, dequantize per operand and per
GEMM), not a GPU speed-up. A number for one machine in one run: re-run it where you need it.

    python benchmarks/bench_block_recipes.py
    python benchmarks/bench_block_recipes.py --recipes fp32,fp8-current,mxfp8 --steps 20

Measured (2-core AMD EPYC, AVX2, no BF16/FP16 units, torch 2.13 CPU, numba 0.68.1, machine otherwise idle; the
fp32 step itself moves by 15-25% from run to run and hour to hour here, so read each ratio as +-15%), three runs
in a row on the tree with the compiled kernels of ``mpcourse.core.quant.kernels.loops``::

    python benchmarks/bench_block_recipes.py --steps 5 --warmup 1 --threads 1 --clock cpu

            recipe   x fp32, runs 1 / 2 / 3   median     (fp32 step 213.8 / 216.3 / 184.8 ms)
       fp8-current   1.38 / 1.48 / 1.51        1.48
       fp8-delayed   1.49 / 1.48 / 1.57        1.49
       fp8-rowwise   1.31 / 1.30 / 1.62        1.31
         fp8-block   1.30 / 1.42 / 1.68        1.42
             mxfp8   1.37 / 1.42 / 1.81        1.42
             nvfp4   3.42 / 3.24 / 4.08        3.42

The third run's fp32 step was 15% faster than the first two's while the FP8 steps were not: the 1.5x aimed for
holds in the median of the three runs for every FP8 and MX recipe, not in every run. On the tree before the
kernels (the torch fast paths of ``mpcourse.core.quant.kernels`` only) the same command gave fp8-current 1.33-1.66,
fp8-delayed 1.35-1.72, fp8-rowwise 1.78-1.83, fp8-block 1.77-1.85, mxfp8 1.76-1.90, nvfp4 4.8-5.5 (three runs);
before those fast paths about 1.8-2.1 (per tensor), 2.2-2.6 (rowwise, blocks, MX) and 5.1-6.6 (NVFP4). Every run
gives the same losses as before, bit for bit (``mpcourse compare`` histories).

Where the time goes (cProfile and torch.profiler, fp8-block, one thread). The emulated GEMMs cost what FP32's do
(the same FP32 GEMMs on the dequantized operands). The quantizers, 6 per linear layer and step (x, W and dy, each
along two contraction dimensions: TE's rule), handle about 21 million elements per step on this model; with the
kernels each is two compiled passes (the block amax, about 0.5 ns per element; the scaled cast with its FP32 copy,
about 1 ns), about 35-40 ms of a step, where the torch rules' chain of eager passes (|x|, the block max, the
scaled copy, the cast, the upcast) took about 3x that. The scale rules on the grid of blocks are one kernel call
each (as seven small torch ops they cost about a tenth of the step). What is left over FP32: the kernels, the bias
added after the GEMM (FP32's ``addmm`` fuses it; adding it inside the GEMM would change the rounding), the
per-call Python of 100 quantizations a step, and for NVFP4 the rule's 62-bit random draw per gradient element
(``torch.randint``, about a third of its step; drawing 32 bits would change the rule and every stored nvfp4 number)
and the random Hadamard transforms. Without numba (or with ``MPCOURSE_FUSED=0``) the torch rules run, as in the
tree before.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.training.train import TrainConfig, Trainer

DEFAULT = "fp32,fp8-current,fp8-delayed,fp8-rowwise,fp8-block,mxfp8,nvfp4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time), which a busy "
                         "machine's descheduling does not inflate (with --threads 1 it is the step's compute time)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="the step time of a recipe: the median or the fastest of its timed steps (min is the "
                         "steadier one on a machine that other jobs share)")
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
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for i in range(args.warmup + args.steps):
        for n, tr in trainers.items():
            t0 = clock()
            tr.train_step()
            if i >= args.warmup:
                times[n].append(clock() - t0)
    stat = statistics.median if args.stat == "median" else min
    base = stat(times["fp32"])
    print(f"{'recipe':>14}  {'step ms':>8}  {'x fp32':>6}   ({args.steps} steps, {args.stat}; threads {torch.get_num_threads()}; {args.clock} clock)")
    for n in names:
        t = stat(times[n])
        print(f"{n:>14}  {t * 1e3:8.1f}  {t / base:6.2f}")


if __name__ == "__main__":
    main()
