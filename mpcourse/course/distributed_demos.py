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
* ``reduce``: the mean of the ranks' gradients all-reduced in FP32 or BF16 against an FP64 reference; the error
  relative to the mean and relative to the mean of the magnitudes (the quantity the rounding bound is about).
* ``sharding``: one AdamW step of a small MLP in ZeRO's mixed-precision Adam (BF16 working weights and gradients,
  FP32 master and moments) under DDP, ZeRO-1, ZeRO-2 and FSDP2; the bytes each rank holds after the step, by
  kind, counted from the live tensors by ``mpcourse.experiment.recipes.held.count_bytes`` (the course's one counter).

The FP8 all-gather of section 5 trains a small FSDP2 model; its worker is in ``fp8_all_gather_demo``.
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
    ref, mag = grad.double(), grad.double().abs()
    dist.all_reduce(ref)
    dist.all_reduce(mag)
    ref /= world                                                 # fp64 mean over the ranks
    mag /= world                                                 # fp64 mean of the ranks' |gradient|
    out = {}
    for name in dtype_names:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        t = grad.to(dtype) / world                               # cast (rounds once), divide by 2^k (exact)
        dist.all_reduce(t)                                       # the sum rounds again, in dtype
        err = (t.double() - ref).abs()                           # (n,) fp64, |reduced - exact mean|
        rel = err / ref.abs().clamp_min(1e-30)                   # relative to the exact mean
        out[name] = {"median": float(rel.median()), "p99": float(rel.quantile(0.99)), "max": float(rel.max()),
                     "max_vs_magnitudes": float((err / mag).max())}   # relative to the mean of |addends|
    return out


LAYOUTS = ("ddp", "zero1", "zero2", "fsdp2")


def _zero_step(model, x, layout: str) -> tuple[dict, torch.Tensor]:
    """One step of ZeRO's mixed-precision Adam by hand, on flat buffers: ``"ddp"`` every rank holds everything;
    ``"zero1"`` each rank holds the FP32 master and moments of its 1/N slice of the parameters; ``"zero2"`` the
    gradients too (reduce-scatter, not all-reduce). Returns (tensors held after the step by kind, BF16 weights)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model.bfloat16()                                     # working weights: BF16, whole, every rank
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    lo, hi = (0, n) if layout == "ddp" else (rank * n // world, (rank + 1) * n // world)   # this rank's slice
    master = torch.nn.Parameter(torch.cat([p.detach().float().flatten() for p in params])[lo:hi].clone())  # fp32
    opt = torch.optim.AdamW([master], lr=1e-3, foreach=False)
    model(x.bfloat16()).float().square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in params]).div_(world)   # (n,) bf16, divided by 2^k: exact
    for p in params:
        p.grad = None
    if layout == "zero2":                                        # each rank keeps the sum of its slice only
        mine = torch.empty(hi - lo, dtype=torch.bfloat16)
        dist.reduce_scatter_single(mine, grads)
        del grads
        held_grads = [mine]
    else:                                                        # every rank holds the whole averaged gradient
        dist.all_reduce(grads)
        mine, held_grads, offset = grads[lo:hi], [grads], 0
        for p in params:                                         # p.grad: views of the one buffer (as DDP's)
            p.grad, offset = grads[offset:offset + p.numel()].view_as(p), offset + p.numel()
    master.grad = mine.float()                                   # a transient FP32 copy, freed after the step
    opt.step()
    master.grad = None
    new = master.detach().bfloat16()                             # (hi - lo,) bf16: my slice, updated
    if layout != "ddp":
        whole = torch.empty(n, dtype=torch.bfloat16)
        dist.all_gather_single(whole, new)                       # every rank gets every slice
        new = whole
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(new[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]   # Adam's m and v
    return {"weights": params, "grads": held_grads, "master": [master], "optimizer": state}, new


def _fsdp2_step(model, x) -> tuple[dict, torch.Tensor]:
    """The same step under FSDP2: the FP32 parameters, sharded, are the master; ``param_dtype`` makes the BF16
    working copy of one layer at a time (freed after use); BF16 gradients reduce-scattered onto FP32 shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with torch.no_grad():                                        # the master starts from the BF16 weights, as
        for p in model.parameters():                             # the other layouts' (whose master is a copy)
            p.copy_(p.bfloat16().float())
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())                            # DTensors: this rank's rows of each weight
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    model(x).float().square().mean().backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    weights = torch.cat([p.full_tensor().detach().flatten() for p in params]).bfloat16()   # (n,) gathered
    return {"weights": [], "grads": [p.grad for p in params], "master": params, "optimizer": state}, weights


def sharding(layouts=LAYOUTS, width: int = 64, depth: int = 4) -> dict:
    """Per layout of ``LAYOUTS``: one AdamW step of a ``depth``-layer MLP of ``width x width`` weights; ``bytes``
    this rank holds after the step by kind (weights, grads, master, optimizer; ``count_bytes``, each storage
    once), ``n_params``, and the BF16 ``weights`` after the step, flat (n_params,). No biases, and 64 rows over
    2 or 4 ranks pad no shard, so the counts are exact. Sources: Rajbhandari et al. 2020, "ZeRO", §3.1
    (16 B per parameter) and §5 (the stages)."""
    from mpcourse.experiment.recipes.held import count_bytes

    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout {unknown[0]!r}: pick from {', '.join(LAYOUTS)}")
    rank = dist.get_rank()
    out = {}
    for layout in layouts:
        torch.manual_seed(0)                                     # the same FP32 initial weights on every rank
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
        n = sum(p.numel() for p in model.parameters())
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))   # (8, width) fp32, my rows
        held, weights = _fsdp2_step(model, x) if layout == "fsdp2" else _zero_step(model, x, layout)
        out[layout] = {"bytes": count_bytes(held), "n_params": n, "weights": weights}
    return out


def _rank(rank, world, init_method, out_dir, worker, args):
    from mpcourse.experiment.parallel.distributed import ranks

    with ranks(rank, world, init_method, threads=1):
        result = worker(*args)
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def run(worker, world: int, *args) -> list:
    """``worker(*args)`` on ``world`` spawned gloo ranks; returns their results, rank 0's first."""
    from mpcourse.experiment.parallel.distributed import rendezvous, spawn

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    with tempfile.TemporaryDirectory() as d:
        spawn(_rank, world, (world, rendezvous(d), d, worker, args))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]
