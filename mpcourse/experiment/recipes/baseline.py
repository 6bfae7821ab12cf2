"""The anchor recipes: FP32, PyTorch's own AMP, and naive pure FP16.

* ``fp32``: everything in FP32, the reference every other row is measured against.
* ``torch-amp-bf16``: ``torch.autocast(dtype=torch.bfloat16)`` around the forward pass, FP32 weights,
  no loss scaling (BF16 has FP32's range). PyTorch's documented recipe (torch.amp docs, "Automatic
  Mixed Precision examples").
* ``torch-amp-fp16``: ``torch.autocast(dtype=torch.float16)`` plus ``torch.amp.GradScaler``
  (scale -> backward -> unscale_ -> clip -> step -> update), same source.
* ``fp16-pure``: model and AdamW state in FP16, no master weights, no loss scaling: the naive
  thing, kept to show what breaks (Micikevicius et al. 2018, section 3: lost updates, underflowing
  gradients, Adam's eps of 1e-8 flushing to 0 in FP16).
"""
from __future__ import annotations

import torch

from .base import TrainingRecipe, StepResult, register


@register
class FP32Reference(TrainingRecipe):
    name = "fp32"
    description = "FP32 weights, activations, gradients and optimizer: the reference"


@register
class TorchAmpBF16(TrainingRecipe):
    name = "torch-amp-bf16"
    description = "PyTorch anchor: torch.autocast(bfloat16), FP32 weights, no loss scaling"
    gemm_dtype = "bf16"

    def forward_context(self):
        return torch.autocast("cpu" if not _on_cuda(self.model) else "cuda", dtype=torch.bfloat16)


@register
class TorchAmpFP16(TrainingRecipe):
    name = "torch-amp-fp16"
    description = "PyTorch anchor: torch.autocast(float16) + torch.amp.GradScaler, FP32 weights"
    gemm_dtype = "fp16"

    def __init__(self, model, optim=None):
        super().__init__(model, optim)
        self.scaler = torch.amp.GradScaler("cuda" if _on_cuda(self.model) else "cpu")

    def forward_context(self):
        return torch.autocast("cpu" if not _on_cuda(self.model) else "cuda", dtype=torch.float16)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.scaler.unscale_(self.optimizer)
        self.clip_grads(self.optimizer)
        self.scaler.step(self.optimizer)
        scale_used = self.scaler.get_scale()
        self.scaler.update()
        # GradScaler backs off (scale * 0.5) exactly when it skipped the step: read that, not its privates.
        return StepResult(skipped=self.scaler.get_scale() < scale_used, loss_scale=scale_used)

    def state_dict(self):
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])


@register
class FP16Pure(TrainingRecipe):
    name = "fp16-pure"
    description = "naive: FP16 weights and AdamW state, no master copy, no loss scaling (breaks)"
    gemm_dtype = "fp16"

    def prepare_model(self, model):
        return model.half()


def _on_cuda(model) -> bool:
    return next(model.parameters()).is_cuda
