"""The BF16 recipes: autocast with FP32 weights, an FP32 master copy, and pure BF16 with three write-backs.

* ``bf16-autocast``: the course's ``mpcourse.core.autocast.autocast(dtype=torch.bfloat16)`` around the forward pass,
  FP32 weights, gradients and AdamW; no loss scaling (BF16 has FP32's exponent range). The same recipe as the
  ``torch-amp-bf16`` anchor, with the course's op policy in place of torch's. Takes lesson 05's ``cast_args`` and
  ``cached_cast`` as overrides (``autocast(cast_args=, cached_cast=)``).
* ``bf16-master``: BF16 model (``cast_model``, every module), FP32 master weights + AdamW (``MasterWeights``),
  Micikevicius et al. 2018 section 3.1 with BF16 in place of FP16 (no loss scaling needed).
* ``bf16-pure``, ``bf16-pure-sr``, ``bf16-pure-kahan``: BF16 model and BF16 AdamW state, no master copy; AdamW
  steps in FP32 on temporaries (``mpcourse.core.bf16.BF16Optimizer``) and the new weight is written back to BF16 by
  round-to-nearest (the stagnation case), stochastic rounding, or a Kahan-compensated update (Zamirai et al.
  2020, "Revisiting BFloat16 Training", Algorithm 2 for Kahan). The three differ only in that write-back,
  so the rows isolate its effect. Gradients are accumulated in FP32 (``accumulate_grads``) and clipped there.
* ``bf16-master-bf16-moments``: ``bf16-master`` with AdamW's moments stored in BF16 between steps
  (``mpcourse.core.optim.state.LowPrecisionState``; DeepSeek-V3, arXiv 2412.19437 section 3.3.3), rounded to
  nearest: a moment whose per-step change is under half a BF16 step stalls (the second moment stops decaying
  when the gradients go quiet: ``v * 0.999`` rounds back to ``v``).
* ``bf16-master-bf16-moments-sr``: the same with the moments rounded stochastically into BF16 (unbiased, so
  they decay as FP32's on average); not in the default run (name it with ``--recipes``).

Bytes per parameter (``memory()``, after the step, before ``zero_grad``)::

    recipe            weights   grads          master   AdamW state   extra            total
    bf16-autocast     fp32 4    fp32 4         -        fp32 8        -                16
    bf16-master       bf16 2    bf16 2+fp32 4  fp32 4   fp32 8        -                20
    bf16-pure(-sr)    bf16 2    fp32 4         -        bf16 4        -                10
    bf16-pure-kahan   bf16 2    fp32 4         -        bf16 4        compensation 2   12
    bf16-master-bf16-moments  bf16 2  bf16 2+fp32 4  fp32 4  bf16 4  -                16
    (bf16-master-bf16-moments-sr: the same bytes)
"""
from __future__ import annotations

import torch

from mpcourse.core.autocast import autocast
from mpcourse.core.bf16 import BF16Optimizer
from mpcourse.core.learner_table import exercise_names
from mpcourse.core.optim.state import LowPrecisionState
from .base import MasterWeightsRecipe, TrainingRecipe, StepResult, register

SR_SEED = 0          # seeds bf16-pure-sr's stochastic-rounding generator (checkpointed with the recipe)


@register
class BF16Autocast(TrainingRecipe):
    name = "bf16-autocast"
    description = "course autocast (mpcourse.core.autocast, bfloat16), FP32 weights, no loss scaling"
    gemm_dtype = "bf16"
    OVERRIDABLE = exercise_names("cast_args", "cached_cast")   # lesson 05: the casts of a call, the cast cache

    def forward_context(self):
        return autocast(next(self.model.parameters()).device.type, dtype=torch.bfloat16,
                        cast_args=self.overrides.get("cast_args"), cached_cast=self.overrides.get("cached_cast"))


