"""``FP8DotProductAttention``: causal attention whose products run in FP8, a module with checkpointed scales.

Transformer Engine's ``DotProductAttention`` under a recipe with ``fp8_dpa=True``: Q, K, V come in, O goes out, and
every tensor in between is cast as ``fp8_attention`` states (the rule; its autograd function is here). The scales
and amax histories (``scaling.AttentionScaling``) follow the recipe's scaling and the FP8 region's update schedule,
as ``Float8Linear``'s do, and are saved in the module's extra state (``state_dict()['..._extra_state']``: one float32
tensor, a row ``[scale, *amax_history]`` per role that keeps state), so a run resumes bit for bit.

Options:
  roles:        which tensors are FP8 (default all of ``ROLES``; the others stay FP32). No roles: FP32 attention.
  kv_block:     keys per block of the online softmax (128, cuDNN's reference); None: softmax over whole rows.
  fp8_dpa_bwd:  False computes the backward in FP32 from the FP32 Q, K, V (TE ``NVTE_FP8_DPA_BWD=0``;
                FlashAttention-3's FP8 is forward only): the gradients are those of FP32 attention at these inputs
                (straight through the forward's casts; TE's F16 backward reads the FP8 forward's O and softmax
                statistics instead).
  fixed_scales: {role: scale} constant scales (e.g. cuDNN's MXFP8 attention casts P with a fixed 16).

Outside an FP8 region a call is its own region (its forward states update when it returns), inside
``quant.autocast(enabled=False)`` the layer computes FP32 attention, and under ``torch.no_grad()`` it uses its scales
and records nothing: the policies of ``mpcourse.core.quant.region``. Inputs (..., T, d) float32 / bfloat16 / float16;
the output has the input's dtype and the gradients the inputs' dtypes.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Optional

import torch
import torch.nn as nn

from ..quant.recipe import DelayedScaling, Recipe
from ..quant.region import get_fp8_recipe, is_fp8_enabled
from ..quant.rules.tensor import Float8Tensor
from .fp8_attention import (BACKWARD_ROLES, FORWARD_ROLES, KV_BLOCK, ROLES, ForwardResult, attention_backward,
                            attention_forward)
from .inspected import report, watched
from .scaling import AttentionScaling
from ..checkpoint import extra_state_missing

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _pack(operands) -> list:
    """[data, scale_inv or None] per operand, for ``save_for_backward``."""
    out = []
    for a in operands:
        out += [a.data, a.scale_inv] if isinstance(a, Float8Tensor) else [a, None]
    return out


def _unpack(saved) -> list:
    return [t if s is None else Float8Tensor(t, s) for t, s in zip(saved[::2], saved[1::2])]


class _FP8AttentionFunction(torch.autograd.Function):
    """O = attention(Q, K, V) with the forward and backward of ``fp8_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, scaling, options, record, observer=None):
        # options: (attn_scale, causal, kv_block, fp8_dpa_bwd); scaling: an AttentionScaling (no roles: FP32);
        # observer: None, or where each cast tensor goes (``inspected.report``: the numerics inspector)
        attn_scale, causal, kv_block, fp8_dpa_bwd = options
        casts = scaling.casts(FORWARD_ROLES, q.device)
        if "s" in casts and casts["s"].scale is not None:       # the backward casts P with this step's scale
            casts["s"] = replace(casts["s"], scale=casts["s"].scale.detach().clone())
        if observer is not None:
            casts = watched(casts)
        fwd = attention_forward(q, k, v, casts, attn_scale=attn_scale, causal=causal, kv_block=kv_block)
        if observer is not None:
            report(observer, casts, backward=False)
            casts = {r: replace(how, seen=None) for r, how in casts.items()}
        if record:
            scaling.record(fwd.amax, FORWARD_ROLES)
        ctx.scaling, ctx.options, ctx.s_cast, ctx.observer = scaling, options, casts.get("s"), observer
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        if fp8_dpa_bwd:
            ctx.save_for_backward(*_pack([fwd.q8, fwd.k8, fwd.v8, fwd.o8]), fwd.lse)
        else:
            ctx.save_for_backward(q, k, v)
        return fwd.out.to(q.dtype)                                  # (..., T, d_v)

    @staticmethod
    def backward(ctx, grad):
        scaling, (attn_scale, causal, kv_block, fp8_dpa_bwd) = ctx.scaling, ctx.options
        if fp8_dpa_bwd:
            *saved, lse = ctx.saved_tensors
            fwd = ForwardResult(*_unpack(saved), lse, {})
            casts = scaling.casts(BACKWARD_ROLES, grad.device)
            if ctx.s_cast is not None:
                casts["s"] = ctx.s_cast
            if ctx.observer is not None:
                casts = watched(casts)
            dq, dk, dv, amax = attention_backward(grad, fwd, casts, attn_scale=attn_scale, causal=causal)
            if ctx.observer is not None:
                report(ctx.observer, casts, backward=True)
            scaling.record(amax, BACKWARD_ROLES)
        else:                                                     # FP32 attention's backward at the FP32 inputs
            q, k, v = ctx.saved_tensors
            fwd = attention_forward(q, k, v, {}, attn_scale=attn_scale, causal=causal, kv_block=kv_block)
            dq, dk, dv, _ = attention_backward(grad, fwd, {}, attn_scale=attn_scale, causal=causal)
        dq, dk, dv = (g.to(dt) for g, dt in zip((dq, dk, dv), ctx.dtypes))
        return dq, dk, dv, None, None, None, None


