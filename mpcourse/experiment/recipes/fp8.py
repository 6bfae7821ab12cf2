"""The FP8 recipes: the GPT's linear layers compute in FP8, as Transformer Engine and torchao train.

* ``fp8-current``: current (just-in-time) per-tensor scaling, TE ``Float8CurrentScaling`` / torchao's
  tensorwise default: every cast takes its scale from the tensor itself (``mpcourse.core.quant.CurrentScaling``).
* ``fp8-delayed``: delayed scaling, TE ``DelayedScaling``: each tensor's scale comes from the amax history
  of earlier steps (``mpcourse.core.quant.DelayedScaling``).

Both use ``Format.HYBRID`` (E4M3 for activations and weights, E5M2 for gradients; TE's default) and
``mpcourse.core.quant.convert_to_float8_training`` to swap linear layers for ``QuantizedLinear``, whose three GEMMs
(forward, input gradient, weight gradient) run through ``torch._scaled_mm``.

What is FP8 and what is not (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3.1: the
embedding, the output head, normalisation and attention keep their original precision; TE quantizes
only its GEMM modules, ``te.Linear`` / ``LayerNormLinear`` / ``LayerNormMLP``)::

    FP8   blocks.*.attn.qkv, blocks.*.attn.proj, blocks.*.mlp.fc, blocks.*.mlp.proj   (4 per block)
    FP32  tok_emb, pos_emb, the LayerNorms, q @ k^T, softmax, att @ v, GELU, ln_f, the head
          (tied to tok_emb), the cross-entropy

The head stays out (``module_filter_fn`` excludes ``head``): its logits feed the softmax of the loss
directly, and it shares its weight with the token embedding, which must not be quantized.

Master weights. The FP8 layers keep their weights in FP32 and quantize a fresh E4M3 copy at every
forward, as ``te.Linear`` and torchao's ``Float8Linear`` do; the optimizer (AdamW) steps those FP32
weights directly, so the FP32 weights *are* the master copy and no second copy exists (the table shows
master 0 B). Gradients reach the weights in FP32 (the weight-gradient GEMM writes the weight's dtype).
``fp8-delayed-fp8-weights`` (``fp8_weights.py``) stores those weights in FP8 instead, with an FP32 master in AdamW.

The non-FP8 compute dtype is FP32 (no ``torch.autocast`` around the FP8 region). Why not BF16 autocast,
as TE is usually run on GPUs (BF16 activations around FP8 GEMMs)? So that the gap of these rows to
``fp32`` is the effect of FP8 alone: everything that is not one of the four FP8 GEMMs per block runs
exactly as in the ``fp32`` row, and the ``torch-amp-bf16`` row shows the BF16 effect on its own. (It also
avoids emulated BF16 matmuls on CPUs without BF16 units.) To run as TE usually does on a GPU, put
``torch.autocast(dtype=torch.bfloat16)`` around ``quant.autocast``: ``QuantizedLinear`` then returns BF16.

Delayed scaling uses TE's ``DelayedScaling`` defaults except ``amax_history_len=16`` (default 1024),
the value of TE's own examples (``docs/examples/quickstart.ipynb``, "Enabling FP8":
``DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")``). Reason: a
``mpcourse compare`` run has 80-200 steps, so a 1024-entry window would never forget anything: every
scale would be the largest amax since step 0, i.e. not delayed scaling as it behaves in a long run,
where 1024 steps are a small part of the run. Sixteen steps still cover the step-to-step jitter of the amax. Measured on a 150-step
run (``--steps 150``, 1 thread): final validation loss 2.282 with 16, 2.274 with 1024, fp32 2.286; the choice is about
behaving like delayed scaling, not about the loss.

How the state moves through a step (``mpcourse.core.quant.region``): the forward runs inside
``quant.autocast(enabled=True, recipe=...)`` (``forward_context``; TE 1.x spelled it ``fp8_autocast``); each
layer records the amaxes of its input and weight, and when the region exits, the forward states of every layer update once. The
backward (``loss.backward()``) runs after the region has exited, as TE requires; each layer's backward
quantizes its output gradient with the layer's own recipe and updates that state right after using it.
Under ``torch.no_grad()`` (evaluation) the layers use their scales and record nothing.

Checkpoints: the scales and amax histories are in each ``QuantizedLinear``'s extra state, so
``model.state_dict()`` (part of ``TrainingRecipe.state_dict``) carries them and a run resumes bit for bit.
``memory()['extra']`` counts that state: per FP8 layer, 3 tensors x (scale 4 B + history 4 B x L).
"""
from __future__ import annotations


