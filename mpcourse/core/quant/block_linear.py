"""The autograd function of a linear layer under a finer-grained recipe (rowwise, 1x128/128x128, MXFP8, NVFP4).

y = x @ W^T + b with x (M, K), W (N, K). Every operand of every GEMM is quantized by the recipe's quantizer
for its role, along that GEMM's contraction dimension, from the high-precision tensor (TE's rule; see
``block_recipes``), and the GEMM runs through ``block_gemm.scaled_gemm`` (``F.scaled_mm`` where the device
takes the scaling, else the exact emulation)::

    forward  y  = Q(x, 1) @ Q(W, 1)^T                 -> (M, N) out dtype
    dgrad    dx = Q(dy, 1) @ Q(W, 0)                  -> (M, K) x dtype
    wgrad    dW = Q(dy, 0, wgrad)^T @ Q(x, 0, wgrad)  -> (N, K) weight dtype  (NVFP4: RHT on both)

The high-precision x and W are saved for the backward (the re-quantization needs them). A 2-D weight block
(128x128, NVFP4's 16x16) is the same block along either axis, so Q(W, 0) *is* Q(W, 1): the forward's copy is
saved and used again by the input-gradient GEMM (TE quantizes such a weight once per step for both GEMMs),
the same bits without a second quantization. The bias is added after the GEMM in the output dtype; its
gradient is summed in FP32.
"""
from __future__ import annotations

import torch

from .block_gemm import scaled_gemm
from .block_recipes import block_for
from .scaled import ScaledTensor


class BlockScaledLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers, out_dtype):
        # x: (M, K); weight: (N, K); bias: (N,) or None. quantizers: {role: BlockQuantizer} of the layer's recipe
        q = quantizers
        xq = q["input"](x, 1)                                     # (M, K), blocks along K
        wq = q["weight"](weight, 1)                               # (N, K), blocks along K
        y = scaled_gemm(xq, wq.t(), out_dtype)                    # (M, N)
        xq = wq.dequantized = None                                # the kept FP32 copies have been read
        if bias is not None:
            y = y + bias.to(out_dtype)
        if same_both_axes(q["weight"].recipe, "weight"):                     # Q(W, 0) == Q(W, 1): keep it for dgrad
            ctx.save_for_backward(x, weight, wq.data, wq.scale_inv, wq.tensor_scale_inv)
            ctx.w0 = (wq.block, wq.elem_format, wq.orig_dtype)
        else:
            ctx.save_for_backward(x, weight)
            ctx.w0 = None
        ctx.quantizers = q
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):  # (M, N) out dtype
        x, weight, *w0 = ctx.saved_tensors
        q = ctx.quantizers
        dx = dw = db = None
        grad_y = grad_y.contiguous()
        if ctx.needs_input_grad[0]:
            g1 = q["grad_output"](grad_y, 1)                        # (M, N), blocks along N
            if ctx.w0 is not None:                                  # the forward's copy, (N, K)
                w0 = ScaledTensor(w0[0], w0[1], ctx.w0[0], ctx.w0[1], w0[2], ctx.w0[2])
            else:
                w0 = q["weight"](weight, 0)                         # (N, K), blocks along N
            dx = scaled_gemm(g1, w0, x.dtype)                       # (M, K)
            del g1, w0                                              # and their FP32 copies, before the wgrad
        if ctx.needs_input_grad[1]:
            g0 = q["grad_output"](grad_y, 0, wgrad=True)                 # (M, N), blocks along M
            x0 = q["input"](x, 0, wgrad=True)                            # (M, K), blocks along M
            dw = scaled_gemm(g0.t(), x0, weight.dtype)                   # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_y.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def check_backward_shapes(recipe, x_shape, n: int, needs: tuple) -> None:
    """Refuse, in the forward, a shape the backward GEMMs could not quantize: the weight gradient scales dy and x
    in blocks along the tokens M (the rows of the input flattened to (M, K)), the input gradient dy along the
    N output features. ``needs``: (input needs a gradient, weight needs one), under the caller's grad mode."""
    (M, K), name = x_shape, type(recipe).__name__
    checks = ([("grad_output", 1, n, f"out_features = {n}")] if needs[0] else []) + \
        [(role, 0, M, f"token count M = {M} (the input's rows, flattened to (-1, {K}))")
         for role in ("input", "grad_output") if needs[1]]
    for role, axis, size, what in checks:
        r = block_for(recipe, role, axis)[axis]
        if r > 0 and size % r:
            raise ValueError(f"{name} cannot train on a {what}: its backward GEMMs scale {role} in blocks of {r} "
                             f"along that dimension, so it must be a multiple of {r} (e.g. {r}, {2 * r}, {4 * r}); "
                             "for a model, choose batch size x sequence length accordingly")


def same_both_axes(recipe, role: str) -> bool:
    """Whether quantizing along axis 0 equals quantizing along axis 1 under ``recipe``: a square 2-D block (the
    same blocks whichever axis is contracted), rounded to nearest (weights are; stochastic rounding draws)."""
    blocks = {block_for(recipe, role, axis) for axis in (0, 1)}
    return len(blocks) == 1 and role != "grad_output"
