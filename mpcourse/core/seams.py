"""Checks for functions handed to the library in place of its own (a learner's ``round_to_bf16``, ...).

Several library pieces take, as an optional keyword, one function per concept with the signature of the
lesson that builds it (``DynamicLossScaler(update_scale=...)``, ``BF16Optimizer(stochastic_round_bf16=...)``,
``MasterWeights(round_to_model=...)``). The library calls the rule it is given and checks what comes back
with these helpers, so that a wrong return value stops with one line naming the function and the fix
instead of spreading NaNs or shape errors through the training step. Without such a function the
library runs its own (fused where torch has a kernel).
"""
from __future__ import annotations

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
