"""Lesson 09's training comparison: outlier channels planted in the inputs of the layers fed by a LayerNorm,
trained under per-tensor FP8, rowwise FP8, 1x128 tiles and MXFP8 (1x32 blocks), against FP32.

The plant (``plant_outliers``), in every block, on the two linear layers that read a LayerNorm's output
(``attn.qkv`` and ``mlp.fc``), with D the diagonal matrix of 1s except ``RATIO`` at ``OUTLIER_CHANNELS``:

* the layer's input x (tokens, C) is multiplied by D (a forward pre-hook): x' = x D, channels 3 and 17 are
  ``RATIO`` = 2^20 (about 1e6) times larger than the other 126, as the outlier features of large LLMs are
  (Dettmers et al. 2022, arXiv 2208.07339; there about 20x-100x, here far more, so that the failure shows in
  a 40-step run);
* the layer's GEMM reads the weight W D^-1 (a ``torch.nn.utils.parametrize`` parametrization): the parameter
  the optimizer updates is still W, and x' (W D^-1)^T = x W^T.

RATIO is a power of two, so both products are exact in FP32: the FP32 run computes and trains bit for bit as
the unplanted model (tests/experiment/ablations/test_ablation_outliers.py checks it). The low-precision recipes quantize x' and
W D^-1. Per-tensor E4M3 scales x' by 448 / amax(x'), which puts the ordinary channels about 2^20 below 448,
under half of E4M3's smallest subnormal (2^-9): they flush to zero, and the layer sees the two outlier
channels only. Rowwise scales and 1x128 tiles do no better (every row of x' holds the outlier channels).
1x32 MX blocks lose the 30 ordinary channels in the outliers' block (channels 0-31) and scale the other 96
on their own.

    python -m mpcourse.experiment.ablations.outlier_channels [--steps 40] [--seeds 0] [--out notebooks/data/09]

writes OUT/outlier-channels.json (the final losses are in lesson 09).
"""
from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from mpcourse.experiment.recipes import get_recipe
from .common import AblationConfig, over_seeds

OUTLIER_CHANNELS = (3, 17)          # both in the first 1x32 block of each row
RATIO = 2.0 ** 20                   # a power of two: x D and W D^-1 are exact in FP32
PLANTED = ("attn.qkv", "mlp.fc")    # the linear layers that read a LayerNorm's output
RECIPES = ("fp32", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8")


class _ScaleColumns(torch.nn.Module):
    """The parametrization W -> W * d (d: (in_features,), broadcast over the rows of W)."""

    def __init__(self, d: torch.Tensor):
        super().__init__()
        self.register_buffer("d", d)

    def forward(self, w):                                              # (N, K) -> (N, K)
        return w * self.d


def channel_scale(width: int, ratio: float = RATIO, channels=OUTLIER_CHANNELS) -> torch.Tensor:
    """The diagonal of D: (width,) float32, 1 except ``ratio`` at ``channels``."""
    d = torch.ones(width)
    d[list(channels)] = ratio
    return d


def plant_outliers(model: torch.nn.Module, ratio: float = RATIO, channels=OUTLIER_CHANNELS,
                   layers=PLANTED) -> None:
    """In every block, make each layer in ``layers`` compute (x D) (W D^-1)^T (see the module docstring).
    Call after the recipe converted the model: the parameter objects (and so the optimizer's) stay the same."""
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0 (1 plants nothing), got {ratio}")
    for block in model.blocks:
        for name in layers:
            layer = block.get_submodule(name)
            d = channel_scale(layer.in_features, ratio, channels).to(layer.weight.device)
            layer.register_forward_pre_hook(lambda m, args, d=d: (args[0] * d.to(args[0].dtype),) + args[1:])
            parametrize.register_parametrization(layer, "weight", _ScaleColumns(1.0 / d))


def run(acfg: AblationConfig, ratio: float = RATIO) -> dict:
    runs = []
    for name in RECIPES:
        cls = get_recipe(name)

        def make(model, optim, cls=cls):
            recipe = cls(model, optim)
            plant_outliers(recipe.model, ratio)
            return recipe
        runs += [{**r, "recipe": name} for r in over_seeds(name, make, acfg)]
    return {"ablation": "outlier-channels", "outlier_channels": list(OUTLIER_CHANNELS), "ratio": ratio,
            "planted": [f"blocks.*.{n}" for n in PLANTED], "recipes": list(RECIPES), "runs": runs}


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations.outlier_channels")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--ratio", type=float, default=RATIO, help="outlier / ordinary channel ratio (default 2^20)")
    p.add_argument("--out", default="notebooks/data/09")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, e.g. 0,1; got {a.seeds!r}")
    if not a.ratio > 0 or a.steps < 1:
        p.error(f"--ratio must be > 0 and --steps >= 1; got {a.ratio}, {a.steps}")
    result = run(AblationConfig(steps=a.steps, seeds=seeds), a.ratio)
    result["command"] = (f"python -m mpcourse.experiment.ablations.outlier_channels --steps {a.steps} "
                         f"--seeds {a.seeds}" + ("" if a.ratio == RATIO else f" --ratio {a.ratio:g}"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "outlier-channels.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
