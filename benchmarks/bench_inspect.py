"""Overhead of the numerics inspector (``mpcourse compare --inspect N``) on the compare model's training step.

Runs the same steps of one recipe without the inspector and with it recording every N steps, interleaved
over repeats, and prints the ratio of the median step times (same run, same machine): of the process's CPU
time, which a shared machine's other jobs do not inflate (one thread), and of the wall time.

    python benchmarks/bench_inspect.py [--recipe fp32] [--every 1,10] [--steps 20] [--repeats 3]

Measured (``--steps 20 --repeats 5``, fp32, one thread, the 2-core CPU shared with other jobs), CPU time:
every step 4.38x the step time (per repeat 3.77-4.67x), every 10 steps 1.37x (1.09-1.67x); the wall-time
ratios were 3.78x and 1.17x with a far wider spread (0.39-4.51x per repeat).
"""
import argparse
import statistics
import time

import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.training.train import TrainConfig, Trainer


def time_steps(recipe, corpus, steps, every):
    """(CPU seconds, wall seconds) per step. With one thread the process's CPU time is the work done,
    whatever else the machine runs; the wall time also counts the waits for a core."""
    trainer = Trainer(recipe, corpus, TrainConfig(steps=steps + 1, eval_interval=10 ** 9), inspect_every=every)
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
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    corpus = load_corpus(None)
    everies = [0] + [int(e) for e in a.every.split(",")]
    times = {e: [] for e in everies}
    for _ in range(a.repeats):
        for e in everies:
            times[e].append(time_steps(a.recipe, corpus, a.steps, e))
    for kind, k in (("CPU time", 0), ("wall time", 1)):
        base = statistics.median(t[k] for t in times[0])
        print(f"recipe {a.recipe}, {a.steps} steps x {a.repeats} repeats, {a.threads} thread(s); {kind}: median step "
              f"{base * 1e3:.1f} ms without the inspector")
        for e in everies[1:]:
            ratio = statistics.median(t[k] for t in times[e]) / base
            per_repeat = ", ".join(f"{t[k] / t0[k]:.2f}" for t, t0 in zip(times[e], times[0]))
            print(f"  --inspect {e}: {ratio:.2f}x the step time (per repeat: {per_repeat})")


if __name__ == "__main__":
    main()
