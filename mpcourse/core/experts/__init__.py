"""Experts in low precision: the pieces of a mixture-of-experts layer whose GEMMs run in FP32, BF16 or FP8.

``grouping``: tokens sorted into one contiguous group per expert (int32 group ends, as ``torch._grouped_mm`` takes
them), each group padded to its format's alignment with exact zeros, and back. ``formats``: the formats of the
experts' GEMMs, each a dense recipe of ``mpcourse.core.quant`` applied to one expert's group at a time.
``expert_gemms``: one expert's forward, input-gradient and weight-gradient GEMMs in a format (the dense rule).
``grouped_mm``: the grouped GEMM as an autograd function, a loop over experts. ``group_scales``: rowwise FP8's
weight-gradient scales, one per expert group and column.

Sources: torchao ``prototype/moe_training``; DeepSeek-V3 technical report (arXiv 2412.19437) section 3.3;
Transformer Engine ``GroupedLinear`` and ``Fp8Padding``; torchtitan's MoE (``set_token_group_alignment_size_m``).
"""
from .formats import GROUPED_FORMATS, GroupedFormat, grouped_format
from .grouped_mm import GroupedMM, grouped_mm
from .group_scales import group_colwise_scales
from .grouping import (ALIGNMENT, TokenGroups, group_tokens, pad_groups, pad_token_groups, token_groups, unpad_groups,
                       unpad_token_groups)

__all__ = ["ALIGNMENT", "GROUPED_FORMATS", "GroupedFormat", "GroupedMM", "TokenGroups", "group_tokens",
           "group_colwise_scales", "grouped_format", "grouped_mm", "pad_groups", "pad_token_groups", "token_groups",
           "unpad_groups", "unpad_token_groups"]
