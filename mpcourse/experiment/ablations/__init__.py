"""Ablations for lesson 11: each changes one thing and trains the course's GPT, to isolate one cause.

    python -m mpcourse.experiment.ablations NAME [--steps 80] [--seeds 0,1] [--out notebooks/data/11]

writes ``OUT/NAME.json`` (strict JSON; every run's per-step log, see ``common.run_one``), which lesson 11
loads. NAME is one of ``ABLATIONS``:

    underflow        (i)   FP16 gradient underflow that harms training; loss scaling rescues it
    underflow-bf16   (i)   the same multiplier on BF16 recipes with no loss scale (stored apart)
    optimizer-state  (ii)  FP32 optimizer state vs FP32 master weights (why fp16-pure dies)
    op-precision     (iii) softmax, LayerNorm and the loss in low precision vs FP32
    fp8-format       (iv)  FP8 HYBRID (E5M2 gradients) vs E4M3 everywhere
    failures               gradient overflow and a loss scale too high (logs for the lesson's exercise)
    fp8-attention          (lesson 14) each attention tensor alone in FP8, forward-only FP8, all; per-op errors
"""
from __future__ import annotations

import importlib

ABLATIONS = {
    "underflow": "underflow",
    "underflow-bf16": "underflow_bf16",
    "optimizer-state": "optimizer_state",
    "op-precision": "op_precision",
    "fp8-format": "fp8_format",
    "failures": "failures",
    "fp8-attention": "fp8_attention",
}


def get_ablation(name: str):
    """The ``run(AblationConfig) -> dict`` of ablation ``name``; KeyError listing the known names."""
    if name not in ABLATIONS:
        raise KeyError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}")
    return importlib.import_module(f"{__name__}.{ABLATIONS[name]}").run
