"""Mixture-of-experts rows of ``mpcourse compare``: the GPT with every block's MLP a top-2 mixture of 4 experts.

Each row trains the MoE twin of the run's model (``gpt.model.to_moe``: embeddings, attention and norms the dense
model's, experts and routers from the run's seed, the same for every row), under the precision of a dense row:

    moe-fp32          everything FP32                                      (as ``fp32``)
    moe-bf16          the course's BF16 autocast, FP32 weights             (as ``bf16-autocast``)
    moe-fp8-rowwise   attention's linears and the experts' grouped GEMMs in torchao's rowwise FP8   (``fp8-rowwise``)
    moe-fp8-block     the same in DeepSeek-V3's 1x128 / 128x128 blocks     (``fp8-block``)
    moe-mxfp8         the same in MXFP8                                    (``mxfp8``)
    moe-bf16-router   moe-fp32 with the router (logits, softmax, top-k, combine weights) in BF16: the ablation

The router, its softmax, top-k and the combine weights stay FP32 in every row but the ablation's
(``core.experts.layer``); the experts' format comes from the row's region (the FP8 rows' ``quant.autocast``
recipe, the BF16 row's autocast). Each step's history record (``results.json``) holds ``tokens_per_expert`` (one
list per block, the step's assignments per expert) and, in the ablation, ``routing_flipped`` (per block, the
fraction of the step's tokens the BF16 router sent elsewhere than the FP32 router would have).

Token counts: every group is padded to its format's alignment (128 for fp8-block), so any routing trains; the
default widths (C = 128, each expert 256 wide) are multiples of every block.

A learner's lesson 13 functions (``--with``, ``train_yours``): the FP8 rows take ``pad_token_groups`` and
``unpad_token_groups`` (the experts' groups padded with them), ``moe-fp8-rowwise`` also ``group_scales`` (the
per-group scales of the experts' weight gradient); they ride in the row's quantization recipe.
"""
from __future__ import annotations

import torch

from mpcourse.core import quant
from mpcourse.core.learner_table import exercise_names
from ..gpt.model import to_moe
from .base import StepResult, TrainingRecipe, register
from .bf16 import BF16Autocast
from .fp8_blocks import FP8Block, FP8Rowwise, MXFP8

#: the MoE the rows train: 4 experts, each token to 2, each expert 4 * C / 2 wide (a token's FLOPs as dense)
MOE = {"n_experts": 4, "top_k": 2}


class MoERecipe:
    """Mixin before a precision recipe: its ``prepare_model`` gets the MoE twin; its steps report the routing."""

    moe = MOE
    router_dtype = torch.float32
    #: no learner's function in the high-precision rows: the experts' grouped GEMMs run the library's rules (and
    #: switch autocast off), so a learner's quantizer or cast rule would reach only the attention's linears; the FP8
    #: rows take lesson 13's (``MoEQuantized``)
    OVERRIDABLE: tuple[str, ...] = ()

    def prepare_model(self, model):
        twin = to_moe(model, **self.moe)
        for block in twin.blocks:
            block.mlp.router_dtype = self.router_dtype
        return super().prepare_model(twin)

    def step(self) -> StepResult:
        result = super().step()
        layers = [block.mlp for block in self.model.blocks]
        result.stats["tokens_per_expert"] = [m.tokens_per_expert.tolist() for m in layers]
        if self.router_dtype != torch.float32:
            result.stats["routing_flipped"] = [round(m.flipped, 6) for m in layers]
        return result


@register
class MoEFP32(MoERecipe, TrainingRecipe):
    name = "moe-fp32"
    description = "MoE GPT (4 experts, top-2, FP32 router), everything FP32"


@register
class MoEBF16(MoERecipe, BF16Autocast):
    name = "moe-bf16"
    description = "MoE GPT under the course's BF16 autocast: experts' grouped GEMMs BF16, router FP32"


class MoEQuantized(MoERecipe):
    """Mixin of the FP8 MoE rows: lesson 13's functions ride in the quantization recipe, which the FP8 region holds
    (``forward_context``), so the MoE layer finds them where it finds its format (``layer.format_in_effect``)."""

    #: lesson 13: the padding of the experts' token groups (every FP8 format pads: 16, 128 or 32 rows)
    OVERRIDABLE = exercise_names("pad_token_groups", "unpad_token_groups")

    def forward_context(self):
        return quant.autocast(enabled=True, recipe=self.quantization())   # fp8_recipe with the learner's functions


@register
class MoEFP8Rowwise(MoEQuantized, FP8Rowwise):
    name = "moe-fp8-rowwise"
    description = "MoE GPT, linears and experts' grouped GEMMs in torchao rowwise FP8, router FP32"
    #: lesson 13: the padding and the per-group weight-gradient scales (rowwise's own)
    OVERRIDABLE = exercise_names("pad_token_groups", "unpad_token_groups", "group_scales")


@register
class MoEFP8Block(MoEQuantized, FP8Block):
    name = "moe-fp8-block"
    description = "MoE GPT, linears and experts in DeepSeek-V3 FP8 blocks (1x128, 128x128), router FP32"


@register
class MoEMXFP8(MoEQuantized, MXFP8):
    name = "moe-mxfp8"
    description = "MoE GPT, linears and experts' grouped GEMMs in MXFP8 (E8M0 per 32), router FP32"


@register
class MoEBF16Router(MoERecipe, TrainingRecipe):
    name = "moe-bf16-router"
    description = "moe-fp32 with the router's logits, softmax, top-k and combine weights in BF16 (the ablation)"
    router_dtype = torch.bfloat16
