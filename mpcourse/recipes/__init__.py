"""Registry of precision recipes for ``mpcourse compare`` (see ``base.py`` for the interface).

Importing this package registers every recipe; the order below is the order of the compare table.
"""
from .base import RECIPES, OptimConfig, Recipe, StepResult, get_recipe, register
from . import baseline  # noqa: F401  fp32, torch-amp-bf16, torch-amp-fp16, fp16-pure

__all__ = ["RECIPES", "OptimConfig", "Recipe", "StepResult", "get_recipe", "register"]
