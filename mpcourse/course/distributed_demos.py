"""Lesson 10's experiments, run on two gloo ranks spawned from the notebook (a spawned process imports its
worker function, so the workers live here, not in the notebook).

``run_demos()`` starts the ranks once and returns what each measured, by experiment:

* ``overflow``: one rank's gradient shard (a plain tensor, as a ZeRO rank holds it) overflows; the course's
  ``DynamicLossScaler`` deciding per rank (a one-rank process group) vs all-reducing its flag (the default
  group, FSDP ``ShardedGradScaler`` semantics).
* ``amax``: a ``Float8Linear`` with delayed scaling, each rank seeing different activations; scales with
  ``reduce_amax=True`` (TE's default: MAX over the ranks) and ``False``.
* ``reduce``: the mean of the ranks' gradients all-reduced in FP32 and in BF16, against an FP64 reference.
* ``bytes``: bytes per parameter per rank, measured after one step of a small GPT under DDP, DDP with torch's
  ``ZeroRedundancyOptimizer`` (ZeRO-1: optimizer state sharded) and FSDP2 (ZeRO-3), for ``fp32`` and
  ``fp16-master``.
* ``allgather``: the bytes one all-gather of a weight moves in FP32 and in FP8 (E4M3 payload plus its scale),
  and whether the FP8 GEMM after it sees the same operand either way.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

WORLD = 2


def _overflow(group):
    from mpcourse.core.scaling import DynamicLossScaler

    w = torch.nn.Parameter(torch.ones(4))                      # this rank's shard of the weights, fp32
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**16, process_group=group)
    scaler.scale(w.sum()).backward()
    if dist.get_rank() == 1:
        w.grad[0] = float("inf")                               # only rank 1's shard overflows
    scaler.step(opt)
    scaler.update()
    return {"skipped": scaler.last_step_skipped, "scale": scaler.get_scale(), "w0": float(w.detach()[1])}


def _amax():
    from mpcourse.core.quant import DelayedScaling, Float8Linear, fp8_autocast

    out = {}
    for reduce_amax in (False, True):
        torch.manual_seed(0)
        recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
        layer = Float8Linear(16, 16, bias=False, recipe=recipe)
        x = torch.full((4, 16), 2.0 * (dist.get_rank() + 1))   # rank 0: amax 2, rank 1: amax 4
        with fp8_autocast(fp8_recipe=recipe):
            layer(x).sum().backward()
        out[reduce_amax] = float(layer.scaling_state["input"].scale)
    return out


def _reduce():
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    grad = torch.randn(1 << 14, generator=g) * 1e-3            # (n,) fp32, this rank's gradient
    ref = grad.double()
    dist.all_reduce(ref)
    ref /= WORLD                                               # fp64 mean over the ranks
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t = grad.to(dtype) / WORLD                             # divide first, as DDP does
        dist.all_reduce(t)
        err = ((t.double() - ref).abs() / ref.abs().clamp_min(1e-12)).median()
        out[name] = float(err)
    return out


def _bytes():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from mpcourse.experiment.data import load_corpus
    from mpcourse.experiment.distributed import DataParallelTrainer
    from mpcourse.experiment.model import GPTConfig
    from mpcourse.experiment.train import TrainConfig

    cfg = TrainConfig(steps=1, batch_size=4, eval_interval=1000, eval_batches=1,
                      model=GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=64))
    corpus = load_corpus(None)
    out = {}
    for parallel in ("ddp", "fsdp"):
        for name in ("fp32", "fp16-master"):
            t = DataParallelTrainer(name, corpus, cfg, parallel)
            t.train_step()
            n = sum(p.numel() for p in t.recipe.model.parameters())
            out[(parallel, name)] = {k: v / n for k, v in t.memory.items()}
    # ZeRO-1: DDP replicas, AdamW state sharded by torch's ZeroRedundancyOptimizer
    t = DataParallelTrainer("fp32", corpus, cfg, "ddp")
    params = list(t.recipe.model.parameters())
    t.recipe.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
    t.train_step()
    n = sum(p.numel() for p in params)
    state = sum(v.nbytes for s in t.recipe.optimizer.optim.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    out[("zero1", "fp32")] = {"weights": 4.0, "grads": 4.0, "master": 0.0, "optimizer": state / n}
    return out


def _allgather():
    from mpcourse.core.quant import compute_scale, to_float8

    g = torch.Generator().manual_seed(7)
    full = torch.randn(256, 256, generator=g) * 0.02           # (256, 256) fp32, the whole weight
    shard = full.chunk(WORLD)[dist.get_rank()]                 # (128, 256) fp32, this rank's rows
    gathered32 = [torch.empty_like(shard) for _ in range(WORLD)]
    dist.all_gather(gathered32, shard)                         # moves 4 B per element
    amax = shard.abs().max().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)                # one scale for the whole weight
    scale = compute_scale(amax[0], "e4m3")
    q = to_float8(shard, "e4m3", scale)
    payload = q.data.view(torch.uint8)                         # (128, 256) e4m3 bits
    gathered8 = [torch.empty_like(payload) for _ in range(WORLD)]
    dist.all_gather(gathered8, payload)                        # moves 1 B per element (+ the scale)
    w8 = torch.cat(gathered8).view(q.data.dtype)               # (256, 256) e4m3
    w8_after = to_float8(torch.cat(gathered32), "e4m3", scale).data   # gather FP32, then quantize
    return {"fp32_bytes": sum(t.nbytes for t in gathered32), "fp8_bytes": sum(t.nbytes for t in gathered8) + 4,
            "same_operand": bool(torch.equal(w8.view(torch.uint8), w8_after.view(torch.uint8)))}


def _rank(rank, init_method, out_dir):
    from mpcourse.experiment.distributed import ranks

    with ranks(rank, WORLD, init_method, threads=1):
        solo = [dist.new_group([r]) for r in range(WORLD)][rank]   # every rank creates every group
        res = {"overflow": {"alone": _overflow(solo), "all-reduce": _overflow(None)}, "amax": _amax(),
               "reduce": _reduce(), "bytes": _bytes(), "allgather": _allgather()}
        del solo
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


def run_demos() -> list[dict]:
    """Run every experiment on two gloo ranks; returns [rank 0's results, rank 1's results]."""
    from mpcourse.experiment.distributed import rendezvous, spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(_rank, WORLD, (rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(WORLD)]
