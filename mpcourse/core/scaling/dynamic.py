"""`DynamicLossScaler`: torch.amp.GradScaler's dynamic loss scaling, with DeepSpeed's hysteresis and floor.

Skip and back off on inf/NaN, grow after `growth_interval` clean steps. Growth timing follows torch
(ATen `_amp_update_scale_`) and Megatron (core/optimizer/grad_scaler.py); hysteresis, `min_scale` and the error at
the floor follow DeepSpeed (runtime/fp16/loss_scaler.py). The constructor takes torch.amp.GradScaler's arguments
in its order (`DynamicLossScaler("cuda", init_scale=...)`) and the same getters and setters.

The update's rule is `scaling.update.update_scale` (lesson 04's function); its kernel, ATen's fused
`torch._amp_update_scale_`, is `scaling.fused.update_scale_`. `_set_config` binds one of them (or a learner's
`update_scale=`) once, at construction and at `load_state_dict`; `_update` calls what was bound.
"""
from __future__ import annotations

import torch

from ..learner_table import returned
from . import fused, validate
from .base import LossScaleFloorError, LossScalerBase
from .check import FP32_MAX, FP32_TINY
from .update import update_scale as _update_scale_rule
_GRAD_SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
_OWN_KEYS = {"hysteresis", "consecutive_hysteresis", "_hysteresis_tracker", "min_scale", "max_scale",
             "skipped_steps"}


def _config(sd: dict) -> dict:
    """Validate a full configuration-and-state dict (the constructor's arguments or a checkpoint); returns it
    normalised. Raises ValueError/TypeError naming the bad entry."""
    c = {"scale": validate.scale(sd["scale"], "init_scale" if sd.get("_ctor") else "scale"),
         "growth_factor": validate.factor(sd["growth_factor"], "growth_factor", 1.0, float("inf")),
         "backoff_factor": validate.factor(sd["backoff_factor"], "backoff_factor", 0.0, 1.0),
         "growth_interval": validate.integer(sd["growth_interval"], "growth_interval", 1),
         "hysteresis": validate.integer(sd["hysteresis"], "hysteresis", 1),
         "consecutive_hysteresis": validate.boolean(sd["consecutive_hysteresis"], "consecutive_hysteresis"),
         "min_scale": None if sd["min_scale"] is None else validate.scale(sd["min_scale"], "min_scale"),
         "max_scale": None if sd["max_scale"] is None else validate.scale(sd["max_scale"], "max_scale"),
         "skipped_steps": validate.integer(sd["skipped_steps"], "skipped_steps", 0)}
    c["_growth_tracker"] = validate.integer(sd["_growth_tracker"], "_growth_tracker", 0, c["growth_interval"] - 1)
    c["_hysteresis_tracker"] = validate.integer(sd["_hysteresis_tracker"], "_hysteresis_tracker", 1,
                                                c["hysteresis"])
    lo, hi = c["min_scale"] or FP32_TINY, c["max_scale"] or FP32_MAX
    if not lo <= c["scale"] <= hi:
        raise ValueError(f"the scale {c['scale']} must lie in [min_scale, max_scale] = [{c['min_scale']}, "
                         f"{c['max_scale']}]: set min_scale <= init_scale <= max_scale (None: no bound)")
    return c


