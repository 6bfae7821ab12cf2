"""A learner's functions are checked once on their way to a quantizer (``engine.check_functions``).

* A plain dict handed to ``Float8Linear``, ``convert_to_float8_training`` or ``quantizers`` is checked, and a wrong
  function is refused with the same one line naming the fix as before: a name the recipe does not take, a signature
  the library cannot call, a recipe field the lesson's rule does not follow (``engine.rule_refusal``).
* It is checked once: for a whole model converted with one dict, and once per layer built directly, however many
  times the layer's quantizers are built (``from_float`` builds them twice).
* What the check returns (``learner_table.CheckedFunctions``) is taken as it is by the engine for the recipe it was
  checked for, and checked again for any other (the record is of what was checked, not a pass).
"""

import pytest
import torch.nn as nn

from mpcourse.core.learner_table import CheckedFunctions, OverrideRefused, check_overrides
from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8Linear, MXFP8BlockScaling,
                                 convert_to_float8_training, fp8_autocast, quantizers)
from mpcourse.core.quant.engine import check_functions
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
    assert {"mpcourse.core.learner_table", "mpcourse.core.quant.engine"} <= patched   # the count sees the engine
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
@pytest.mark.parametrize("door", ["Float8Linear", "convert_to_float8_training", "quantizers"])
def test_a_plain_dict_is_still_checked_with_the_fix_named(door, recipe, functions, words):
    with pytest.raises(OverrideRefused) as e:
        if door == "Float8Linear":
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                Float8Linear(32, 16, recipe=recipe, functions=functions)
        elif door == "convert_to_float8_training":
            convert_to_float8_training(_model(), recipe=recipe, functions=functions)
        else:
            quantizers(recipe, functions=functions)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def test_a_plain_dict_is_checked_once_for_a_converted_model_and_once_per_layer_built(checks):
    functions = {"compute_scale": _compute_scale}
    model = convert_to_float8_training(_model(), recipe=CurrentScaling(), functions=functions)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 3 and checks == ["CurrentScaling"]
    assert all(layer.functions is layers[0].functions for layer in layers)       # the one checked mapping
    assert isinstance(layers[0].functions, CheckedFunctions) and layers[0].functions == functions
    checks.clear()
    Float8Linear.from_float(nn.Linear(32, 16), recipe=CurrentScaling(), functions=functions)   # builds twice
    assert checks == ["CurrentScaling"]
    checks.clear()
    layer = Float8Linear(32, 16, recipe=CurrentScaling(), functions=functions)
    layer.load_state_dict(layer.state_dict())
    layer._reset_scaling_state()                                                  # the quantizers built again
    assert checks == ["CurrentScaling"]


def test_checked_functions_are_taken_as_they_are_for_their_recipe_only(checks):
    floor = MXFP8BlockScaling(scale_rule="floor")
    checked = check_functions(floor, {"mx_shared_exponent": _mx_shared_exponent})
    assert isinstance(checked, CheckedFunctions) and checked.checked_for == floor
    checks.clear()
    assert check_functions(MXFP8BlockScaling(scale_rule="floor"), checked) is checked   # an equal recipe: as it is
    layer = Float8Linear(32, 16, recipe=floor, functions=checked)
    quantizers(floor, functions=checked)
    assert layer.functions is checked and checks == []
    # checked for another recipe (rceil), or by a check that knew no recipe: checked again, and refused
    for other in (checked, check_overrides({"mx_shared_exponent": _mx_shared_exponent}, ("mx_shared_exponent",),
                                           "recipe 'x'")):
        with pytest.raises(OverrideRefused, match="mx_shared_exponent is lesson 09's floor rule"):
            Float8Linear(32, 16, recipe=MXFP8BlockScaling(), functions=other)
    with pytest.raises(OverrideRefused, match="CurrentScaling cannot use mx_shared_exponent"):
        quantizers(CurrentScaling(), functions=checked)


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
    for door in (lambda: Float8Linear(32, 16, recipe=recipe, functions=claimed),
                 lambda: convert_to_float8_training(_model(), recipe=recipe, functions=claimed),
                 lambda: quantizers(recipe, functions=claimed)):
        with pytest.raises(OverrideRefused) as e:
            door()
        assert str(e.value) == words
