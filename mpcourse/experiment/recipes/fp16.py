"""The FP16 recipes of Micikevicius et al. 2018 ("Mixed Precision Training", ICLR 2018), built up in three rows.

* ``fp16-master``: FP16 model, FP32 master weights (``mpcourse.core.master.MasterWeights``), no loss scaling.
  Section 3.1: the optimizer steps an FP32 copy, so small updates are not swamped and Adam's eps (1e-8, 0 in
  FP16) keeps its meaning. Gradients still underflow (the FP16 backward flushes |g| < 2**-24 to 0).
* ``fp16-static``: plus a constant loss scale (``StaticLossScaler``, section 3.2), here 2**12, chosen by
  ``mpcourse.core.scaling.choose_loss_scale`` from the largest measured gradient.
* ``fp16-dynamic``: plus dynamic loss scaling (``DynamicLossScaler``: skip and back off on inf/NaN, grow after
  ``growth_interval`` clean steps; torch/amp/grad_scaler.py semantics), here with ``growth_interval=50``.

Where each dtype lives (per parameter; ``memory()`` counts these, after the step and before ``zero_grad``)::

    model params            fp16  2 B  forward and backward run on them (every module, norms included)
    model grads             fp16  2 B  written by backward: grads of S * loss
    master params           fp32  4 B  MasterWeights' copy; the optimizer steps these
    master grads            fp32  4 B  copied up from the fp16 grads (exact), unscaled and clipped in place
    AdamW exp_avg/exp_avg_sq fp32 8 B  next to the master params
                                 ---
                                 20 B  (ZeRO's 16 B omits the FP32 master grads: DeepSpeed frees them after
                                        each step; here both grad copies are alive until zero_grad)

One step of the scaling recipes (the order of torch.amp's "gradient clipping" example, with a master copy)::

    scaler.scale(loss).backward()          # fp32 () loss * S -> fp16 grads on the model
    master.copy_grads_to_master()          # fp16 -> fp32 master .grad, exact (still scaled by S)
    scaler.unscale_(optimizer)             # master grads / S in fp32; inf/NaN check (one fused kernel)
    clip_grads(optimizer)                  # global norm of the *unscaled* fp32 grads <= grad_clip
    scaler.step(optimizer)                 # AdamW on the fp32 master, or skipped on inf/NaN
    master.copy_master_to_model()          # fp32 -> fp16, round to nearest even (not after a skip)
    scaler.update()                        # back off / grow the scale

Norms: every module is cast to FP16, LayerNorm included (no Apex-O2 ``keep_batchnorm_fp32``). Reasons: the
only difference between ``fp16-pure`` and ``fp16-master`` is then the master copy, which is what the row is
meant to show; PyTorch's LayerNorm kernels for FP16 inputs already accumulate mean and variance in FP32 (CPU
and CUDA); the model has no BatchNorm running statistics (Apex's reason for keeping BN in FP32). The loss is
computed in FP32 by the model itself (``logits.float()``).

Choice of the static scale, 2**12 (= 4096), by ``choose_loss_scale(2.7, 65504, margin=2)`` (lesson 03's rule:
the largest power of two S with S * 2.7 * 2**2 <= 65504). The scale must keep every gradient of the FP16 backward below 65504
and should lift the small ones out of FP16's zero and subnormal range. Measured on the default compare config
(seed 0): the largest gradient is a bias gradient (a sum over all B*T = 1024 positions), 0.62 at step 0 and
0.1-0.4 most of the time, but it spikes to 2.7 around step 10-12 (``blocks.0.attn.proj.bias``, at the end of the
learning-rate warm-up), which is exactly where ``fp16-dynamic`` overflows at 2**16 and at 2**15 (its two skipped
steps in ``mpcourse compare``: 2.7 * 2**15 = 8.8e4 > 65504). 2**12 keeps that spike at 1.1e4, a margin of about
6x, and no step of ``fp16-static`` overflows (0 skipped); it still moves every gradient up 12 binades: most
activation gradients lie between 2**-30 and 2**-14 (lesson 01's histogram), and values down to 2**-36 are no
longer zero, values down to 2**-26 no longer subnormal.

Choice of the dynamic defaults: ``init_scale=2**16`` as torch, but ``growth_interval=50`` instead of 2000. With
2000 a 200-step run can only ever lower its scale: one early overflow would be permanent. With 50 the scale
probes upward about 4 times per 200 steps; each probe that overflows costs one skipped step (<= 2% of a run).
"""
from __future__ import annotations

import torch

from mpcourse.core.formats import get_format
from mpcourse.core.lost_updates import is_update_lost, lost_update_fraction
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler, choose_loss_scale
from mpcourse.core.learner_table import exercise_names, returned
from .base import MasterWeightsRecipe, TrainingRecipe, StepResult, register

