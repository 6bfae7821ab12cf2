"""Overhead of the numerics inspector (``mpcourse compare --inspect N``) on the compare model's training step.

Runs the same steps of one recipe without the inspector and with it recording every N steps, interleaved
over repeats, and prints the ratio of the median step times (same run, same machine).

    python benchmarks/bench_inspect.py [--recipe fp32] [--every 1,10] [--steps 20] [--repeats 3]
"""
import argparse
import statistics
import time

import torch

from mpcourse.experiment.data import load_corpus
from mpcourse.experiment.train import TrainConfig, Trainer


def time_steps(recipe, corpus, steps, every):
    trainer = Trainer(recipe, corpus, TrainConfig(steps=steps + 1, eval_interval=10 ** 9), inspect_every=every)
    trainer.train_step()                                   # the first (memory-counting) step is not timed
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / steps


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
    base = statistics.median(times[0])
    print(f"recipe {a.recipe}, {a.steps} steps x {a.repeats} repeats, {a.threads} thread(s); median step "
          f"{base * 1e3:.1f} ms without the inspector")
    for e in everies[1:]:
        per_repeat = ", ".join(f"{t / t0:.2f}" for t, t0 in zip(times[e], times[0]))
        print(f"--inspect {e}: {statistics.median(times[e]) / base:.2f}x the step time (per repeat: {per_repeat})")


if __name__ == "__main__":
    main()
