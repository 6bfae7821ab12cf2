"""Two more failures, for lesson 12's exercise (diagnose a run from its log): overflow, and a scale too high.

* ``fp16-master x 2**17``: FP16 model, FP32 master, no loss scaler, and the loss backward sees multiplied by
  2**17 (as a loss *summed* over many tokens instead of averaged would be). The largest gradient at the first
  step is about 0.56 (``mpcourse.experiment.recipes.fp16``), so 0.56 * 2**17 = 7.3e4 > 65504: FP16 gradients
  overflow to inf, nothing skips the step, and the inf reaches the weights.
* ``fp16-static 2**24``: a static loss scale of 2**24: every scaled gradient overflows, the scaler skips every
  step, and the model never trains (the scale cannot back off: it is static).

Each next to ``fp32`` on the same setting (the reference of the diagnosis).
"""
from __future__ import annotations

from mpcourse.core.scaling import StaticLossScaler
from mpcourse.experiment.recipes import get_recipe
from .common import AblationConfig, over_seeds
from .underflow import scaled_loss_trainer

OVERFLOW_MULTIPLIER = 2.0 ** 17
TOO_HIGH_SCALE = 2.0 ** 24


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
