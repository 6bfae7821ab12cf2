"""The GradScaler state machine shared by `StaticLossScaler` and `DynamicLossScaler` (torch.amp.GradScaler's API).

Per optimizer, stage READY -> UNSCALED -> STEPPED, reset by `update()` (torch/amp/grad_scaler.py). `unscale_` groups
the gradients by (device, dtype) and runs one check-and-unscale per group: the rule `check.check_and_unscale_` or
its kernel `fused.check_and_unscale_`, chosen once at construction (``MPCOURSE_FUSED=0``: the rule); with more than one
rank the flag is all-reduced (MAX) before `step` decides (FSDP's ShardedGradScaler). `step` makes the iteration's
one host sync: the inf/NaN flag and the current scale come back together in one transfer; the scale seeds a
host-side lower bound of the next iteration's scale (`_scale_lower_bound`), which tells `unscale_` without a
sync whether 1/S can exceed 1, the only case where unscaling itself can overflow.

Optimizers that declare `_step_supports_amp_scaling = True` (torch's fused Adam/AdamW/SGD, or a custom one) unscale
and skip inside their own step: as torch, `step` sets `optimizer.grad_scale` and `optimizer.found_inf` for the call
(or passes `grad_scaler=self` to a step() that takes that keyword, with torch's FutureWarning: a deprecated
contract). Where S may be below 1 the gradients are
unscaled here first (with the overflow check) and the optimizer gets `grad_scale=None`.

With more than one rank the scalers must agree: the all-reduce of the inf/NaN flag carries the scale and the
trackers too, so every step checks, at no extra collective, that every rank holds the same state (a resume that
restored one rank's scaler, a scale set by hand on one rank), and raises RuntimeError otherwise.
"""
from __future__ import annotations

import inspect
import numbers
import warnings
from collections import defaultdict

import torch

from ..distributed import all_reduce_max_, world_size
from ..learner_table import returned
from . import validate
from .check import has_inf_or_nan
from .fused import choose_check_and_unscale

READY, UNSCALED, STEPPED = "READY", "UNSCALED", "STEPPED"

_FP16_GRAD_FIX = (
    "Unscaling must happen in FP32: an FP16/BF16 gradient has already lost its small values (FP16 flushes "
    "|g| < 2**-24 to 0) and dividing it in FP16 loses more. Keep FP32 master weights: "
    "master = mpcourse.core.master.MasterWeights(model, torch.optim.AdamW, lr=...), then per iteration "
    "scaler.scale(loss).backward(); master.step(scaler)  (or master.copy_grads_to_master(); "
    "scaler.step(master.optimizer); master.copy_master_to_model()); scaler.update().")

_NO_GRADS = (
    "No parameter of this optimizer has a gradient, so there is nothing to unscale or check "
    "(torch: 'No inf checks were recorded for this optimizer'). Check that backward() ran on "
    "scaler.scale(loss) and reached these parameters (requires_grad, frozen or unused modules); "
    "with MasterWeights call master.copy_grads_to_master() (or master.step(scaler)) first. If this "
    "optimizer has nothing to update this iteration, do not call scaler.step() on it.")


class LossScaleFloorError(RuntimeError):
    """Raised by `DynamicLossScaler.update()` when the gradients overflow while the scale is at its floor."""


