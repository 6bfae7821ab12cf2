"""Registry of precision recipes for ``mpcourse compare`` (see ``base.py`` for the interface).

Importing this package registers every recipe; the order below is the order of the compare table.
"""
from .base import RECIPES, OptimConfig, Recipe, StepResult, get_recipe, register
from . import baseline  # noqa: F401  fp32, torch-amp-bf16, torch-amp-fp16, fp16-pure
from . import fp16  # noqa: F401  fp16-master, fp16-static, fp16-dynamic
from . import bf16  # noqa: F401  bf16-autocast, bf16-master, bf16-pure, bf16-pure-sr, bf16-pure-kahan
from . import fp8  # noqa: F401  fp8-current, fp8-delayed

__all__ = ["RECIPES", "OptimConfig", "Recipe", "StepResult", "get_recipe", "register"]
