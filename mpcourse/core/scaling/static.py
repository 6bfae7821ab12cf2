"""`StaticLossScaler`: one constant loss scale (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2)."""
from __future__ import annotations

from . import validate
from .base import LossScalerBase


class StaticLossScaler(LossScalerBase):
    """A constant loss scale S (Micikevicius et al. 2018, section 3.2: a fixed scale, e.g. 8 for SSD).

    loss_scale: a finite float in [2**-126, FP32 max]; powers of two make scaling exact. Steps whose unscaled FP32
    gradients hold inf/NaN are skipped and counted in `skipped_steps` (DeepSpeed's static scaler does not check);
    the scale never changes (except by `update(new_scale=...)`). Same methods as `DynamicLossScaler`.
    No overflow needs S * max|g| <= 65504 (FP16 max); `mpcourse.core.scaling.choose_loss_scale` picks the largest
    such power of two. enabled=False: every method passes through.
    unscale_grads_: optional rule with lesson 03's signature, ``unscale_grads_(grads, scale) -> found_inf`` (a list
    of fp32 gradient tensors, modified in place, and the scale as a float), used by ``unscale_`` in place of the
    fused kernel (one host sync per step; its flag is checked by ``mpcourse.core.seams.returned_flag``).
    all_reduce_found_inf_: lesson 10's ``all_reduce_found_inf_(found_inf, group)`` in place of the library's MAX
    all-reduce of the inf/NaN flag (used only with more than one rank).
    """

    def __init__(self, loss_scale: float, enabled: bool = True, process_group=None, *, unscale_grads_=None,
                 all_reduce_found_inf_=None):
        super().__init__(loss_scale, enabled, process_group, unscale_grads_, all_reduce_found_inf_)

    def _update(self, found_inf, overflow):
        pass

    def state_dict(self) -> dict:
        """{"scale": float, "skipped_steps": int}; call it after update(). Disabled: {} (as torch)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore scale and skipped-step count; performs no step. Validated as the constructor validates
        (ValueError/TypeError, scaler unchanged). Disabled: does nothing."""
        if not self._enabled:
            return
        validate.keys(state_dict, {"scale"}, {"skipped_steps"}, "StaticLossScaler")
        scale = validate.scale(state_dict["scale"], "scale")
        skipped = validate.integer(state_dict.get("skipped_steps", 0), "skipped_steps", 0)
        self._init_scale, self.skipped_steps, self._scale_lower_bound = scale, skipped, scale
        if self._scale is not None:
            self._scale.fill_(scale)