class DynamicLossScaler(LossScalerBase):
    """Dynamic loss scaling: skip and back off on inf/NaN, grow after `growth_interval` clean steps.

    Args (torch.amp.GradScaler's, in its order; then hysteresis as DeepSpeed fp16 `hysteresis`):
        device: the device type ("cuda", "cpu", ...) as torch's first argument, or None. Informational: the
            state is created on the loss's device at the first scale() (torch disables a "cuda" scaler when CUDA
            is missing; this one never disables itself).
        init_scale: first scale, in [2**-126, FP32 max]. growth_factor (> 1), backoff_factor (in (0, 1)).
        growth_interval: the scale grows on the growth_interval-th consecutive clean step (torch/Megatron timing;
            DeepSpeed grows one step later), if the grown scale is finite (torch: at 2**127 the scale stays and
            the tracker resets) and at most `max_scale`.
        enabled: False makes every method pass through (scale returns its input, step just steps), as torch.
        hysteresis: an overflow first spends one unit of hysteresis (scale kept, step skipped); when one unit
            is left, the overflow backs the scale off instead. Refilled to `hysteresis` at each growth, or at every
            clean step if consecutive_hysteresis=True. Any overflow resets the growth tracker.
        min_scale: floor: a backoff never goes below it; an overflow while the scale is already at the floor
            (hysteresis spent) raises LossScaleFloorError (DeepSpeed: "Current loss scale already at minimum").
            None: no floor, as torch, except that a scale below 2**-126 raises LossScaleFloorError.
        max_scale: cap on growth. None: no cap.
        process_group: the torch.distributed group whose ranks share one inf/NaN decision (None: the default
            group). Ignored unless torch.distributed is initialized with more than one rank.
        update_scale: optional rule with lesson 04's signature, ``update_scale(scale, growth_tracker, found_inf,
            growth_factor, backoff_factor, growth_interval) -> (new_scale, new_growth_tracker)`` on Python
            numbers, used by ``update()`` in place of the library's (one host sync per step). Only with
            hysteresis=1 and no min_scale/max_scale (the lesson's rule has neither).
        unscale_grads_: optional rule with lesson 03's signature, as ``StaticLossScaler``'s.
        all_reduce_found_inf_: optional lesson 10 ``all_reduce_found_inf_(found_inf, group) -> found_inf``, the MAX
            all-reduce of the inf/NaN flag over ``process_group`` in place of the library's (more than one rank only).
    With hysteresis=1 and no floor/cap the trajectory equals torch.amp.GradScaler's bit for bit (the fused
    `torch._amp_update_scale_` is used then, unless MPCOURSE_FUSED=0; the rule `update_scale` is plain tensor
    ops, no host sync).
    State: scale fp32 (), growth tracker int32 (), hysteresis tracker int32 (), on the loss's device.
    Every value is validated the same way in the constructor, the setters and load_state_dict (torch validates
    only the constructor's factors).
    """

    def __init__(self, device=None, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, *, hysteresis=1, consecutive_hysteresis=False, min_scale=None, max_scale=None,
                 process_group=None, update_scale=None, unscale_grads_=None, all_reduce_found_inf_=None):
        if update_scale is not None and (hysteresis != 1 or min_scale is not None or max_scale is not None):
            raise ValueError("update_scale= is the rule without hysteresis, floor or cap: use it with hysteresis=1, "
                             "min_scale=None, max_scale=None")
        self.update_scale = update_scale
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"the first argument is the device type, as torch.amp.GradScaler's, got {device!r}; "
                            "pass the scale by name: DynamicLossScaler(init_scale=...)")
        self.device = None if device is None else torch.device(device).type
        c = _config({"_ctor": True, "scale": init_scale, "growth_factor": growth_factor,
                     "backoff_factor": backoff_factor, "growth_interval": growth_interval, "hysteresis": hysteresis,
                     "consecutive_hysteresis": consecutive_hysteresis, "min_scale": min_scale,
                     "max_scale": max_scale, "skipped_steps": 0, "_growth_tracker": 0,
                     "_hysteresis_tracker": hysteresis})
        super().__init__(c["scale"], enabled, process_group, unscale_grads_, all_reduce_found_inf_)
        self._growth_tracker = self._hysteresis_tracker = None  # int32 (), created with the scale
        self._set_config(c)

    def _set_config(self, c):
        self._growth_factor, self._backoff_factor = c["growth_factor"], c["backoff_factor"]
        self._growth_interval = c["growth_interval"]
        self.hysteresis, self.consecutive_hysteresis = c["hysteresis"], c["consecutive_hysteresis"]
        self.min_scale, self.max_scale = c["min_scale"], c["max_scale"]
        self._init_growth_tracker, self._init_hysteresis_tracker = c["_growth_tracker"], c["_hysteresis_tracker"]
        self._init_scale = self._scale_lower_bound = c["scale"]
        self.skipped_steps = c["skipped_steps"]
        lesson_shape = self.hysteresis == 1 and self.min_scale is None and self.max_scale is None
        self._update_step = (_by_learner if self.update_scale is not None
                             else _by_kernel if lesson_shape and fused.use_fused_update() else _by_rule)

    def _lazy_init(self, device):
        super()._lazy_init(device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device)

    def _tensor_state_names(self):
        return {"_scale": "_init_scale", "_growth_tracker": "_init_growth_tracker",
                "_hysteresis_tracker": "_init_hysteresis_tracker"}

    # -- torch.amp.GradScaler's getters and setters (validated) ---------------------------------------------
    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = validate.factor(new_factor, "growth_factor", 1.0, float("inf"))

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = validate.factor(new_factor, "backoff_factor", 0.0, 1.0)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = validate.integer(new_interval, "growth_interval", 1)

    def _get_growth_tracker(self) -> int:
        return self._get("_growth_tracker") if self._enabled else 0

    # -- the update rule -----------------------------------------------------------------------------------
    def _bound_after_overflow(self, bound: float) -> float:
        backed_off = float(torch.tensor(bound * self._backoff_factor, dtype=torch.float64).float())
        return max(backed_off, self.min_scale) if self.min_scale is not None else backed_off

    def _update(self, found_inf, overflow):
        scale, hyst = self._scale, self._hysteresis_tracker
        if overflow is None or overflow:  # check the floor (a sync, only on iterations that overflowed)
            backed_off = (scale.double() * self._backoff_factor).float()
            at_floor = (scale <= self.min_scale) if self.min_scale is not None else (backed_off < FP32_TINY)
            if bool((found_inf > 0) & (hyst <= 1) & at_floor):
                raise LossScaleFloorError(
                    f"Current loss scale already at minimum ({scale.item()}; min_scale={self.min_scale}) and the "
                    "gradients overflowed again: cannot decrease the scale any more. Usual causes: inf/NaN "
                    "gradients of a skipped step were never cleared (call optimizer.zero_grad() or "
                    "MasterWeights.zero_grad() every iteration, also after a skipped step), or the model/data "
                    "produce inf/NaN even in FP32 (check inputs and loss with torch.isfinite; try "
                    "torch.autograd.set_detect_anomaly(True)).")
        self._update_step(self, found_inf)

    def _update_with_rule(self, found_inf) -> None:
        """The given ``update_scale`` on Python numbers; its result is checked (``seams.returned_update_scale``) and
        written back in FP32."""
        new_scale, new_tracker = returned("update_scale", self.update_scale(
            float(self._scale), int(self._growth_tracker), bool(found_inf > 0), self._growth_factor,
            self._backoff_factor, self._growth_interval))
        self._scale.fill_(new_scale)                                     # fp32, rounded to nearest
        self._growth_tracker.fill_(new_tracker)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """GradScaler's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker) plus
        hysteresis, consecutive_hysteresis, _hysteresis_tracker, min_scale, max_scale, skipped_steps.
        Python scalars; call it after update(). Disabled: {} (as torch)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get("_growth_tracker"), "hysteresis": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "_hysteresis_tracker": self._get("_hysteresis_tracker"), "min_scale": self.min_scale,
                "max_scale": self.max_scale, "skipped_steps": self.skipped_steps}

    def _get(self, name):
        t = getattr(self, name)
        return getattr(self, "_init" + name) if t is None else int(t.item())

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the full state (also the config, as GradScaler does); performs no step. Accepts a
        torch.amp.GradScaler state_dict too (the hysteresis fields then keep this scaler's values). Everything is
        validated as the constructor validates it before anything changes: on error (ValueError/TypeError) the
        scaler is left as it was. Disabled: does nothing (as torch)."""
        if not self._enabled:
            return
        if isinstance(state_dict, dict) and not state_dict:
            raise RuntimeError("The state dict is empty (saved from a disabled scaler?).")
        validate.keys(state_dict, _GRAD_SCALER_KEYS, _OWN_KEYS, "DynamicLossScaler")
        own = {"hysteresis": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
               "min_scale": self.min_scale, "max_scale": self.max_scale, "skipped_steps": self.skipped_steps}
        merged = {**own, **state_dict}
        merged.setdefault("_hysteresis_tracker", merged["hysteresis"])
        c = _config(merged)
        self._set_config(c)
        if self._scale is not None:
            self._scale.fill_(c["scale"])
            self._growth_tracker.fill_(c["_growth_tracker"])
            self._hysteresis_tracker.fill_(c["_hysteresis_tracker"])


