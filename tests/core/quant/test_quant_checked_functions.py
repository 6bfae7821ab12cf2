"""A learner's functions ride in the quantization recipe, checked once, where the recipe is made
(``Recipe.__post_init__``: ``quant.recipe.check_functions``).

* A plain dict given as ``functions=`` (or through ``with_functions``) is checked, and a wrong function is refused
  with the same one line naming the fix as before: a name the recipe does not take, a signature the library cannot
  call, a recipe field the lesson's rule does not follow (``Recipe.refusal``).
* It is checked once: for a whole model converted with that recipe, however many layers and however many times
  their quantizers are built (``from_float`` builds them twice); no layer, converter or engine function takes the
  functions as an argument.
* What the check returns (``learner_table.CheckedFunctions``) is taken as it is for the recipe it was checked for,
  and checked again for any other (the record is of what was checked, not a pass).
"""
import dataclasses
import inspect

import pytest
import torch.nn as nn

from mpcourse.core.learner_table import CheckedFunctions, OverrideRefused, check_overrides
from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8Linear, MXFP8BlockScaling,
                                 convert_to_float8_training, quantizers)
from mpcourse.core.quant.engine import quantizer
from mpcourse.core.quant.recipe import check_functions
from learner_fixtures import count_check_overrides


def _compute_scale(amax, fp8_max, margin=0):
    return fp8_max / amax


def _update(history, scale, amax, fp8_max, margin=0, algo="max"):
    return history, scale


def _mx_shared_exponent(amax, elem):
    return amax


@pytest.fixture
def checks(monkeypatch):
    """The ``who`` of every call of ``learner_table.check_overrides``, wherever a module imported it."""
    calls, patched = count_check_overrides(monkeypatch)
    assert {"mpcourse.core.learner_table", "mpcourse.core.quant.recipe"} <= patched   # the count sees the recipe
    return calls


def _model():
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


@pytest.mark.parametrize("recipe,functions,words", [
    (CurrentScaling(), {"update": _update},
     "CurrentScaling cannot use update: it takes compute_scale, quantize; update (lesson 08) goes to DelayedScaling"),
    (CurrentScaling(), {"compute_scale": lambda amax, fp8_max: fp8_max / amax},
     "your compute_scale(amax, fp8_max) cannot be called as the library calls it, compute_scale(amax, fp8_max, "
     "margin) (lesson 07's signature: "),
    (MXFP8BlockScaling(), {"mx_shared_exponent": _mx_shared_exponent},
     "mx_shared_exponent is lesson 09's floor rule: use it with scale_rule='floor' (the mxfp8-floor recipe)"),
    (DelayedScaling(amax_compute_algo=lambda h: h.max()), {"update": _update},
     "update is lesson 08's update (amax_compute_algo 'max' or 'most_recent', the library's scale rule): drop the "
     "callable amax_compute_algo / scaling_factor_compute_algo"),
])
@pytest.mark.parametrize("door", ["field", "with_functions"])
def test_a_plain_dict_is_checked_where_the_recipe_is_made_with_the_fix_named(door, recipe, functions, words):
    with pytest.raises(OverrideRefused) as e:
        if door == "field":
            type(recipe)(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name != "functions"},
                         functions=functions)
        else:
            recipe.with_functions(functions)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def test_the_functions_are_checked_once_however_many_layers_and_builds(checks):
    functions, plain = {"compute_scale": _compute_scale}, CurrentScaling()
    checks.clear()
    recipe = CurrentScaling(functions=functions)
    assert checks == ["CurrentScaling"] and isinstance(recipe.functions, CheckedFunctions)
    assert recipe.functions == functions and recipe == plain and hash(recipe) == hash(plain)   # a recipe is its fields
    model = convert_to_float8_training(_model(), recipe=recipe)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 3 and all(layer.recipe.functions is recipe.functions for layer in layers)
    Float8Linear.from_float(nn.Linear(32, 16), recipe=recipe)                     # builds its quantizers twice
    layer = Float8Linear(32, 16, recipe=recipe)
    layer.load_state_dict(layer.state_dict())
    layer._reset_scaling_state()                                                  # the quantizers built again
    assert checks == ["CurrentScaling"]


@pytest.mark.parametrize("door", [Float8Linear, Float8Linear.from_float, convert_to_float8_training, quantizers,
                                  quantizer], ids=lambda f: f.__qualname__)
def test_no_layer_converter_or_engine_door_takes_the_functions(door):
    assert not {"functions", "overrides"} & set(inspect.signature(door).parameters)


def test_checked_functions_are_taken_as_they_are_for_their_recipe_only(checks):
    floor = MXFP8BlockScaling(scale_rule="floor")
    checked = check_functions(floor, {"mx_shared_exponent": _mx_shared_exponent})
    assert isinstance(checked, CheckedFunctions) and checked.checked_for == floor
    checks.clear()
    assert check_functions(MXFP8BlockScaling(scale_rule="floor"), checked) is checked   # an equal recipe: as it is
    layer = Float8Linear(32, 16, recipe=floor.with_functions(checked))
    assert layer.recipe.functions is checked and checks == []
    # checked for another recipe (rceil), or by a check that knew no recipe: checked again, and refused
    for other in (checked, check_overrides({"mx_shared_exponent": _mx_shared_exponent}, ("mx_shared_exponent",),
                                           "recipe 'x'")):
        with pytest.raises(OverrideRefused, match="mx_shared_exponent is lesson 09's floor rule"):
            MXFP8BlockScaling(functions=other)
    with pytest.raises(OverrideRefused, match="CurrentScaling cannot use mx_shared_exponent"):
        CurrentScaling().with_functions(checked)


@pytest.mark.parametrize("recipe,functions,words", [
    (DelayedScaling(), {"compute_scale": _compute_scale},
     "DelayedScaling cannot use compute_scale: it takes quantize, update; compute_scale (lesson 07) goes to "
     "CurrentScaling"),
    (MXFP8BlockScaling(), {"mx_shared_exponent": _mx_shared_exponent},
     "mx_shared_exponent is lesson 09's floor rule: use it with scale_rule='floor' (the mxfp8-floor recipe)"),
])
def test_a_record_of_the_recipe_from_a_check_without_its_names_or_refusal_is_checked_again(recipe, functions, words):
    """``checked_for`` says which recipe a check was for, not that it was the engine's: a check that accepted other
    names or did not refuse what the recipe's fields refuse does not pass its functions to the quantizers."""
    claimed = check_overrides(functions, tuple(functions), "recipe 'x'", checked_for=recipe)
    assert claimed.checked_for == recipe
    with pytest.raises(OverrideRefused) as e:
        recipe.with_functions(claimed)
    assert str(e.value) == words
