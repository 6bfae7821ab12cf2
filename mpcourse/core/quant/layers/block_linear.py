"""The autograd function of a linear layer under a finer-grained recipe (rowwise, 1x128/128x128, MXFP8, NVFP4).

y = x @ W^T + b with x (M, K), W (N, K). Every operand of every GEMM is quantized by the recipe's quantizer
for its role, along that GEMM's contraction dimension, from the high-precision tensor (TE's rule; see
``block_recipes``), and the GEMM runs through ``block_gemm.scaled_gemm`` (``F.scaled_mm`` where the device
takes the scaling, else the exact emulation, dequantizing with the quantizers' ``backend``: the engine chose
rule or kernel)::

    forward  y  = Q(x, 1) @ Q(W, 1)^T                 -> (M, N) out dtype    fprop_operands
    dgrad    dx = Q(dy, 1) @ Q(W, 0)                  -> (M, K) x dtype      dgrad_operands
    wgrad    dW = Q(dy, 0, wgrad)^T @ Q(x, 0, wgrad)  -> (N, K) weight dtype  wgrad_operands (NVFP4: RHT on both)

With a ``PerDirectionBlockScaling`` the forward Q is its forward recipe's and the backward Qs its backward
recipe's (``engine.quantizers`` builds them so), and with ``backward_operand="dequantized"`` the backward
copies of W and x are quantized from the forward's dequantized copies instead (``backward_source``).
The high-precision x and W (or those dequantized copies, in x's and W's dtypes: the numerics of a backward that
keeps only the forward's low-precision copies, not its memory) are saved for the backward (the re-quantization
needs them). A 2-D weight block
(128x128, NVFP4's 16x16) is the same block along either axis, so Q(W, 0) *is* Q(W, 1): the forward's copy is
saved and used again by the input-gradient GEMM (TE quantizes such a weight once per step for both GEMMs),
the same bits without a second quantization. The bias is added after the GEMM in the output dtype; its
gradient is summed in FP32.
"""
from __future__ import annotations

import torch

from .block_gemm import scaled_gemm
from ..block_recipes import block_for
from ..rules.scaled import ScaledTensor


def fprop_operands(q: dict, x: torch.Tensor, weight: torch.Tensor) -> tuple[ScaledTensor, ScaledTensor]:
    """The forward GEMM's operands, from the high-precision tensors: Q_fwd(x, 1) (M, K), Q_fwd(W, 1) (N, K)."""
    return q["input"](x, 1), q["weight"](weight, 1)


def backward_source(t: torch.Tensor, fwd_copy: ScaledTensor, backward_operand: str) -> torch.Tensor:
    """What a backward copy of ``t`` (x or W) is quantized from: ``t`` itself ("source") or the forward's copy
    dequantized to ``t``'s dtype ("dequantized": Q_bwd(dequant(Q_fwd(t))), a double quantization)."""
    return t if backward_operand == "source" else fwd_copy.dequantize_fp32().to(t.dtype)


def dgrad_operands(q: dict, grad_y: torch.Tensor, w_src: torch.Tensor) -> tuple[ScaledTensor, ScaledTensor]:
    """The input-gradient GEMM's operands: Q_bwd(dy, 1) (M, N), blocks along N; Q_bwd(W_src, 0) (N, K), along N."""
    return q["grad_output"](grad_y, 1), q["dgrad_weight"](w_src, 0)


def wgrad_operands(q: dict, grad_y: torch.Tensor, x_src: torch.Tensor) -> tuple[ScaledTensor, ScaledTensor]:
    """The weight-gradient GEMM's operands, both in blocks along M: Q_bwd(dy, 0) (M, N), Q_bwd(x_src, 0) (M, K)."""
    return q["grad_output"](grad_y, 0, wgrad=True), q["wgrad_input"](x_src, 0, wgrad=True)


class BlockScaledLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers, out_dtype, backward_operand="source"):
        # x: (M, K); weight: (N, K); bias: (N,) or None. quantizers: ``engine.quantizers`` of the layer's recipe
        q = quantizers
        xq, wq = fprop_operands(q, x, weight)                     # (M, K), (N, K), blocks along K
        y = scaled_gemm(xq, wq.t(), out_dtype, backend=q["input"].backend)          # (M, N)
        x_src = backward_source(x, xq, backward_operand)          # (M, K): what wgrad's copy of x comes from
        w_src = backward_source(weight, wq, backward_operand)     # (N, K): what dgrad's copy of W comes from
        xq = wq.dequantized = None                                # the kept FP32 copies have been read
        if bias is not None:
            y = y + bias.to(out_dtype)
        # Q_bwd(W, 0) == Q_fwd(W, 1) (one recipe, a square 2-D block, from the source): keep the copy for dgrad
        if backward_operand == "source" and q["dgrad_weight"].recipe == q["weight"].recipe \
                and same_both_axes(q["weight"].recipe, "weight"):
            ctx.save_for_backward(x_src, w_src, wq.data, wq.scale_inv, wq.tensor_scale_inv)
            ctx.w0 = (wq.block, wq.elem_format, wq.orig_dtype)
        else:
            ctx.save_for_backward(x_src, w_src)
            ctx.w0 = None
        ctx.quantizers = q
        ctx.weight_dtype = weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):  # (M, N) out dtype
        x_src, w_src, *w0 = ctx.saved_tensors
        q = ctx.quantizers
        dx = dw = db = None
        grad_y = grad_y.contiguous()
        if ctx.needs_input_grad[0]:
            if ctx.w0 is None:
                g1, w1 = dgrad_operands(q, grad_y, w_src)           # (M, N), (N, K)
            else:                                                   # the forward's copy: dgrad_operands' W bits
                g1 = q["grad_output"](grad_y, 1)
                w1 = ScaledTensor(w0[0], w0[1], ctx.w0[0], ctx.w0[1], w0[2], ctx.w0[2])
            dx = scaled_gemm(g1, w1, x_src.dtype, backend=q["grad_output"].backend)   # (M, K)
            del g1, w1                                              # and their FP32 copies, before the wgrad
        if ctx.needs_input_grad[1]:
            g0, x0 = wgrad_operands(q, grad_y, x_src)               # (M, N), (M, K)
            dw = scaled_gemm(g0.t(), x0, ctx.weight_dtype, backend=q["grad_output"].backend)   # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_y.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


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
