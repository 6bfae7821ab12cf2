"""The rules of the unscale and its inf/NaN check: `has_inf_or_nan`, `unscale_grads_`, `check_and_unscale_`.

The rule: a step may use its gradients only if every unscaled gradient g / S is finite. `unscale_grads_` is lesson
03's function (Python numbers in and out); `check_and_unscale_` is the same rule on tensors, the form the scalers
run (no host sync). Its kernel, ATen's fused `torch._amp_foreach_non_finite_check_and_unscale_` (one pass over
memory; ATen AmpKernels, used by torch.amp.GradScaler), lives in `scaling/fused.py`. That kernel checks the
*scaled* value, which is enough while 1/S <= 1: a finite g times a factor <= 1 stays finite. With S < 1 (reached
by backing off, or set by hand) the product can overflow (g = 3e38, S = 0.5 gives inf) and the fused kernel would
report "finite" for an infinite gradient; torch.amp.GradScaler then hands that inf to the optimizer. Here the
caller says whether that can happen (`may_overflow`, from a host-side lower bound of the scale, no sync), and only
then the gradients are multiplied first and the *products* checked.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..formats import get_format

FP32 = get_format("fp32")
FP32_TINY = FP32.min_normal  # 2**-126: below it 1/scale overflows FP32
FP32_MAX = FP32.max


def has_inf_or_nan(tensors) -> torch.Tensor:
    """True (a bool tensor of shape (), no host sync) if any element of `tensors` is inf or NaN.

    tensors: a tensor or an iterable of tensors, any shapes, floating dtypes (others cannot overflow and are
    ignored). One fused `torch._foreach_norm(ord=inf)` per (device, dtype) group: max|x| is inf/NaN exactly when
    some element is, and (unlike a sum) never overflows on finite input. Reads only: safe on tensors that
    autograd saved for backward. Result lives on the first tensor's device (CPU if there is none).
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    groups = defaultdict(list)  # (device, dtype) -> tensors
    for t in tensors:
        t = t._values() if t.is_sparse else t
        if t.is_floating_point() and t.numel() > 0:
            groups[(t.device, t.dtype)].append(t)
    if not groups:
        return torch.zeros((), dtype=torch.bool, device=tensors[0].device if tensors else "cpu")
    out_device = next(iter(groups))[0]
    maxes = [torch.stack(torch._foreach_norm(g, float("inf"))).float().to(out_device) for g in groups.values()]
    return ~torch.isfinite(torch.cat(maxes)).all()


def unscale_grads_(grads, scale: float) -> bool:
    """The rule of the unscale, unfused (lesson 03's signature): ``g *= float32(1 / scale)`` in place for every
    gradient; returns whether any element was inf/NaN before or after. ``check_and_unscale_`` is the same rule on
    tensors, the form the scalers run; a learner's ``unscale_grads_`` given to a scaler replaces it.

    grads: list of fp32/fp64 tensors (any shapes). scale: the loss scale S (positive).
    """
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()    # fp32 (): 1/S rounded once
    found = bool(has_inf_or_nan(grads))
    torch._foreach_mul_(list(grads), inv_scale)
    return found or bool(has_inf_or_nan(grads))


def check_and_unscale_(grads, found_inf, inv_scale, may_overflow: bool) -> None:
    """found_inf := max(found_inf, 1.0 if some grads[i] * inv_scale is inf/NaN); grads[i] *= inv_scale in place.

    grads: list of tensors of one device and dtype (fp32/fp64). found_inf: fp32 tensor () on that device.
    inv_scale: fp32 tensor () on that device, 1/S rounded once. may_overflow: True when inv_scale may exceed 1
    (S < 1): the products are checked, not the inputs.
    """
    if may_overflow:  # multiply first, then check the products: catches g finite, g / S = inf
        torch._foreach_mul_(grads, inv_scale)
        found_inf.copy_(torch.maximum(found_inf, has_inf_or_nan(grads).float()))
        return
    found_inf.copy_(torch.maximum(found_inf, has_inf_or_nan(grads).float()))  # check g, then multiply
    torch._foreach_mul_(grads, inv_scale)