STATIC_GRAD_ABS_MAX = 2.7            # fp16-static: the largest gradient measured (module docstring)
STATIC_MARGIN = 2                    # powers of two of headroom above it
STATIC_LOSS_SCALE = choose_loss_scale(STATIC_GRAD_ABS_MAX, get_format("fp16").max, STATIC_MARGIN)   # 2**12
DYNAMIC_INIT_SCALE = 2.0**16         # torch.amp.GradScaler's default
DYNAMIC_GROWTH_INTERVAL = 50         # torch: 2000, longer than a whole compare run


@register
class FP16Master(MasterWeightsRecipe):
    """FP16 model with an FP32 master copy stepped by AdamW; no loss scaling (gradients still underflow)."""

    name = "fp16-master"
    description = "FP16 model, FP32 master weights + AdamW (MasterWeights), no loss scaling"
    model_dtype = torch.float16
    #: lesson 01's rule: given (``is_update_lost``), each step also reports ``lost_updates``, the fraction of FP16
    #: weight elements whose update would be lost added straight to the FP16 weights (``lost_update_fraction``).
    OVERRIDABLE = MasterWeightsRecipe.OVERRIDABLE + exercise_names("is_update_lost")
    #: the opt-in statistics' rules: name in OVERRIDABLE -> the library's function (``train_yours`` trains the
    #: library's row with it, so both rows have the column); a default run computes none of them.
    STATISTICS = {"is_update_lost": is_update_lost}

    def step(self) -> StepResult:
        rule = self.overrides.get("is_update_lost")
        if rule is None:
            return super().step()
        pairs = [(p, m) for p, m in zip(self.master.model_params, self.master.master_params) if m is not p]
        weights = [p.detach().clone() for p, _ in pairs]                # fp16, before the step
        before = [m.detach().clone() for _, m in pairs]                # fp32, before the step
        result = super().step()
        result.stats["lost_updates"] = lost_update_fraction(weights, before, [m for _, m in pairs], rule)
        return result


class _ScaledFP16(FP16Master):
    """FP16 model + FP32 master weights + a loss scaler (``make_scaler``); the step order of the module docstring."""

    def __init__(self, model, optim=None):
        super().__init__(model, optim)
        self.scaler = self.make_scaler()

    def make_scaler(self):
        raise NotImplementedError

    def backward(self, loss):
        self.scaler.scale(loss).backward()                             # fp32 () * S; fp16 grads of S * loss

    def step(self) -> StepResult:
        self.master.copy_grads_to_master()                             # fp16 -> fp32, exact, still scaled
        self.scaler.unscale_(self.optimizer)                           # fp32 grads / S, inf/NaN check
        self.clip_grads(self.optimizer)                                # unscaled fp32 grads
        self.scaler.step(self.optimizer)                               # AdamW in fp32, or skip
        skipped = self.scaler.last_step_skipped
        if not skipped:
            self.master.copy_master_to_model()                         # fp32 -> fp16, nearest even
        scale_used = self.scaler.get_scale()
        self.scaler.update()
        return StepResult(skipped=skipped, loss_scale=scale_used)

    def state_dict(self) -> dict:
        """Model, master copy + optimizer state, and the scaler's state (call after a step, i.e. after update())."""
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])


@register
class FP16Static(_ScaledFP16):
    name = "fp16-static"
    description = "FP16 model, FP32 master weights, static loss scale 2**12 (StaticLossScaler)"

    OVERRIDABLE = exercise_names("round_to_fp16", "make_master", "choose_loss_scale", "unscale_grads_",
                                 "all_reduce_found_inf_")   # lessons 00, 02, 03, 10 (with --nproc > 1)

    def make_scaler(self):
        choose = self.overrides.get("choose_loss_scale")
        scale = STATIC_LOSS_SCALE if choose is None else returned(
            "choose_loss_scale", choose(STATIC_GRAD_ABS_MAX, get_format("fp16").max, STATIC_MARGIN))
        return StaticLossScaler(scale, unscale_grads_=self.overrides.get("unscale_grads_"),
                                all_reduce_found_inf_=self.overrides.get("all_reduce_found_inf_"))


@register
class FP16Dynamic(_ScaledFP16):
    name = "fp16-dynamic"
    description = "FP16 model, FP32 master weights, dynamic loss scaling (DynamicLossScaler, growth_interval 50)"
    OVERRIDABLE = exercise_names("round_to_fp16", "make_master", "unscale_grads_", "update_scale",
                                 "all_reduce_found_inf_")     # lessons 00, 02, 03, 04, 10

    def make_scaler(self):
        return DynamicLossScaler(init_scale=DYNAMIC_INIT_SCALE, growth_interval=DYNAMIC_GROWTH_INTERVAL,
                                 update_scale=self.overrides.get("update_scale"),
                                 unscale_grads_=self.overrides.get("unscale_grads_"),
                                 all_reduce_found_inf_=self.overrides.get("all_reduce_found_inf_"))