import torch.nn as nn

from mpcourse.core import quant
from mpcourse.core.quant import CurrentScaling, DelayedScaling, QuantizedLinear, Format, convert_to_float8_training
from mpcourse.core.quant.layers.module_filter import linear_fqns, summarize_fqns
from .base import TrainingRecipe, register

FP8_FORMAT = Format.HYBRID               # E4M3 forward, E5M2 gradients (TE's default)
AMAX_HISTORY_LEN = 16                    # TE default 1024; 16 as in TE's quickstart example (see above)
HIGH_PRECISION_MODULES = ("head",)       # linear layers kept out of FP8 (by their fully qualified name)


def keep_linear_in_fp8(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``convert_to_float8_training``: every linear layer except the output head."""
    return fqn not in HIGH_PRECISION_MODULES


def _check_high_precision_modules(model: nn.Module) -> None:
    """A kept-high name the model lacks would silently convert the layer it meant (a renamed head)."""
    linears = linear_fqns(model)
    missing = [n for n in HIGH_PRECISION_MODULES if n not in linears]
    if missing:
        raise ValueError(f"keep_linear_in_fp8 keeps {missing} in high precision, but the model has no nn.Linear of "
                         f"that name; its nn.Linear layers are: {summarize_fqns(linears)}")


keep_linear_in_fp8.check_model = _check_high_precision_modules


class QuantizedRecipe(TrainingRecipe):
    """FP32 model whose linear layers (not the head) are ``QuantizedLinear`` under a quantization recipe (FP8, MXFP8 or
    NVFP4); forward inside TE's ``autocast``. ``OVERRIDABLE``: the learner's functions the recipe's quantizers take
    (its quantization recipe's class ``TAKES``), which ride in that recipe (``quantization()``) to every layer."""

    fp8_recipe: quant.Recipe
    gemm_dtype = "fp8"

    def checked_overrides(self, overrides):
        """``TrainingRecipe.checked_overrides`` with the refusal of a function this recipe's ``fp8_recipe`` fields
        do not follow (``fp8_recipe.refusal``), checked for that ``fp8_recipe``: the quantization recipe that
        carries them takes the result as it is (``quant.recipe.check_functions``)."""
        return super().checked_overrides(overrides, refuse=self.fp8_recipe.refusal, checked_for=self.fp8_recipe)

    def quantization(self) -> quant.Recipe:
        """The quantization recipe the layers are built with: ``fp8_recipe`` carrying the learner's functions."""
        return self.fp8_recipe.with_functions(self.overrides)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        # Swaps modules in place; the weight and bias Parameters (FP32) are kept, so the optimizer built next
        # steps them and the head stays tied to tok_emb.
        return convert_to_float8_training(model, module_filter_fn=keep_linear_in_fp8, recipe=self.quantization())

    def forward_context(self):
        return quant.autocast(enabled=True, recipe=self.fp8_recipe)   # TE's FP8 region (older name: fp8_autocast)

    def fp8_layers(self) -> dict[str, QuantizedLinear]:
        """The model's FP8 layers by fully qualified name."""
        return {name: m for name, m in self.model.named_modules() if isinstance(m, QuantizedLinear)}

    def memory_tensors(self):
        """FP8 scaling state: every scale and amax history (FP32) of every FP8 layer; none for current scaling,
        whose scales live only during one cast."""
        return {"extra": [t for layer in self.fp8_layers().values() for state in layer.scaling_state.values()
                          for t in (state.scale, state.amax_history)]}


@register
class FP8Current(QuantizedRecipe):
    name = "fp8-current"
    description = "FP8 linear layers (HYBRID, current per-tensor scaling), FP32 weights and the rest in FP32"
    fp8_recipe = CurrentScaling(fp8_format=FP8_FORMAT)
    OVERRIDABLE = fp8_recipe.TAKES  # lesson 07: compute_scale, quantize


@register
class FP8Delayed(QuantizedRecipe):
    name = "fp8-delayed"
    description = "FP8 linear layers (HYBRID, delayed scaling, amax history 16), FP32 weights and the rest in FP32"
    fp8_recipe = DelayedScaling(fp8_format=FP8_FORMAT, amax_history_len=AMAX_HISTORY_LEN)
    OVERRIDABLE = fp8_recipe.TAKES  # lessons 07 and 08: quantize, update
