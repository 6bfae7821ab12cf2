"""Selective precision: ``nvfp4`` with the last transformer block's linear layers kept in high precision.

Production low-precision recipes do not convert every linear layer. NVIDIA's NVFP4 pretraining recipe (arXiv
2509.25149) keeps about 16% of its 12B model's linear layers in BF16, mostly those of the last blocks;
torchtitan's NVFP4 Llama3-8B keeps the last ~15% of its blocks in BF16. Scaled to the course's GPT (5 blocks, 4
linears each): 16% of 5 blocks is 0.8 of a block, so the last block
(``KEEP_LAST = 1``, its qkv, attention proj, MLP fc and proj: 4 of the 20 block linears, 20%) stays high and the
first ones (``KEEP_FIRST = 0``) are NVFP4 as in ``nvfp4``. ``mpcourse.core.inspect.layer_sensitivity`` measured on
this model after 80 FP32 steps ranks the *first* block's linears as the ones NVFP4 hurts most (the last block
carries about 6% of the summed gradient error; see lesson 11 and ``python -m mpcourse.experiment.ablations.sensitivity``):
the last block is the production recipe's choice, kept here as that, not as this model's measured optimum.

* ``nvfp4-selective``: TE ``NVFP4BlockScaling`` (the ``nvfp4`` row's defaults) for blocks 0 .. n_layer-2;
  the last block's linears stay ``nn.Linear``. "High precision" is the recipe's own: FP32 in these rows (no
  autocast around the quantized region, see ``fp8.py``), the course's stand-in for the paper's BF16.

The filter is ``mpcourse.core.quant.edge_blocks_filter`` combined with the head rule of ``fp8.py``. With
``KEEP_FIRST = KEEP_LAST = 0`` this recipe converts exactly the layers ``nvfp4`` converts and trains bit for bit
as it (tested). Lesson 11 measures which layers NVFP4 hurts most (``mpcourse.core.inspect.layer_sensitivity``).
"""
from __future__ import annotations

import torch.nn as nn

from mpcourse.core.quant import all_of, convert_to_float8_training, edge_blocks_filter
from .base import register
from .fp8 import keep_linear_in_fp8
from .fp8_blocks import NVFP4


@register
class NVFP4Selective(NVFP4):
    name = "nvfp4-selective"
    description = "nvfp4 with the last block's linear layers in high precision (FP32 here; NVIDIA's recipe: BF16)"
    KEEP_FIRST = 0      # blocks at the start kept high
    KEEP_LAST = 1       # blocks at the end kept high (16% of 5 blocks, rounded up to one block)

    def module_filter(self, model: nn.Module):
        """``module_filter_fn``: not the head (as every quantized row), not the first/last kept blocks."""
        return all_of(keep_linear_in_fp8, edge_blocks_filter(len(model.blocks), self.KEEP_FIRST, self.KEEP_LAST))

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return convert_to_float8_training(model, module_filter_fn=self.module_filter(model), recipe=self.quantization())
