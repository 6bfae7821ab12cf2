"""Step time of each emulated low-precision recipe over the FP32 step, on the course's GPT (default config).

Times ``--steps`` training steps (after ``--warmup`` untimed ones) of ``mpcourse.experiment.train.Trainer``
per recipe, interleaving the recipes round by round so that a busy machine slows them alike, and prints the
median (``--stat min``: fastest) step time of each, by wall clock or by CPU time (``--clock cpu``), and its
ratio to ``fp32``. On a CPU the FP8 / MX / NVFP4 GEMMs are emulated
(``F.scaled_mm`` upcasts to FP32 for tensorwise and rowwise; the block kinds dequantize, then one FP32 GEMM),
so the ratio is the cost of the emulation's extra passes (amax, scale, cast, dequantize per operand and per
GEMM), not a GPU speed-up. A number for one machine in one run: re-run it where you need it.

    python benchmarks/bench_block_recipes.py
    python benchmarks/bench_block_recipes.py --recipes fp32,fp8-current,mxfp8 --steps 20

Measured (2-core AMD EPYC, AVX2, no BF16/FP16 units, torch 2.13 CPU, machine otherwise idle; the fp32 step itself
moves by about 25% from hour to hour here, so read each ratio as +-15%), three runs in a row on the tree whose
block quantizers keep the FP32 copy the emulated GEMM reads (``keep_fp32``, ``fastpath.fp8_blocks_to_float32``)::

    python benchmarks/bench_block_recipes.py --steps 5 --warmup 1 --threads 1 --clock cpu

            recipe   step ms  x fp32   (5 steps, median; threads 1; cpu clock)     runs 2 and 3: x fp32
              fp32     178.1    1.00                                                 1.00   1.00  (208.5, 192.0 ms)
       fp8-current     295.0    1.66                                                 1.33   1.41
       fp8-delayed     305.5    1.72                                                 1.35   1.66
       fp8-rowwise     322.1    1.81                                                 1.78   1.83
         fp8-block     329.8    1.85                                                 1.77   1.80
             mxfp8     337.7    1.90                                                 1.79   1.76
             nvfp4     972.0    5.46                                                 4.82   5.04

The same command on the tree before (three runs): fp8-current 1.45 / 1.62 / 1.69, fp8-delayed 1.42 / 1.77 / 1.68,
fp8-rowwise 1.99 / 2.31 / 2.20, fp8-block 2.06 / 2.11 / 2.31, mxfp8 2.15 / 2.27 / 2.44, nvfp4 4.45 / 4.93 / 4.86;
and before the fast paths of ``mpcourse.core.quant.fastpath`` about 1.8-2.1 (per tensor), 2.2-2.6 (rowwise, blocks,
MX) and 5.1-6.6 (NVFP4). Interleaved in one process (both versions of the quantizers, training steps of each,
CPU time, fastest of 6 rounds): fp8-rowwise 2.26 -> 1.78, fp8-block 2.02 -> 1.70, mxfp8 2.01 -> 1.87. Every run
gives the same losses as before, bit for bit (``mpcourse compare`` histories).

Where the time goes. The emulated GEMMs cost what FP32's do (the same FP32 GEMMs on the dequantized operands); the
rest is the quantizers, 6 per linear layer and step (x, W and dy, each along two contraction dimensions: TE's
rule), about 23 million elements per step on this model, each a chain of eager passes over memory: |x|, the block
amax, the scaled copy, the cast (torch's float -> float8 cast, about 1 ns per element, the slowest), and the
upcast of the codes through FP16 bits into the scaled copy's buffer times each block's multiplier. That is about
50 bytes of memory traffic per element (counted from the passes' reads and writes), about 1.2 GB per step, against which the small ops on the scale grids
(a few microseconds each) hardly count. The 1.5x target for FP8 and MX steps and the 3x aim for NVFP4 are not
met: every pass left is one the rule needs, and fusing them needs a compiled kernel (a ``torch.compile``d MX
quantizer, bit-identical, was about 1.4x faster after about 30 s of compilation per process, and needs a C++
compiler that a learner's laptop may lack); NVFP4's random draw could be halved by drawing 32 bits per element,
which changes the rule (and every stored nvfp4 number). A glibc allocator that keeps freed memory
(``mallopt``, no page faults left in a step) changed no step time measurably.
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
