"""The three GEMMs of one expert, y = x @ W^T, in a ``GroupedFormat``: the dense layer's rule on one group of tokens.

For expert e with tokens x (M_e, K) and weight W (N, K)::

    forward  y  = Q(x, 1) @ Q(W, 1)^T        (M_e, N)  out dtype      blocks along K
    dgrad    dx = Q(dy, 1) @ Q(W, 0)         (M_e, K)  x's dtype      blocks along N
    wgrad    dW = Q(dy, 0)^T @ Q(x, 0)       (N, K)    W's dtype      blocks along the tokens M_e

Q(t, axis) is the format's dense recipe quantizing ``t`` in blocks along ``axis`` (``block_recipes.block_for``:
the block the dense ``Float8Linear`` uses for that role and axis), each copy from the high-precision tensor, by the
dense layer's own quantizers (``quantizers_for``: ``engine.quantizers`` of the format's recipe, whose backend holds
the rules ``blockwise.quantize_fp32_scaled`` / ``mx.quantize_mx`` or the kernels equal to them bit for bit, chosen
once by ``backend.choose``) and the dense layer's operand helpers (``block_linear.fprop_operands``, ...); the GEMM
is ``block_gemm.scaled_gemm`` (``F.scaled_mm`` where the device takes the scaling, else dequantize, one FP32 GEMM,
one rounding). These are the GEMMs of ``block_linear.BlockScaledLinearFunction`` on the expert's tokens alone, so
no scale spans two experts.

In the weight gradient the contraction runs over the expert's tokens, which the format scales in blocks along M
(32 for MXFP8, 128 for 1x128 tiles, one column for rowwise): ``wgrad`` pads the group with zero rows to a multiple
of that block (``block_recipes.token_multiple``). Zero rows add exact zeros to every sum and never raise a block's
amax, so any group size trains (Transformer Engine's MXFP8 grouped linear refused sizes that are not multiples of
32, TransformerEngine#2966). An expert with no token gets an exactly zero weight gradient, computed from no GEMM.

High precision (``fmt.dtype``): operands cast to that dtype, ``torch.mm``, the result in that dtype, as a linear
layer under ``torch.autocast`` computes it (a BF16/FP16 ``torch.mm`` on a CPU inside ``emulation.tensor_cores()``
is the tensor-core emulation: exact products, FP32 sums, one rounding, as for the dense layers); the operand
layouts are those of ``torch.nn.functional.linear``'s forward and autograd backward, so the bits are too.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..quant.block_recipes import token_multiple
from ..quant.engine import quantizers
from ..quant.layers.block_gemm import scaled_gemm
from ..quant.layers.block_linear import dgrad_operands, fprop_operands, wgrad_operands
from ..quant.rules.blockwise import encode_fp32_scaled
from .formats import GroupedFormat

#: {role: quantizer} of the format's dense recipe (``engine.quantizers``), None in high precision
Quantizers = Optional[dict]


def quantizers_for(fmt: GroupedFormat) -> Quantizers:
    """The dense layer's quantizers of ``fmt``'s recipe, the backend chosen once (None in high precision)."""
    return quantizers(fmt.recipe) if fmt.quantized else None


def forward(x: torch.Tensor, w: torch.Tensor, fmt: GroupedFormat, out_dtype: torch.dtype, q: Quantizers = None
            ) -> torch.Tensor:
    """y = x @ W^T for one expert: x (M_e, K), w (N, K) -> (M_e, N) ``out_dtype`` (high precision: ``fmt.dtype``).
    q: ``quantizers_for(fmt)`` (made here if not given)."""
    if not fmt.quantized:
        return torch.mm(x.to(fmt.dtype), w.to(fmt.dtype).t())
    q = quantizers_for(fmt) if q is None else q
    xq, wq = fprop_operands(q, x, w)                 # (M_e, K), (N, K): blocks along K
    return scaled_gemm(xq, wq.t(), out_dtype, backend=q["input"].backend)


def dgrad(dy: torch.Tensor, w: torch.Tensor, fmt: GroupedFormat, x_dtype: torch.dtype, q: Quantizers = None
          ) -> torch.Tensor:
    """dx = dy @ W for one expert: dy (M_e, N), w (N, K) -> (M_e, K) ``x_dtype``."""
    if not fmt.quantized:
        return torch.mm(dy.to(fmt.dtype), w.to(fmt.dtype)).to(x_dtype)
    q = quantizers_for(fmt) if q is None else q
    gq, wq = dgrad_operands(q, dy, w)                # (M_e, N), (N, K): blocks along N
    return scaled_gemm(gq, wq, x_dtype, backend=q["grad_output"].backend)


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` (M, C) with zero rows appended up to a multiple of ``multiple`` rows (itself if it is one)."""
    extra = -t.shape[0] % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


def wgrad(dy: torch.Tensor, x: torch.Tensor, fmt: GroupedFormat, w_dtype: torch.dtype, n: int, k: int,
          q: Quantizers = None, scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """dW = dy^T @ x for one expert: dy (M_e, N), x (M_e, K) -> (N, K) ``w_dtype``; exactly zero when M_e = 0.
    ``scales``: rowwise FP8's (1, N) and (1, K) column scales of this expert's dy and x (``group_scales``), which
    are those the rowwise quantizer computes from the group itself."""
    if dy.shape[0] == 0:
        return torch.zeros(n, k, dtype=w_dtype, device=dy.device)
    if not fmt.quantized:
        return torch.mm(dy.to(fmt.dtype).t(), x.to(fmt.dtype)).to(w_dtype)
    if scales is not None:                           # rowwise: one block of all M_e rows per column
        qdy = encode_fp32_scaled(dy, (dy.shape[0], 1), "e4m3", scales[0])
        return scaled_gemm(qdy.t(), encode_fp32_scaled(x, (x.shape[0], 1), "e4m3", scales[1]), w_dtype)
    q = quantizers_for(fmt) if q is None else q
    m = token_multiple(fmt.recipe)                   # the block the tokens are scaled in (1: any count)
    dy, x = pad_rows(dy, m), pad_rows(x, m)          # (M_e', N), (M_e', K): zero rows add exact zeros
    gq, xq = wgrad_operands(q, dy, x)                # (M_e', N), (M_e', K): blocks along the tokens
    return scaled_gemm(gq.t(), xq, w_dtype, backend=q["grad_output"].backend)
