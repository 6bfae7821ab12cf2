"""The grouped GEMM of a mixture of experts, forward and backward, in any ``GroupedFormat``: one expert at a time.

``grouped_mm(x, w, groups, fmt)`` computes, for every expert e, y_e = x_e @ W_e^T over the rows of x that hold
e's tokens, as ``torch._grouped_mm(x, w.transpose(-2, -1), offs)`` does (torchao's
``_to_fp8_rowwise_then_scaled_grouped_mm`` and ``_to_mxfp8_then_scaled_grouped_mm`` in the FP8 formats)::

    x       (rows, K)     tokens grouped by expert and padded (``grouping.pad_groups``), any float dtype
    w       (E, N, K)     each expert's weight, as ``nn.Linear`` stores it (torchao's B_t is w.transpose(-2, -1))
    groups  TokenGroups   where each expert's tokens sit (``groups.spans()``: first row and real rows)
    y       (rows, N)     out dtype; dx (rows, K) in x's dtype; dW (E, N, K) in w's dtype

The rule is the dense layer's, group by group (``expert_gemms``): a loop over experts, never over tokens. What the
upstream kernels got wrong, and this rule makes structural:

* padding rows (inside a group, or past the last group) are exactly zero in y and in dx: the GEMMs read and
  write only the rows that hold a token, and the rest are allocated as zeros (``torch._grouped_mm`` left them
  uninitialised, also in autograd's dx, and a later backward turned NaN since 0 x NaN = NaN: pytorch#154557);
* an expert with no token gets an exactly zero dW (one GPU generation gave a non-zero one: pytorch#172439);
* a NaN or inf in one expert's tokens, weights or scales reaches only that expert's rows and dW: every scale is
  computed from one expert's tokens (a NaN scale leaked into another expert's rows of a shared tile:
  flashinfer#3103);
* any group size works: the weight gradient pads a group to its block along the tokens (TransformerEngine#2966).

In rowwise FP8 the weight gradient's scales of dy and x are computed for all groups at once, per group and column
(``group_scales``: lesson 13's rule, or the learner's ``group_scales`` where the format's recipe carries one).

The GEMMs run with autocast off inside (``torch.autocast`` and the course's: the format, not an enclosing region,
says their dtypes); their BF16/FP16 ``torch.mm`` is the tensor-core emulation inside ``emulation.tensor_cores()``.
"""
from __future__ import annotations

from typing import Optional

import contextlib

import torch

from ..autocast import any_autocast_enabled, no_autocast
from ..learner_table import returned
from ..quant.block_recipes import Float8RowwiseScaling
from . import expert_gemms
from .formats import GroupedFormat, grouped_format
from .group_scales import group_colwise_scales
from .grouping import TokenGroups


