"""Loss scaling for FP16 training: `StaticLossScaler` and `DynamicLossScaler`.

Why: FP16 gradients below 2**-24 flush to zero (Micikevicius et al. 2018, "Mixed Precision Training", ICLR 2018,
section 3.2). Multiplying the loss by S shifts every gradient up by S (chain rule); the gradients are divided by
S again in FP32 before the optimizer uses them. Too large an S overflows (S * max|g| > 65504 gives inf), so the
dynamic scaler skips such steps, backs off, and grows S again after `growth_interval` clean steps.

API and semantics follow `torch.amp.GradScaler` (torch/amp/grad_scaler.py, ATen AmpGradScalerKernels.cpp), so code
written for it runs with the class swapped: `DynamicLossScaler("cuda", init_scale=..., growth_factor=...,
backoff_factor=..., growth_interval=..., enabled=...)`, `scale, unscale_, step, update(new_scale=None), get_scale,
get_init_scale, get_/set_growth_factor, get_/set_backoff_factor, get_/set_growth_interval, is_enabled, state_dict,
load_state_dict`, pickling between iterations, and optimizers that declare `_step_supports_amp_scaling`.
Per-optimizer stage READY -> UNSCALED -> STEPPED, reset by `update()`; `inv_scale = scale.double().reciprocal()
.float()`; one fused `torch._amp_foreach_non_finite_check_and_unscale_` per (device, dtype) group of gradients;
the only host sync of an iteration is in `step()` (the skip decision).

The rules, each one plain function: `update_scale` (module `update`, lesson 04: one update of the dynamic scale)
and `unscale_grads_` / `check_and_unscale_` (module `check`, lesson 03: unscale and the inf/NaN check). Their
kernels, ATen's fused `torch._amp_update_scale_` and `torch._amp_foreach_non_finite_check_and_unscale_`, are in
`fused`, which no rule imports; a scaler binds rule or kernel once at construction (``MPCOURSE_FUSED=0``: the
rules). Other modules: `validate` (one rule set for constructor, setters and checkpoints), `base` (the state
machine), `static`, `dynamic`; `mpcourse.core.distributed` holds the all-reduce.

Typical loop (FP16 model, FP32 master weights; see mpcourse/core/master.py)::

    scaler.scale(loss).backward()        # FP16 grads of the *scaled* loss land on the model params
    master.copy_grads_to_master()        # FP16 grads -> FP32 .grad of the master params (still scaled)
    scaler.unscale_(master.optimizer)    # optional: FP32 grads / S, inf/NaN check (clip here)
    scaler.step(master.optimizer)        # skipped (returns None) if any grad was inf/NaN
    master.copy_master_to_model()        # FP32 master -> FP16 model (round to nearest even)
    scaler.update()                      # back off / grow the scale
    master.zero_grad()                   # THE CALLER clears gradients, every iteration, skipped or not

Who clears gradients: the caller, with `optimizer.zero_grad()` (or `MasterWeights.zero_grad()`), as with
torch's GradScaler. A skipped step leaves the inf/NaN gradients in `.grad`; never clearing them makes every
later step overflow too and drives the scale down (PaddlePaddle/Paddle#67895); with `min_scale` set this ends in
`LossScaleFloorError` instead of a scale of 0 (pytorch/pytorch#99640).

Many processes (data parallel): when torch.distributed is initialized with more than one rank, `unscale_`
all-reduces the inf/NaN flag with MAX over `process_group` (mpcourse.core.distributed.all_reduce_max_), as FSDP's
ShardedGradScaler does (torch/distributed/fsdp/sharded_grad_scaler.py), so one rank's overflow makes every rank
skip and back off: the ranks keep the same scale and the same weights. Every rank must call `unscale_`/`step` for
the same optimizers in the same order (each is a collective); a rank whose optimizer has no gradient this
iteration takes part with a clean flag instead of raising (raising on one rank would leave the others waiting).

Policies (where public implementations disagree; each is tested against torch.amp.GradScaler):
- No inf/NaN reaches the optimizer: with a scale below 1 (after backoffs, or set by hand) g / S can overflow
  although g is finite; the products are checked then (scaling/check.py). torch checks only g and lets that
  inf through. Sparse gradients are coalesced before the check (duplicate indices are summed by the optimizer;
  torch coalesces FP16 ones only).
- An optimizer none of whose parameters has a `.grad` is an error (`unscale_`/`step` raise), as in torch
  ("No inf checks were recorded for this optimizer", e.g. huggingface/transformers#24003); the message names the
  fixes. If an optimizer legitimately has nothing to do this iteration, do not call `scaler.step` on it
  (nerfstudio-project/nerfstudio#1919).
- FP16 and BF16 gradients are refused by the unscaler (torch refuses FP16 only): unscale in FP32 master grads.
- `StaticLossScaler` also checks for inf/NaN and skips such steps (DeepSpeed's static scaler does not check);
  a silently applied inf gradient would corrupt the weights.
- Values are validated everywhere they enter (constructor, setters, `update(new_scale)`, `load_state_dict`): a
  scale outside [2**-126, FP32 max], a growth factor <= 1, a backoff factor outside (0, 1), an interval < 1 raise
  and leave the scaler unchanged. torch validates only the constructor's two factors.
- The `device` argument is informational (the state lives on the loss's device); torch disables a "cuda"
  scaler on a machine without CUDA, this one stays enabled.
- With `min_scale=None` the scale may fall below 1 as in torch, but an overflow that would push it below the
  smallest normal FP32 number (2**-126, where 1/scale overflows) raises `LossScaleFloorError`; torch would carry
  on to a subnormal scale and 0 (pytorch/pytorch#99640). This is the only difference from GradScaler's
  trajectory, and only in a run that is already broken.
"""
from .base import READY, STEPPED, UNSCALED, LossScaleFloorError, LossScalerBase
from .check import FP32_TINY as _FP32_TINY
from .check import has_inf_or_nan, unscale_grads_
from .choose import choose_loss_scale
from .dynamic import DynamicLossScaler
from .static import StaticLossScaler
from .update import update_scale

__all__ = ["DynamicLossScaler", "StaticLossScaler", "LossScaleFloorError", "LossScalerBase", "has_inf_or_nan",
           "choose_loss_scale", "unscale_grads_", "update_scale",
           "READY", "UNSCALED", "STEPPED"]
