"""The sizes ``mpcourse compare`` trains at: the model presets (``--preset``) with their batch, and ``--quick``."""
from __future__ import annotations

from ..training.train import TrainConfig

# model-size presets: "small" is the default every recipe runs in a few minutes on a laptop CPU; "large" has
# GEMMs (M = 32 x 256 = 8192 tokens, K, N = 1024..4096) near or past the FP8 break-even on an H100-class GPU
# (mpcourse.core.breakeven), and is meant for --device cuda.
PRESETS = {"small": dict(n_layer=5, n_embd=128, n_head=4, block_size=64),
           "large": dict(n_layer=8, n_embd=1024, n_head=16, block_size=256)}
PRESET_BATCH = {"small": TrainConfig.batch_size, "large": 32}

# ``--quick``: every recipe, on under a third of the default's tokens (a first contact, not a measurement:
# 50 steps are barely past the 20-step warm-up, so the gaps between recipes are mostly noise).
QUICK = {"steps": 50, "batch_size": 8}
