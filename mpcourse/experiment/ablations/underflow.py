"""Ablation (i): FP16 gradient underflow that really harms training, and loss scaling rescuing it.

On the default run ``fp16-master`` (FP16 model, FP32 master, no loss scaling) trains like FP32: most of the
GPT's small gradients land *subnormal* in FP16, not zero (lesson 01). Underflow bites when the gradients are
smaller. The one change here: the loss backward sees is multiplied by ``LOSS_MULTIPLIER`` (2**-12), as
happens when a loss is divided by the number of gradient-accumulation micro-batches (nanoGPT divides each
micro-batch's loss by ``gradient_accumulation_steps``), by a sequence length or a world size before the
backward, or when an auxiliary loss has a small weight. Every gradient shrinks by the same factor. AdamW's
update is invariant to that factor except through ``eps`` and the clipping threshold, so both are scaled
with it (``eps * m``, ``grad_clip * m``): then in FP32 the multiplier changes nothing beyond rounding (the FP32 rows at 1
and at 2**-12 agree within 0.3%, under the seed spread), and what changes in FP16 is underflow alone: the gradients fall below
2**-24 and flush to zero. (Measured without that: eps = 1e-8 next to gradients 4096x smaller slows FP32 itself
by 0.2-0.5 nats in 80 steps, which would hide the cause.)

Runs (same init and batches, each at multiplier 1 and 2**-12): ``fp32``, ``fp16-master`` (no scaling),
``fp16-static`` (2**12: exactly undoes the multiplier) and ``fp16-dynamic`` (starts at 2**16 and finds its
own scale). The reported loss is the true loss (divided back by the multiplier).
"""
from __future__ import annotations

from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.experiment.training.train import Trainer
from .common import AblationConfig, over_seeds

LOSS_MULTIPLIER = 2.0 ** -12
MULTIPLIERS = (1.0, LOSS_MULTIPLIER)
RECIPES = ("fp32", "fp16-master", "fp16-static", "fp16-dynamic")


def scaled_loss_trainer(multiplier: float) -> type[Trainer]:
    """A Trainer whose backward sees ``loss * multiplier`` and whose log reports ``loss``."""

    class ScaledLossTrainer(Trainer):
        def forward_loss(self, x, y):
            return super().forward_loss(x, y) * multiplier          # fp32 ()

        def loss_value(self, loss):
            return float(loss.detach()) / multiplier

    return ScaledLossTrainer


def run(acfg: AblationConfig, recipes: tuple[str, ...] = RECIPES, ablation: str = "underflow") -> dict:
    """Every recipe of ``recipes`` at each multiplier of ``MULTIPLIERS``, over the seeds of ``acfg``."""
    runs, base = [], OptimConfig()
    for m in MULTIPLIERS:
        optim = OptimConfig(eps=base.eps * m, grad_clip=base.grad_clip * m)
        for name in recipes:
            cls = get_recipe(name)
            for r in over_seeds(name, lambda model, optim, cls=cls: cls(model, optim), acfg, optim=optim,
                                trainer_cls=scaled_loss_trainer(m)):
                runs.append({**r, "loss_multiplier": m})
    return {"ablation": ablation, "loss_multiplier": LOSS_MULTIPLIER, "recipes": list(recipes), "runs": runs}