def check_operands(x: torch.Tensor, w: torch.Tensor, groups: TokenGroups) -> None:
    """ValueError naming the fix for operands ``grouped_mm`` cannot take."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm takes x (rows, K) and w (E, N, K), got shapes {tuple(x.shape)} and "
                         f"{tuple(w.shape)}: flatten the tokens to (-1, K) first")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"x has K = {x.shape[1]} columns but w is (E, N, K) with K = {w.shape[2]}")
    if w.shape[0] != groups.num_experts or x.shape[0] != groups.rows:
        raise ValueError(f"groups describe {groups.num_experts} experts over {groups.rows} rows, but w has "
                         f"{w.shape[0]} experts and x {x.shape[0]} rows: pad x with grouping.pad_groups(x, groups)")
    if not (x.is_floating_point() and w.is_floating_point()):
        raise ValueError(f"grouped_mm takes floating-point x and w, got {x.dtype} and {w.dtype}")


def own_dtypes(device_type: str):
    """A region where no autocast (torch's or the course's) casts the GEMMs: the format says their dtypes."""
    return no_autocast(device_type) if any_autocast_enabled(device_type) else contextlib.nullcontext()


def learner_function(fmt: GroupedFormat, name: str):
    """The learner's lesson 13 function ``name`` the format's recipe carries (``recipe.functions``), or None."""
    return fmt.recipe.functions.get(name) if fmt.quantized else None


def wgrad_scales(dy: torch.Tensor, x: torch.Tensor, groups: TokenGroups, fmt: GroupedFormat):
    """Rowwise FP8: the weight gradient's scales of dy (E, N) and x (E, K), one per expert group and column over the
    group's real rows (``group_scales.group_colwise_scales``, or a learner's ``group_scales``); None otherwise."""
    if not isinstance(fmt.recipe, Float8RowwiseScaling):
        return None
    fn = learner_function(fmt, "group_scales")
    out = []
    for t in (dy, x):
        real = t.detach().index_select(0, groups.index)                  # (num_tokens, C): padding rows left out
        if fn is None:
            out.append(group_colwise_scales(real, groups.offs, fmt.recipe.round_scales_to_power_of_2))
        else:
            out.append(returned("group_scales", real, groups.offs, fn(real, groups.offs)))
    return tuple(out)


class GroupedMM(torch.autograd.Function):
    """y = grouped x @ W^T per expert (see the module docstring); the backward runs ``expert_gemms.dgrad`` and
    ``expert_gemms.wgrad`` on each expert's rows."""

    @staticmethod
    def forward(ctx, x, w, groups: TokenGroups, fmt: GroupedFormat, out_dtype: torch.dtype):
        # x: (rows, K); w: (E, N, K)
        q = expert_gemms.quantizers_for(fmt)                                   # the backend chosen once
        with own_dtypes(x.device.type):
            y = x.new_zeros(groups.rows, w.shape[1], dtype=out_dtype)            # (rows, N): padding stays zero
            for e, (s, n) in enumerate(groups.spans()):
                if n:
                    y[s:s + n] = expert_gemms.forward(x[s:s + n], w[e], fmt, out_dtype, q)
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.fmt, ctx.q = groups, fmt, q
        return y

    @staticmethod
    def backward(ctx, dy):  # dy: (rows, N)
        x, w = ctx.saved_tensors
        groups, fmt, q = ctx.groups, ctx.fmt, ctx.q
        dy = dy.contiguous()
        E, N, K = w.shape
        dx = x.new_zeros(x.shape) if ctx.needs_input_grad[0] else None           # (rows, K): padding stays zero
        dws = []
        with own_dtypes(x.device.type):
            scales = wgrad_scales(dy, x, groups, fmt) if ctx.needs_input_grad[1] else None   # (E, N), (E, K)
            for e, (s, n) in enumerate(groups.spans()):
                if dx is not None and n:
                    dx[s:s + n] = expert_gemms.dgrad(dy[s:s + n], w[e], fmt, x.dtype, q)
                if ctx.needs_input_grad[1]:
                    own = None if scales is None else (scales[0][e:e + 1], scales[1][e:e + 1])   # (1, N), (1, K)
                    dws.append(expert_gemms.wgrad(dy[s:s + n], x[s:s + n], fmt, w.dtype, N, K, q, own))
        dw = torch.stack(dws) if ctx.needs_input_grad[1] else None                 # (E, N, K)
        return dx, dw, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: TokenGroups, fmt="fp32",
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The experts' grouped GEMM: (rows, K) tokens grouped and padded, (E, N, K) weights -> (rows, N).

    fmt: a ``GroupedFormat`` or its name (``formats.GROUPED_FORMATS``: "fp32", "bf16", "fp16", "fp8-rowwise",
    "fp8-block", "mxfp8"). out_dtype: the output's dtype; default the format's dtype in high precision, x's dtype
    in the FP8 formats (which round the FP32 GEMM once to it). Differentiable in x and w."""
    fmt = grouped_format(fmt)
    check_operands(x, w, groups)
    if out_dtype is None:
        out_dtype = fmt.dtype if not fmt.quantized else x.dtype
    elif not fmt.quantized and out_dtype != fmt.dtype:
        raise ValueError(f"the {fmt.name} format computes its GEMMs in {fmt.dtype}: leave out_dtype as None")
    return GroupedMM.apply(x, w, groups, fmt, out_dtype)
