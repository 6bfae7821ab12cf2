"""The few ``torch.distributed`` collectives the library needs, safe to call in a single process.

Loss scalers and FP8 delayed scaling each keep a small state (an inf/NaN flag, amaxes) that every rank must
agree on before a decision, or the ranks' weights and scales drift apart. The rule: reduce with MAX over the
process group, so one rank's overflow or large amax is every rank's. Transformer Engine reduces amaxes this way
(``reduce_and_update_fp8_tensors``). FSDP's ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py,
``_unscale_grads_``) all-reduces found_inf with the default SUM and then only asks "nonzero?": the same decision
for a 0/1 flag, but the sum of N flags is not itself a flag, so the course takes MAX. A NaN takes part as
``torch.maximum`` takes it (``all_reduce_max_``), so every rank sees what one process would.

Both helpers are no-ops (no collective, no error) when torch.distributed is unavailable, not initialized, or
the group has one rank, so single-process code calls them unconditionally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    """Number of ranks in ``group`` (None: the default group); 1 when torch.distributed is not initialized."""
    if not is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_max_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In place: every rank's ``t`` becomes the elementwise MAX of ``t`` over the ranks of ``group``, where a NaN on
    any rank is a NaN on every rank.

    t: a tensor of the same shape and dtype on every rank, on a device the group's backend supports (gloo: CPU,
    nccl: CUDA). Returns ``t``. A no-op when ``world_size(group) == 1``. The call is collective: every rank of
    the group must make it, in the same order as its other collectives, or the ranks wait on each other; so a
    caller makes it whatever its data (an empty tensor's amax is 0, which MAX over amaxes >= 0 ignores).

    The rule: the result is ``torch.stack([t of each rank]).amax(0)``, which propagates NaN (and keeps inf), i.e.
    one process's amax over the union of the ranks' tensors. The backends' MAX does not say what a NaN does, and
    gloo's keeps or drops it depending on which rank holds it (measured on torch 2.13: a NaN on rank 0 wins; on
    rank 1 of 2 it is dropped; on rank 1 of 3 the third rank's values are dropped too). NCCL drops it ("max(NAN,
    3) = 3 in NCCL AllReduce", Azure/MS-AMP PR #58, which maps NaN to inf first); NVIDIA/TransformerEngine#3550 asks
    for NaN-preserving amax reductions. Here a floating ``t`` travels as one tensor ``(t with NaN -> -inf, isnan(t)
    as 0/1)``, reduced with MAX (now NaN-free, so exact and order-free), and each element whose flag came back 1
    becomes NaN; integer and bool tensors have no NaN and reduce as they are. Same collective count as a plain
    MAX (one), twice the bytes.
    """
    if world_size(group) <= 1:
        return t
    if not t.is_floating_point():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t
    nan = torch.isnan(t)
    n = t.numel()
    packed = torch.cat([t.masked_fill(nan, float("-inf")).reshape(n), nan.reshape(n).to(t.dtype)])   # (2n,)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    t.copy_(packed[:n].masked_fill(packed[n:] > 0, float("nan")).reshape(t.shape))
    return t
