"""Which of a learner's functions each recipe takes (``OVERRIDABLE``), against the table of the exercises' functions
(``mpcourse.core.learner_table``), and the one check where a recipe is built: a misspelled name, a recipe that
does not take it, or a wrong signature stops with one line naming the fix (``OverrideRefused``)."""
import re
from pathlib import Path

import pytest

from mpcourse.core import quant
from mpcourse.core.learner_table import EXERCISE_FUNCTIONS, OverrideRefused
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.parallel.data_parallel import ShardedMasterRecipe, overridable
from mpcourse.experiment.recipes import RECIPES, get_recipe
from mpcourse.experiment.recipes.fp8 import QuantizedRecipe

ROOT = Path(__file__).resolve().parents[3]
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


def test_every_recipes_names_are_exercise_functions_the_library_checks():
    taken = set()
    for name, cls in RECIPES.items():
        assert isinstance(cls.OVERRIDABLE, tuple), name
        for fn in cls.OVERRIDABLE:
            assert fn in EXERCISE_FUNCTIONS, f"{name} takes {fn}, which is not in the table"
            assert EXERCISE_FUNCTIONS[fn].returned is not None, f"{name} takes {fn}, whose result nothing checks"
        for parallel in ("ddp", "fsdp"):
            assert set(overridable(cls, parallel)) <= set(cls.OVERRIDABLE)
        if issubclass(cls, QuantizedRecipe):                 # a quant recipe takes what its engine recipe takes
            assert set(cls.OVERRIDABLE) <= set(type(cls.fp8_recipe).TAKES), name
        taken |= set(cls.OVERRIDABLE)
    assert set(ShardedMasterRecipe.OVERRIDABLE) <= taken
    checked = {n for n, e in EXERCISE_FUNCTIONS.items() if e.returned is not None}
    assert checked == taken, f"checked but taken by no recipe: {sorted(checked - taken)}"


def test_the_docs_table_says_which_recipes_take_each_function():
    """docs/training-with-your-code.md: one row per function a recipe takes, with its lesson and every recipe."""
    rows = [r for r in (ROOT / "docs" / "training-with-your-code.md").read_text().splitlines()
            if re.match(r"\| \d\d \|", r)]
    said = {}
    for row in rows:
        lesson, functions, recipes = [c.strip() for c in row.strip("|").split("|")[:3]]
        for fn in re.findall(r"`(\w+)`", functions):
            said[fn] = (lesson, set(re.findall(r"`([\w-]+)`", recipes)))
    want = {fn: (EXERCISE_FUNCTIONS[fn].lesson, {r for r, cls in RECIPES.items() if fn in cls.OVERRIDABLE})
            for fn in {n for cls in RECIPES.values() for n in cls.OVERRIDABLE}}
    assert said == want


def _update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    return scale, growth_tracker


@pytest.mark.parametrize("recipe,overrides,words", [
    ("fp16-dynamic", {"updat_scale": _update_scale},
     "updat_scale is not one of the exercises' functions (did you mean update_scale?); recipe 'fp16-dynamic' takes "
     "round_to_fp16, make_master, unscale_grads_, update_scale, all_reduce_found_inf_"),
    ("fp32", {"update_scale": _update_scale},
     "recipe 'fp32' cannot use update_scale: it takes none; update_scale (lesson 04) goes to fp16-dynamic"),
    ("mxfp8", {"mx_shared_exponent": lambda amax, elem: amax},
     "recipe 'mxfp8' cannot use mx_shared_exponent: it takes none; mx_shared_exponent (lesson 09) goes to mxfp8-floor"),
    ("fp16-dynamic", {"update_scale": lambda scale, growth_tracker: (scale, 0)},
     "your update_scale(scale, growth_tracker) cannot be called as the library calls it, update_scale(scale, "
     "growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval) (lesson 04's signature: "),
    ("fp8-current", {"compute_scale": lambda amax, fp8_max: fp8_max / amax},
     "your compute_scale(amax, fp8_max) cannot be called as the library calls it, compute_scale(amax, fp8_max, "
     "margin) (lesson 07's signature: "),
    ("bf16-pure-kahan", {"kahan_add_": "not a function"}, "kahan_add_ must be a function (def kahan_add_(w: "),
])
def test_a_wrong_function_is_one_line_where_the_recipe_is_built(recipe, overrides, words):
    with pytest.raises(OverrideRefused) as e:
        get_recipe(recipe).with_functions(overrides)(GPT(TINY))
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def test_a_right_function_is_taken_wrapped_and_named():
    recipe = get_recipe("fp16-dynamic").with_functions({"update_scale": _update_scale})(GPT(TINY))
    assert list(recipe.overrides) == ["update_scale"] and recipe.overrides["update_scale"].__wrapped__ is _update_scale
