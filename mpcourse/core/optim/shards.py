"""The blocks of a blockwise-quantized optimizer moment when each rank holds only some rows of it (FSDP2).

``mpcourse.core.optim.fp8`` and ``optim.int8`` quantize a moment in blocks of ``block_size`` consecutive
elements of the tensor read flat, one scale per block (torchao's ``AdamWFp8`` / ``AdamW8bit``). Under FSDP2 a
parameter is a DTensor sharded by rows (``Shard(0)``, ``torch.chunk``'s split: ``ceil(rows / N)`` rows per
rank, the last ranks shorter or empty), so a rank holds a run of consecutive flat elements that need not
start or end on a block boundary: 144 rows of 48 on 2 ranks are 13.5 blocks of 256 each, 64 rows of 64 on 3
ranks (22, 22 and 20 rows) 5.5, 5.5 and 5.

The rule here: the blocks stay the whole tensor's. A rank's run is padded with zeros to whole blocks, each
block's amax over the rank's elements is taken, and the amaxes are all-reduced with MAX over the ranks (a max
is exact in any order, and the zeros of the padding never exceed an ``|x|``): every rank gets the amax the
whole tensor's block has, so every scale is the one-process scale and every code (an elementwise function of
the element and its block's scale) the one-process code. The optimizer's numbers do not depend on the number
of ranks: one all-reduce per moment and parameter per step, of one FP32 value per block, buys that; each rank
keeps every block's scale (4 bytes per 256 elements of the whole tensor per moment, replicated) beside the codes
of its own rows. torchao does otherwise: ``_AdamBase._new_buffer`` (torchao/optim/adam.py, 0.18) quantizes each
rank's local shard in blocks of its own and keeps full-precision moments on a rank whose shard has under 4096
elements or a ``numel`` that is not a multiple of the block size, so its FSDP2 numbers change with the number
of ranks (and differ from one process) wherever a shard boundary cuts a block (pytorch/ao#4912; its proposed fix,
ao PR #4913, refuses a shard that cuts a block).

Where the two can differ: a NaN moment (from a NaN gradient). One process's block amax is then NaN and so are all
the block's codes; a MAX all-reduce (gloo, NCCL) need not carry a NaN through, so a sharded block may keep finite
codes beside the NaN element. The weight that got the NaN gradient is NaN either way.

Supported: a DTensor on a one-dimensional mesh, sharded by rows (``Shard(0)``) or replicated; a plain tensor is
a run that covers the whole tensor (no collective). Anything else is refused with a ValueError.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..distributed import all_reduce_max_


@dataclass(frozen=True)
class Span:
    """Where this rank's elements lie in a tensor read flat: ``numel`` elements from ``offset``, of ``total``;
    ``group`` is the process group that holds the rest (None: this rank holds all of it)."""

    offset: int
    numel: int
    total: int
    group: object = None

    @property
    def whole(self) -> bool:
        return self.numel == self.total


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor, ``t`` itself otherwise."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def span_of(p: torch.Tensor) -> Span:
    """The ``Span`` of this rank's part of ``p`` (a DTensor sharded by rows, or any tensor: the whole of it)."""
    if type(p).__name__ != "DTensor":
        return Span(0, p.numel(), p.numel())
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    if placements == (Replicate(),):
        return Span(0, p.numel(), p.numel())
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"a blockwise-quantized moment supports DTensors on a one-dimensional mesh sharded by "
                         f"rows (FSDP2's Shard(0)) or replicated; got placements {placements} on a {mesh.ndim}-D "
                         "mesh: shard the parameter with fully_shard on a 1-D mesh")
    rows, row_numel = p.shape[0], math.prod(p.shape[1:])
    per_rank = -(-rows // mesh.size())                                        # torch.chunk: ceil(rows / N)
    start = min(mesh.get_local_rank() * per_rank, rows)
    mine = min(per_rank, rows - start)
    if local(p).shape[0] != mine:
        raise ValueError(f"the local shard has {local(p).shape[0]} rows where torch.chunk's split gives {mine}: "
                         "shard the parameter with fully_shard (Shard(0), torch.chunk's split)")
    return Span(start * row_numel, mine * row_numel, p.numel(), mesh.get_group())


def to_blocks(x: torch.Tensor, span: Span, block_size: int) -> tuple[torch.Tensor, int]:
    """This rank's elements ``x`` (any shape, ``span.numel`` elements) padded with zeros to the whole tensor's
    blocks that they touch -> ((k, block_size) of x's dtype, index of the first of those k blocks)."""
    first = span.offset // block_size
    head = span.offset - first * block_size                                    # elements of block `first` before x
    k = -(-(head + span.numel) // block_size) if span.numel else 0
    padded = x.new_zeros(k * block_size)
    padded[head:head + span.numel] = x.reshape(-1)
    return padded.reshape(k, block_size), first


def from_blocks(blocks: torch.Tensor, span: Span, block_size: int, shape) -> torch.Tensor:
    """Inverse of ``to_blocks``: the ``span.numel`` elements of ``blocks`` (k, block_size) that are this rank's,
    shaped ``shape``."""
    head = span.offset - (span.offset // block_size) * block_size
    return blocks.reshape(-1)[head:head + span.numel].reshape(shape)


def block_amax(blocks: torch.Tensor, first: int, span: Span, block_size: int) -> torch.Tensor:
    """The whole tensor's block amaxes (total // block_size,) fp32, the same on every rank: this rank's padded
    ``blocks`` (k, block_size) give blocks ``first .. first + k - 1``, zeros elsewhere, then MAX over the ranks
    (collective: every rank of ``span.group`` calls it, in the same order)."""
    amax = blocks.new_zeros(span.total // block_size, dtype=torch.float32)    # (B,)
    if blocks.numel():
        amax[first:first + blocks.shape[0]] = blocks.abs().amax(-1)
    return all_reduce_max_(amax, span.group)


def shard_like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (this rank's part, shaped like ``local(p)``) as a tensor placed as ``p``: a DTensor with ``p``'s mesh,
    placements, shape and stride when ``p`` is one (torchao's ``_new_buffer`` wraps its state so too), else ``t``."""
    if type(p).__name__ != "DTensor":
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def replicated_like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (the same on every rank) as a replicated DTensor on ``p``'s mesh when ``p`` is a DTensor, else ``t``:
    a checkpoint (torch.distributed.checkpoint) then writes it once."""
    if type(p).__name__ != "DTensor":
        return t
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t, p.device_mesh, (Replicate(),), run_check=False)