class LossScalerBase:
    """What both scalers share; subclasses define `_update(found_inf, overflow)` and `_bound_after_overflow`."""

    def __init__(self, init_scale: float, enabled: bool = True, process_group=None, unscale_grads_=None,
                 all_reduce_found_inf_=None):
        self.unscale_grads_ = unscale_grads_  # optional rule: fn(list of fp32 grads, scale) -> found_inf (lesson 03)
        self._check_and_unscale_ = choose_check_and_unscale()  # the rule or its kernel, bit for bit the same
        self._enabled = validate.boolean(enabled, "enabled")
        # lesson 10's all_reduce_found_inf_(found_inf, group) -> found_inf in place of all_reduce_max_ (None: it)
        self.all_reduce_found_inf_ = all_reduce_found_inf_
        self._init_scale = validate.scale(init_scale, "init_scale")
        self._scale = None                    # fp32, shape (), created at the first scale() on the loss's device
        self._per_optimizer_states = {}       # id(optimizer) -> {"stage", "found_inf_per_device", "skipped"}
        self.process_group = process_group    # torch.distributed group the inf/NaN flag is all-reduced over
        self.last_step_skipped = False        # did the most recent step() skip optimizer.step()?
        self.skipped_steps = 0                # number of optimizer steps skipped so far (inf/NaN gradients)
        self._scale_lower_bound = self._init_scale  # host float, <= the live scale: no sync needed to read it

    # -- scale ---------------------------------------------------------------------------------------------
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
        Disabled (`enabled=False`): returns `outputs` itself.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if hasattr(outputs, "__iter__"):
            return map(self.scale, outputs)
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}")

    # -- the inf/NaN check -------------------------------------------------------------------------------------
    def _state(self, optimizer):
        return self._per_optimizer_states.setdefault(
            id(optimizer), {"stage": READY, "found_inf_per_device": {}, "skipped": None})

    def _record_found_inf(self, optimizer, inv_scale):
        """Check (and, given inv_scale, unscale) the optimizer's grads; store and return {device: found_inf}."""
        scale = self._scale
        groups = defaultdict(list)  # (device, dtype) -> grads (fp32/fp64), one kernel per group
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if inv_scale is not None and p.grad.dtype in (torch.float16, torch.bfloat16):
                        raise ValueError(f"Attempting to unscale {p.grad.dtype} gradients (parameter of shape "
                                         f"{tuple(p.shape)}). " + _FP16_GRAD_FIX)
                    if p.grad.is_sparse:  # duplicate indices are summed by the optimizer: check the sums
                        if not p.grad.is_coalesced():
                            p.grad = p.grad.coalesce()
                        g = p.grad._values()
                    else:
                        g = p.grad
                    groups[(g.device, g.dtype)].append(g)
            distributed = world_size(self.process_group) > 1
            if not groups and not distributed:  # a rank without grads still joins the all-reduce below
                raise RuntimeError(_NO_GRADS)
            found = {}  # device -> found_inf, fp32 ()
            may_overflow = self._scale_lower_bound < 1.0  # 1/S may exceed 1: unscaling can overflow
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = torch.zeros((), dtype=torch.float32, device=device)
                if inv_scale is None:  # check only (the optimizer unscales)
                    found[device] = torch.maximum(found[device], has_inf_or_nan(grads).float())
                elif self.unscale_grads_ is not None:  # a given rule (lesson 03's signature), on Python numbers
                    flag = returned("unscale_grads_", self.unscale_grads_(grads, float(scale)))
                    found[device] = torch.maximum(found[device], torch.tensor(float(flag), device=device))
                else:
                    self._check_and_unscale_(grads, found[device], inv_scale.to(device), may_overflow)
            if distributed:  # one flag for all ranks (FSDP ShardedGradScaler): all skip or all step, same scale
                flag = torch.zeros((), dtype=torch.float32, device=scale.device)
                for f in found.values():
                    flag = torch.maximum(flag, f.to(scale.device))
                if self.all_reduce_found_inf_ is None:
                    flag = self._reduce_flag_and_check_ranks_agree(flag)
                else:                                # a learner's all-reduce, checked (seams.returned_found_inf)
                    self._reduce_flag_and_check_ranks_agree(torch.zeros_like(flag))
                    flag = returned("all_reduce_found_inf_", self.all_reduce_found_inf_(flag, self.process_group))
                found = {scale.device: flag}
        self._state(optimizer)["found_inf_per_device"] = found
        return found

    def _reduce_flag_and_check_ranks_agree(self, flag):
        """The MAX of ``flag`` (fp32 ()) over the ranks of ``process_group``, and a check, in the same all-reduce,
        that every rank holds the same scaler state (the scale and the trackers): (flag, state, -state) in FP64,
        reduced with MAX, gives each entry's maximum and minimum over the ranks. Ranks whose scales differ
        unscale by different factors, and the averaged gradient, hence every rank's weights, is silently wrong:
        RuntimeError on every rank (all see the same reduced values), naming the fix."""
        names = list(self._tensor_state_names())
        vals = torch.stack([getattr(self, n).double() for n in names])
        packed = all_reduce_max_(torch.cat([flag.double().reshape(1), vals, -vals]), self.process_group)
        hi, lo = packed[1:1 + len(names)], -packed[1 + len(names):]
        if not torch.equal(hi, lo):
            spread = ", ".join(f"{n.lstrip('_')} from {a:g} to {b:g}" for n, a, b in zip(names, lo.tolist(), hi.tolist())
                               if a != b)
            raise RuntimeError(
                f"the ranks' loss scalers disagree ({spread} over the {world_size(self.process_group)} ranks): "
                "their gradients would be unscaled by different factors and the weights silently diverge. Give "
                "every rank the same scaler state: load the same scaler state_dict on every rank (a checkpoint "
                "saved from one rank, loaded on all), and set a scale by hand on every rank or on none.")
        return packed[0].float()

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record whether any g / S is inf/NaN.

        Call it at most once per optimizer between `update()`s, before `step()` (e.g. to clip).
        Raises RuntimeError if called twice or after `step()` (as torch), or if no parameter has a gradient;
        ValueError for FP16/BF16 gradients (use `mpcourse.core.master.MasterWeights`). Disabled: does nothing.
        The flag is taken here: gradients changed between `unscale_` and `step` are not checked again (as torch).
        """
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._state(optimizer)
        if state["stage"] == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update(); "
                               "call it once per iteration, then step() and update().")
        if state["stage"] == STEPPED:
            raise RuntimeError("unscale_() is being called after step(); unscale_ must come before step(), "
                               "and update() must run before the next iteration's unscale_.")
        self._record_found_inf(optimizer, scale.double().reciprocal().float())  # 1/S rounded once to fp32
        state["stage"] = UNSCALED

    def found_inf_per_device(self, optimizer) -> dict:
        """{device: fp32 tensor ()} for this iteration (> 0 means inf/NaN). With torch.distributed initialized
        (world size > 1) `unscale_` has already all-reduced (MAX) them into one flag on the scale's device."""
        return self._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device", {})

    # torch.amp.GradScaler's names used by optimizers with _step_supports_amp_scaling (apex-style fused ones)
    _found_inf_per_device = found_inf_per_device

    def _check_inf_per_device(self, optimizer) -> dict:
        self._require_scale("_check_inf_per_device")
        return self._record_found_inf(optimizer, None)

    def _get_scale_async(self):
        return self._scale

    # -- step and update --------------------------------------------------------------------------------------
    def _sync(self, found_inf, scale) -> bool:
        """The iteration's one host sync: the flag and the scale in one transfer; refreshes the lower bound."""
        flag, s = torch.stack([found_inf.to(scale.device).float(), scale]).tolist()
        self._scale_lower_bound = s
        return bool(flag)

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless `unscale_` already ran), then `optimizer.step(*args, **kwargs)` unless some gradient
        is inf/NaN. Returns what optimizer.step returns, or None when skipped (see `last_step_skipped`).

        Closures are not supported (RuntimeError). A skipped step leaves the gradients in place: the caller
        clears them with zero_grad(). Disabled: just `optimizer.step(*args, **kwargs)`.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("Closures are not supported by loss scalers: compute the loss, call "
                               "scaler.scale(loss).backward(), then scaler.step(optimizer).")
        scale = self._require_scale("step")
        state = self._state(optimizer)
        if state["stage"] == STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_self_scaling(optimizer, state, scale, args, kwargs)
        if state["stage"] == READY:
            self.unscale_(optimizer)
        skipped = self._sync(sum(f.to(scale.device) for f in state["found_inf_per_device"].values()), scale)
        state["skipped"], self.last_step_skipped = skipped, skipped
        retval = None
        if skipped:
            self.skipped_steps += 1
        else:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = STEPPED
        return retval

    def _step_self_scaling(self, optimizer, state, scale, args, kwargs):
        """An optimizer that unscales and skips by itself (torch's contract for `_step_supports_amp_scaling`)."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:  # the older contract: pass the scaler
            warnings.warn("the loss scaler passes itself to optimizer.step(grad_scaler=...), a contract torch.amp."
                          "GradScaler deprecates: let the optimizer read its `grad_scale` and `found_inf` "
                          "attributes instead (torch's fused optimizers do)", FutureWarning, stacklevel=3)
            retval = optimizer.step(*args, **kwargs, grad_scaler=self)
            found = state["found_inf_per_device"]
            skipped = bool(found) and self._sync(sum(f.to(scale.device) for f in found.values()), scale)
        else:
            if state["stage"] == READY and self._scale_lower_bound < 1.0:
                self.unscale_(optimizer)  # g * (1/S) may overflow inside the optimizer: unscale and check here
            if state["stage"] == READY:
                self._check_inf_per_device(optimizer)
            found_inf = sum(f.to(scale.device) for f in state["found_inf_per_device"].values())
            optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] == UNSCALED
                                    else scale * getattr(optimizer, "grad_scale", 1))
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            skipped = self._sync(found_inf, scale)
        state["skipped"], self.last_step_skipped = skipped, skipped
        self.skipped_steps += skipped
        state["stage"] = STEPPED
        return retval

    def update(self, new_scale=None) -> None:
        """End the iteration: update the scale from the inf/NaN checks of every optimizer (one decision per
        iteration, however many optimizers overflowed), and reset all optimizers to READY.

        new_scale: set the scale to this instead (a float, or a one-element tensor without grad; validated as
        the constructor's init_scale, which costs a sync for a tensor). Trackers are kept, as torch.
        Raises RuntimeError if no optimizer was unscaled/stepped since the last update(). Disabled: does nothing.
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            value = validate.scale(self._new_scale_value(new_scale), "new_scale")
            scale.fill_(value)
            self._scale_lower_bound = value
            self._per_optimizer_states = {}
            return
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
        if overflow is None or overflow:  # the scale may have backed off: lower the bound (no sync)
            self._scale_lower_bound = self._bound_after_overflow(self._scale_lower_bound)

    @staticmethod
    def _new_scale_value(new_scale):
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
                raise ValueError("new_scale must be a float or a one-element floating tensor with "
                                 f"requires_grad=False, got shape {tuple(new_scale.shape)}, dtype {new_scale.dtype}, "
                                 f"requires_grad={new_scale.requires_grad}")
            return float(new_scale.item())
        if isinstance(new_scale, numbers.Real) and not isinstance(new_scale, bool):
            return float(new_scale)
        raise TypeError(f"new_scale must be a float or a one-element tensor, got {type(new_scale).__name__}")

    def _update(self, found_inf, overflow):
        raise NotImplementedError

    def _bound_after_overflow(self, bound: float) -> float:
        return bound

    # -- queries, pickling ---------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), the initial scale before the first scale(),
        1.0 when disabled (as torch)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_init_scale(self) -> float:
        """The scale the scaler starts from: init_scale, or the scale of the last load_state_dict/unpickling."""
        return self._init_scale

    def is_enabled(self) -> bool:
        return self._enabled

    def _tensor_state_names(self):
        return {"_scale": "_init_scale"}

    def __getstate__(self):
        """Pickle between iterations only (as torch): live tensors become their initial values."""
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                raise RuntimeError("A loss scaler may only be pickled at the beginning of an iteration, or at "
                                   "the end after scaler.update().")
            for tensor_name, init_name in self._tensor_state_names().items():
                t = getattr(self, tensor_name)
                if t is not None:
                    state[init_name] = t.item() if init_name == "_init_scale" else int(t.item())
                state[tensor_name] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
