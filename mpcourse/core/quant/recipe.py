"""FP8 recipes with Transformer Engine's names and defaults, and the delayed-scaling update.

Matches ``transformer_engine/common/recipe/__init__.py`` (``Format``, ``DelayedScaling``,
``Float8CurrentScaling``) and the unfused PyTorch update in ``transformer_engine/pytorch/quantization.py``
(``_default_get_amax_and_update_history``, ``_update_amax_history``, ``_default_sf_compute``),
read at NVIDIA/TransformerEngine commit d0067d0.

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
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, NamedTuple, Optional, Union

import torch

from ..seams import check_delayed_update
from .tensor import compute_scale, fp8_max


class _FormatHelper(NamedTuple):
    fwd: str  # format of activations and weights (forward-pass tensors)
    bwd: str  # format of gradients (backward-pass tensors)


class Format(Enum):
    """FP8 formats of a recipe (TE ``Format``): which format the forward and the backward tensors use.

    E4M3:   E4M3 everywhere (max 448 forward and backward).
    E5M2:   E5M2 everywhere (max 57344); refused by the recipes, as TE refuses it.
    HYBRID: E4M3 forward (precision for activations and weights), E5M2 backward (range for gradients).
    """

    E4M3 = _FormatHelper("e4m3", "e4m3")
    E5M2 = _FormatHelper("e5m2", "e5m2")
    HYBRID = _FormatHelper("e4m3", "e5m2")

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    @property
    def fwd(self) -> str:
        return self.value.fwd

    @property
    def bwd(self) -> str:
        return self.value.bwd

    @property
    def max_fwd(self) -> float:
        return fp8_max(self.value.fwd)

    @property
    def max_bwd(self) -> float:
        return fp8_max(self.value.bwd)


def _check_format(fp8_format) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be Format.E4M3 or Format.HYBRID, got {fp8_format!r}")
    if fp8_format is Format.E5M2:
        raise ValueError("Pure E5M2 training is not supported (as in Transformer Engine): E5M2's 2 mantissa "
                         "bits are too coarse for weights and activations. Use Format.HYBRID (E4M3 forward, "
                         "E5M2 gradients) or Format.E4M3.")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amax history of earlier steps (TE ``DelayedScaling``).

    Fields (TE's names and defaults):
      margin: int = 0                     scale = (fp8_max / amax) / 2**margin
      fp8_format: Format = Format.HYBRID  E4M3 forward, E5M2 gradients; Format.E5M2 raises ValueError
      amax_history_len: int = 1024        length L of each tensor's amax window
      amax_compute_algo: "max" | "most_recent" | Callable[[history (L,)], amax ()] = "max"
      scaling_factor_compute_algo: None | Callable[[amax, scale, fp8_max, recipe], scale] = None
      reduce_amax: bool = True            all-reduce amaxes with MAX over ranks before each update
    Not TE's: a learner's functions in place of the library's (``mpcourse.core.seams`` checks what they return):
      quantize_fn: None | lesson 07's ``quantize(x, scale, fp8_max) -> fp8 tensor``
      update_fn: None | lesson 08's ``update(history, scale, amax, fp8_max, margin, algo) -> (history, scale)``;
                 only with amax_compute_algo "max" / "most_recent" and no scaling_factor_compute_algo
    Raises ValueError / TypeError for values TE rejects.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    quantize_fn: Optional[Callable] = field(default=None, repr=False)   # a learner's rule (not a TE field): kept out of the repr
    update_fn: Optional[Callable] = field(default=None, repr=False)   # a learner's rule (not a TE field): kept out of the repr

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.update_fn is not None and (callable(self.amax_compute_algo) or self.scaling_factor_compute_algo):
            raise ValueError("update_fn is lesson 08's update (amax_compute_algo 'max' or 'most_recent', the "
                             "library's scale rule): drop the callable amax_compute_algo / scaling_factor_compute_algo")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"margin must be an int, got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")

    def quantizers(self, layer_key: str = "", device=None) -> dict:
        """{role: ``DelayedQuantizer``} for one layer, each with its own scaling state on ``device``
        (``mpcourse.core.quant.quantizers``; ``layer_key`` names the layer in the amax all-reduce)."""
        from .quantizers import delayed_quantizers
        return delayed_quantizers(self, layer_key, device)


@dataclass(frozen=True)
class CurrentScaling:
    """Current ("just-in-time") per-tensor scaling: every cast takes its scale from the tensor itself.

    TE ``Float8CurrentScaling`` (``Float8CurrentScaling`` below is the same class); torchao's default
    tensorwise dynamic scaling. No state survives between steps.
    Fields: fp8_format (Format.HYBRID; Format.E5M2 raises ValueError), use_power_2_scales (False: round
    each scale down to a power of two), amax_epsilon (0.0: floor for the amax).
    Not TE's: compute_scale_fn / quantize_fn, a learner's lesson 07 ``compute_scale(amax, fp8_max, margin)`` and
    ``quantize(x, scale, fp8_max)`` in place of the library's (None: the library's).
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    compute_scale_fn: Optional[Callable] = field(default=None, repr=False)   # a learner's rule (not a TE field): kept out of the repr
    quantize_fn: Optional[Callable] = field(default=None, repr=False)   # a learner's rule (not a TE field): kept out of the repr

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")


    def quantizers(self, layer_key: str = "", device=None) -> dict:
        """{role: ``CurrentQuantizer``} for one layer (``mpcourse.core.quant.quantizers``)."""
        from .quantizers import current_quantizers
        return current_quantizers(self)


Float8CurrentScaling = CurrentScaling  # Transformer Engine's name for the same recipe
Recipe = Union[DelayedScaling, CurrentScaling]

ROLES = ("input", "weight", "grad_output")  # the three tensors an FP8 linear layer quantizes


def fp8_format_for(recipe: Recipe, role: str) -> str:
    """Format of one tensor role under ``recipe``: forward format for "input"/"weight", backward for "grad_output"."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return recipe.fp8_format.bwd if role == "grad_output" else recipe.fp8_format.fwd


def amax_and_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                          margin: int = 0, amax_compute_algo: Union[str, Callable] = "max",
                          scaling_factor_compute_algo: Optional[Callable] = None,
                          recipe: Optional[DelayedScaling] = None):
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


class DelayedScalingState:
    """Scaling state of one tensor under ``DelayedScaling``: ``scale`` (fp32 ()) and ``amax_history`` (fp32 (L,)).

    ``record(amax)`` max-reduces an amax into ``amax_history[0]`` (so micro-batches of one step share one
    entry); ``update(fp8_max, recipe)`` applies ``amax_and_scale_update`` in place.
    """

    def __init__(self, amax_history_len: int, device=None):
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32, device=device)

    def record(self, amax: torch.Tensor) -> None:
        """``amax_history[0] = max(amax_history[0], amax)`` (NaN propagates)."""
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.to(self.amax_history))

    def update(self, fp8_max: float, recipe: DelayedScaling) -> None:
        if recipe.update_fn is not None:  # a learner's update: row 0 already holds this step's amax (recorded)
            history, scale = check_delayed_update("update", self.amax_history, recipe.update_fn(
                self.amax_history.clone(), self.scale.clone(), self.amax_history[0].clone(), fp8_max, recipe.margin,
                recipe.amax_compute_algo))
        else:
            history, scale = amax_and_scale_update(self.amax_history, self.scale, fp8_max, recipe.margin,
                                                   recipe.amax_compute_algo, recipe.scaling_factor_compute_algo,
                                                   recipe)
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
