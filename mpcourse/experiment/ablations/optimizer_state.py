"""Ablation (ii): FP32 optimizer state vs FP32 master weights, one at a time.

``fp16-pure`` (FP16 weights, AdamW state in FP16) dies at its first steps. Two things are FP16 there: the
weights (no FP32 master copy) and Adam's moments ``exp_avg``/``exp_avg_sq`` with the arithmetic of the
update. This ablation changes one at a time, as a 2 x 2 grid:

    weights \\ state      FP16 state                        FP32 state
    FP16 only          fp16-pure                         fp16-weights-fp32-state (this module)
    FP32 master        fp32-master-fp16-state (here)     fp16-master

``StateDtypeAdamW`` is AdamW (torch's single-tensor ``torch.optim.AdamW`` algorithm, decoupled weight decay)
whose moments live in, and whose update is computed in, ``state_dtype``, whatever the parameters' dtype; the
result is rounded once into the parameter. With ``state_dtype`` equal to the parameters' dtype it is
``torch.optim.AdamW(foreach=False)`` bit for bit (tests/experiment/ablations/test_ablations.py checks FP32 and FP16).

Why FP16 state fails (Micikevicius et al. 2018; lesson 02): ``exp_avg_sq`` holds g**2, which for the
GPT's gradients (1e-4 and below) is under FP16's smallest subnormal 2**-24 = 6e-8 and flushes to 0, and
``eps = 1e-8`` rounds to 0 in FP16, so ``m / (sqrt(v) + eps)`` is x / 0 = inf, or 0 / 0 = NaN.
"""
from __future__ import annotations

import math

import torch

from mpcourse.core.master import MasterWeights
from mpcourse.experiment.recipes import MasterWeightsRecipe, TrainingRecipe, get_recipe
from .common import AblationConfig, over_seeds


class StateDtypeAdamW(torch.optim.Optimizer):
    """AdamW with moments and update arithmetic in ``state_dtype`` (default: each parameter's own dtype)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, state_dtype=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                dt = self.state_dtype or p.dtype
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=dt)          # (shape of p) state_dtype
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=dt)
                st["step"] += 1
                step = float(st["step"])
                g = p.grad.to(dt)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)  # eps added in state_dtype
                if dt == p.dtype:                                          # torch's own in-place update
                    p.mul_(1 - lr * wd)
                    p.addcdiv_(m, denom, value=-step_size)
                else:                                                      # computed in the wider dtype, rounded once
                    wide = torch.promote_types(dt, p.dtype)
                    new = p.to(wide).mul_(1 - lr * wd).addcdiv_(m.to(wide), denom.to(wide), value=-step_size)
                    p.copy_(new)                                           # -> p.dtype, nearest even
        return None


class FP16WeightsFP32State(TrainingRecipe):
    """FP16 model, no master copy; AdamW's moments and update in FP32, rounded once into the FP16 weights."""

    name = "fp16-weights-fp32-state"
    description = "FP16 weights (no master), AdamW state and update arithmetic in FP32"

    def prepare_model(self, model):
        return model.half()

    def make_optimizer(self, params):
        o = self.optim
        return StateDtypeAdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                               state_dtype=torch.float32)


class FP32MasterFP16State(MasterWeightsRecipe):
    """FP16 model with an FP32 master copy, but AdamW's moments and update arithmetic in FP16."""

    name = "fp32-master-fp16-state"
    description = "FP16 model, FP32 master weights, AdamW state and update arithmetic in FP16"

    def make_optimizer(self, params):
        o = self.optim
        self.master = MasterWeights(params, StateDtypeAdamW, lr=o.lr, betas=o.betas, eps=o.eps,
                                    weight_decay=o.weight_decay, state_dtype=torch.float16)
        return self.master.optimizer


GRID = (  # (label, weights, state, recipe class)
    ("fp16-pure", "fp16", "fp16", get_recipe("fp16-pure")),
    ("fp16-weights-fp32-state", "fp16", "fp32", FP16WeightsFP32State),
    ("fp32-master-fp16-state", "fp32 master", "fp16", FP32MasterFP16State),
    ("fp16-master", "fp32 master", "fp32", get_recipe("fp16-master")),
    ("fp32", "fp32", "fp32", get_recipe("fp32")),
)


def run(acfg: AblationConfig) -> dict:
    runs = []
    for label, weights, state, cls in GRID:
        for r in over_seeds(label, lambda model, optim, cls=cls: cls(model, optim), acfg):
            runs.append({**r, "weights": weights, "state": state})
    return {"ablation": "optimizer-state", "runs": runs}
