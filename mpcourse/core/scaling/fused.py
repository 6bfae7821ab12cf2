"""Kernels of loss scaling: ATen's fused scale update and fused unscale, each equal bit for bit to a rule.

* `update_scale_` runs `torch._amp_update_scale_` (ATen AmpGradScalerKernels.cpp), in place on the scaler's state.
  It equals `scaling.update.update_scale` with hysteresis 1, no `min_scale`, no `max_scale` (the only case where
  `DynamicLossScaler` picks it).
* `check_and_unscale_` runs `torch._amp_foreach_non_finite_check_and_unscale_` (ATen AmpKernels: one pass over
  memory, each element checked, then multiplied by 1/S). It equals `scaling.check.check_and_unscale_` when
  `may_overflow` is False; the kernel checks the inputs, not the products, so where 1/S may exceed 1 it hands the
  call to the rule.

No rule imports this module. A scaler chooses once, at construction (`DynamicLossScaler._set_config`,
`LossScalerBase.__init__`): the kernel where ATen has it (``HAS_FUSED_UPDATE``, ``HAS_FUSED_UNSCALE``) and the
library's switch allows (``mpcourse.core.kernels_switch``: ``MPCOURSE_FUSED=0`` makes every scaler run the rules).
`tests/core/scaling/test_scaling.py` compares kernel, rule and torch.amp.GradScaler bit for bit.
"""
from __future__ import annotations

import torch

from .. import kernels_switch
from . import check

#: whether this torch has ATen's fused calls (a fact about the install; the switch is asked at construction)
HAS_FUSED_UPDATE = hasattr(torch, "_amp_update_scale_")
HAS_FUSED_UNSCALE = hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_")


def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval) -> None:
    """In place: (scale, growth_tracker) := update.update_scale(scale, growth_tracker, found_inf, growth_factor,
    backoff_factor, growth_interval). scale fp32 (), growth_tracker int32 (), found_inf fp32 (), one device."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)


def check_and_unscale_(grads, found_inf, inv_scale, may_overflow: bool) -> None:
    """check.check_and_unscale_ in one pass over memory where 1/S <= 1 (may_overflow False); else the rule."""
    if may_overflow:
        check.check_and_unscale_(grads, found_inf, inv_scale, may_overflow)
        return
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def use_fused_update() -> bool:
    """Whether a scaler built now binds ATen's fused update (where its rule's shape allows): ATen has it and the
    switch (``kernels_switch.enabled()``) is on."""
    return HAS_FUSED_UPDATE and kernels_switch.enabled()


def choose_check_and_unscale():
    """The unscale a scaler binds at construction: the kernel where ATen has it and the switch is on, else the rule."""
    return check_and_unscale_ if HAS_FUSED_UNSCALE and kernels_switch.enabled() else check.check_and_unscale_
