"""Training-step time of the per-tensor FP8 recipes and NVFP4 over the FP32 step, measured in one process.

Builds the course's GPT with ``mpcourse compare``'s default configuration (``TrainConfig()``'s model, batch and
optimizer; evaluation off in the timed steps) once per recipe, on one intra-op thread as ``compare`` trains
(``training_threads()``), runs ``--warmup`` untimed steps of each (the first is ``measure_step``'s), then
``--rounds`` rounds; in each round every recipe runs ``--steps`` steps back to back, the recipes in a rotated
order, so a busy machine slows them alike. A recipe's time is the median over rounds of its per-round mean
step time; the ratio to ``fp32`` is taken per round (the same round's fp32 step) and its median printed with the
spread (min-max over rounds) beside it. Printed for each recipe: ``recipe  ms/step  ratio-to-fp32``, and the
target where there is one (fp8-current, fp8-delayed <= 1.5; nvfp4 <= 2.0; mxfp8 for information).

On a CPU the FP8 and NVFP4 GEMMs are emulated: the per-tensor recipes' ``torch._scaled_mm`` upcasts both
operands to FP32 and runs one FP32 GEMM (``upcast.cpu_scaled_mm``), the block recipes dequantize and run one
FP32 GEMM; on top come the quantizers (amax, scale, cast) and for NVFP4 the random Hadamard transforms and the
stochastic rounding draws. So a ratio is the cost of the emulation's extra passes on this CPU, not a GPU
speed-up.

    python benchmarks/bench_step_ratio.py                       # fp32, fp8-current, fp8-delayed, nvfp4, mxfp8
    python benchmarks/bench_step_ratio.py --rounds 12 --clock wall
    MPCOURSE_FUSED=0 python benchmarks/bench_step_ratio.py      # the torch rules instead of the kernels

``--clock cpu`` (default) times with this process's CPU time (``time.process_time``): on one thread that is the
step's compute, which other jobs on a shared machine inflate less than the wall clock.

Measured 2026-12-04 on a shared 2-core AMD EPYC (AVX-512 with BF16 units, no FP16 units), torch 2.13 CPU, numba
0.68.1, ``--rounds 12`` (CPU clock), the tree before the kernel work and this one alternating, two runs each,
under a load average of 3-4 from other jobs (the fp32 step 106-127 ms; unloaded it is about 105 ms). Ratio to fp32,
median of rounds (spread over the rounds in brackets):

    recipe        before                       after
    fp8-current   1.32, 1.37  (1.06-1.66)      1.35, 1.40  (1.29-2.72)
    fp8-delayed   1.38, 1.34  (1.15-2.04)      1.34, 1.39  (1.29-2.10)
    nvfp4         3.05, 3.01  (2.50-3.64)      1.64, 1.73  (1.53-1.95)
    mxfp8         1.36, 1.35  (1.13-1.65)      1.36, 1.41  (1.28-1.71)

Before any change, on a quieter machine: fp8-current 1.30 (1.27-1.34), fp8-delayed 1.35 (1.33-1.42), nvfp4 2.88
(2.82-3.01), mxfp8 1.33. The FP8 rows are unchanged within the noise (the faster FP8 upcast saves about 3% of
a step, less than one round's spread here); a round's ratio can exceed a target when another job lands on it.

Re-measured on the merged tree (the kernels behind the engine's one kernel table), same machine, load average
about 5, ``--rounds 8``: fp32 108.7 ms; fp8-current 1.34 (1.32-1.47), fp8-delayed 1.33 (1.22-1.49), nvfp4 1.63
(1.55-1.88), mxfp8 1.37 (1.30-1.50). No GPU was measured.

The MoE rows (``--recipes moe-fp32,moe-bf16,moe-fp8-rowwise,moe-fp8-block,moe-mxfp8 --base moe-fp32 --rounds 5``),
measured 2026-12-07 on the same kind of machine, load average about 1, on the tree where the experts' GEMMs take
the dense layers' quantizers (the kernels where bound) and the rowwise weight gradient its per-group scales:
moe-fp32 117.3 ms; moe-bf16 1.81 (1.52-1.93), moe-fp8-rowwise 1.79 (1.71-1.89), moe-fp8-block 1.64 (1.61-1.68),
moe-mxfp8 1.68 (1.60-2.20): each emulated FP8 / MXFP8 MoE step within 2x of moe-fp32 (median). (Earlier the same
day, under a load average of 7-8, before the per-group scales: 1.67, 1.67, 1.70.) Before, with the experts
quantizing through the rules, a ``mpcourse compare --jobs 1 --steps 6`` run of the same rows gave 2.4-2.7x
moe-fp32's time per token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.training.threads import training_threads
from mpcourse.experiment.training.train import TrainConfig, Trainer

DEFAULT = "fp32,fp8-current,fp8-delayed,nvfp4,mxfp8"
#: the MoE rows, each against moe-fp32 (``--base moe-fp32``): an emulated FP8 / MXFP8 MoE step at most 2x
MOE = "moe-fp32,moe-bf16,moe-fp8-rowwise,moe-fp8-block,moe-mxfp8"
TARGETS = {"fp8-current": 1.5, "fp8-delayed": 1.5, "nvfp4": 2.0,
           "moe-fp8-rowwise": 2.0, "moe-fp8-block": 2.0, "moe-mxfp8": 2.0}


def measure(names: list[str], rounds: int, steps: int, warmup: int, clock) -> dict[str, list[float]]:
    """{recipe: [mean seconds per step in round r]} for ``rounds`` rounds of ``steps`` steps each."""
    corpus = load_corpus()
    cfg = TrainConfig(steps=warmup + rounds * steps + 1, eval_interval=10 ** 9)   # no evaluation in timed steps
    trainers = {n: Trainer(n, corpus, cfg) for n in names}
    for _ in range(warmup):
        for tr in trainers.values():
            tr.train_step()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]            # rotate who runs first
        for n in order:
            t0 = clock()
            for _ in range(steps):
                trainers[n].train_step()
            per_round[n].append((clock() - t0) / steps)
    return per_round


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=DEFAULT, help=f"comma-separated (the base is always added; default {DEFAULT}"
                    f"; the MoE rows: --recipes {MOE} --base moe-fp32)")
    ap.add_argument("--base", default="fp32", help="the recipe every ratio is taken against (default fp32)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps per recipe per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    if args.base not in names:
        names.insert(0, args.base)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with training_threads():
        per_round = measure(names, args.rounds, args.steps, args.warmup, clock)
    base = per_round[args.base]
    print(f"{'recipe':>15}  {'ms/step':>8}  {'x ' + args.base:>6}  {'spread':>11}  target   ({args.rounds} rounds x "
          f"{args.steps} steps, medians; 1 intra-op thread; "
          f"{args.clock} clock)")
    for n in names:
        ratios = [t / b for t, b in zip(per_round[n], base)]
        med = statistics.median(ratios)
        target = TARGETS.get(n)
        verdict = "" if target is None else f"<= {target:.1f} {'ok' if med <= target else 'MISSED'}"
        print(f"{n:>15}  {statistics.median(per_round[n]) * 1e3:8.1f}  {med:6.2f}  "
              f"{min(ratios):5.2f}-{max(ratios):<5.2f}  {verdict}")


if __name__ == "__main__":
    main()
