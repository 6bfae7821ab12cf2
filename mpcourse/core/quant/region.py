"""The FP8 region, ``autocast`` (and its older spelling ``fp8_autocast``): it switches FP8 on or off and
decides when delayed scales update.

Transformer Engine's two spellings of the same region, both here with the same semantics:
``autocast(enabled=True, recipe=None, amax_reduction_group=None)`` (TE 2.x,
``transformer_engine.pytorch.autocast``) and ``fp8_autocast(enabled=True, fp8_recipe=None, fp8_group=None)``
(TE 1.x, kept by TE as a deprecated alias). Not to be confused with ``mpcourse.core.autocast.autocast``, the
op-level cast policy of ``torch.autocast`` (FP16/BF16): the two nest (``torch.autocast`` outside).

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
  are all-reduced as one flat tensor in that order). This is checked: before the amaxes, the ranks
  all-reduce a fixed-size signature (the number of states and a CRC32 of their layers' shapes, roles
  and formats, with MAX and with MIN through negation), and if any rank differs every rank raises the
  same RuntimeError. So ranks that ran different FP8 layers never combine unrelated amaxes and never
  block in all-reduces of different sizes. (One small extra collective per update; a rank that makes
  *fewer* updates than the others still blocks until the process group's timeout, as in any collective.
  A rank with no data makes as many: a layer whose input is empty still records, amax 0, and updates,
  ``layers.linear``.) The amaxes are reduced by ``distributed.all_reduce_max_``: a NaN on any rank is a NaN on
  every rank, as in one process on the union of the ranks' tensors, so every rank keeps its scale alike.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch

from ..distributed import all_reduce_max_, world_size
from .rules.delayed import DelayedScalingState
from .recipe import DelayedScaling, check_recipe


@dataclass
class _FP8RegionState:
    depth: int = 0  # number of open FP8 regions
    enabled: bool = True  # FP8 on for converted layers (True outside any region)
    recipe: object = None  # the innermost region's recipe, or None: each layer's own recipe
    group: object = None  # process group for the amax all-reduce; None = the default group
    pending: dict = field(default_factory=dict)  # id(state) -> (state, fp8_max, recipe, group, key), first-use order


_REGION = _FP8RegionState()


def is_fp8_enabled() -> bool:
    """Whether converted layers compute in FP8 right now (False only inside ``autocast(enabled=False)``)."""
    return _REGION.enabled


def get_fp8_recipe():
    """The recipe of the innermost open FP8 region (``autocast``/``fp8_autocast``) that gave one, else None."""
    return _REGION.recipe


def in_fp8_region() -> bool:
    return _REGION.depth > 0


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe=None, amax_reduction_group=None):
    """Region of FP8 computation (TE ``autocast(enabled, recipe, amax_reduction_group)``).

    Args:
      enabled: False runs converted layers in their high-precision dtype (no FP8, no state change).
      recipe:  a ``Recipe`` (``DelayedScaling``, ``Float8CurrentScaling``, a block recipe); None keeps the enclosing region's recipe, or
               each layer's own (the one given to ``convert_to_float8_training``). A layer whose own
               recipe differs raises ValueError (its state was sized for its own recipe).
      amax_reduction_group: ``torch.distributed`` process group for the amax all-reduce (None: the
               default group).
    On exit of the outermost region, pending delayed-scaling states are all-reduced and updated.
    """
    check_recipe(recipe, "recipe")
    saved = (_REGION.enabled, _REGION.recipe, _REGION.group)
    _REGION.enabled = bool(enabled)
    _REGION.recipe = recipe if recipe is not None else saved[1]
    _REGION.group = amax_reduction_group if amax_reduction_group is not None else saved[2]
    _REGION.depth += 1
    try:
        yield
    finally:
        _REGION.depth -= 1
        _REGION.enabled, _REGION.recipe, _REGION.group = saved
        if _REGION.depth == 0:
            pending, _REGION.pending = list(_REGION.pending.values()), {}
            reduce_and_update(pending)


def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None):
    """TE 1.x's spelling of ``autocast``: ``fp8_autocast(enabled, fp8_recipe, fp8_group)`` is
    ``autocast(enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group)``, same region, same updates."""
    check_recipe(fp8_recipe, "fp8_recipe")
    return autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group)


def schedule_update(state: DelayedScalingState, fp8_max: float, recipe: DelayedScaling, key: str = "") -> None:
    """Update ``state`` at the outermost region's exit if a region is open, else now.

    ``key`` names the tensor (layer shape, role, format) so the amax all-reduce can check that every rank
    reduces the same tensors in the same order.
    """
    entry = (state, fp8_max, recipe, _REGION.group, key)
    if _REGION.depth > 0:
        _REGION.pending.setdefault(id(state), entry)
    else:
        reduce_and_update([entry])


def _check_same_states_on_all_ranks(keys: list, device: torch.device, group) -> None:
    """Raise RuntimeError on every rank unless all ranks are about to reduce the same list of ``keys``."""
    n, crc = len(keys), zlib.crc32("\n".join(keys).encode())  # identical on every rank (unlike hash())
    sig = torch.tensor([n, crc, -n, -crc], dtype=torch.int64, device=device)  # MAX of (v, -v): max and -min
    all_reduce_max_(sig, group)
    n_max, crc_max, n_min, crc_min = sig[0].item(), sig[1].item(), -sig[2].item(), -sig[3].item()
    if n_max != n_min or crc_max != crc_min:
        raise RuntimeError(
            f"FP8 amax all-reduce refused: the ranks ran different FP8 layers (this rank has {n} delayed-scaling "
            f"states to reduce, the ranks have between {n_min} and {n_max}, or the same number of different "
            "layers). Every rank must run the same converted layers in the same order inside each fp8_autocast "
            "region; for layers only some ranks run, use DelayedScaling(reduce_amax=False) or CurrentScaling.")


def reduce_and_update(entries: list) -> None:
    """All-reduce (MAX) the current amaxes of ``entries`` where asked, then update every state.

    ``entries``: list of (DelayedScalingState, fp8_max, DelayedScaling, process group or None, key str).
    Raises RuntimeError (on every rank, states unchanged) if the ranks' entries differ.
    """
    by_group: dict = {}
    for state, _, recipe, group, key in entries:
        if recipe.reduce_amax and world_size(group) > 1:
            by_group.setdefault(id(group), (group, [], []))
            by_group[id(group)][1].append(state)
            by_group[id(group)][2].append(key)
    for group, states, keys in by_group.values():
        amaxes = torch.stack([s.amax_history[0] for s in states])  # (n_states,) fp32, one collective
        _check_same_states_on_all_ranks(keys, amaxes.device, group)
        all_reduce_max_(amaxes, group)
        for s, amax in zip(states, amaxes):
            s.amax_history[0] = amax
    for state, fp8_max, recipe, _, _ in entries:
        state.update(fp8_max, recipe)
