"""More failures, for lesson 12's exercise (diagnose a run from its log): overflow, a scale too high, and an FP8
amax spike under delayed scaling.

* ``fp16-master x 2**17``: FP16 model, FP32 master, no loss scaler, and the loss backward sees multiplied by
  2**17 (as a loss *summed* over many tokens instead of averaged would be). The largest gradient at the first
  step is about 0.56 (``mpcourse.experiment.recipes.fp16``), so 0.56 * 2**17 = 7.3e4 > 65504: FP16 gradients
  overflow to inf, nothing skips the step, and the inf reaches the weights.
* ``fp16-static 2**24``: a static loss scale of 2**24: every scaled gradient overflows, the scaler skips every
  step, and the model never trains (the scale cannot back off: it is static).
* ``fp8-delayed`` hit by an **amax spike** (``plant_amax_spike``): on one training step (``AMAX_SPIKE_STEP``,
  counted from 0 as the Trainer counts) the activations entering ``attn.qkv`` and ``mlp.fc`` of every block (the
  layers that read a LayerNorm's output, lesson 09's ``outlier_channels.PLANTED``) are ``AMAX_SPIKE_FACTOR`` =
  2**8 times larger, and the weights those layers' GEMMs read 2**8 times smaller. A power of two: in FP32 both
  products are exact, so FP32 trains bit for bit as without the plant, and so does current scaling (its scale
  comes from this step's amax, and a power of two moves no rounding). Delayed scaling casts the 256x larger
  input with a scale from earlier steps' amaxes (TE ``DelayedScaling``: the scale of step t comes from the amax
  history of steps < t), so it clamps almost every element of it at E4M3's 448: the saturated fraction
  (``SaturationCounter``) jumps on that one step. The plant is constructed, as lesson 09's outlier channels are;
  it isolates what delayed scaling does with a jump in amax, since nothing else in the run changes.

Each next to ``fp32`` on the same setting (the reference of the diagnosis).
"""
from __future__ import annotations

import math

import torch
from torch.nn.utils import parametrize

from mpcourse.core.quant import QuantizedLinear
from mpcourse.core.quant.rules.tensor import fp8_max
from mpcourse.core.scaling import StaticLossScaler
from mpcourse.experiment.recipes import get_recipe
from .common import AblationConfig, over_seeds
from .outlier_channels import PLANTED
from .underflow import scaled_loss_trainer

OVERFLOW_MULTIPLIER = 2.0 ** 17
TOO_HIGH_SCALE = 2.0 ** 24
AMAX_SPIKE_STEP = 12              # the training step the activations jump on (counted from 0)
AMAX_SPIKE_FACTOR = 2.0 ** 8      # how much larger they are then: a power of two, exact in FP32
AMAX_SPIKE_LAYERS = PLANTED       # ("attn.qkv", "mlp.fc") in every block: the layers fed by a LayerNorm


class FP16StaticTooHigh(get_recipe("fp16-static")):
    name = "fp16-static-2**24"

    def make_scaler(self):
        return StaticLossScaler(TOO_HIGH_SCALE)


def run(acfg: AblationConfig) -> dict:
    fp32, master = get_recipe("fp32"), get_recipe("fp16-master")
    runs = []
    for r in over_seeds("fp32", lambda m, o: fp32(m, o), acfg):
        runs.append({**r, "loss_multiplier": 1.0})
    for r in over_seeds("fp32 x 2**17", lambda m, o: fp32(m, o), acfg, trainer_cls=scaled_loss_trainer(OVERFLOW_MULTIPLIER)):
        runs.append({**r, "loss_multiplier": OVERFLOW_MULTIPLIER})
    for r in over_seeds("fp16-master x 2**17", lambda m, o: master(m, o), acfg,
                        trainer_cls=scaled_loss_trainer(OVERFLOW_MULTIPLIER)):
        runs.append({**r, "loss_multiplier": OVERFLOW_MULTIPLIER})
    for r in over_seeds("fp16-static 2**24", lambda m, o: FP16StaticTooHigh(m, o), acfg):
        runs.append({**r, "loss_multiplier": 1.0})
    return {"ablation": "failures", "runs": runs}


