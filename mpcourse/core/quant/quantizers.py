"""One quantizer per tensor role of one linear layer, built by the layer's recipe (TE's ``Quantizer`` objects).

Every recipe has ``recipe.quantizers(layer_key, device)``, returning ``{role: quantizer}`` for "input", "weight"
and "grad_output"; ``Float8Linear`` calls ``quantizers[role](...)`` and never asks which recipe it holds.
Where each recipe's rule is applied (the one line a new rule, or a learner's function, plugs into):

* ``CurrentQuantizer``: ``quantize_current`` (the scale from the tensor itself), no state.
* ``DelayedQuantizer``: ``quantize`` with the scale of earlier steps, then records this tensor's amax and
  schedules the delayed-scaling update (``region.schedule_update``); holds the role's ``DelayedScalingState``.
* ``BlockQuantizer``: the finer-grained recipes' ``recipe.quantize(role, x, axis, wgrad)`` (``block_recipes``).

``per_tensor`` says which autograd function the layer runs: per-tensor copies (``Float8Tensor``, one per
tensor, reused by the backward GEMMs through ``torch._scaled_mm``) or ``ScaledTensor`` copies re-quantized
along each GEMM's contraction dimension (``block_linear``).
"""
from __future__ import annotations

import torch

from .recipe import ROLES, CurrentScaling, DelayedScaling, DelayedScalingState, fp8_format_for
from .region import schedule_update
from .tensor import Float8Tensor, compute_amax, fp8_max, quantize, quantize_current


class CurrentQuantizer:
    """Current per-tensor scaling of one role (TE ``Float8CurrentScalingQuantizer``)."""

    per_tensor = True
    state = None

    def __init__(self, recipe: CurrentScaling, role: str):
        self.recipe, self.fmt = recipe, fp8_format_for(recipe, role)

    def __call__(self, x: torch.Tensor, record: bool) -> Float8Tensor:
        return quantize_current(x, self.fmt, power_2_scale=self.recipe.use_power_2_scales,
                                amax_epsilon=self.recipe.amax_epsilon, compute_scale_fn=self.recipe.compute_scale_fn,
                                quantize_fn=self.recipe.quantize_fn)


class DelayedQuantizer:
    """Delayed per-tensor scaling of one role (TE ``Float8Quantizer`` with its amax history)."""

    per_tensor = True

    def __init__(self, recipe: DelayedScaling, role: str, key: str, device=None):
        self.recipe, self.fmt = recipe, fp8_format_for(recipe, role)
        self.state = DelayedScalingState(recipe.amax_history_len, device)
        # The key lets the amax all-reduce check that every rank ran the same layers in the same order.
        self.key = f"{key}.{role}:{self.fmt}"

    def __call__(self, x: torch.Tensor, record: bool) -> Float8Tensor:
        x8 = quantize(x, self.fmt, self.state.scale, quantize_fn=self.recipe.quantize_fn)  # earlier steps' scale
        if record:
            self.state.record(compute_amax(x))
            schedule_update(self.state, fp8_max(self.fmt), self.recipe, key=self.key)
        return x8


class BlockQuantizer:
    """A finer-grained recipe's quantizer of one role; ``axis`` picks the contraction dimension."""

    per_tensor = False
    state = None

    def __init__(self, recipe, role: str):
        self.recipe, self.role = recipe, role

    def __call__(self, x: torch.Tensor, axis: int, wgrad: bool = False):
        # On a CPU every block-scaled GEMM is emulated (``block_gemm.scaled_gemm``), which reads each operand in
        # float32: the quantizer keeps that copy, computed with the quantization from its own scratch buffer.
        return self.recipe.quantize(self.role, x, axis, wgrad=wgrad, keep_fp32=x.device.type == "cpu")


def delayed_quantizers(recipe: DelayedScaling, layer_key: str, device=None) -> dict:
    return {role: DelayedQuantizer(recipe, role, layer_key, device) for role in ROLES}


def current_quantizers(recipe: CurrentScaling) -> dict:
    return {role: CurrentQuantizer(recipe, role) for role in ROLES}


def block_quantizers(recipe) -> dict:
    return {role: BlockQuantizer(recipe, role) for role in ROLES}
