"""The delayed-scaling rule (lesson 08): ``amax_and_scale_update`` and the per-tensor state it updates.

Matches the unfused PyTorch update in ``transformer_engine/pytorch/quantization.py``
(``_default_get_amax_and_update_history``, ``_update_amax_history``, ``_default_sf_compute``),
read at NVIDIA/TransformerEngine commit d0067d0. No kernel: the update is a few ops on (L,) tensors once per step.
The engine (``engine.Float8Quantizer``) binds a state's update to this rule or to a learner's ``update``.

Delayed scaling, per tensor (input, weight, output gradient of every FP8 layer):

    state:   scale (fp32, starts at 1.0), amax_history (fp32, zeros, length amax_history_len)
    step t:  quantize with the *current* scale (it came from steps < t), and record this step's amax
             into amax_history[0] (max-reduced over micro-batches of the same step)
    update:  amax = max(amax_history)            ("max")   or amax_history[0] ("most_recent"),
             computed *before* rolling
             amax_history = roll(amax_history, -1); amax_history[0] = 0
             scale = (fp8_max / amax) / 2**margin  where amax > 0 and finite, else the previous scale;
                     FP32 max where that division overflows

Worked example (E4M3, margin 0, L = 4): history [5, 1, 2, 3] -> amax 5, scale 448 / 5 = 89.6,
history [0, 2, 3, 5]. With margin 1 the scale is 44.8.

Where TE's two implementations disagree we follow the unfused PyTorch code above:
* a NaN in the window: ``torch.max`` propagates it, so the scale is kept while the NaN is in the
  window (TE's fused CUDA kernel ``common/recipe/delayed_scaling.cu`` uses ``fmaxf``, which skips NaN);
* a step whose amax is 0 still rolls the history (the fused bulk kernel skips the roll then);
* the margin is applied as ``(fp8_max / amax) / 2**margin`` (the kernel uses ``fp8_max * 2**-margin / amax``;
  the two agree unless fp8_max / amax overflows FP32).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from .tensor import compute_scale


def amax_and_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                          margin: int = 0, amax_compute_algo: Union[str, Callable] = "max",
                          scaling_factor_compute_algo: Optional[Callable] = None,
                          recipe=None):
    """One delayed-scaling update, out of place: returns ``(new_amax_history, new_scale)``.

    Args:
      amax_history: (L,) float32, row 0 holds the amax of the step that just ended.
      scale:        () float32, the scale used during that step.
      fp8_max:      448.0 or 57344.0 (the format of this tensor's role).
      margin, amax_compute_algo, scaling_factor_compute_algo: as in ``DelayedScaling``.
    The amax comes from the history *before* it rolls (TE ``_default_get_amax_and_update_history``);
    amax 0 / inf / NaN keeps ``scale``; an overflowing scale becomes FP32 max (``_default_sf_compute``).
    """
    history = amax_history.float()
    if callable(amax_compute_algo):
        amax = amax_compute_algo(history)
    elif amax_compute_algo == "max":
        amax = history.max()  # propagates NaN, so a NaN in the window keeps the previous scale
    elif amax_compute_algo == "most_recent":
        amax = history[0].clone()
    else:
        raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, got {amax_compute_algo!r}")
    new_history = torch.roll(history, -1, 0)  # oldest entry (index 1) falls out; index 0 moves to the end
    new_history[0] = 0.0  # the slot the next step records into
    if scaling_factor_compute_algo is None:
        new_scale = compute_scale(amax, fp8_max, margin, prev_scale=scale)
    else:
        new_scale = scaling_factor_compute_algo(amax, scale, fp8_max, recipe).float()
    return new_history, new_scale.reshape(())


def library_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe):
    """``amax_and_scale_update`` with ``recipe``'s margin and algorithms: a state's default update."""
    return amax_and_scale_update(amax_history, scale, fp8_max, recipe.margin, recipe.amax_compute_algo,
                                 recipe.scaling_factor_compute_algo, recipe)


class DelayedScalingState:
    """Scaling state of one tensor under ``DelayedScaling``: ``scale`` (fp32 ()) and ``amax_history`` (fp32 (L,)).

    ``record(amax)`` max-reduces an amax into ``amax_history[0]`` (so micro-batches of one step share one
    entry); ``update(fp8_max, recipe)`` applies ``rule`` in place: ``rule(amax_history, scale, fp8_max, recipe) ->
    (history, scale)``, by default ``library_update`` (``amax_and_scale_update`` with the recipe's fields); the
    engine passes a learner's update, checked, in its place.
    """

    def __init__(self, amax_history_len: int, device=None, rule: Optional[Callable] = None):
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32, device=device)
        self.rule = library_update if rule is None else rule

    def record(self, amax: torch.Tensor) -> None:
        """``amax_history[0] = max(amax_history[0], amax)`` (NaN propagates)."""
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.to(self.amax_history))

    def update(self, fp8_max: float, recipe) -> None:
        history, scale = self.rule(self.amax_history, self.scale, fp8_max, recipe)
        self.amax_history.copy_(history)
        self.scale.copy_(scale)

    def to(self, device) -> "DelayedScalingState":
        """Move to ``device`` in place, keeping float32 (``model.bfloat16()`` must not round the history)."""
        self.scale = self.scale.to(device=device, dtype=torch.float32)
        self.amax_history = self.amax_history.to(device=device, dtype=torch.float32)
        return self

    def state_dict(self) -> dict:
        return {"scale": self.scale.detach().clone(), "amax_history": self.amax_history.detach().clone()}

    def check_state_dict(self, state: dict, name: str = "") -> None:
        """Raise ValueError unless ``state`` fits this state: history length, one scale, finite and > 0.

        Runs on the host (one sync per tensor: at load time, not per step), so a checkpoint with a scale of 0,
        inf or NaN is refused when it is loaded, on every device, instead of poisoning the first FP8 cast.
        """
        what = f" for {name!r}" if name else ""
        history, scale = torch.as_tensor(state["amax_history"]), torch.as_tensor(state["scale"])
        if history.shape != self.amax_history.shape:
            raise ValueError(f"checkpoint amax_history{what} has length {history.numel()} but the recipe's "
                             f"amax_history_len is {self.amax_history.shape[0]}: convert the model with the "
                             "recipe the checkpoint was trained with")
        if scale.numel() != 1:
            raise ValueError(f"checkpoint scale{what} must have one element, got shape {tuple(scale.shape)}")
        if scale.device.type == "meta":
            return  # shapes only: no value to check
        value = float(scale.detach().reshape(()).float().cpu())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"checkpoint scale{what} is {value}: an FP8 scale must be finite and > 0. The "
                             "checkpoint is damaged; load an earlier one, or reset the FP8 state by loading the "
                             "model's weights without its '_extra_state' entries")

    def load_state_dict(self, state: dict) -> None:
        """Load ``{"scale", "amax_history"}`` after ``check_state_dict`` (nothing changes if it raises)."""
        self.check_state_dict(state)
        self.amax_history.copy_(torch.as_tensor(state["amax_history"]))
        self.scale.copy_(torch.as_tensor(state["scale"]).reshape(()))

    def __repr__(self) -> str:
        return f"DelayedScalingState(scale={float(self.scale):.6g}, amax_history_len={self.amax_history.numel()})"