# -- the update steps a scaler binds in `_set_config` (plain functions: a bound scaler still pickles) ------------
def _by_rule(s: DynamicLossScaler, found_inf) -> None:
    """The library's rule, `update.update_scale`, written back into the scaler's state tensors."""
    new = _update_scale_rule(s._scale, s._growth_tracker, found_inf, s._growth_factor, s._backoff_factor,
                             s._growth_interval, hysteresis=s.hysteresis, hysteresis_tracker=s._hysteresis_tracker,
                             consecutive_hysteresis=s.consecutive_hysteresis, min_scale=s.min_scale,
                             max_scale=s.max_scale)
    for state, value in zip((s._scale, s._growth_tracker, s._hysteresis_tracker), new):
        state.copy_(value)


def _by_kernel(s: DynamicLossScaler, found_inf) -> None:
    """ATen's fused update (`fused.update_scale_`), equal to `_by_rule` with hysteresis 1 and no floor or cap."""
    fused.update_scale_(s._scale, s._growth_tracker, found_inf, s._growth_factor, s._backoff_factor,
                        s._growth_interval)


def _by_learner(s: DynamicLossScaler, found_inf) -> None:
    """A learner's `update_scale=` on Python numbers (one host sync), checked by `_update_with_rule`."""
    s._update_with_rule(found_inf)
