"""``mpcourse compare --parallel ep``: the MoE recipes with their experts split over the ranks (expert parallelism).

Each rank holds E / nproc experts of every block (``core.experts.expert_parallel.ExpertParallelMoE``) and the whole
rest of the model (embeddings, attention, norms, routers), replicated as under DDP: every rank trains on its slice
of the batch, DDP averages the replicated parameters' gradients (``wrap_ddp``, the experts left out of it), and the
rows travel to their expert's rank and back by all-to-all in the ``--dispatch`` mode (``core.experts.dispatch``:
``fp8`` DeepSeek-V3's FP8 dispatch with a BF16 combine, ``bf16``, or ``fp32``, exact).

What one process computes, and what this does to match it (the losses of the whole batch, up to the order of the
additions, as DDP's; with ``--dispatch fp8`` or ``bf16``, one process running the same trips as a rule, ``dispatch``
set on its MoE layers):

* an expert's weight gradient collects the rows of every rank, each rank's loss a mean over its own slice, so it is
  nproc times the whole batch's: a gradient hook divides it by nproc (as DDP divides before it sums);
* gradient clipping needs the norm of the whole model's gradient: the replicated parameters' once, plus every
  rank's experts' (their squared norms all-reduced, SUM): ``clip_global_norm`` replaces the recipe's ``clip_grads``,
  with ``torch.nn.utils.clip_grad_norm_``'s coefficient (max_norm / (norm + 1e-6), at most 1);
* the balance loss takes the group's counts (``ExpertParallelMoE``).

The rows travel on a process group of their own (``dist.new_group``), beside the default one DDP reduces on.
``gather_dispatch_bytes``: every rank's bytes per training step (``DispatchLog.per_step``), gathered on every rank.
"""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from mpcourse.core.experts.dispatch import dispatch_mode
from mpcourse.core.experts.expert_parallel import DispatchLog, shard_experts
from .data_parallel import wrap_ddp


def clip_global_norm(recipe, optimizer, experts: set, group=None) -> float | None:
    """Clip the gradients of ``optimizer`` to the recipe's ``grad_clip`` by the norm of the whole model's gradient:
    the replicated parameters' (the same on every rank) and the experts' of every rank (``experts``: ids of this
    rank's), whose squares are all-reduced over ``group`` (every rank enters, whatever its gradients)."""
    if not recipe.optim.grad_clip:
        return None
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    squares = [torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)]   # replicated, experts
    for p in params:
        squares[id(p) in experts] += torch.linalg.vector_norm(p.grad.float()).square()
    mine = squares[1].reshape(1)
    dist.all_reduce(mine, group=group)                                          # SUM over the ranks' experts
    total = (squares[0] + mine[0]).sqrt()
    coef = (recipe.optim.grad_clip / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return float(total)


def expert_parallel_recipe(trainer, recipe_cls, model):
    """``DataParallelTrainer.build_recipe`` under ``--parallel ep`` (see the module docstring): the recipe over
    ``model`` with this rank's experts, and the DDP module that trains it. Sets on ``trainer`` its experts'
    ``group`` (timeout ``trainer.timeout_s``) and ``dispatch_log``. ValueError for a recipe without MoE layers."""
    recipe = recipe_cls(model, trainer.cfg.optim)
    trainer.group = dist.new_group(timeout=datetime.timedelta(seconds=trainer.timeout_s))
    trainer.dispatch_log = DispatchLog()
    names = shard_experts(recipe.model, trainer.group, trainer.dispatch, trainer.dispatch_log)
    if not names:
        raise ValueError(f"recipe {recipe_cls.name!r} has no mixture-of-experts layer for --parallel ep")
    experts = [p for n, p in recipe.model.named_parameters() if n in names]
    for p in experts:                                 # every rank's rows: nproc x the batch mean's gradient
        p.register_hook(functools.partial(torch.div, other=trainer.world))
    recipe.optimizer = recipe.make_optimizer(list(recipe.model.parameters()))   # over this rank's experts
    recipe.clip_grads = functools.partial(clip_global_norm, recipe, experts={id(p) for p in experts},
                                          group=trainer.group)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(recipe.model, names)
    return recipe, wrap_ddp(recipe.model, trainer.reduce_dtype)     # the replicated parameters, averaged


def gather_dispatch_bytes(log: DispatchLog, steps: int, group=None) -> list[dict]:
    """Every rank's bytes per training step (``DispatchLog.per_step``), rank by rank (a collective)."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, log.per_step(steps), group=group)
    return every


def dispatch_lines(mode: str, gathered: dict) -> list[str]:
    """One line per row: each rank's bytes sent per training step in the all-to-alls (and the counts), and the
    same rows with the BF16 dispatch."""
    m = dispatch_mode(mode)
    lines = []
    for name, ranks in gathered.items():
        sent = ", ".join(f"rank {r} {b['sent']:,.0f} B" for r, b in enumerate(ranks))
        bf16 = ", ".join(f"{b['bf16']:,.0f} B" for b in ranks)
        ratio = sum(b["sent"] for b in ranks) / max(sum(b["bf16"] for b in ranks), 1)
        lines.append(f"{name}: expert-parallel all-to-all per rank per step ({m.to_experts} to the experts, "
                     f"{m.from_experts} back; payload + scales + counts): {sent}; the same rows with the BF16 "
                     f"dispatch: {bf16} ({ratio:.3f} of BF16)")
    return lines
