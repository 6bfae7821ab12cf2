"""Ablation (i), BF16 rows: the same 2**-12 loss multiplier as ``underflow``, on BF16 recipes with no loss scale.

``underflow`` shows FP16 gradients flushing to zero once the loss backward sees is multiplied by 2**-12, and
loss scaling rescuing them. BF16 has FP32's 8 exponent bits (smallest normal 2**-126, smallest subnormal
2**-133), so gradients 4096x smaller are still far inside its range: ``bf16-master`` (BF16 model, FP32
master, no scaling) should need no scale exactly where ``fp16-master`` breaks (Kalamkar et al. 2019, "A Study
of BFLOAT16 for Deep Learning Training", arXiv 1905.12322). Same runs, init, batches, multipliers, ``eps``
and clipping as ``underflow`` (its ``run``, with other recipes); stored apart so that ``underflow.json``'s
runs stay as they were.
"""
from __future__ import annotations

from . import underflow
from .common import AblationConfig

RECIPES = ("bf16-master", "bf16-pure")


def run(acfg: AblationConfig) -> dict:
    return underflow.run(acfg, RECIPES, ablation="underflow-bf16")
