"""The formats an expert's GEMMs run in: high precision (FP32, BF16, FP16) or one of three finer-grained FP8 scalings.

Each low-precision format *is* a dense recipe of the library (``mpcourse.core.quant.block_recipes``) applied to one
expert's group of tokens at a time, so its blocks, scales and element formats are the dense layer's, and no block
ever spans two experts' tokens::

    name          dense recipe                 activations / grads       weights             group alignment
    fp32          none (FP32 GEMMs)            -                         -                   1
    bf16, fp16    none (tensor-core GEMMs)     -                         -                   8
    fp8-rowwise   Float8RowwiseScaling()       E4M3, a scale per token   per output column   16
    fp8-block     Float8BlockScaling()         E4M3, 1x128 tiles         128x128 blocks      128
    mxfp8         MXFP8BlockScaling()          E4M3, 1x32 E8M0 (RCEIL)   1x32 E8M0           32

Sources: torchao ``prototype/moe_training`` (``_to_fp8_rowwise_then_scaled_grouped_mm``: per-token activation scales,
per-expert per-output-column weight scales, power-of-two, E4M3, the weight gradient scaled per expert group;
``_to_mxfp8_then_scaled_grouped_mm``: 1x32 blocks along the contraction dimension, RCEIL); DeepSeek-V3 technical
report (arXiv 2412.19437) section 3.3 (1x128 activation tiles, 128x128 weight blocks, every expert GEMM in FP8);
group alignments: ``grouping.ALIGNMENT``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quant.block_recipes import BlockRecipe, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from .grouping import ALIGNMENT


@dataclass(frozen=True)
class GroupedFormat:
    """One format of the experts' GEMMs: a dense ``recipe`` (low precision) or a GEMM ``dtype`` (high precision).

    Fields: name; recipe (a block recipe, None in high precision); dtype (the high-precision GEMMs' operand and
    output dtype; None for a recipe); alignment (rows each expert's group is padded to a multiple of)."""

    name: str
    recipe: Optional[BlockRecipe]
    dtype: Optional[torch.dtype]
    alignment: int

    @property
    def quantized(self) -> bool:
        return self.recipe is not None


def _format(name: str, recipe=None, dtype=None) -> GroupedFormat:
    return GroupedFormat(name, recipe, dtype, ALIGNMENT[name])


GROUPED_FORMATS = {f.name: f for f in (
    _format("fp32", dtype=torch.float32), _format("bf16", dtype=torch.bfloat16),
    _format("fp16", dtype=torch.float16), _format("fp8-rowwise", Float8RowwiseScaling()),
    _format("fp8-block", Float8BlockScaling()), _format("mxfp8", MXFP8BlockScaling()))}


def grouped_format(fmt) -> GroupedFormat:
    """``GROUPED_FORMATS[fmt]`` for a name (a ``GroupedFormat`` is returned as it is); ValueError naming the rest."""
    if isinstance(fmt, GroupedFormat):
        return fmt
    if fmt not in GROUPED_FORMATS:
        raise ValueError(f"unknown experts' GEMM format {fmt!r}: use one of {', '.join(GROUPED_FORMATS)}")
    return GROUPED_FORMATS[fmt]
