"""The rule of dynamic loss scaling, `update_scale`: one update of the scale per iteration (lesson 04's function).

Back off on inf/NaN, grow on the `growth_interval`-th clean step in a row, never grow to inf (torch.amp.GradScaler,
torch/amp/grad_scaler.py; ATen AmpGradScalerKernels.cpp `_amp_update_scale_`; Megatron core/optimizer/grad_scaler.py
for the timing), with DeepSpeed's hysteresis, floor and cap (runtime/fp16/loss_scaler.py) as keyword-only options.
Written in tensor ops so a scaler runs it without a host sync; Python numbers work too (lesson 04's form).
Its kernel, ATen's fused `torch._amp_update_scale_`, lives in `scaling/fused.py` (`update_scale_`), equal bit for
bit where it applies (hysteresis 1, no floor, no cap); `DynamicLossScaler` picks one of the two at construction.
"""
from __future__ import annotations

import torch


def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, *,
                 hysteresis=1, hysteresis_tracker=None, consecutive_hysteresis=False, min_scale=None,
                 max_scale=None):
    """One update of a dynamic loss scale, as torch.amp.GradScaler.update() (lesson 04's name and signature).

    If found_inf: scale * backoff_factor (the product in float64, rounded once to FP32, as ATen), tracker 0.
    Otherwise tracker + 1; on reaching growth_interval: scale * growth_factor unless that is inf in FP32 (then the
    scale stays), tracker 0. DeepSpeed's options: with `hysteresis_tracker` h given, an overflow while h > 1 spends
    one unit (h - 1) and keeps the scale; h refills to `hysteresis` at each growth (at every clean step with
    consecutive_hysteresis). `min_scale` floors a backoff, `max_scale` caps a growth.

    scale: FP32 tensor () or float. growth_tracker, hysteresis_tracker: int32 tensors () or ints. found_inf:
    a tensor (> 0: overflow) or bool. Returns new tensors (new_scale fp32, new_growth_tracker int32), and
    new_hysteresis_tracker third when hysteresis_tracker was given. Nothing is modified in place.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32)
    tracker = torch.as_tensor(growth_tracker, dtype=torch.int32)
    hyst = torch.as_tensor(hysteresis if hysteresis_tracker is None else hysteresis_tracker, dtype=torch.int32)
    ovf = torch.as_tensor(found_inf) > 0                             # bool ()
    spend = ovf & (hyst > 1)                                         # spend hysteresis, keep the scale
    backoff = ovf & ~spend
    backed_off = (scale.double() * backoff_factor).float()           # fp32 product as ATen: double, rounded
    if min_scale is not None:
        backed_off = backed_off.clamp(min=min_scale)
    clean_run = tracker + 1
    grow = ~ovf & (clean_run == growth_interval)
    grown = (scale.double() * growth_factor).float()
    if max_scale is not None:
        grown = grown.clamp(max=max_scale)
    grown = torch.where(torch.isfinite(grown), grown, scale)         # never grow to inf (pytorch#98828)
    new_scale = torch.where(backoff, backed_off, torch.where(grow, grown, scale))
    new_tracker = torch.where(ovf | grow, 0, clean_run)
    if hysteresis_tracker is None:
        return new_scale, new_tracker
    refill = grow | (~ovf & consecutive_hysteresis)
    return new_scale, new_tracker, torch.where(spend, hyst - 1, torch.where(refill, hysteresis, hyst))
