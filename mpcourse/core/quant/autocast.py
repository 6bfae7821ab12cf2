"""``fp8_autocast``: the region that switches FP8 on or off and decides when delayed scales update.

Transformer Engine semantics (``transformer_engine/pytorch/quantization.py``: ``autocast``,
``FP8GlobalStateManager.autocast_exit`` / ``reduce_and_update_fp8_tensors``):

* Inside the region each FP8 layer records its tensors' amaxes into ``amax_history[0]``. When the
  *outermost* region exits, the forward states (input, weight) of every layer that ran are updated:
  first, with several ranks, their amaxes are all-reduced with MAX (one collective for all of them,
  when the recipe's ``reduce_amax`` is True and ``torch.distributed`` is initialized with world size > 1),
  then each state takes one ``amax_and_scale_update``.
* Output-gradient states are updated in the backward pass, right after the layer's backward used them,
  when the backward runs outside any region (the usual ``loss.backward()`` after the ``with`` block).

Policies of this library (documented differences from TE):

* Gradient accumulation: run all micro-batches of one optimizer step, forward *and* backward, inside
  one outer region. Every amax of the step is then max-reduced into the same history entry and all
  states update once, at the exit: one history entry per optimizer step.
* A converted layer computes in FP8 outside any region too (torchao style; TE runs such a layer in
  high precision). Each call outside a region then counts as its own region: its forward states update
  when the call returns. ``fp8_autocast(enabled=False)`` runs converted layers in high precision.
* Under ``torch.no_grad()`` (evaluation) a delayed-scaling layer uses its scales but records nothing, so
  evaluation never changes the training state (TE skips the update there, ``torch.is_grad_enabled()``).
* The state is module-global, not thread-local, as in TE: backward on a GPU runs in autograd's own
  thread and must see the region. Every rank must run the same layers in the same order (the amaxes
  are all-reduced as one flat tensor in that order).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..distributed import all_reduce_max_, world_size
from .recipe import CurrentScaling, DelayedScaling, DelayedScalingState


@dataclass
class _Fp8RegionState:
    depth: int = 0  # number of open fp8_autocast regions
    enabled: bool = True  # FP8 on for converted layers (True outside any region)
    recipe: object = None  # the innermost region's recipe, or None: each layer's own recipe
    group: object = None  # process group for the amax all-reduce; None = the default group
    pending: dict = field(default_factory=dict)  # id(state) -> (state, fp8_max, recipe, group), in first-use order


_REGION = _Fp8RegionState()


def is_fp8_enabled() -> bool:
    """Whether converted layers compute in FP8 right now (False only inside ``fp8_autocast(enabled=False)``)."""
    return _REGION.enabled


def get_fp8_recipe():
    """The recipe of the innermost open ``fp8_autocast`` region that gave one, else None."""
    return _REGION.recipe


def in_fp8_region() -> bool:
    return _REGION.depth > 0


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None):
    """Region of FP8 computation (TE ``fp8_autocast(enabled, fp8_recipe, fp8_group)``).

    Args:
      enabled:    False runs converted layers in their high-precision dtype (no FP8, no state change).
      fp8_recipe: ``DelayedScaling`` or ``CurrentScaling``; None keeps the enclosing region's recipe, or
                  each layer's own (the one given to ``convert_to_float8_training``). A layer whose own
                  recipe differs raises ValueError (its state was sized for its own recipe).
      fp8_group:  ``torch.distributed`` process group for the amax all-reduce (None: the default group).
    On exit of the outermost region, pending delayed-scaling states are all-reduced and updated.
    """
    from .block_recipes import BLOCK_RECIPES
    if fp8_recipe is not None and not isinstance(fp8_recipe, (DelayedScaling, CurrentScaling, *BLOCK_RECIPES)):
        raise TypeError(f"fp8_recipe must be DelayedScaling or CurrentScaling, got {fp8_recipe!r}")
    saved = (_REGION.enabled, _REGION.recipe, _REGION.group)
    _REGION.enabled = bool(enabled)
    _REGION.recipe = fp8_recipe if fp8_recipe is not None else saved[1]
    _REGION.group = fp8_group if fp8_group is not None else saved[2]
    _REGION.depth += 1
    try:
        yield
    finally:
        _REGION.depth -= 1
        _REGION.enabled, _REGION.recipe, _REGION.group = saved
        if _REGION.depth == 0:
            pending, _REGION.pending = list(_REGION.pending.values()), {}
            reduce_and_update(pending)


def schedule_update(state: DelayedScalingState, fp8_max: float, recipe: DelayedScaling) -> None:
    """Update ``state`` at the outermost region's exit if a region is open, else now."""
    entry = (state, fp8_max, recipe, _REGION.group)
    if _REGION.depth > 0:
        _REGION.pending.setdefault(id(state), entry)
    else:
        reduce_and_update([entry])


def reduce_and_update(entries: list) -> None:
    """All-reduce (MAX) the current amaxes of ``entries`` where asked, then update every state.

    ``entries``: list of (DelayedScalingState, fp8_max, DelayedScaling, process group or None).
    """
    by_group: dict = {}
    for entry in entries:
        state, _, recipe, group = entry
        if recipe.reduce_amax and world_size(group) > 1:
            by_group.setdefault(id(group), (group, []))[1].append(state)
    for group, states in by_group.values():
        amaxes = torch.stack([s.amax_history[0] for s in states])  # (n_states,) fp32, one collective
        all_reduce_max_(amaxes, group)
        for s, amax in zip(states, amaxes):
            s.amax_history[0] = amax
    for state, fp8_max, recipe, _ in entries:
        state.update(fp8_max, recipe)
