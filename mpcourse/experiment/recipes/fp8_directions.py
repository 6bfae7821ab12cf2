"""A format per GEMM direction: ``mxfp8-fwd-nvfp4-bwd``, MXFP8 for the forward GEMM, NVFP4 for the backward ones.

The same layers as the other finer-grained rows (``fp8_blocks.py``: the four linear layers of every block; the
embeddings, the head, the LayerNorms, attention's own products and the loss stay FP32). In each of them:

    fprop   y  = x @ W^T    x, W: MXFP8 (E4M3, a shared E8M0 scale per 32 along K; TE ``MXFP8BlockScaling()``)
    dgrad   dx = dy @ W     dy, W: NVFP4 (E2M1, E4M3 scale per 16, FP32 tensor scale; dy stochastically rounded,
    wgrad   dW = dy^T @ x   dy, x: NVFP4      16x16 weight blocks, RHT on wgrad's inputs: ``NVFP4BlockScaling()``)

Each backward operand is quantized from the high-precision tensor (``backward_operand="source"``), so the forward
GEMM computes exactly as the ``mxfp8`` row's and the backward GEMMs exactly as the ``nvfp4`` row's, given the same
tensors (tested in ``tests/core/quant/layers/test_block_directions.py``). The forward keeps MXFP8's finer values (3 mantissa bits)
where errors reach the loss directly; the backward, two thirds of the GEMM work, takes NVFP4's cheaper arithmetic,
with stochastic rounding keeping the gradients unbiased. The recipe is ``PerDirectionBlockScaling`` from
``mpcourse.core.quant`` (Transformer Engine expresses such a split with ``CustomRecipe`` and a quantizer factory
per tensor role; ``transformer_engine/common/recipe/__init__.py``). Token counts per step must be multiples of 32
(MXFP8's forward blocks do not run along M; NVFP4's wgrad blocks of 16 do), which the defaults are.
"""
from __future__ import annotations

from mpcourse.core.quant import MXFP8BlockScaling, NVFP4BlockScaling, PerDirectionBlockScaling
from .base import register
from .fp8 import QuantizedRecipe


@register
class MXFP8FwdNVFP4Bwd(QuantizedRecipe):
    name = "mxfp8-fwd-nvfp4-bwd"
    description = "MXFP8 forward GEMM, NVFP4 backward GEMMs (RHT, SR grads), each from the FP32 tensor; rest FP32"
    fp8_recipe = PerDirectionBlockScaling(fwd_recipe=MXFP8BlockScaling(), bwd_recipe=NVFP4BlockScaling(),
                                          backward_operand="source")
