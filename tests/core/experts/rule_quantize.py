"""The experts tests' oracle quantizer: a format's dense recipe quantizing one tensor, straight from the library's
rules (``blockwise.quantize_fp32_scaled``, ``mx.quantize_mx``) with the block ``block_recipes.block_for`` names,
not through the engine's quantizers and backend that ``expert_gemms`` uses."""
from __future__ import annotations

import torch

from mpcourse.core.experts.formats import GroupedFormat
from mpcourse.core.quant.block_recipes import Float8BlockScaling, MXFP8BlockScaling, block_for
from mpcourse.core.quant.rules.blockwise import quantize_fp32_scaled
from mpcourse.core.quant.rules.mx import quantize_mx
from mpcourse.core.quant.rules.scaled import ScaledTensor


def quantize(t: torch.Tensor, fmt: GroupedFormat, role: str, axis: int) -> ScaledTensor:
    """``t`` (2-D) quantized as the format's dense recipe quantizes ``role``'s tensor along ``axis``."""
    recipe = fmt.recipe
    block = block_for(recipe, role, axis)
    if isinstance(recipe, MXFP8BlockScaling):
        elem = recipe.fp8_format.bwd if role == "grad_output" else recipe.fp8_format.fwd
        return quantize_mx(t, block, elem, recipe.scale_rule)
    if isinstance(recipe, Float8BlockScaling):
        return quantize_fp32_scaled(t, block, "e4m3", power_2_scale=recipe.power_2_scales,
                                    amax_epsilon=recipe.amax_epsilon)
    return quantize_fp32_scaled(t, block, "e4m3", power_2_scale=recipe.round_scales_to_power_of_2)   # rowwise
