"""Lesson 10's experiments: small worker functions, each run on a few gloo ranks spawned from the notebook.

A spawned process imports the function it runs, so the workers live in this module, not in the notebook
(the lesson prints each one's source with ``inspect.getsource`` before running it). ``run(worker, world,
*args)`` starts ``world`` gloo ranks on this machine (file rendezvous, loopback only), calls ``worker(*args)``
on every rank and returns the ranks' return values, rank 0's first.

Workers (each a few collectives on tensors of a few kilobytes):

* ``overflow``: one rank's gradient overflows. ``"ddp"``: the gradients are averaged first (DDP's all-reduce),
  then every rank checks the average; ``"shard"``: each rank checks only its own shard (ZeRO/FSDP), deciding
  alone; ``"shard+max"``: the same with the flag all-reduced (MAX) first, as FSDP's ``ShardedGradScaler``.
* ``amax``: each rank holds the slice of one activation tensor that sequence parallelism gives it; the FP8 scale
  from the amax reduced over no group, the tensor-parallel group, or the world (Transformer Engine's
  ``amax_reduction_group``).
* ``reduce``: the mean of the ranks' gradients all-reduced in FP32 or BF16 against an FP64 reference.
* ``bytes``: bytes per parameter per rank after one step of a small GPT under DDP, ZeRO-1 and FSDP2.

The FP8 all-gather of section 4 trains a small FSDP2 model; its worker is in ``fp8_all_gather_demo``.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist


def overflow(modes=("ddp", "shard", "shard+max"), overflow_rank: int = 1) -> dict:
    from mpcourse.core.scaling import DynamicLossScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]    # every rank creates every group, uses its own
    out = {}
    for mode in modes:
        w = torch.nn.Parameter(torch.ones(4))                    # this rank's weights (or shard), fp32
        scaler = DynamicLossScaler(init_scale=2.0**16, process_group=None if mode == "shard+max" else solo)
        scaler.scale(w.sum() * (rank + 1)).backward()            # scaled grads, different per rank
        if rank == overflow_rank:
            w.grad[0] = float("inf")                             # only this rank's gradient overflows
        if mode == "ddp":                                        # DDP: average the gradients, then check
            dist.all_reduce(w.grad)                              # inf + finite = inf on every rank
            w.grad /= world
        scaler.step(torch.optim.SGD([w], lr=0.1))
        scaler.update()
        out[mode] = {"skipped": scaler.last_step_skipped, "scale": scaler.get_scale(), "w": w.detach().tolist()}
    return out


def amax(group_kinds=("none", "tp", "world"), tp: int = 2) -> dict:
    from mpcourse.core.quant import compute_scale

    rank, world = dist.get_rank(), dist.get_world_size()
    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]   # every rank creates all
    g = torch.Generator().manual_seed(rank // tp)                # one sequence per data-parallel replica
    x = torch.randn(8 * tp, 16, generator=g) * (1 + torch.arange(8 * tp)).unsqueeze(1)   # (seq, hidden) fp32
    x_mine = x.chunk(tp)[rank % tp]                              # sequence parallel: my rows of the sequence
    out = {"tp_group": rank // tp, "local_amax": float(x_mine.abs().max())}
    for kind in group_kinds:
        group = {"none": None, "tp": tp_groups[rank // tp], "world": dist.group.WORLD}[kind]
        a = x_mine.abs().max().reshape(1)                        # (1,) fp32, my amax
        if group is not None:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)   # the amax of what the group holds
        out[kind] = float(compute_scale(a[0], "e4m3"))           # E4M3 max / amax
    return out


def reduce(dtype_names=("fp32", "bf16"), n: int = 1 << 14) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    grad = torch.randn(n, generator=g) * 1e-3                    # (n,) fp32, this rank's gradient
    ref = grad.double()
    dist.all_reduce(ref)
    ref /= world                                                 # fp64 mean over the ranks
    out = {}
    for name in dtype_names:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        t = grad.to(dtype) / world                               # cast (rounds once), divide by 2^k (exact)
        dist.all_reduce(t)                                       # the sum rounds again, in dtype
        rel = (t.double() - ref).abs() / ref.abs().clamp_min(1e-30)   # relative to the exact mean
        out[name] = {"median": float(rel.median()), "p99": float(rel.quantile(0.99)), "max": float(rel.max())}
    return out


def _rank(rank, world, init_method, out_dir, worker, args):
    from mpcourse.experiment.distributed import ranks

    with ranks(rank, world, init_method, threads=1):
        result = worker(*args)
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def run(worker, world: int, *args) -> list:
    """``worker(*args)`` on ``world`` spawned gloo ranks; returns their results, rank 0's first."""
    from mpcourse.experiment.distributed import rendezvous, spawn

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    with tempfile.TemporaryDirectory() as d:
        spawn(_rank, world, (world, rendezvous(d), d, worker, args))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]
