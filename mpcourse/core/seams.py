"""Checks for functions handed to the library in place of its own (a learner's ``round_to_bf16``, ...).

Several library pieces take, as an optional keyword, one function per concept with the signature of the
lesson that builds it (``DynamicLossScaler(update_scale=...)``, ``BF16Optimizer(stochastic_round_bf16=...)``,
``MasterWeights(round_to_model=..., make_master=...)``, ``MasterWeights.step_with(master_step)``, the loss
scalers' ``unscale_grads_=``, ``fp16-static``'s ``choose_loss_scale``). The library calls the rule it is given and checks what comes back
with these helpers, so that a wrong return value stops with one line naming the function and the fix
instead of spreading NaNs or shape errors through the training step. Without such a function the
library runs its own (fused where torch has a kernel).
"""
from __future__ import annotations

import math

import torch


class SeamError(TypeError):
    """A function given in place of the library's returned something the library cannot use."""


def check_rounded(name: str, x: torch.Tensor, out, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (from ``name(x)``) as a tensor of ``dtype``: it must be a tensor of x's shape holding values of
    ``dtype`` (in that dtype or in float32). Raises ``SeamError`` naming ``name`` otherwise."""
    if not isinstance(out, torch.Tensor):
        raise SeamError(f"{name} returned {type(out).__name__}, expected a tensor")
    if out.shape != x.shape:
        raise SeamError(f"{name} returned shape {tuple(out.shape)} for input shape {tuple(x.shape)}")
    if out.dtype not in (dtype, torch.float32):
        raise SeamError(f"{name} returned dtype {out.dtype}, expected {dtype} or torch.float32")
    low = out.to(dtype)
    if out.dtype == torch.float32:
        same = (low.float() == out) | out.isnan()
        if not bool(same.all()):
            bad = out[~same].flatten()[0].item()
            raise SeamError(f"{name} returned {bad!r}, which is not a {str(dtype).replace('torch.', '')} value")
    return low


def check_flag(name: str, out) -> bool:
    """``out`` (from ``name(...)``, a yes/no answer such as found_inf) as a bool: a bool, or a one-element bool or
    0/1 tensor. Raises ``SeamError`` naming ``name`` otherwise (None: a forgotten ``return``)."""
    if isinstance(out, torch.Tensor) and out.numel() == 1 and (out.dtype == torch.bool or bool((out == 0) | (out == 1))):
        return bool(out)
    if isinstance(out, bool) or type(out).__name__ == "bool_":            # Python or NumPy bool
        return bool(out)
    raise SeamError(f"{name} returned {out!r}, expected True or False")


def check_scale(name: str, out) -> float:
    """``out`` (from ``name(...)``, a loss scale) as a float: a positive finite number. ``SeamError`` otherwise."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not (math.isfinite(out) and out > 0):
        raise SeamError(f"{name} returned {out!r}, expected a positive finite loss scale")
    return float(out)


def check_masters(name: str, params: list, out) -> list:
    """``out`` (from ``name(params)``, FP32 master copies) as a list: one float32 leaf tensor per param, same shape,
    equal values, requires_grad, sharing no memory with it. ``SeamError`` naming ``name`` and the index otherwise."""
    if not isinstance(out, (list, tuple)) or len(out) != len(params):
        got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
        raise SeamError(f"{name} returned {got}, expected a list of {len(params)} tensors (one per parameter)")
    for i, (p, m) in enumerate(zip(params, out)):
        where = f"{name} returned, for parameter {i} of shape {tuple(p.shape)},"
        if not isinstance(m, torch.Tensor):
            raise SeamError(f"{where} a {type(m).__name__}, expected a tensor")
        if m.dtype != torch.float32 or m.shape != p.shape:
            raise SeamError(f"{where} {m.dtype} of shape {tuple(m.shape)}, expected torch.float32 of its shape")
        if not (m.is_leaf and m.requires_grad):
            raise SeamError(f"{where} a tensor that is not a leaf with requires_grad=True (use .detach() then "
                            ".requires_grad_(True))")
        if m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            raise SeamError(f"{where} a tensor sharing memory with the parameter (copy it)")
        if not torch.equal(m.detach(), p.detach().float()):
            raise SeamError(f"{where} values that differ from the parameter's (a master starts as an exact copy)")
    return list(out)
