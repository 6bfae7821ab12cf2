"""Token grouping for a mixture of experts: tokens sorted into one contiguous group per expert, each group padded.

A router sends each token to k experts. An expert's GEMM wants its tokens next to each other, so the (token,
expert) assignments are sorted by expert (a stable sort: within a group, tokens keep their order) and the groups
are described as ``torch._grouped_mm`` takes them, by int32 *offsets*: the end row of each group::

    counts  = [3, 0, 5, 2]          tokens per expert
    offs    = [3, 3, 8, 10]         group ends (int32), group e is rows offs[e-1] .. offs[e]

Low-precision grouped GEMMs want each group's row count to be a multiple of an *alignment* (``ALIGNMENT``): 16 for
FP8 (the GEMM's operands in multiples of 16 bytes), 32 for MXFP8 (the weight gradient contracts over tokens in
blocks of 32), 128 for DeepSeek-V3's 1x128 tiles (their weight gradient contracts over tokens in tiles of 128,
DeepGEMM's "contiguous layout" aligns every expert to 128 rows). Sources: torchtitan
``set_token_group_alignment_size_m`` (BF16 8, FP8 16, MXFP8 32); Transformer Engine ``Fp8Padding`` (32 for MXFP8,
16 otherwise); torchao ``pad_token_groups``. Each group is padded with zero rows up to the next multiple, an
empty group stays empty (torchao's ``torch_pad_token_groups`` gives the same offsets)::

    alignment 4:  padded_offs = [4, 4, 12, 16]      rows 3, 10, 11, 14, 15 are padding

``pad_groups`` writes every token to its padded row in one ``index_copy`` and every other row is exactly zero;
``unpad_groups`` reads them back with one ``index_select``; the row map (``TokenGroups.index``) is built with
``repeat_interleave``, never a Python loop over tokens. Both are differentiable: the gradient of a padded row is
dropped, and ``unpad_groups``' backward writes exact zeros into the padded rows of the gradient it returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: rows each expert's token group is padded to a multiple of, per grouped-GEMM format (see the module docstring).
#: FP32 needs none; BF16/FP16 8 is torchtitan's default (newer kernels take 1); the FP8 formats follow the GEMM's
#: operand alignment (16) or the block the weight gradient contracts over tokens in (MXFP8 32, 1x128 tiles 128).
ALIGNMENT = {"fp32": 1, "bf16": 8, "fp16": 8, "fp8-rowwise": 16, "fp8-block": 128, "mxfp8": 32}


def round_up(n: torch.Tensor, multiple: int) -> torch.Tensor:
    """Each element of the int tensor ``n`` rounded up to a multiple of ``multiple`` (0 stays 0)."""
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TokenGroups:
    """Where each expert's tokens sit, before and after padding.

    Fields:
      counts:      (E,) int64, tokens per expert (the real rows of each group).
      offs:        (E,) int32, group ends without padding (``torch._grouped_mm``'s ``offs``).
      padded_offs: (E,) int32, group ends after padding each group to a multiple of ``alignment``.
      alignment:   the multiple (1: no padding).
      rows:        rows of the padded tensor: ``padded_offs[-1]``, or more (rows past the last group are padding
                   too, as in a buffer sized ahead of time).
    """

    counts: torch.Tensor
    offs: torch.Tensor
    padded_offs: torch.Tensor
    alignment: int
    rows: int

    @property
    def num_experts(self) -> int:
        return self.counts.numel()

    @property
    def num_tokens(self) -> int:
        """Rows before padding (the assignments routed)."""
        return int(self.offs[-1]) if self.counts.numel() else 0

    @property
    def padded_starts(self) -> torch.Tensor:
        """(E,) int64, the first row of each group in the padded tensor."""
        return self.padded_offs.long() - round_up(self.counts, self.alignment)

    def spans(self) -> list[tuple[int, int]]:
        """[(first padded row, real rows)] of each expert, as Python ints (the per-expert loops read them)."""
        return list(zip(self.padded_starts.tolist(), self.counts.tolist()))

    @property
    def index(self) -> torch.Tensor:
        """(num_tokens,) int64: the padded row of each unpadded row (row i of group e moves by e's padding shift)."""
        starts = self.offs.long() - self.counts                                      # (E,) unpadded group starts
        shift = torch.repeat_interleave(self.padded_starts - starts, self.counts)    # (num_tokens,)
        return torch.arange(self.num_tokens, device=self.offs.device) + shift

    @property
    def real_rows(self) -> torch.Tensor:
        """(rows,) bool: True on the rows that hold a token, False on padding."""
        mask = torch.zeros(self.rows, dtype=torch.bool, device=self.offs.device)
        return mask.index_fill_(0, self.index, True)


def token_groups(counts: torch.Tensor, alignment: int = 1, rows: int | None = None) -> TokenGroups:
    """The ``TokenGroups`` of experts receiving ``counts`` (E,) tokens, each group padded to ``alignment``.

    ``rows``: rows of the padded buffer (default: exactly the padded total; more leaves padding rows at the end).
    ValueError for a negative count, an alignment below 1 or too few rows."""
    counts = torch.as_tensor(counts).long()
    if counts.dim() != 1 or bool((counts < 0).any()):
        raise ValueError(f"counts must be a 1-D tensor of token counts >= 0, got {counts.tolist()}")
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"alignment must be a positive int (1: no padding), got {alignment!r}")
    padded_offs = torch.cumsum(round_up(counts, alignment), 0).int()               # (E,) int32
    total = int(padded_offs[-1]) if counts.numel() else 0
    if rows is None:
        rows = total
    if rows < total:
        raise ValueError(f"rows={rows} cannot hold the padded groups ({total} rows): pass rows >= {total} or None")
    return TokenGroups(counts, torch.cumsum(counts, 0).int(), padded_offs, alignment, rows)


def group_tokens(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort assignments by expert: (order, counts).

    expert_ids: (A,) int64, the expert of each (token, choice) assignment. Returns ``order`` (A,) int64, the
    assignments in expert order (stable: a group keeps the assignments' order), and ``counts`` (E,) int64.
    ``x[order]`` is the grouped token tensor; ``offs = cumsum(counts)``."""
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got {int(expert_ids.min())}.."
                         f"{int(expert_ids.max())}")
    order = torch.argsort(expert_ids, stable=True)
    return order, torch.bincount(expert_ids, minlength=num_experts)


def pad_groups(x: torch.Tensor, groups: TokenGroups) -> torch.Tensor:
    """(num_tokens, K) grouped tokens -> (rows, K), each group at its padded start, every padding row exactly zero."""
    if x.shape[0] != groups.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows but the groups hold {groups.num_tokens} tokens")
    out = x.new_zeros(groups.rows, *x.shape[1:])
    return out.index_copy(0, groups.index, x)            # differentiable in x; padding rows get no gradient


def unpad_groups(y: torch.Tensor, groups: TokenGroups) -> torch.Tensor:
    """(rows, N) padded -> (num_tokens, N): the real rows in order (the backward puts zeros in the padding rows)."""
    if y.shape[0] != groups.rows:
        raise ValueError(f"y has {y.shape[0]} rows but the padded groups have {groups.rows}")
    return y.index_select(0, groups.index)


def pad_token_groups(x: torch.Tensor, counts: torch.Tensor, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lesson 13's padding (torchao's ``pad_token_groups``): tokens x (num_tokens, K) grouped by expert, ``counts``
    (E,) tokens per expert -> (padded (rows, K) in x's dtype, padded_offs (E,) int32), each group starting at its
    padded start and every padding row exactly zero. ``pad_groups(x, token_groups(counts, alignment))``."""
    groups = token_groups(counts, alignment)
    return pad_groups(x, groups), groups.padded_offs


def unpad_token_groups(y: torch.Tensor, counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """Lesson 13's unpadding: y (rows, N), padded by ``pad_token_groups(., counts, alignment)`` -> (num_tokens, N),
    the real rows in order, in y's dtype. ``unpad_groups(y, token_groups(counts, alignment))``."""
    return unpad_groups(y, token_groups(counts, alignment))
