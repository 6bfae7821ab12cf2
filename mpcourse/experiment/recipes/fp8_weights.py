"""``fp8-delayed-fp8-weights``: ``fp8-delayed`` with the FP8 layers' weights stored only in FP8, FP32 master in
the optimizer, as Transformer Engine's ``quantized_model_init`` with ``FusedAdam(master_weights=True)``.

The four linear layers of each block (``fp8.py`` says which) become ``mpcourse.core.quant.Float8WeightLinear``:
the module holds the weight as E4M3 data + a scale, and no high-precision weight; AdamW steps an FP32 master
in its place, the weight-gradient GEMM writes the master's gradient in FP32, and after every optimizer step
each master is cast to its layer's FP8 weight (``cast_master_to_weight_``). The forward and backward GEMMs use
the stored FP8 weight directly; nothing re-quantizes it from a high-precision weight.

Which scaling the cast uses: the layer's delayed-scaling weight state (the scale of the amax history, then the
master's amax recorded), as TE's FusedAdam writes an FP8 parameter with the scale its quantizer holds. Two
reasons: it is TE's path for FP8 parameters under ``DelayedScaling``, and it makes this row differ from
``fp8-delayed`` in memory only. With the master started from the FP32 initial weights (TE's
``preserve_high_precision_init_val=True``; ``MASTER_INIT``), each forward's FP8 weight is bit for bit the one
``fp8-delayed`` quantizes from its FP32 weight (``mpcourse.core.quant.layers.fp8_weights`` explains why), so the losses
are identical, which the tests check. The master is an FP32 copy the model lacks in ``fp8-delayed`` (there the
FP32 weight is its own master), so the rounding "master -> FP8 once per step" is the same rounding
``fp8-delayed`` does once per forward.

Not ``MasterWeightsRecipe``'s ``MasterWeights``: that writes master -> model as a plain dtype cast and copies
model gradients up to the master; here the write-back is a scaled FP8 quantization by the layer's quantizer and
the gradient arrives at the master directly (there is no FP8 gradient). The other parameters (embeddings,
LayerNorms, biases) stay FP32 and are their own master, as in ``fp8-delayed``.

Bytes per parameter of an FP8 layer's weight (``memory()``): weight 1 (E4M3) + grad 4 (the master's, FP32) +
master 4 + AdamW 8 = 17, against ``fp8-delayed``'s 4 + 4 + 0 + 8 = 16: the module's weight drops from 4 to 1
byte, but the FP32 master it needs is a new copy, and the moments stay. Against a model that keeps a master
anyway (``bf16-master``: 2 + 2 + 4 + 4 + 8 = 20, the BF16 model TE usually trains), FP8 weights save the
16-bit weight and its 16-bit gradient: 17. Extra state: the delayed-scaling states and one FP32 scale_inv per layer.
"""
from __future__ import annotations

import torch

from mpcourse.core.checkpoint import CheckpointError, check_optimizer_state_dict
from mpcourse.core.quant import Float8WeightLinear, convert_to_fp8_weights
from .base import StepResult, register
from .fp8 import FP8Delayed

MASTER_INIT = "fp32"        # the masters start from the FP32 initial weights (TE preserve_high_precision_init_val)


@register
class FP8DelayedFP8Weights(FP8Delayed):
    name = "fp8-delayed-fp8-weights"
    description = ("fp8-delayed with the FP8 layers' weights stored only in FP8 (E4M3 + scale), FP32 master "
                   "in the optimizer (TE quantized_model_init)")
    OVERRIDABLE = ()
    master_init = MASTER_INIT

    def prepare_model(self, model):
        model = super().prepare_model(model)                          # QuantizedLinear layers, FP32 weights
        self.masters = convert_to_fp8_weights(model, master_init=self.master_init)   # {fqn: (N, K) fp32}
        return model

    def make_optimizer(self, params):
        # Each FP8 weight's master takes its place, so AdamW and the clipping see the parameters in the same
        # order as fp8-delayed's (the global gradient norm sums them in that order).
        by_weight = {id(self.model.get_submodule(fqn).weight): m for fqn, m in self.masters.items()}
        return super().make_optimizer([by_weight.get(id(p), p) for p in params])

    def fp8_weight_layers(self) -> dict[str, Float8WeightLinear]:
        return {fqn: self.model.get_submodule(fqn) for fqn in self.masters}

    def step(self) -> StepResult:
        result = super().step()                                       # clip, AdamW on the masters (fp32)
        for layer in self.fp8_weight_layers().values():
            layer.cast_master_to_weight_()                            # fp32 master -> E4M3 weight, delayed scale
        return result

    def memory_tensors(self):
        own = super().memory_tensors()
        return {"extra": own["extra"] + [layer.weight_scale_inv for layer in self.fp8_weight_layers().values()]}

    def state_dict(self) -> dict:
        """{"model": FP8 weights + scales + delayed-scaling states, "optimizer": AdamW, "master": {fqn: fp32}}."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "master": dict(self.masters)}

    def load_state_dict(self, state: dict) -> None:
        """Everything is checked (keys, masters' names, shapes and dtypes, optimizer state) before anything loads."""
        self.check_state_keys(state)
        masters = state["master"]
        if not isinstance(masters, dict) or set(masters) != set(self.masters):
            got = sorted(masters) if isinstance(masters, dict) else type(masters).__name__
            raise CheckpointError(f"recipe {self.name!r}: the checkpoint's masters are {got}, this model's "
                                  f"{sorted(self.masters)}")
        for fqn, m in self.masters.items():
            saved = masters[fqn]
            if not isinstance(saved, torch.Tensor) or saved.dtype != torch.float32 or saved.shape != m.shape:
                what = f"{saved.dtype} {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise CheckpointError(f"recipe {self.name!r}: master {fqn!r} must be float32 {tuple(m.shape)}, "
                                      f"got {what}")
        check_optimizer_state_dict(self.optimizer, state["optimizer"], f"recipe {self.name!r} optimizer")
        self.model.load_state_dict(state["model"])       # each layer refreshes its master from the loaded weight,
        with torch.no_grad():                             # then the checkpoint's masters (their low bits) replace it
            for fqn, m in self.masters.items():
                m.copy_(masters[fqn])
        self.optimizer.load_state_dict(state["optimizer"])
