"""Step time of a recipe under FSDP2 over its step under DDP, on two gloo ranks of this machine, and where it goes.

One job of two spawned ranks builds, per recipe, a ``DataParallelTrainer`` under ``ddp`` and one under ``fsdp``
(the course's GPT, default config, global batch 16) and times ``Trainer.train_step`` alternately, round by
round, so that a busy machine slows both alike; it prints rank 0's median step time of each and the ratio.
``--profile`` adds torch.profiler's table of one FSDP2 step of the first recipe (self CPU time per op or
region: ``FSDP::all_gather`` / ``FSDP::post_backward_reduce`` are FSDP2's copy-in, collective and copy-out of
a block, ``PythonSubclass`` the DTensor dispatch in Python, ``Optimizer.step`` AdamW over the DTensor shards).
Numbers for one machine in one run; no GPU here, so nothing about NCCL.

    python benchmarks/bench_parallel.py --recipes fp32,bf16-pure-sr --steps 4 --profile

Measured (2-core AMD EPYC, AVX2, torch 2.13 CPU, shared with other jobs at a load of about 14, so read the
ratios as +-20%)::

                  recipe    DDP ms  FSDP2 ms  FSDP2/DDP   (median of 4, 2 ranks x 1 thread)
                    fp32    1028.0    1595.7       1.55
            bf16-pure-sr    3722.9    4531.3       1.22

In the profile of one FSDP2 ``fp32`` step (2.92 s of self CPU time on rank 0) the GEMMs (``mm``, ``addmm``,
``bmm``) take 0.98 s, as under DDP; what FSDP2 adds is AdamW over DTensor shards (``Optimizer.step`` 0.64 s in
all, against 0.27 s in a DDP step profiled the same way just before: every elementwise op of AdamW goes through DTensor's
Python dispatch, ``PythonSubclass`` 0.51 s in all over 458 calls) and each block's all-gather before its forward
and backward and reduce-scatter after its backward (``FSDP::all_gather`` / ``FSDP::post_backward_reduce`` and the
gloo collectives, about 0.5 s, copies included). Our code adds nothing per op there: the course's recipes call
plain ``torch.optim.AdamW`` on the shards.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist


def _rank(rank, port, recipes, steps, warmup, profile):
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.parallel.distributed import DataParallelTrainer
    from mpcourse.experiment.training.train import TrainConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    corpus, cfg = load_corpus(None), TrainConfig(steps=warmup + steps + 1, eval_interval=10**6, eval_batches=1)
    times = {}
    for name in recipes:
        trainers = {mode: DataParallelTrainer(name, corpus, cfg, mode) for mode in ("ddp", "fsdp")}
        for t in trainers.values():
            for _ in range(warmup):
                t.train_step()                              # the first step also measures memory: untimed
        for _ in range(steps):
            for mode, t in trainers.items():
                dist.barrier()
                s = time.perf_counter()
                t.train_step()
                times.setdefault((name, mode), []).append(time.perf_counter() - s)
    if rank == 0:
        print(f"{'recipe':>24}  {'DDP ms':>8}  {'FSDP2 ms':>8}  FSDP2/DDP   (median of {steps}, 2 ranks x 1 thread)")
        for name in recipes:
            d, f = (statistics.median(times[(name, m)]) * 1e3 for m in ("ddp", "fsdp"))
            print(f"{name:>24}  {d:8.1f}  {f:8.1f}  {f / d:9.2f}")
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        t = DataParallelTrainer(recipes[0], corpus, cfg, "fsdp")
        for _ in range(warmup):
            t.train_step()
        with prof(activities=[ProfilerActivity.CPU]) as p:
            t.train_step()
        if rank == 0:
            print(f"one FSDP2 step of {recipes[0]}, rank 0:")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))
    dist.destroy_process_group()


def main(argv=None):
    from mpcourse.experiment.parallel.distributed import free_port, spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="fp32,bf16-pure-sr")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    spawn(_rank, 2, (free_port(), a.recipes.split(","), a.steps, a.warmup, a.profile))


if __name__ == "__main__":
    main()
