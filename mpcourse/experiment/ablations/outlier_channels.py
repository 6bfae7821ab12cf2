"""Lesson 09's training comparison: outlier channels planted in one layer's input, trained under per-tensor FP8,
rowwise FP8, 1x128 tiles and MXFP8 (1x32 blocks), against FP32.

The plant: in every block, LayerNorm ``ln2``'s gain of the channels ``OUTLIER_CHANNELS`` is multiplied by
``FACTOR`` and the matching input columns of ``mlp.fc`` divided by it. In exact arithmetic the model computes the
same function from the same initialisation; the input of ``mlp.fc`` now has a few channels ``FACTOR`` times
larger than the rest, as the activations of large LLMs do (Dettmers et al. 2022, arXiv 2208.07339). Per-tensor
E4M3 then puts the ordinary channels at or below its smallest subnormal (2^-9, 2^17.8 below the scaled amax):
they flush to zero or keep a bit or two, and ``mlp.fc`` sees little but the outliers. Rowwise scales and 1x128 tiles
(whole rows at width 128) cannot help: every row holds the outlier channels. 1x32 MX blocks put both outlier
channels in block 0 and scale the other 96 channels on their own.

    python -m mpcourse.experiment.ablations.outlier_channels [--steps 40] [--seeds 0] [--out notebooks/data/09]

writes OUT/outlier-channels.json. Measured (40 steps, seed 0, this CPU): the final training losses of fp32 3.09,
fp8-current 2.98, fp8-rowwise 3.04, mxfp8 3.12: at this size and length per-tensor FP8 does NOT visibly fail,
because a 40-step model leans little on ``mlp.fc``; the lesson does not use this run yet.
"""
from __future__ import annotations

import torch

from mpcourse.experiment.recipes import get_recipe
from .common import AblationConfig, over_seeds

OUTLIER_CHANNELS = (3, 17)          # both in the first 1x32 block of each row
FACTOR = 1e5
RECIPES = ("fp32", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8")


@torch.no_grad()
def plant_outliers(model: torch.nn.Module, factor: float = FACTOR, channels=OUTLIER_CHANNELS) -> None:
    """Scale ``channels`` of every block's ``ln2`` gain by ``factor`` and ``mlp.fc``'s matching columns by
    1 / ``factor`` (the same function in exact arithmetic; outlier channels in ``mlp.fc``'s input)."""
    ch = list(channels)
    for block in model.blocks:
        block.ln2.weight[ch] *= factor
        block.mlp.fc.weight[:, ch] /= factor


def run(acfg: AblationConfig) -> dict:
    runs = []
    for name in RECIPES:
        cls = get_recipe(name)

        def make(model, optim, cls=cls):
            plant_outliers(model)
            return cls(model, optim)
        runs += [{**r, "recipe": name} for r in over_seeds(name, make, acfg)]
    return {"ablation": "outlier-channels", "outlier_channels": list(OUTLIER_CHANNELS), "factor": FACTOR,
            "recipes": list(RECIPES), "runs": runs}


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations.outlier_channels")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--out", default="notebooks/data/09")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, e.g. 0,1; got {a.seeds!r}")
    result = run(AblationConfig(steps=a.steps, seeds=seeds))
    result["command"] = (f"python -m mpcourse.experiment.ablations.outlier_channels --steps {a.steps} "
                         f"--seeds {a.seeds}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "outlier-channels.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
