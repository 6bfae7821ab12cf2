"""The few ``torch.distributed`` collectives the library needs, safe to call in a single process.

Loss scalers and FP8 delayed scaling each keep a small state (an inf/NaN flag, amaxes) that every rank must
agree on before a decision, or the ranks' weights and scales drift apart. The rule: reduce with MAX over the
process group, so one rank's overflow or large amax is every rank's. Transformer Engine reduces amaxes this way
(``reduce_and_update_fp8_tensors``). FSDP's ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py,
``_unscale_grads_``) all-reduces found_inf with the default SUM and then only asks "nonzero?": the same decision
for a 0/1 flag, but the sum of N flags is not itself a flag, so the course takes MAX.

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
    """In place: every rank's ``t`` becomes the elementwise MAX of ``t`` over the ranks of ``group``.

    t: a tensor of the same shape and dtype on every rank, on a device the group's backend supports (gloo: CPU,
    nccl: CUDA). Returns ``t``. A no-op when ``world_size(group) == 1``. The call is collective: every rank of
    the group must make it, in the same order as its other collectives, or the ranks wait on each other.
    """
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