class FP8DotProductAttention(nn.Module):
    """Causal scaled-dot-product attention with FP8 products (module docstring).

    Args: ``recipe`` (``DelayedScaling`` (default: TE's defaults) or ``CurrentScaling``), ``roles``, ``kv_block``,
    ``fp8_dpa_bwd``, ``fixed_scales``; ``key`` names the layer in the amax all-reduce; ``device`` holds the state.
    ``forward(q, k, v, attn_scale=None, causal=True)``: q, k (..., T, d), v (..., T, d_v) -> (..., T, d_v);
    ``attn_scale`` None means 1 / sqrt(d). ``scaling_state``: {role: DelayedScalingState}.

    Switches (``mpcourse.core.autoswitch``; not in the checkpoint, the switch's own state says them again):
    ``high_precision = True`` computes FP32 attention, as outside an FP8 region; ``high_precision_roles``, a set of
    roles, leaves those tensors uncast (their scales still follow their amaxes). ``observer``: None, or the callable
    each cast tensor is reported to on a pass that records (``inspected.report``; the numerics inspector sets it).
    """

    observer = None

    def __init__(self, recipe: Optional[Recipe] = None, *, roles=ROLES, kv_block: Optional[int] = KV_BLOCK,
                 fp8_dpa_bwd: bool = True, fixed_scales: Optional[Mapping[str, float]] = None, key: str = "",
                 device=None):
        super().__init__()
        self.recipe = DelayedScaling() if recipe is None else recipe
        if kv_block is not None and (isinstance(kv_block, bool) or not isinstance(kv_block, int) or kv_block < 1):
            raise ValueError(f"kv_block must be a positive int (keys per block) or None (whole rows), got {kv_block!r}")
        self.roles, self.kv_block, self.fp8_dpa_bwd = tuple(roles), kv_block, bool(fp8_dpa_bwd)
        self.fixed_scales, self.key = dict(fixed_scales or {}), key
        self.high_precision, self.high_precision_roles = False, set()
        self._reset_scaling_state(device)

    def _reset_scaling_state(self, device=None) -> None:
        self.scaling = AttentionScaling(self.recipe, self.roles, self.fixed_scales, device, self.key or "attention",
                                        high=self.high_precision_roles)

    @property
    def scaling_state(self) -> dict:
        return self.scaling.states

    def _check(self, q, k, v) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype not in HIGH_PRECISION:
                raise TypeError(f"FP8DotProductAttention takes float32/bfloat16/float16 {name}, got {t.dtype}")
        if q.dim() < 2 or q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2] or q.shape[-1] != k.shape[-1] \
                or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"attention takes q, k (..., T, d) and v (..., T, d_v) with the same leading dims and "
                             f"as many keys as values, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: Optional[float] = None,
                causal: bool = True) -> torch.Tensor:
        self._check(q, k, v)
        attn_scale = 1.0 / math.sqrt(q.shape[-1]) if attn_scale is None else float(attn_scale)
        options = (attn_scale, causal, self.kv_block, self.fp8_dpa_bwd)
        if not is_fp8_enabled() or self.high_precision:    # quant.autocast(enabled=False), or switched: FP32
            return _FP8AttentionFunction.apply(q, k, v, AttentionScaling(self.recipe, ()), options, False, None)
        region_recipe = get_fp8_recipe()
        if region_recipe is not None and region_recipe != self.recipe:
            raise ValueError(f"the FP8 region's recipe {region_recipe} differs from this attention's {self.recipe}: "
                             "build the layer with the region's recipe (or fp8_recipe=None)")
        grad = torch.is_grad_enabled()
        return _FP8AttentionFunction.apply(q, k, v, self.scaling, options, grad, self.observer if grad else None)

    # -- checkpointing --------------------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        return self.scaling.get_extra_state()

    def set_extra_state(self, state) -> None:
        self.scaling.set_extra_state(state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """As ``nn.Module``'s, but a checkpoint without this layer's state (saved before FP8 attention was turned on)
        starts it fresh."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if extra_state_missing(state_dict, prefix, missing_keys):
            self._reset_scaling_state(self._device())

    def _device(self):
        states = list(self.scaling.states.values())
        return states[0].scale.device if states else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self._device()
        if device is not None:                         # follow a move (model.to(device)), stay FP32
            self.scaling.to(fn(torch.zeros((), device=device)).device)
        return self

    def extra_repr(self) -> str:
        roles = "all" if self.roles == ROLES else ",".join(self.roles) or "none"
        return f"recipe={self.recipe}, roles={roles}, kv_block={self.kv_block}, fp8_dpa_bwd={self.fp8_dpa_bwd}"


def attention_layers(model: nn.Module) -> dict[str, FP8DotProductAttention]:
    """The FP8 attention modules of ``model`` by fully qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8DotProductAttention)}