@register
class BF16Master(MasterWeightsRecipe):
    """BF16 model with an FP32 master copy stepped by AdamW (the FP16 recipe's step, no loss scaling)."""

    name = "bf16-master"
    description = "BF16 model, FP32 master weights + AdamW (MasterWeights), no loss scaling"
    model_dtype = torch.bfloat16
    gemm_dtype = "bf16"
    OVERRIDABLE = exercise_names("round_to_bf16", "make_master", "master_step")   # lessons 00 (the rounding) and 02


class _BF16Pure(TrainingRecipe):
    """BF16 model + ``BF16Optimizer(AdamW, rounding=self.rounding, kahan=self.kahan)``; ``self.optimizer`` is
    the wrapper."""

    rounding, kahan = "nearest", False
    gemm_dtype = "bf16"

    def prepare_model(self, model):
        return model.to(torch.bfloat16)                                # every param (N,) bf16; ids stay int64

    def make_optimizer(self, params):
        return BF16Optimizer(super().make_optimizer(params), rounding=self.rounding, kahan=self.kahan,
                             seed=SR_SEED, **self.overrides)          # names in OVERRIDABLE = its keywords

    def step(self) -> StepResult:
        self.optimizer.accumulate_grads()                              # bf16 grads -> fp32 buffers
        if self.optim.grad_clip:
            self.optimizer.clip_grad_norm_(self.optim.grad_clip)      # on the fp32 grads
        self.optimizer.step()                                          # AdamW in fp32, written back to bf16
        return StepResult()

    def memory_tensors(self):
        return {"grads": [g for g in self.optimizer.grads if g is not None],   # the fp32 buffers, not param.grad
                "extra": list(self.optimizer.comp or [])}                     # Kahan compensation (bf16)


@register
class BF16Pure(_BF16Pure):
    name = "bf16-pure"
    description = "BF16 weights and AdamW state, no master copy, round-to-nearest updates (small updates are lost)"
    rounding = "nearest"
    OVERRIDABLE = exercise_names("round_to_bf16")        # lesson 00


@register
class BF16PureSR(_BF16Pure):
    name = "bf16-pure-sr"
    description = "BF16 weights and AdamW state, no master copy, stochastic rounding of the updated weights"
    rounding = "stochastic"
    OVERRIDABLE = exercise_names("stochastic_round_bf16")   # lesson 06


@register
class BF16PureKahan(_BF16Pure):
    name = "bf16-pure-kahan"
    description = "BF16 weights and AdamW state, no master copy, Kahan-compensated updates (BF16 buffer)"
    rounding, kahan = "nearest", True
    OVERRIDABLE = exercise_names("kahan_add_")           # lesson 06


@register
class BF16MasterBF16Moments(BF16Master):
    """``bf16-master`` with AdamW's two moments stored in BF16 (DeepSeek-V3 section 3.3.3): 4 instead of 8
    bytes of optimizer state per parameter; master weights and their gradients stay FP32."""

    name = "bf16-master-bf16-moments"
    description = ("BF16 model, FP32 master weights, AdamW moments stored in BF16 rounded to nearest (DeepSeek-V3; "
                   "small decays of the moments are lost)")
    OVERRIDABLE = ()                                   # no learner seams: lessons 00 and 02 grade bf16-master's
    #: MasterWeightsRecipe.make_optimizer builds the master with it (and FSDP2's sharded master steps with it too)
    master_optimizer = LowPrecisionState(torch.optim.AdamW, torch.bfloat16)


@register
class BF16MasterBF16MomentsSR(BF16MasterBF16Moments):
    """``bf16-master-bf16-moments`` with the moments rounded into BF16 stochastically (``LowPrecisionState(...,
    rounding="stochastic")``, seeded with ``SR_SEED``, its generator in the optimizer's state_dict)."""

    name = "bf16-master-bf16-moments-sr"
    description = ("BF16 model, FP32 master weights, AdamW moments stored in BF16 with stochastic rounding "
                   "(unbiased: the moments decay as FP32's on average)")
    master_optimizer = LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding="stochastic", seed=SR_SEED)
