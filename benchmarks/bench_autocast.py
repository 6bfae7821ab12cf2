"""The course's autocast (a Python TorchFunctionMode) against torch.autocast (C++ dispatcher key).

One training step of the compare model (default ``GPTConfig``, batch 16 x 64 tokens), the trainer's
own step (``Trainer.train_step``): forward under the autocast region, backward, clip, ``AdamW.step()``,
``zero_grad``; FP32 weights, as the ``bf16-autocast`` recipe runs it, and inside
``mpcourse.core.emulation.tensor_cores()`` (auto), as the training loop does. The two implementations are timed in one process, interleaved
(A B, B A, A B, ...) so that drift in the machine's speed hits both alike. Printed per autocast
dtype: the median step time of each, and two ratios mpcourse / torch, each the median over the
back-to-back pairs: of wall time, and of CPU time (``time.process_time``: the work done, which other
jobs on a shared machine disturb far less than the wall clock). Target: at most 1.3x (the Python
policy should cost little next to the math).

Before timing, one step of each from the same weights is checked to give the same loss bits (the
two are the same computation; lesson 05 and tests/core/autocast/test_autocast.py check every gradient too).

    python benchmarks/bench_autocast.py [--repeats 12] [--dtypes bf16,fp16] [--threads N]

On a machine shared with other jobs, multi-threaded steps are dominated by scheduling noise (an
OpenMP barrier waits for a descheduled thread): ``--threads 1`` gives stable ratios there.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpcourse.core.autocast as mpa
from mpcourse.core import emulation
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.recipes import OptimConfig, TrainingRecipe
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.training.train import TrainConfig, Trainer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _AutocastRecipe(TrainingRecipe):
    """FP32 weights and AdamW, forward under ``ctx_factory("cpu", dtype=dtype)`` (not registered)."""

    def __init__(self, model, ctx_factory, dtype):
        self.ctx_factory, self.dtype = ctx_factory, dtype
        super().__init__(model, OptimConfig(lr=1e-4, warmup_steps=0))

    def forward_context(self):
        return self.ctx_factory("cpu", dtype=self.dtype)


def make_step(ctx_factory, corpus, dtype):
    """A closure running the trainer's step on a fresh, seeded model under ``ctx_factory(dtype)``."""
    torch.manual_seed(0)
    recipe = _AutocastRecipe(GPT(GPTConfig(vocab_size=corpus.vocab_size)), ctx_factory, dtype)
    trainer = Trainer.wrap(recipe, corpus, TrainConfig(steps=10**6, batch_size=16), evaluate=False)
    return lambda: trainer.train_step()["loss"]                              # same batches for both


def bench(dtype, corpus, repeats: int, warmup: int = 2):
    """Wall and CPU step times (s; lists per implementation, interleaved) and whether the first losses agree."""
    ref, ours = make_step(torch.autocast, corpus, dtype), make_step(mpa.autocast, corpus, dtype)
    same_loss = ref() == ours()                                               # first step: same weights, same batch
    for _ in range(warmup):
        ref(), ours()
    wall = {"torch": [], "mpcourse": []}
    cpu = {"torch": [], "mpcourse": []}
    for i in range(repeats):
        order = (("torch", ref), ("mpcourse", ours)) if i % 2 == 0 else (("mpcourse", ours), ("torch", ref))
        for name, fn in order:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    return wall, cpu, same_loss


def pair_ratio(times) -> float:
    """Median over the interleaved pairs of mpcourse time / torch time."""
    return statistics.median(b / a for a, b in zip(times["torch"], times["mpcourse"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=12, help="timed steps per implementation (default 12)")
    p.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16, fp16 (default both)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    corpus = load_corpus()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {emulation.status()}")
    print("compare model, default GPTConfig, batch 16 x 64, forward + backward + AdamW, FP32 weights; "
          f"{args.repeats} interleaved steps each; medians")
    print(f"{'autocast dtype':<16}{'torch.autocast ms':>19}{'mpcourse ms':>13}{'ratio (wall)':>14}"
          f"{'ratio (CPU time)':>18}  same first-step loss")
    # each step enters tensor_cores() (auto) itself, as Trainer.train_step does
    for key in args.dtypes.split(","):
        wall, cpu, same = bench(DTYPES[key.strip()], corpus, args.repeats)
        t_ref, t_ours = statistics.median(wall["torch"]), statistics.median(wall["mpcourse"])
        print(f"{key:<16}{t_ref * 1e3:>19.1f}{t_ours * 1e3:>13.1f}{pair_ratio(wall):>13.2f}x"
              f"{pair_ratio(cpu):>17.2f}x  {same}")


if __name__ == "__main__":
    main()
