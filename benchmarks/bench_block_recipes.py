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

Measured (2-core AMD EPYC, AVX2, no BF16/FP16 units, torch 2.13 CPU), with nothing else running, on the tree with
the FP8 upcast through FP16 bits (``fastpath.fp8_to_float32``)::

    python benchmarks/bench_block_recipes.py --steps 5 --warmup 1 --threads 1 --clock cpu

            recipe   step ms  x fp32   (5 steps, median; threads 1; cpu clock)
              fp32     152.1    1.00
       fp8-current     272.4    1.79
       fp8-delayed     281.0    1.85
       fp8-rowwise     400.0    2.63
         fp8-block     368.5    2.42
             mxfp8     392.7    2.58
             nvfp4     837.1    5.50

The same command on the final tree (with no autocast on, the FP8 layers no longer enter a disabled autocast
region, so their quantizer ops skip a Python mode), three runs in a row, machine otherwise idle but slower that hour (the fp32 step
181-201 ms against 152 above, the FP8 steps 5-15% slower too): fp8-current 1.45 / 1.62 / 1.69, fp8-delayed
1.42 / 1.77 / 1.68, fp8-rowwise 1.99 / 2.31 / 2.20, fp8-block 2.06 / 2.11 / 2.31, mxfp8 2.15 / 2.27 / 2.44,
nvfp4 4.45 / 4.93 / 4.86. The ratios are lower than above mostly because the FP32 step slowed more than the
others: read them, too, as +-15%.

The upcast itself is about 3x faster than the table gather it replaced (1024 x 512 E4M3, 1 thread), but the step
ratios above are those of the earlier measurement below within its +-15%: old and new upcast interleaved in one
process (training steps of each recipe, CPU time, 6 rounds, load 3-5) gave new / old = 0.99 (fastest round) / 0.92
(median) for fp8-current, 0.86 / 0.96 fp8-delayed, 0.89 / 0.98 fp8-rowwise, 0.96 / 1.00 fp8-block, 0.97 / 1.03 mxfp8,
0.99 / 1.00 nvfp4: at most a few percent of a step.

The earlier measurement, with the machine shared with other jobs
(load 15-17 on 2 cores during the last runs), so wall-clock steps were useless; ``--clock cpu`` times the
process's CPU time, which descheduling does not inflate, but cache and memory-bandwidth contention still do:
read the step ratios as +-15%. After the fast paths of ``mpcourse.core.quant.fastpath`` (list there) and the
per-tensor FP8 backward that upcasts each operand once::

    python benchmarks/bench_block_recipes.py --steps 5 --warmup 1 --threads 1 --clock cpu

            recipe   step ms  x fp32   (5 steps, median; threads 1; cpu clock)
              fp32     189.3    1.00
       fp8-current     350.7    1.85
       fp8-delayed     337.1    1.78
       fp8-rowwise     467.1    2.47
         fp8-block     440.2    2.33
             mxfp8     462.8    2.45
             nvfp4     970.2    5.13

The same command (3 steps) on the tree before them: fp8-current 2.06, fp8-delayed 1.93, fp8-rowwise 2.22,
fp8-block 2.35, mxfp8 2.36, nvfp4 6.04 (and 2.04 / 2.15 / 2.36 / 2.37 / 2.65 / 6.62 in a run an hour earlier):
at this load the step ratios cannot resolve a 10% change. The before/after ratio was therefore measured on the
FP8 layers alone, both trees imported side by side in one process and interleaved: forward + backward of the
GPT's four linear shapes (1024 tokens; 128->384, 128->128, 128->512, 512->128), CPU time, 6 rounds,
new / old = 0.81 (fastest round) / 0.95 (median) for fp8-current, 0.80 / 0.81 fp8-delayed, 1.02 / 1.07
fp8-rowwise (no change: it has none of the paths above), 0.94 / 0.93 fp8-block, 0.98 / 0.97 mxfp8,
0.99 / 0.93 nvfp4. Every run gives the same losses as before, bit for bit (``mpcourse compare`` histories).

Where the time goes (a ``TorchDispatchMode`` timing every op of one nvfp4 step by CPU time, before the 32-bit
rewrite of the rounding, which takes about a fifth off it alone): about a third is NVFP4's stochastic rounding
of the two gradient copies per layer (the rule's one 62-bit ``torch.randint`` draw per element, then some
twenty elementwise passes), the emulated GEMMs about a tenth; the rest is the other
quantize / dequantize passes, each a separate pass over memory in eager PyTorch. The 1.5x target for FP8 and
MX steps and the 3x aim for NVFP4 are not met: the passes that remain are each needed by the rule as written,
and fusing them needs a compiled kernel; NVFP4's random draw could be halved by drawing 32 bits per element,
which changes the rule (and every stored nvfp4 number).
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
