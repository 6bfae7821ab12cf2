"""Loss scaling for FP16 training: `StaticLossScaler` and `DynamicLossScaler`.

Why: FP16 gradients below 2**-24 flush to zero (Micikevicius et al. 2018, "Mixed Precision Training", ICLR 2018,
section 3.2). Multiplying the loss by S shifts every gradient up by S (chain rule); the gradients are divided by
S again in FP32 before the optimizer uses them. Too large an S overflows (S * max|g| > 65504 gives inf), so the
dynamic scaler skips such steps, backs off, and grows S again after `growth_interval` clean steps.

API and semantics follow `torch.amp.GradScaler` (torch/amp/grad_scaler.py, ATen AmpGradScalerKernels.cpp):
`scale, unscale_, step, update, get_scale, state_dict, load_state_dict`; per-optimizer stage
READY -> UNSCALED -> STEPPED, reset by `update()`; `inv_scale = scale.double().reciprocal().float()`; one fused
`torch._amp_foreach_non_finite_check_and_unscale_` per (device, dtype) group of gradients, with a pure-torch
fallback (same contract, two passes over memory instead of one); the only host sync of an iteration is the
`.item()` in `step()` that decides whether to skip. Hysteresis, `min_scale` and the error at the floor follow
DeepSpeed (runtime/fp16/loss_scaler.py); growth timing follows torch and Megatron (core/optimizer/grad_scaler.py).

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

Policies (where public implementations disagree):
- An optimizer none of whose parameters has a `.grad` is an error (`unscale_`/`step` raise), as in torch
  ("No inf checks were recorded for this optimizer", e.g. huggingface/transformers#24003); the message names the
  fixes. If an optimizer legitimately has nothing to do this iteration, do not call `scaler.step` on it
  (nerfstudio-project/nerfstudio#1919).
- FP16 and BF16 gradients are refused by the unscaler (torch refuses FP16 only): unscale in FP32 master grads.
- `StaticLossScaler` also checks for inf/NaN and skips such steps (DeepSpeed's static scaler does not check);
  a silently applied inf gradient would corrupt the weights.
- With `min_scale=None` the scale may fall below 1 as in torch, but an overflow that would push it below the
  smallest normal FP32 number (2**-126, where 1/scale overflows) raises `LossScaleFloorError`; torch would carry
  on to a subnormal scale and 0 (pytorch/pytorch#99640). This is the only difference from GradScaler's
  trajectory, and only in a run that is already broken.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .distributed import all_reduce_max_, world_size

READY, UNSCALED, STEPPED = "READY", "UNSCALED", "STEPPED"
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, smallest normal FP32
_HAS_FUSED_UNSCALE = hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
_HAS_FUSED_UPDATE = hasattr(torch, "_amp_update_scale_")

_FP16_GRAD_FIX = (
    "Unscaling must happen in FP32: an FP16/BF16 gradient has already lost its small values (FP16 flushes "
    "|g| < 2**-24 to 0) and dividing it in FP16 loses more. Keep FP32 master weights: "
    "master = mpcourse.core.master.MasterWeights(model, torch.optim.AdamW, lr=...), then per iteration "
    "scaler.scale(loss).backward(); master.step(scaler)  (or master.copy_grads_to_master(); "
    "scaler.step(master.optimizer); master.copy_master_to_model()); scaler.update().")


class LossScaleFloorError(RuntimeError):
    """Raised by `DynamicLossScaler.update()` when the gradients overflow while the scale is at its floor."""


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


def _check_and_unscale_(grads, found_inf, inv_scale):
    """found_inf (fp32, ()) := 1.0 if any grad is inf/NaN; grads *= inv_scale in place. Same device and dtype."""
    if _HAS_FUSED_UNSCALE:  # one pass over memory (ATen AmpKernels)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    found_inf.copy_(torch.maximum(found_inf, has_inf_or_nan(grads).float()))  # fallback: read, then write
    for g in grads:
        g.mul_(inv_scale)


class _LossScalerBase:
    """The GradScaler state machine shared by both scalers; subclasses define `_update(found_inf)`."""

    def __init__(self, init_scale: float, process_group=None):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"loss scale must be a positive finite number, got {init_scale}; powers of two "
                             "(e.g. 2.0**16) make scaling and unscaling exact.")
        self._init_scale = float(init_scale)
        self._scale = None                    # fp32, shape (), created at the first scale() on the loss's device
        self._per_optimizer_states = {}       # id(optimizer) -> {"stage", "found_inf_per_device", "skipped"}
        self.process_group = process_group    # torch.distributed group the inf/NaN flag is all-reduced over
        self.last_step_skipped = False        # did the most recent step() skip optimizer.step()?
        self.skipped_steps = 0                # number of optimizer steps skipped so far (inf/NaN gradients)

    def _lazy_init(self, device):
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)

    def _require_scale(self, what):
        if self._scale is None:
            raise RuntimeError(f"{what}() called before scaler.scale(loss): the scale is created at the first "
                               "scale() call; use scaler.scale(loss).backward() in every iteration.")
        return self._scale

    def scale(self, outputs):
        """Return outputs * scale (a tensor, or a list/tuple/iterable of tensors, structure kept).

        The product follows torch's type promotion (an FP16 0-dim loss times the fp32 scale is fp32).
        """
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if hasattr(outputs, "__iter__"):
            return map(self.scale, outputs)
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}")

    def _state(self, optimizer):
        return self._per_optimizer_states.setdefault(
            id(optimizer), {"stage": READY, "found_inf_per_device": {}, "skipped": None})

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record whether any is inf/NaN.

        Call it at most once per optimizer between `update()`s, before `step()` (e.g. to clip).
        Raises RuntimeError if called twice or after `step()` (as torch), or if no parameter has a gradient;
        ValueError for FP16/BF16 gradients (use `mpcourse.core.master.MasterWeights`).
        """
        scale = self._require_scale("unscale_")
        state = self._state(optimizer)
        if state["stage"] == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update(); "
                               "call it once per iteration, then step() and update().")
        if state["stage"] == STEPPED:
            raise RuntimeError("unscale_() is being called after step(); unscale_ must come before step(), "
                               "and update() must run before the next iteration's unscale_.")
        inv_scale = scale.double().reciprocal().float()  # 1/S rounded once to fp32
        groups = defaultdict(list)  # (device, dtype) -> grads (fp32/fp64), one fused kernel per group
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.dtype in (torch.float16, torch.bfloat16):
                        raise ValueError(f"Attempting to unscale {p.grad.dtype} gradients (parameter of shape "
                                         f"{tuple(p.shape)}). " + _FP16_GRAD_FIX)
                    g = p.grad._values() if p.grad.is_sparse else p.grad
                    groups[(g.device, g.dtype)].append(g)
            distributed = world_size(self.process_group) > 1
            if not groups and not distributed:  # a rank without grads still joins the all-reduce below
                raise RuntimeError(
                    "No parameter of this optimizer has a gradient, so there is nothing to unscale or check "
                    "(torch: 'No inf checks were recorded for this optimizer'). Check that backward() ran on "
                    "scaler.scale(loss) and reached these parameters (requires_grad, frozen or unused modules); "
                    "with MasterWeights call master.copy_grads_to_master() (or master.step(scaler)) first. If this "
                    "optimizer has nothing to update this iteration, do not call scaler.step() on it.")
            found = {}  # device -> found_inf, fp32 ()
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = torch.zeros((), dtype=torch.float32, device=device)
                _check_and_unscale_(grads, found[device], inv_scale.to(device))
            if distributed:  # one flag for all ranks (FSDP ShardedGradScaler): all skip or all step, same scale
                flag = torch.zeros((), dtype=torch.float32, device=scale.device)
                for f in found.values():
                    flag = torch.maximum(flag, f.to(scale.device))
                found = {scale.device: all_reduce_max_(flag, self.process_group)}
        state["found_inf_per_device"] = found
        state["stage"] = UNSCALED

    def found_inf_per_device(self, optimizer) -> dict:
        """{device: fp32 tensor ()} for this iteration (> 0 means inf/NaN). With torch.distributed initialized
        (world size > 1) `unscale_` has already all-reduced (MAX) them into one flag on the scale's device."""
        return self._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device", {})

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless `unscale_` already ran), then `optimizer.step(*args, **kwargs)` unless some gradient
        is inf/NaN. Returns what optimizer.step returns, or None when skipped (see `last_step_skipped`).

        The `.item()` here is the iteration's one host sync. Closures are not supported (RuntimeError).
        A skipped step leaves the gradients in place: the caller clears them with zero_grad().
        """
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("Closures are not supported by loss scalers: compute the loss, call "
                               "scaler.scale(loss).backward(), then scaler.step(optimizer).")
        scale = self._require_scale("step")
        state = self._state(optimizer)
        if state["stage"] == STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if state["stage"] == READY:
            self.unscale_(optimizer)
        found_inf = sum(f.to(scale.device) for f in state["found_inf_per_device"].values())
        skipped = bool(found_inf.item())  # the host sync
        state["skipped"], self.last_step_skipped = skipped, skipped
        retval = None
        if skipped:
            self.skipped_steps += 1
        else:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = STEPPED
        return retval

    def update(self) -> None:
        """End the iteration: update the scale from the inf/NaN checks of every optimizer (one decision per
        iteration, however many optimizers overflowed), and reset all optimizers to READY.

        Raises RuntimeError if no optimizer was unscaled/stepped since the last update().
        """
        scale = self._require_scale("update")
        found = [f.to(scale.device) for s in self._per_optimizer_states.values()
                 for f in s["found_inf_per_device"].values()]
        if not found:
            raise RuntimeError("No inf/NaN checks were recorded before update(): call scaler.step(optimizer) "
                               "(or scaler.unscale_(optimizer)) after backward() in each iteration.")
        found_inf = torch.stack(found).sum()  # fp32 (); > 0 if any optimizer overflowed
        known = [s["skipped"] for s in self._per_optimizer_states.values()]
        overflow = any(known) if None not in known else None  # host knowledge from step(), else unknown
        self._per_optimizer_states = {}  # reset first: after a LossScaleFloorError the caller may fix and go on
        self._update(found_inf, overflow)

    def _update(self, found_inf, overflow):
        raise NotImplementedError

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or the initial scale before the first scale()."""
        return self._init_scale if self._scale is None else float(self._scale.item())


