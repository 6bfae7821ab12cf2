"""Finer-grained scaling rows of ``mpcourse compare``: rowwise FP8, DeepSeek-V3 blocks, MXFP8, NVFP4.

The same layers as the per-tensor FP8 rows (``fp8.py``) compute in low precision: the four linear layers of
every block (qkv, attention projection, MLP fc and proj). The embeddings, the output head (tied to the token
embedding), the LayerNorms, attention's own products and the loss stay FP32, as DeepSeek-V3 (section 3.3.1)
and NVIDIA's NVFP4 recipe (arXiv 2509.25149: embeddings and head in BF16) keep them.

* ``fp8-rowwise``: torchao's ``rowwise`` recipe (E4M3 everywhere, power-of-two scale per row / column);
  GEMMs through ``F.scaled_mm`` RowWise on this CPU.
* ``fp8-block``: TE ``Float8BlockScaling`` (E4M3 everywhere, 1x128 tiles for activations and gradients,
  128x128 weight blocks, power-of-two scales), DeepSeek-V3's scheme.
* ``mxfp8``: TE ``MXFP8BlockScaling`` (E4M3 in blocks of 32 sharing an E8M0 scale; RCEIL scale rule).
* ``mxfp8-floor``: the same with the OCP MX spec's floor scale rule (a block max up to 2x E4M3's max saturates),
  the rule lesson 09's ``mx_shared_exponent`` builds.
* ``nvfp4``: TE ``NVFP4BlockScaling`` with its defaults (E2M1 data, E4M3 scale per 16, FP32 tensor scale,
  16x16 weight blocks, RHT on the weight-gradient inputs, stochastic rounding of gradients).

Block GEMMs other than rowwise run in the exact emulation (dequantize, then one FP32 GEMM) on this CPU: the
losses are those of the real formats and scales, but not of a tensor core's accumulator (see
``mpcourse.core.quant.layers.block_gemm``). The token count per step (batch_size x block_size) and the model widths
must be multiples of the block (128 for ``fp8-block``, 32 for ``mxfp8``, 16 for ``nvfp4``); the defaults are.
Nothing here keeps state between steps, so a checkpoint resumes bit for bit (NVFP4's stochastic rounding
draws from torch's global generator, which the trainer's checkpoint saves).
"""
from __future__ import annotations

from mpcourse.core.quant import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling, NVFP4BlockScaling
from mpcourse.core.learner_table import exercise_names
from .base import register
from .fp8 import QuantizedRecipe


@register
class FP8Rowwise(QuantizedRecipe):
    name = "fp8-rowwise"
    description = "FP8 linear layers, torchao rowwise (E4M3, power-of-two scale per row/column), rest FP32"
    fp8_recipe = Float8RowwiseScaling()


@register
class FP8Block(QuantizedRecipe):
    name = "fp8-block"
    description = "FP8 linear layers, DeepSeek-V3 / TE Float8BlockScaling (E4M3, 1x128 tiles, 128x128 weights)"
    fp8_recipe = Float8BlockScaling()
    OVERRIDABLE = exercise_names("block_quantize")   # lesson 09 (lesson 13's padding: the MoE rows only)


@register
class MXFP8(QuantizedRecipe):
    name = "mxfp8"
    description = "MXFP8 linear layers (E4M3, 32-element blocks sharing an E8M0 scale), rest FP32"
    fp8_recipe = MXFP8BlockScaling()


@register
class MXFP8Floor(QuantizedRecipe):
    name = "mxfp8-floor"
    description = "MXFP8 linear layers with the OCP spec's floor E8M0 scale rule (block maxima may saturate)"
    fp8_recipe = MXFP8BlockScaling(scale_rule="floor")
    OVERRIDABLE = exercise_names("mx_shared_exponent")   # lesson 09 (lesson 13's padding: the MoE rows only)


@register
class NVFP4(QuantizedRecipe):
    name = "nvfp4"
    description = "NVFP4 linear layers (E2M1, E4M3 scale per 16 + FP32 per tensor, RHT, SR grads); emb/head FP32"
    fp8_recipe = NVFP4BlockScaling()
    OVERRIDABLE = fp8_recipe.TAKES   # lesson 09: nvfp4_scales
