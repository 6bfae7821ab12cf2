"""Expert parallelism: each rank holds E / world experts; rows travel to their expert's rank and back (all-to-all).

``ExpertParallelMoE`` is ``MoEFeedForward`` with its experts split evenly over the ranks of a process group, rank r
holding experts ``r * E / W .. (r + 1) * E / W - 1`` (``expert_range``); the router, the shared expert and the rest
of the model are replicated (their gradients averaged as DDP averages them: ``mpcourse.experiment.parallel``). One
forward, on every rank whatever its tokens (every step below is a collective that every rank of the group enters,
also with no row to send or none to receive, so no rank waits on another)::

    counts (E,) of this rank's rows -> all_gather -> table (W, E): every rank's rows per expert   (int64)
    rows (A, C), grouped by expert, so by destination rank -> all_to_all (send = table[rank] per rank,
        recv = table[:, mine] per source) -> (R, C) source rank by source rank, each in expert order
    stable sort by local expert -> (R, C) grouped by expert: within an expert, rank 0's rows, then rank 1's ...
        -> the local experts (``run_experts``) -> unsort -> all_to_all back -> (A, C) in this rank's row order

That is the row order one process gives the union of the ranks' tokens (rank 0's batch rows first): an expert sees
its rows in the same order, in one GEMM of the same size. The rows cross in the dispatch mode's wires
(``dispatch``): FP8 towards the experts, BF16 back (DeepSeek-V3), or BF16 / FP32 both ways; the backward sends the
gradients the other way, each on its direction's wire (``AllToAll``). gloo runs ``all_to_all_single`` with uneven
splits and empty tensors on the CPU (torch 2.13, checked), FP8 rows as their uint8 bytes.

The balance loss of a rank uses the whole group's counts (f_e of every rank's rows) and the rank's own mean router
probabilities P_e, so its mean over the ranks, and its gradient once averaged, is one process's (equal batches per
rank); ``tokens_per_expert`` and ``routed`` are the group's counts, as one process counts them.

Bytes (``DispatchLog``): what this rank sends to the other ranks while training (rows to its own experts stay, and
are not counted), per collective: the counts (E x 8 B to each other rank), each all-to-all's rows times the wire's
``bytes_per_row``. Sources: DeepSeek-V3 (arXiv 2412.19437) 3.3.3; torchtitan's expert parallel (all-to-all of the
counts, then of the tokens); Megatron-Core's token dispatcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .dispatch import DispatchMode, bytes_per_row, decode, dispatch_mode, encode
from .formats import GroupedFormat
from .grouping import group_tokens
from .layer import MoEFeedForward


def expert_range(rank: int, world: int, n_experts: int) -> tuple[int, int]:
    """(first, end) of the experts ``rank`` holds: E / world consecutive ones; ValueError when world does not
    divide E."""
    if n_experts % world:
        raise ValueError(f"{n_experts} experts cannot be split evenly over {world} ranks: use a number of ranks that "
                         f"divides {n_experts}")
    per = n_experts // world
    return rank * per, (rank + 1) * per


@dataclass
class DispatchLog:
    """What this rank sent to the other ranks while training: one dict per collective, ``what`` ("counts",
    "dispatch", "combine"), ``pass`` ("forward", "backward"), ``wire``, ``rows``, ``bytes`` and ``values`` (rows x C,
    0 for counts)."""

    calls: list = field(default_factory=list)

    def add(self, what: str, pass_: str, wire: str, rows: int, nbytes: int, values: int) -> None:
        self.calls.append({"what": what, "pass": pass_, "wire": wire, "rows": rows, "bytes": nbytes,
                           "values": values})

    def per_step(self, steps: int) -> dict:
        """Bytes per training step: ``sent`` (measured), by ``what pass`` (e.g. "dispatch forward"), and the same
        rows with every trip in BF16 (``bf16``) and FP32 (``fp32``), counts included in each."""
        steps = max(steps, 1)
        counts = sum(c["bytes"] for c in self.calls if c["what"] == "counts")
        values = sum(c["values"] for c in self.calls)
        by = {}
        for c in self.calls:
            key = f"{c['what']} {c['pass']}"
            by[key] = by.get(key, 0) + c["bytes"] / steps
        return {"sent": sum(c["bytes"] for c in self.calls) / steps,
                "bf16": (counts + bytes_per_row(values, "bf16")) / steps,
                "fp32": (counts + bytes_per_row(values, "fp32")) / steps, "by": by,
                "wires": sorted({c["wire"] for c in self.calls if c["what"] != "counts"})}


def exchange_counts(counts: torch.Tensor, group=None, log: Optional[DispatchLog] = None) -> torch.Tensor:
    """counts (E,) int64 of this rank -> (W, E): row r is rank r's counts (one all_gather, entered by every rank)."""
    world = dist.get_world_size(group)
    table = counts.new_empty(world * counts.numel())
    dist.all_gather_single(table, counts.contiguous(), group=group)
    if log is not None:
        log.add("counts", "forward", "int64", 0, counts.numel() * counts.element_size() * (world - 1), 0)
    return table.view(world, -1)