# -- an FP8 amax spike, and the saturated fraction that names it --------------------------------------------------
class _Rescale(torch.nn.Module):
    """The parametrization W -> W * factor (``factor`` 1.0 except on the spike's step: W * 1.0 is W, bit for bit)."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, w):
        return w * self.factor


def plant_amax_spike(model: torch.nn.Module, step: int = AMAX_SPIKE_STEP, factor: float = AMAX_SPIKE_FACTOR,
                     layers=AMAX_SPIKE_LAYERS) -> None:
    """On training step ``step`` (a layer's ``step``-th forward in training mode with gradients on, counted from 0),
    make each layer of ``layers`` in every block compute (x * factor) (W / factor)^T + b; every other forward is
    the plain layer (see the module docstring). Call after the recipe converted the model (the parameter objects,
    and so the optimizer's, stay the same). ``factor`` must be a power of two (else FP32 would change too)."""
    mantissa, _ = math.frexp(factor)
    if not (factor > 0 and mantissa == 0.5):
        raise ValueError(f"factor must be a power of two (exact in FP32), e.g. 2.0 ** 8; got {factor!r}")
    if step < 0:
        raise ValueError(f"step counts training steps from 0; got {step}")
    for block in model.blocks:
        for name in layers:
            layer = block.get_submodule(name)
            rescale = _Rescale()
            parametrize.register_parametrization(layer, "weight", rescale)
            calls = [0]

            def hook(module, args, rescale=rescale, calls=calls):
                on = False
                if module.training and torch.is_grad_enabled():      # a training forward (not an evaluation)
                    on, calls[0] = calls[0] == step, calls[0] + 1
                rescale.factor = 1.0 / factor if on else 1.0
                return (args[0] * factor,) + tuple(args[1:]) if on else None
            layer.register_forward_pre_hook(hook)


def clamped(x: torch.Tensor, scale, top: float) -> int:
    """How many elements of ``x`` the saturating cast ``fp8(saturate(float32(x) * scale))`` clamps: those with
    ``|float32(x) * scale| > top`` (``top``: the format's max, 448 for E4M3, 57344 for E5M2; +-inf counts, NaN
    does not). The FP32 product is the one the cast rounds (``mpcourse.core.quant.rules.tensor.quantize``, lesson 07)."""
    return int(((x.detach().float() * scale).abs() > top).sum())


class _Counted:
    """A delayed-scaling quantizer that also counts, on every cast that records its amax, the elements it clamps
    at the scale in force before the cast (the scale of earlier steps)."""

    def __init__(self, quantizer, counter: "SaturationCounter"):
        self.quantizer, self.counter = quantizer, counter

    def __call__(self, x: torch.Tensor, record: bool):
        if record:
            q = self.quantizer
            self.counter.clamped += clamped(x, q.state.scale, fp8_max(q.fmt))
            self.counter.cast += x.numel()
        return self.quantizer(x, record)

    def __getattr__(self, name):                          # per_tensor, state, fmt, ...: the quantizer's own
        if name == "quantizer":                           # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.quantizer, name)


class SaturationCounter:
    """The saturated fraction of a run's delayed-scaling FP8 casts, step by step.

    Wraps every delayed-scaling quantizer of ``recipe``'s ``QuantizedLinear`` layers; counts, over the casts that
    record an amax (the training casts: each layer's input and weight in the forward, its output gradient in the
    backward; not evaluation), the elements clamped at the format's max (``clamped``) and the elements cast.
    As ``run_one``'s ``probe`` (read after the backward): ``{"fp8_saturated": clamped / cast}`` since the last call
    (None where the recipe has no delayed-scaling cast, e.g. FP32, FP16 or current scaling), then counts afresh.
    """

    def __init__(self, recipe):
        self.clamped = self.cast = 0
        self.wrapped = 0
        for module in recipe.model.modules():
            if isinstance(module, QuantizedLinear):
                for role, q in module.quantizers.items():
                    if q.state is not None:                        # Float8Quantizer: the scale of earlier steps
                        module.quantizers[role] = _Counted(q, self)
                        self.wrapped += 1

    def __call__(self, recipe=None) -> dict:
        out = {"fp8_saturated": self.clamped / self.cast if self.wrapped and self.cast else None}
        self.clamped = self.cast = 0
        return out
