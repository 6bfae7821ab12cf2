"""A quantized TrainingRecipe checks the learner's functions once, where it is built (``checked_overrides``): the
names, the signatures and the quantization recipe's refusal for its fields (``Recipe.refusal``). The quantization
recipe that carries them to every layer (``QuantizedRecipe.quantization()``) takes what that check returned
(``learner_table.CheckedFunctions``) as it is: one check across building the recipe and training it, with the
learner's functions run by every step."""
import functools

import pytest
import torch

from mpcourse.core.learner_table import CheckedFunctions, OverrideRefused, exercise_names
from mpcourse.core.quant import DelayedScaling, Float8Linear, MXFP8BlockScaling
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.experiment.recipes.fp8 import QuantizedRecipe
from recipe_loop import run_steps
from learner_fixtures import count_check_overrides, fp8_solution_functions

SMALL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
WIDE = GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=128)   # fp8-block: 128 x 128 weight blocks, 128 tokens
B = 2
#: each quantized recipe that takes a learner's functions, and those it takes
TAKING = {"fp8-current": ("compute_scale", "quantize"), "fp8-delayed": ("quantize", "update"),
          "fp8-block": ("block_quantize",), "mxfp8-floor": ("mx_shared_exponent",), "nvfp4": ("nvfp4_scales",),
          "nvfp4-selective": ("nvfp4_scales",)}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def solutions():
    return fp8_solution_functions()


@pytest.fixture
def checks(monkeypatch):
    """The ``who`` of every call of ``learner_table.check_overrides``, wherever a module imported it."""
    calls, patched = count_check_overrides(monkeypatch)
    assert {"mpcourse.core.quant.recipe", "mpcourse.experiment.recipes.base"} <= patched
    return calls


def _counted(name, fn, calls):
    @functools.wraps(fn)
    def call(*args):
        calls[name] += 1
        return fn(*args)
    return call


@pytest.mark.parametrize("name", sorted(TAKING))
def test_a_quantized_recipe_checks_the_learners_functions_once_across_building_and_training(
        name, corpus, solutions, checks):
    assert get_recipe(name).OVERRIDABLE == TAKING[name]
    calls = dict.fromkeys(TAKING[name], 0)
    overrides = {fn: _counted(fn, solutions[fn], calls) for fn in TAKING[name]}
    cfg = WIDE if name == "fp8-block" else SMALL
    torch.manual_seed(0)
    recipe = get_recipe(name).with_functions(overrides)(
        GPT(GPTConfig(**{**cfg.__dict__, "vocab_size": corpus.vocab_size})), OptimConfig())
    assert checks == [f"recipe {name!r}"]                  # built: checked once, by the recipe, for all its layers
    layers = [m for m in recipe.model.modules() if isinstance(m, Float8Linear)]
    assert layers and all(layer.recipe.functions is recipe.overrides for layer in layers)
    assert isinstance(recipe.overrides, CheckedFunctions) and recipe.overrides.checked_for == recipe.fp8_recipe
    run_steps(recipe, corpus, torch.Generator().manual_seed(0), 3, block_size=cfg.block_size, batch_size=B)
    assert checks == [f"recipe {name!r}"]                  # and never again while it trains
    assert all(calls.values()), calls                     # every function ran: the count is over real training


PREPARED = []


class _RceilTakingTheFloorRule(QuantizedRecipe):
    """Not registered: a recipe that takes lesson 09's floor rule under a recipe whose scale_rule is not floor."""
    name = "mxfp8-rceil-floor-rule"
    fp8_recipe = MXFP8BlockScaling()
    OVERRIDABLE = exercise_names("mx_shared_exponent")

    def prepare_model(self, model):
        PREPARED.append(self.name)
        return super().prepare_model(model)


def test_the_engines_refusal_for_the_recipes_fields_runs_where_the_recipe_is_built(checks):
    PREPARED.clear()
    with pytest.raises(OverrideRefused) as e:
        _RceilTakingTheFloorRule.with_functions({"mx_shared_exponent": lambda amax, elem: amax})(GPT(SMALL))
    assert str(e.value) == ("mx_shared_exponent is lesson 09's floor rule: use it with scale_rule='floor' (the "
                            "mxfp8-floor recipe)")
    assert PREPARED == [] and checks == ["recipe 'mxfp8-rceil-floor-rule'"]     # refused before any layer is built


class _DelayedTakingCurrentScalingsRule(QuantizedRecipe):
    """Not registered: a recipe whose ``OVERRIDABLE`` names a function its ``fp8_recipe``'s class does not take
    (lesson 07's ``compute_scale``, which delayed scaling's quantizers never call)."""
    name = "fp8-delayed-taking-compute-scale"
    fp8_recipe = DelayedScaling(amax_history_len=4)
    OVERRIDABLE = exercise_names("compute_scale")


def test_a_function_the_quantization_recipe_does_not_take_is_refused_not_dropped():
    """The recipe's check passes ``compute_scale`` (its ``OVERRIDABLE`` names it) and records the delayed recipe;
    the engine, which takes quantize and update for it, refuses it rather than building quantizers that would
    silently train the library's rule in its place."""
    with pytest.raises(OverrideRefused) as e:
        _DelayedTakingCurrentScalingsRule.with_functions({"compute_scale": lambda amax, fp8_max, margin=0:
                                                          fp8_max / amax})(GPT(SMALL))
    assert str(e.value) == ("DelayedScaling cannot use compute_scale: it takes quantize, update; compute_scale "
                            "(lesson 07) goes to CurrentScaling")