class StaticLossScaler(_LossScalerBase):
    """A constant loss scale S (Micikevicius et al. 2018, section 3.2: a fixed scale, e.g. 8 for SSD).

    loss_scale: positive finite float; powers of two make scaling exact. Steps whose unscaled FP32 gradients hold
    inf/NaN are skipped and counted in `skipped_steps` (DeepSpeed's static scaler does not check); the scale never
    changes. Same methods as `DynamicLossScaler`. No overflow needs S * max|g| <= 65504 (FP16 max).
    """

    def __init__(self, loss_scale: float, process_group=None):
        super().__init__(loss_scale, process_group)

    def _update(self, found_inf, overflow):
        pass

    def state_dict(self) -> dict:
        """{"scale": float, "skipped_steps": int}; call it after update()."""
        return {"scale": self.get_scale(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore scale and skipped-step count; performs no step."""
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


class DynamicLossScaler(_LossScalerBase):
    """Dynamic loss scaling: skip and back off on inf/NaN, grow after `growth_interval` clean steps.

    Args (defaults of torch.amp.GradScaler; hysteresis as DeepSpeed fp16 `hysteresis`/`consecutive_hysteresis`):
        init_scale: first scale (fp32). growth_factor (> 1), backoff_factor (in (0, 1)).
        growth_interval: the scale grows on the growth_interval-th consecutive clean step (torch/Megatron timing;
            DeepSpeed grows one step later), if the grown scale is finite (torch: at 2**127 the scale stays and
            the tracker resets) and at most `max_scale`.
        hysteresis: an overflow first spends one unit of hysteresis (scale kept, step skipped); when one unit
            is left, the overflow backs the scale off instead. Refilled to `hysteresis` at each growth, or at every
            clean step if consecutive_hysteresis=True. Any overflow resets the growth tracker.
        min_scale: floor: a backoff never goes below it; an overflow while the scale is already at the floor
            (hysteresis spent) raises LossScaleFloorError (DeepSpeed: "Current loss scale already at minimum").
            None: no floor, as torch, except that a scale below 2**-126 raises LossScaleFloorError.
        max_scale: cap on growth. None: no cap.
        process_group: the torch.distributed group whose ranks share one inf/NaN decision (None: the default
            group). Ignored unless torch.distributed is initialized with more than one rank.
    With hysteresis=1 and no floor/cap the trajectory equals torch.amp.GradScaler's bit for bit (the fused
    `torch._amp_update_scale_` is used then; the general rule is plain tensor ops, no host sync).
    State: scale fp32 (), growth tracker int32 (), hysteresis tracker int32 (), on the loss's device.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, consecutive_hysteresis=False, min_scale=None, max_scale=None, process_group=None):
        super().__init__(init_scale, process_group)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) < 1 or int(hysteresis) < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}")
        if min_scale is not None and not (_FP32_TINY <= min_scale <= init_scale):
            raise ValueError(f"min_scale must lie in [2**-126, init_scale={init_scale}], got {min_scale}")
        if max_scale is not None and not (init_scale <= max_scale <= torch.finfo(torch.float32).max):
            raise ValueError(f"max_scale must lie in [init_scale={init_scale}, FP32 max], got {max_scale}")
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self.hysteresis, self.consecutive_hysteresis = int(hysteresis), bool(consecutive_hysteresis)
        self.min_scale, self.max_scale = min_scale, max_scale
        self._init_growth_tracker, self._init_hysteresis_tracker = 0, self.hysteresis
        self._growth_tracker = self._hysteresis_tracker = None  # int32 (), created with the scale

    def _lazy_init(self, device):
        super()._lazy_init(device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device)

    def _update(self, found_inf, overflow):
        scale, tracker, hyst = self._scale, self._growth_tracker, self._hysteresis_tracker
        if overflow is None or overflow:  # check the floor (a sync, only on iterations that overflowed)
            backed_off = (scale.double() * self._backoff_factor).float()
            at_floor = (scale <= self.min_scale) if self.min_scale is not None else (backed_off < _FP32_TINY)
            if bool((found_inf > 0) & (hyst <= 1) & at_floor):
                raise LossScaleFloorError(
                    f"Current loss scale already at minimum ({scale.item()}; min_scale={self.min_scale}) and the "
                    "gradients overflowed again: cannot decrease the scale any more. Usual causes: inf/NaN "
                    "gradients of a skipped step were never cleared (call optimizer.zero_grad() or "
                    "MasterWeights.zero_grad() every iteration, also after a skipped step), or the model/data "
                    "produce inf/NaN even in FP32 (check inputs and loss with torch.isfinite; try "
                    "torch.autograd.set_detect_anomaly(True)).")
        if _HAS_FUSED_UPDATE and self.hysteresis == 1 and self.min_scale is None and self.max_scale is None:
            torch._amp_update_scale_(scale, tracker, found_inf, self._growth_factor, self._backoff_factor,
                                     self._growth_interval)
            return
        ovf = found_inf > 0                                              # bool ()
        spend = ovf & (hyst > 1)                                         # spend hysteresis, keep the scale
        backoff = ovf & ~spend
        backed_off = (scale.double() * self._backoff_factor).float()     # fp32 product as ATen: double, rounded
        if self.min_scale is not None:
            backed_off = backed_off.clamp(min=self.min_scale)
        clean_run = tracker + 1
        grow = ~ovf & (clean_run == self._growth_interval)
        grown = (scale.double() * self._growth_factor).float()
        if self.max_scale is not None:
            grown = grown.clamp(max=self.max_scale)
        grown = torch.where(torch.isfinite(grown), grown, scale)         # never grow to inf (pytorch#98828)
        refill = grow | (~ovf & self.consecutive_hysteresis)
        scale.copy_(torch.where(backoff, backed_off, torch.where(grow, grown, scale)))
        tracker.copy_(torch.where(ovf | grow, 0, clean_run))
        hyst.copy_(torch.where(spend, hyst - 1, torch.where(refill, self.hysteresis, hyst)))

    def state_dict(self) -> dict:
        """GradScaler's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker) plus
        hysteresis, consecutive_hysteresis, _hysteresis_tracker, min_scale, max_scale, skipped_steps.
        Python scalars; call it after update()."""
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
        torch.amp.GradScaler state_dict too (hysteresis fields then keep this scaler's values)."""
        if not state_dict:
            raise RuntimeError("The state dict is empty (saved from a disabled GradScaler?).")
        sd = state_dict
        self._init_scale = float(sd["scale"])
        self._growth_factor, self._backoff_factor = float(sd["growth_factor"]), float(sd["backoff_factor"])
        self._growth_interval, self._init_growth_tracker = int(sd["growth_interval"]), int(sd["_growth_tracker"])
        self.hysteresis = int(sd.get("hysteresis", self.hysteresis))
        self.consecutive_hysteresis = bool(sd.get("consecutive_hysteresis", self.consecutive_hysteresis))
        self._init_hysteresis_tracker = int(sd.get("_hysteresis_tracker", self.hysteresis))
        self.min_scale, self.max_scale = sd.get("min_scale", self.min_scale), sd.get("max_scale", self.max_scale)
        self.skipped_steps = int(sd.get("skipped_steps", self.skipped_steps))
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
