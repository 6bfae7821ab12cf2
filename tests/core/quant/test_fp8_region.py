"""The FP8 region's two spellings, Transformer Engine 2.x ``autocast(enabled, recipe, amax_reduction_group)``
and 1.x ``fp8_autocast(enabled, fp8_recipe, fp8_group)``: run side by side, they must give the same outputs,
gradients, scales and amax histories, step after step."""
import copy

import pytest
import torch
import torch.nn as nn

from mpcourse.core.quant import (DelayedScaling, Float8Linear, autocast, convert_to_float8_training, fp8_autocast,
                                 get_fp8_recipe, is_fp8_enabled)


def _model(recipe):
    torch.manual_seed(0)
    return convert_to_float8_training(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), recipe=recipe)


def _step(model, region, x):
    with region():
        y = model(x)                                                   # (M, 16) fp32
    y.square().mean().backward()
    out = [y.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def _states(model):
    return [(s.scale.clone(), s.amax_history.clone()) for m in model.modules() if isinstance(m, Float8Linear)
            for s in m.scaling_state.values()]


def test_autocast_and_fp8_autocast_are_the_same_region():
    recipe = DelayedScaling(amax_history_len=4)
    new, old = _model(recipe), _model(recipe)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 32, generator=g) * 3
        a = _step(new, lambda: autocast(enabled=True, recipe=recipe, amax_reduction_group=None), x)
        b = _step(old, lambda: fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None), x)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        for (s1, h1), (s2, h2) in zip(_states(new), _states(old)):
            assert torch.equal(s1, s2) and torch.equal(h1, h2)
    assert any(float(s) != 1.0 for s, _ in _states(new))              # the scales did move: the test can fail


def test_disabled_region_and_recipe_visibility_agree():
    recipe = DelayedScaling(amax_history_len=4)
    model, plain = _model(recipe), copy.deepcopy(_model(recipe))
    x = torch.randn(8, 32)
    with autocast(enabled=False):
        assert not is_fp8_enabled()
        y_new = model(x)
    with fp8_autocast(enabled=False):
        y_old = model(x)
    want = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, plain[0].weight, plain[0].bias)),
                                plain[2].weight, plain[2].bias)
    assert torch.equal(y_new, want) and torch.equal(y_old, want)
    with autocast(recipe=recipe):
        assert get_fp8_recipe() is recipe
        with fp8_autocast():                                           # inner region keeps the outer recipe
            assert get_fp8_recipe() is recipe
    assert get_fp8_recipe() is None


def test_bad_recipe_names_the_keyword_of_each_spelling():
    with pytest.raises(TypeError, match="recipe must be"):
        with autocast(recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="fp8_recipe must be"):
        with fp8_autocast(fp8_recipe="delayed"):
            pass
