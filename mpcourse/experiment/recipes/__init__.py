"""Registry of precision recipes for ``mpcourse compare`` (see ``base.py`` for the interface).

Importing this package registers every recipe. ``TABLE_ORDER`` below is the one place that says
the order of the compare table and of ``mpcourse recipes`` (import order decides nothing); a
registered recipe missing from it, or a name in it that is not registered, is an error at import.
"""
from .base import RECIPES, MasterWeightsRecipe, OptimConfig, TrainingRecipe, StepResult, get_recipe, register
from . import baseline  # noqa: F401  fp32, torch-amp-bf16, torch-amp-fp16, fp16-pure
from . import fp16  # noqa: F401  fp16-master, fp16-static, fp16-dynamic
from . import bf16  # noqa: F401  bf16-autocast, bf16-master, bf16-pure, bf16-pure-sr, bf16-pure-kahan, bf16-master-bf16-moments(-sr
from . import low_state  # noqa: F401  fp8-moments, int8-moments
from . import fp8  # noqa: F401  fp8-current, fp8-delayed
from . import fp8_weights  # noqa: F401  fp8-delayed-fp8-weights
from . import fp8_attention  # noqa: F401  fp8-attention, fp8-attention-current
from . import fp8_blocks  # noqa: F401  fp8-rowwise, fp8-block, mxfp8, mxfp8-floor, nvfp4
from . import fp8_directions  # noqa: F401  mxfp8-fwd-nvfp4-bwd
from . import selective  # noqa: F401  nvfp4-selective
from . import moe  # noqa: F401  moe-fp32, moe-bf16, moe-fp8-rowwise, moe-fp8-block, moe-mxfp8, moe-bf16-router

TABLE_ORDER = (
    # anchors: FP32 and PyTorch's own AMP
    "fp32", "torch-amp-bf16", "torch-amp-fp16",
    # FP16, built up: no master copy, master copy, static and dynamic loss scaling
    "fp16-pure", "fp16-master", "fp16-static", "fp16-dynamic",
    # BF16: autocast, master copy, pure BF16 with three write-backs
    "bf16-autocast", "bf16-master", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan",
    # memory savers: low-precision optimizer state
    "bf16-master-bf16-moments", "bf16-master-bf16-moments-sr", "fp8-moments", "int8-moments",
    # FP8 per tensor
    "fp8-current", "fp8-delayed",
    # memory savers: FP8 weights with an FP32 master (TE quantized_model_init)
    "fp8-delayed-fp8-weights",
    # FP8 attention: fp8-delayed / fp8-current plus Q, K, V, P, O and their gradients in FP8 (TE fp8_dpa)
    "fp8-attention", "fp8-attention-current",
    # finer-grained scaling: per row, 1x128/128x128 blocks, MX (E8M0), NVFP4
    "fp8-rowwise", "fp8-block", "mxfp8", "mxfp8-floor", "nvfp4",
    # which layers: nvfp4 with the last block's linears kept high
    "nvfp4-selective",
    # a format per GEMM direction: MXFP8 forward, NVFP4 backward
    "mxfp8-fwd-nvfp4-bwd",
    # experts in low precision: the MoE GPT per format, and its router in BF16
    "moe-fp32", "moe-bf16", "moe-fp8-rowwise", "moe-fp8-block", "moe-mxfp8", "moe-bf16-router",
)

# Left out of a plain ``mpcourse compare`` (name them with ``--recipes``); ``mpcourse recipes`` and ``--recipes``
# list them as usual. Every main recipe, the emulated block-scaled ones included, fits the no-argument run's
# few minutes on a 2-core CPU (fast emulation paths, ``mpcourse.core.quant.kernels``, and ``--jobs``).
# ``mxfp8-floor`` is ``mxfp8`` with the OCP spec's floor rule for the shared exponent instead of RCEIL: the
# recipe lesson 09's ``mx_shared_exponent`` plugs into, a variant rather than a row of its own.
# ``fp8-delayed-fp8-weights`` trains bit for bit as ``fp8-delayed`` (tested): only its memory differs, so in the
# default run it would repeat fp8-delayed's losses at the cost of one more FP8 run; name it to see its memory.
# ``bf16-master-bf16-moments-sr`` is ``bf16-master-bf16-moments`` with stochastic rounding of the moments (the fix
# for their stall when the gradients go quiet): a variant to name beside it, not a row of the default table.
# ``mxfp8-fwd-nvfp4-bwd`` computes its forward GEMMs as ``mxfp8`` and its backward GEMMs as ``nvfp4`` (tested): a
# combination of two rows of the default table, to name beside them. ``nvfp4-selective`` is ``nvfp4`` with the last
# block's linears kept in high precision (NVIDIA's NVFP4 recipe), the slowest kind of row: name it beside ``nvfp4``.
# ``fp8-moments`` and ``int8-moments`` change only the optimizer state's storage (blockwise, after torchao's
# AdamWFp8 / AdamW8bit): memory savers named beside ``bf16-master-bf16-moments``; the default table and its 3-seed
# spread predate them. ``fp8-attention`` and ``fp8-attention-current`` put attention itself in FP8, which production
# recipes keep high: lesson 14's rows, named beside ``fp8-delayed`` and ``fp8-current``.
# The ``moe-*`` rows train another model (the MoE twin of the run's GPT, lesson 13): a table of their own, named
# together (``--recipes moe-fp32,moe-bf16,moe-fp8-rowwise,moe-fp8-block,moe-mxfp8,moe-bf16-router``).
MOE_RECIPES = ("moe-fp32", "moe-bf16", "moe-fp8-rowwise", "moe-fp8-block", "moe-mxfp8", "moe-bf16-router")
NOT_IN_DEFAULT_RUN: tuple[str, ...] = ("mxfp8-floor", "fp8-delayed-fp8-weights", "bf16-master-bf16-moments-sr",
                                       "fp8-moments", "int8-moments", "nvfp4-selective", "mxfp8-fwd-nvfp4-bwd",
                                       "fp8-attention", "fp8-attention-current") + MOE_RECIPES


def default_recipes() -> list[str]:
    """The recipes a plain ``mpcourse compare`` runs: every registered one in table order, less ``NOT_IN_DEFAULT_RUN``."""
    return [n for n in RECIPES if n not in NOT_IN_DEFAULT_RUN]


def _apply_table_order() -> None:
    missing = [n for n in RECIPES if n not in TABLE_ORDER]
    unknown = [n for n in TABLE_ORDER if n not in RECIPES]
    if missing or unknown:
        raise RuntimeError(f"recipes/__init__.py TABLE_ORDER is out of date: add {missing}, remove {unknown}")
    ordered = {n: RECIPES[n] for n in TABLE_ORDER}
    RECIPES.clear()
    RECIPES.update(ordered)


_apply_table_order()

__all__ = ["RECIPES", "TABLE_ORDER", "NOT_IN_DEFAULT_RUN", "default_recipes", "MasterWeightsRecipe", "OptimConfig", "TrainingRecipe", "StepResult", "get_recipe",
           "register"]
