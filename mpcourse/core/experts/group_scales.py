"""The scales of an expert's weight gradient in rowwise FP8, one per expert group and column (lesson 13's
``group_scales``).

In the weight gradient of expert e, dW_e = dY_e^T @ X_e, the contraction runs over expert e's tokens, so rowwise
FP8 scales dY and X *per column* over the rows of one group, never over two experts' tokens::

    t       (M, C)   tokens grouped by expert (rows past offs[-1]: padding, ignored), any float dtype
    offs    (E,)     int32 group ends, as ``torch._grouped_mm`` takes them: group e is rows offs[e-1] .. offs[e]
    amax    (E, C)   max |t| over the rows of each group (0 for an empty group; NaN propagates)
    scale   (E, C)   float32, ``tensor.compute_scale(amax, 448, power_2_scale=True)``: 448 / amax rounded down to a
                     power of two; amax 0, inf or NaN -> 1.0 (an empty group: scale 1 and a zero gradient); where
                     448 / amax overflows FP32, FP32 max rounded down: 2**127

The FP8 data of group e is ``e4m3(saturate(t * scale[e]))``, its ``scale_inv`` what the GEMM reads. A NaN or inf in
one group gives that group scale 1.0 and leaves every other group's scale as it was (a NaN scale that crossed into
another expert's rows was flashinfer#3103). These are the scales ``blockwise.quantize_fp32_scaled(t_e, (-1, 1),
"e4m3", power_2_scale=True)`` computes on each group alone, bit for bit.

Source: torchao ``prototype/moe_training`` (``_to_fp8_rowwise_then_scaled_grouped_mm``'s backward: the weight
gradient's operands scaled per group and column, power-of-two scales, E4M3).
"""
from __future__ import annotations

import torch

from ..formats import FORMATS
from ..quant.rules.tensor import compute_scale

E4M3_MAX = FORMATS["e4m3"].max   # 448


def group_colwise_scales(t: torch.Tensor, offs: torch.Tensor, power_2_scale: bool = True) -> torch.Tensor:
    """(E, C) float32 E4M3 scales of t (M, C) per expert group (ends ``offs``) and column (see the module)."""
    if t.dim() != 2 or offs.dim() != 1:
        raise ValueError(f"group_colwise_scales takes t (M, C) and offs (E,), got {tuple(t.shape)}, {tuple(offs.shape)}")
    ends = offs.long().tolist()
    if ends and (ends[-1] > t.shape[0] or any(b < a for a, b in zip([0] + ends, ends))):
        raise ValueError(f"offs must be non-decreasing group ends within the {t.shape[0]} rows, got {ends}")
    amax = torch.zeros(len(ends), t.shape[1], dtype=torch.float32, device=t.device)       # (E, C)
    for e, (start, end) in enumerate(zip([0] + ends, ends)):                               # a loop over experts
        if end > start:
            amax[e] = t[start:end].detach().float().abs().amax(0)
    return compute_scale(amax, E4M3_MAX, 0, None, power_2_scale)
