"""Overhead of the numerics inspector (``mpcourse compare --inspect N``) on the compare model's training step.

Runs the same steps of one recipe without the inspector and with it recording every N steps, interleaved
over repeats, and prints the ratio of the median step times (same run, same machine): of the process's CPU
time, which a shared machine's other jobs do not inflate (one thread), and of the wall time.

    python benchmarks/bench_inspect.py [--recipe fp32] [--every 1,10] [--steps 20] [--repeats 3] [--autoswitch SPEC]

Measured (``--steps 10 --repeats 3``, one thread, the 2-core CPU shared with other jobs), CPU time, with every
recipe's quantizer statistics on each GEMM operand (``mpcourse.core.inspect_quant``): fp32 every step 9.99x the step
time (per repeat 9.06-10.40x), every 10 steps 1.98x (1.87-2.10x); ``--recipe fp8-current --every 10`` 1.52x
(1.25-1.55x), and ``--autoswitch underflow=1`` (the switch watching every step, nothing passing) 1.85x (1.48-1.95x).
Before the recipes' statistics: every step 4.38x, every 10 steps 1.37x (``--steps 20 --repeats 5``).
"""
import argparse
import statistics
import time

import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.training.train import TrainConfig, Trainer


def time_steps(recipe, corpus, steps, every, autoswitch=None):
    """(CPU seconds, wall seconds) per step. With one thread the process's CPU time is the work done,
    whatever else the machine runs; the wall time also counts the waits for a core."""
    trainer = Trainer(recipe, corpus, TrainConfig(steps=steps + 1, eval_interval=10 ** 9), inspect_every=every,
                      autoswitch=autoswitch)
    trainer.train_step()                                   # the first (memory-counting) step is not timed
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.process_time() - c0) / steps, (time.perf_counter() - t0) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--every", default="1,10")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--autoswitch", default=None,
                   help="also time --autoswitch SPEC alone (a threshold nothing passes, e.g. underflow=1, measures "
                        "the watching)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    corpus = load_corpus(None)
    everies = [0] + [int(e) for e in a.every.split(",")] + (["autoswitch"] if a.autoswitch else [])
    times = {e: [] for e in everies}
    for _ in range(a.repeats):
        for e in everies:
            times[e].append(time_steps(a.recipe, corpus, a.steps, 0, a.autoswitch) if e == "autoswitch"
                            else time_steps(a.recipe, corpus, a.steps, e))
    for kind, k in (("CPU time", 0), ("wall time", 1)):
        base = statistics.median(t[k] for t in times[0])
        print(f"recipe {a.recipe}, {a.steps} steps x {a.repeats} repeats, {a.threads} thread(s); {kind}: median step "
              f"{base * 1e3:.1f} ms without the inspector")
        for e in everies[1:]:
            ratio = statistics.median(t[k] for t in times[e]) / base
            per_repeat = ", ".join(f"{t[k] / t0[k]:.2f}" for t, t0 in zip(times[e], times[0]))
            what = f"--autoswitch {a.autoswitch}" if e == "autoswitch" else f"--inspect {e}"
            print(f"  {what}: {ratio:.2f}x the step time (per repeat: {per_repeat})")


if __name__ == "__main__":
    main()
