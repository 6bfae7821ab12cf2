"""Experts in low precision: the pieces of a mixture-of-experts layer whose GEMMs run in FP32, BF16 or FP8.

``grouping``: tokens sorted into one contiguous group per expert (int32 group ends, as ``torch._grouped_mm`` takes
them), each group padded to its format's alignment with exact zeros, and back. ``formats``: the formats of the
experts' GEMMs, each a dense recipe of ``mpcourse.core.quant`` applied to one expert's group at a time.
``expert_gemms``: one expert's forward, input-gradient and weight-gradient GEMMs in a format (the dense rule).
``grouped_mm``: the grouped GEMM as an autograd function, a loop over experts. ``group_scales``: rowwise FP8's
weight-gradient scales, one per expert group and column. ``dispatch``: what a row becomes on
the wire between ranks under expert parallelism (FP8 with scales, BF16, FP32) and one process's rule for it;
``expert_parallel``: the experts split over the ranks of a process group, rows sent by all-to-all.

Sources: torchao ``prototype/moe_training``; DeepSeek-V3 technical report (arXiv 2412.19437) section 3.3;
Transformer Engine ``GroupedLinear`` and ``Fp8Padding``; torchtitan's MoE (``set_token_group_alignment_size_m``)
and expert parallelism.
"""
from .dispatch import DISPATCH_MODES, DispatchMode, bytes_per_row, dispatch_mode, round_trip
from .expert_parallel import DispatchLog, ExpertParallelMoE, shard_experts
from .formats import GROUPED_FORMATS, GroupedFormat, grouped_format
from .grouped_mm import GroupedMM, grouped_mm
from .group_scales import group_colwise_scales
from .grouping import (ALIGNMENT, TokenGroups, group_tokens, pad_groups, pad_token_groups, token_groups, unpad_groups,
                       unpad_token_groups)

__all__ = ["ALIGNMENT", "DISPATCH_MODES", "DispatchLog", "DispatchMode", "ExpertParallelMoE", "GROUPED_FORMATS",
           "GroupedFormat", "GroupedMM", "TokenGroups", "bytes_per_row", "dispatch_mode", "group_colwise_scales",
           "group_tokens", "grouped_format", "grouped_mm", "pad_groups", "pad_token_groups", "round_trip",
           "shard_experts", "token_groups", "unpad_groups", "unpad_token_groups"]