def send_rows(rows: torch.Tensor, send: list[int], recv: list[int], wire: str, group=None,
              log: Optional[DispatchLog] = None, what: str = "dispatch", pass_: str = "forward") -> torch.Tensor:
    """rows (sum(send), C), ``send[r]`` of them for rank r in rank order -> (sum(recv), C) in rows' dtype,
    ``recv[r]`` from rank r: encoded on ``wire``, one ``all_to_all_single``, decoded (``dispatch``)."""
    sent = encode(rows, wire)                                                   # (sum(send), bytes or C)
    got = sent.new_empty(sum(recv), sent.shape[1])
    dist.all_to_all_single(got, sent, recv, send, group=group)
    if log is not None:
        others = sum(send) - send[dist.get_rank(group)]
        log.add(what, pass_, wire, others, others * sent.shape[1] * sent.element_size(), others * rows.shape[1])
    return decode(got, wire, rows.shape[1], rows.dtype)


class AllToAll(torch.autograd.Function):
    """``send_rows`` forward on ``wire``; its gradient goes back by the reverse splits on ``back``."""

    @staticmethod
    def forward(ctx, rows, send, recv, wire: str, back: str, group, log, what: str):
        ctx.send, ctx.recv, ctx.back, ctx.group, ctx.log, ctx.what = send, recv, back, group, log, what
        return send_rows(rows, send, recv, wire, group, log, what, "forward")

    @staticmethod
    def backward(ctx, grad):
        other = "combine" if ctx.what == "dispatch" else "dispatch"         # the gradient's trip is the other one
        dx = send_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.back, ctx.group, ctx.log, other, "backward")
        return dx, None, None, None, None, None, None, None


class ExpertParallelMoE(MoEFeedForward):
    """``layer``'s experts split over ``group`` (see the module docstring); this rank keeps its E / W of them.

    Built from a ``MoEFeedForward`` whose weights are the same on every rank: the router (and shared expert) are
    ``layer``'s own parameters, the experts ``w_in`` (E/W, H, C) and ``w_out`` (E/W, C, H) copies of this rank's
    slices. ``dispatch``: a ``DISPATCH_MODES`` name; ``log``: a ``DispatchLog`` that counts the training bytes."""

    def __init__(self, layer: MoEFeedForward, group=None, dispatch="fp8", log: Optional[DispatchLog] = None):
        nn.Module.__init__(self)
        self.group, self.log, self.mode = group, log, dispatch_mode(dispatch)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.end = expert_range(self.rank, self.world, layer.n_experts)
        self.top_k, self.router_dtype, self.expert_format = layer.top_k, layer.router_dtype, layer.expert_format
        self.router = layer.router                                                   # (E, C), replicated
        self.w_in = nn.Parameter(layer.w_in.detach()[self.first:self.end].clone())   # (E/W, H, C)
        self.w_out = nn.Parameter(layer.w_out.detach()[self.first:self.end].clone())  # (E/W, C, H)
        self.shared_fc, self.shared_proj = layer.shared_fc, layer.shared_proj
        self.aux_loss, self.tokens_per_expert = None, None
        self.routed, self.flipped, self.dispatch = layer.routed.clone(), layer.flipped, None

    def experts(self, rows: torch.Tensor, counts: torch.Tensor, fmt: GroupedFormat
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (A, C) grouped by expert, ``counts`` (E,) -> (each row's expert output (A, C), the group's counts)."""
        mode, log = self.mode, self.log if self.training else None
        table = exchange_counts(counts, self.group, log)                             # (W, E)
        mine = table[:, self.first:self.end]                                         # (W, E/W) rows I receive
        send = table[self.rank].view(self.world, -1).sum(1).tolist()                 # rows to each rank
        recv = mine.sum(1).tolist()                                                  # rows from each rank
        got = AllToAll.apply(rows, send, recv, mode.to_experts, mode.from_experts, self.group, log, "dispatch")
        local = torch.arange(self.end - self.first, device=rows.device).repeat(self.world)       # (W E/W,)
        order, local_counts = group_tokens(torch.repeat_interleave(local, mine.flatten()), self.end - self.first)
        y = self.run_experts(got[order], local_counts, fmt)                          # (R, C) grouped by expert
        y = y[torch.argsort(order)]                                                  # (R, C) as received
        back = AllToAll.apply(y, recv, send, mode.from_experts, mode.to_experts, self.group, log, "combine")
        return back, table.sum(0)


def shard_experts(model: nn.Module, group=None, dispatch="fp8", log: Optional[DispatchLog] = None) -> list[str]:
    """Replace every ``MoEFeedForward`` of ``model`` by its ``ExpertParallelMoE`` over ``group`` (in place); the
    names of the expert parameters this rank now holds (each rank's own: not to be averaged or broadcast)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoEFeedForward) and not isinstance(child, ExpertParallelMoE):
                setattr(parent, name, ExpertParallelMoE(child, group, dispatch, log))
    return [f"{prefix}.{p}" for prefix, m in model.named_modules() if isinstance(m, ExpertParallelMoE)
            for p in ("w_in", "w_out")]


__all__ = ["AllToAll", "DispatchLog", "DispatchMode", "ExpertParallelMoE", "exchange_counts", "expert_range",
           "send_rows", "shard_experts"]
