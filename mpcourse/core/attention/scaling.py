"""Each FP8 attention tensor's scale and amax history under a recipe: which roles keep state, and when it updates.

The rules are the library's (``mpcourse.core.quant``): ``DelayedScalingState`` and ``amax_and_scale_update``
(``rules.delayed``), ``compute_scale`` / ``quantize_current`` (``rules.tensor``, through the attention rule's
``cast``), and the FP8 region's update schedule (``region.schedule_update``: forward roles update when the outermost
``quant.autocast`` region exits, backward roles right after the backward used them, as ``Float8Linear``'s roles do).

Per recipe, as Transformer Engine's ``DotProductAttention.init_fp8_metadata`` sets its quantizers:

    recipe                     q k v o, do dq dk dv              s (P), dp (dS)
    DelayedScaling             delayed, the recipe's fields      delayed, the recipe's fields
    CurrentScaling             current (from the tensor)         delayed: amax_history_len=1, "most_recent"

TE builds that second ``DelayedScaling`` for S and dP under ``Float8CurrentScaling`` because the fused kernel must
know P's and dS's scales before it computes them (``NVTE_DPA_FP8DS_AMAX_HISTLEN=1``,
``NVTE_DPA_FP8DS_AMAX_ALGO=most_recent`` by default). Formats: forward roles ``fp8_format.fwd`` (E4M3), backward roles
``fp8_format.bwd`` (E5M2 under ``Format.HYBRID``). Other recipes (block scaling, MX, NVFP4) are refused, as TE refuses
FP8 attention under them. ``fixed_scales`` gives a role a constant scale and no state (cuDNN's MXFP8 attention casts
P with a fixed scale).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from ..quant.recipe import CurrentScaling, DelayedScaling, Recipe
from ..quant.region import schedule_update
from ..quant.rules.delayed import DelayedScalingState
from ..quant.rules.tensor import fp8_max
from .fp8_attention import FORWARD_ROLES, ROLES, RoleCast

KNOWN_SCALE_ROLES = ("s", "dp")     # scales a fused kernel needs before it computes the tensor


def role_format(recipe: Recipe, role: str) -> str:
    """"e4m3" or "e5m2": the recipe's forward format for ``FORWARD_ROLES``, its backward format for the others."""
    if role not in ROLES:
        raise ValueError(f"attention role must be one of {ROLES}, got {role!r}")
    return recipe.fp8_format.fwd if role in FORWARD_ROLES else recipe.fp8_format.bwd


def state_recipe(recipe: Recipe, role: str) -> Optional[DelayedScaling]:
    """The ``DelayedScaling`` whose update a role's state follows, or None for current scaling (table above)."""
    if isinstance(recipe, DelayedScaling):
        return recipe
    if isinstance(recipe, CurrentScaling):
        if role in KNOWN_SCALE_ROLES:
            return DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=1, amax_compute_algo="most_recent")
        return None
    raise TypeError(f"FP8 attention takes DelayedScaling or CurrentScaling (per-tensor scaling, as Transformer "
                    f"Engine's DotProductAttention), got {type(recipe).__name__}: keep attention in high precision "
                    "under block-scaled recipes")


class AttentionScaling:
    """The scales of one attention layer's quantized ``roles`` (a subset of ``ROLES``) under ``recipe``.

    ``states``: {role: DelayedScalingState} of the roles that keep one; ``casts(roles)`` the ``RoleCast`` of each
    quantized role among ``roles`` (its live scale tensor for delayed roles), none for the roles in ``high`` (a set,
    shared with the layer: those switched to high precision, whose states still record); ``record(amax, roles)`` records
    each delayed role's amax and schedules its update. ``key`` names the layer in the amax all-reduce.
    """

    def __init__(self, recipe: Recipe, roles: Iterable[str] = ROLES, fixed_scales: Optional[Mapping] = None,
                 device=None, key: str = "", high: Optional[set] = None):
        self.recipe, self.roles, self.key = recipe, tuple(roles), key
        self.high = set() if high is None else high       # roles switched to high precision: not cast
        self.fixed = {r: float(s) for r, s in (fixed_scales or {}).items()}
        for role in (*self.roles, *self.fixed):
            role_format(recipe, role)                         # checks the role name
        bad = [r for r, s in self.fixed.items() if not (s > 0 and s < float("inf"))]
        if bad or any(r not in self.roles for r in self.fixed):
            raise ValueError(f"fixed_scales must give finite scales > 0 to quantized roles, got {self.fixed}")
        self.formats = {r: role_format(recipe, r) for r in self.roles}
        self.updates = {r: u for r in self.roles if r not in self.fixed
                        for u in [state_recipe(recipe, r)] if u is not None}
        self.states = {r: DelayedScalingState(u.amax_history_len, device) for r, u in self.updates.items()}

    def casts(self, roles: Iterable[str], device=None) -> dict:
        """{role: RoleCast} for the quantized roles among ``roles`` (a fixed scale made on ``device``)."""
        out = {}
        p2 = getattr(self.recipe, "use_power_2_scales", False)
        eps = getattr(self.recipe, "amax_epsilon", 0.0)
        for r in roles:
            if r not in self.roles or r in self.high:
                continue
            if r in self.fixed:
                scale = torch.tensor(self.fixed[r], dtype=torch.float32, device=device)
            else:
                scale = self.states[r].scale if r in self.states else None
            out[r] = RoleCast(self.formats[r], scale, p2, eps)
        return out

    def record(self, amax: Mapping[str, torch.Tensor], roles: Iterable[str]) -> None:
        """Record each delayed role's amax (max-reduced into its history's row 0) and schedule its update."""
        for r in roles:
            if r in self.states:
                self.states[r].record(amax[r])
                schedule_update(self.states[r], fp8_max(self.formats[r]), self.updates[r],
                                key=f"{self.key}.{r}:{self.formats[r]}")

    def to(self, device) -> "AttentionScaling":
        for s in self.states.values():
            s.to(device)
        return self

    # -- checkpoint: one float32 tensor, a row per state: [scale, *amax_history] ----------------------------
    def get_extra_state(self) -> torch.Tensor:
        """(n_states, 1 + L) float32, rows in ``ROLES`` order; (0, 1) when no role keeps state."""
        if not self.states:
            return torch.zeros(0, 1, dtype=torch.float32)
        return torch.stack([torch.cat([s.scale.reshape(1), s.amax_history]) for s in self.states.values()])

    def set_extra_state(self, state) -> None:
        """Load ``get_extra_state``'s tensor after checking every row (nothing changes if one is refused)."""
        state = torch.as_tensor(state)
        want = (len(self.states), 1 + max((s.amax_history.numel() for s in self.states.values()), default=0))
        if not self.states:
            return
        if tuple(state.shape) != want:
            raise ValueError(f"checkpoint FP8 attention state has shape {tuple(state.shape)}, this layer's "
                             f"{want} (roles {list(self.states)}): build the layer with the checkpoint's recipe "
                             "and roles")
        rows = {r: {"scale": row[0], "amax_history": row[1:]} for r, row in zip(self.states, state)}
        for r, row in rows.items():
            self.states[r].check_state_dict(row, r)
        for r, row in rows.items():
            self.states[r].load_state_dict(row)
