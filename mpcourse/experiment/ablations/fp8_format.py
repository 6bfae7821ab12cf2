"""Ablation (iv): FP8 ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) vs ``Format.E4M3`` everywhere.

The only change from ``fp8-current`` and ``fp8-delayed`` (``mpcourse.experiment.recipes.fp8``) is the
format of the output gradients in the backward GEMMs: E5M2 (HYBRID, TE's default; max 57344, 5 exponent
bits) or E4M3 (max 448, 4 exponent bits, one more mantissa bit). Per-tensor scaling puts a tensor's amax at
the top of the format, so what E4M3 loses is the bottom: its smallest subnormal is 2**-9 = 448 / 2**17.7
below the amax, E5M2's 2**-16 = 57344 / 2**31.8, so elements more than ~17.8 binades under the amax flush to
zero in E4M3 and ~31.8 in E5M2.

Each run also logs one layer's output gradient (``PROBE_LAYER``) per step: its amax and the fractions of its
nonzero elements that underflow in E4M3 and in E5M2 under current per-tensor scaling
(``mpcourse.core.inspect.tensor_stats``: the what-if of the format the run is not using).
"""
from __future__ import annotations

from mpcourse.core.inspect import tensor_stats
from mpcourse.core.quant import CurrentScaling, DelayedScaling, Format
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.recipes.fp8 import AMAX_HISTORY_LEN
from .common import AblationConfig, over_seeds

PROBE_LAYER = "blocks.0.mlp.fc"


def variant(base: str, fmt: Format) -> type:
    """``fp8-current`` / ``fp8-delayed`` with ``fp8_format=fmt``."""
    cls = get_recipe(base)
    rec = CurrentScaling(fp8_format=fmt) if base == "fp8-current" else \
        DelayedScaling(fp8_format=fmt, amax_history_len=AMAX_HISTORY_LEN)
    return type(f"{cls.__name__}_{fmt.name}", (cls,), {"fp8_recipe": rec, "name": f"{base}-{fmt.name.lower()}"})


class GradProbe:
    """Backward hook on ``PROBE_LAYER`` keeping the stats of the latest output gradient."""

    def __init__(self):
        self.last, self.hooked = {}, None

    def __call__(self, recipe) -> dict:
        if self.hooked is not recipe:
            layer = dict(recipe.model.named_modules())[PROBE_LAYER]
            layer.register_full_backward_hook(self._hook)
            self.hooked = recipe
            return {}
        return dict(self.last)

    def _hook(self, module, grad_input, grad_output):
        s = tensor_stats(grad_output[0], ("e4m3", "e5m2"))
        self.last = {"probe_grad_amax": s["amax"], "probe_dynamic_range_binades": round(s["dynamic_range_binades"], 3),
                     **{f"probe_underflow_{f}": round(v["underflow"], 6) for f, v in s["formats"].items()}}


def run(acfg: AblationConfig) -> dict:
    runs = []
    for base in ("fp8-current", "fp8-delayed"):
        for fmt in (Format.HYBRID, Format.E4M3):
            cls = variant(base, fmt)
            for seed in acfg.seeds:
                probe = GradProbe()
                [r] = over_seeds(f"{base} {fmt.name}", lambda model, optim, cls=cls: cls(model, optim),
                                 type(acfg)(steps=acfg.steps, batch_size=acfg.batch_size, seeds=(seed,),
                                            eval_batches=acfg.eval_batches), probe=probe)
                runs.append({**r, "base": base, "fp8_format": fmt.name})
    fp32 = get_recipe("fp32")
    runs += [{**r, "base": "fp32", "fp8_format": None} for r in over_seeds("fp32", lambda m, o: fp32(m, o), acfg)]
    return {"ablation": "fp8-format", "probe_layer": PROBE_LAYER, "runs": runs}
