"""FP8 recipes (mpcourse.core.quant.recipe) against Transformer Engine's published rules.

Oracle: the delayed-scaling update of TE ``transformer_engine/pytorch/quantization.py``
(``_default_get_amax_and_update_history``, ``_update_amax_history``, ``_default_sf_compute``), written out
below in numpy, and the worked example of REFERENCE.md; field names and defaults of TE
``common/recipe/__init__.py``.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, DelayedScalingState, Float8CurrentScaling, Float8Linear,
                          Format, amax_and_scale_update, fp8_autocast, fp8_format_for)

NAN, INF = float("nan"), float("inf")
F32_MAX = np.finfo(np.float32).max


def te_update(history: np.ndarray, scale: float, fp8_max: float, margin: int, algo: str):
    """TE's unfused delayed-scaling update in numpy (the oracle)."""
    history = history.astype(np.float32)
    amax = history.max() if algo == "max" else history[0]  # np.max propagates NaN, like torch.max
    new_history = np.roll(history, -1)
    new_history[0] = 0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        sf = (np.float32(fp8_max) / np.float32(amax)) / np.float32(2.0 ** margin)
    if not (amax > 0 and np.isfinite(amax)):
        sf = np.float32(scale)
    if np.isinf(sf):
        sf = F32_MAX
    return new_history, np.float32(sf)


def update(history, scale=1.0, fp8_max=448.0, margin=0, algo="max"):
    h, s = amax_and_scale_update(torch.tensor(history, dtype=torch.float32), torch.tensor(scale), fp8_max, margin, algo)
    return h.tolist(), float(s)


def test_te_field_names_and_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.scaling_factor_compute_algo,
            r.reduce_amax) == (0, Format.HYBRID, 1024, "max", None, True)
    # TE's fields, nothing else, beside the keyword-only field that carries a learner's functions
    assert [f.name for f in dataclasses.fields(DelayedScaling) if not f.kw_only] == [
        "margin", "fp8_format", "amax_history_len", "amax_compute_algo", "scaling_factor_compute_algo", "reduce_amax"]
    assert [f.name for f in dataclasses.fields(CurrentScaling) if not f.kw_only] == [
        "fp8_format", "use_power_2_scales", "amax_epsilon"]
    assert [f.name for f in dataclasses.fields(DelayedScaling) if f.kw_only] == ["functions"]
    assert CurrentScaling().fp8_format is Format.HYBRID and Float8CurrentScaling is CurrentScaling
    assert (Format.E4M3.max_fwd, Format.E4M3.max_bwd) == (448.0, 448.0)
    assert (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd) == (448.0, 57344.0)
    assert (Format.E5M2.max_fwd, Format.E5M2.max_bwd) == (57344.0, 57344.0)


def test_hybrid_picks_e5m2_for_gradients_only():
    hybrid, e4m3 = DelayedScaling(), DelayedScaling(fp8_format=Format.E4M3)
    assert [fp8_format_for(hybrid, r) for r in ("input", "weight", "grad_output")] == ["e4m3", "e4m3", "e5m2"]
    assert [fp8_format_for(e4m3, r) for r in ("input", "weight", "grad_output")] == ["e4m3"] * 3
    with pytest.raises(ValueError, match="role"):
        fp8_format_for(hybrid, "bias")


@pytest.mark.parametrize("recipe_cls", [DelayedScaling, CurrentScaling])
def test_pure_e5m2_is_refused(recipe_cls):
    with pytest.raises(ValueError, match="Pure E5M2 training is not supported.*Format.HYBRID"):
        recipe_cls(fp8_format=Format.E5M2)


def test_bad_recipe_fields_raise():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(TypeError, match="margin"):
        DelayedScaling(margin=0.5)
    with pytest.raises(TypeError, match="fp8_format"):
        DelayedScaling(fp8_format="e4m3")
    with pytest.raises(ValueError, match="amax_epsilon"):
        CurrentScaling(amax_epsilon=-1.0)


def test_worked_example():
    # REFERENCE.md: E4M3, margin 0, L = 4, history [5, 1, 2, 3] -> scale 89.6, history [0, 2, 3, 5].
    h, s = update([5, 1, 2, 3])
    assert h == [0, 2, 3, 5] and s == np.float32(448 / 5) and s == pytest.approx(89.6)
    assert update([5, 1, 2, 3], margin=1)[1] == pytest.approx(44.8)
    assert update([5, 1, 2, 3], margin=1)[1] == np.float32(448 / 5) / 2


def test_most_recent_uses_slot_zero_max_uses_the_window():
    assert update([2, 8, 1, 1], algo="most_recent")[1] == np.float32(448 / 2)
    assert update([2, 8, 1, 1], algo="max")[1] == np.float32(448 / 8)
    # the amax is taken before the roll: the entry that falls out (index 1) still counts this time
    assert update([1, 8, 0, 0])[1] == np.float32(448 / 8)


@pytest.mark.parametrize("history", [[0, 0, 0, 0], [INF, 1, 2, 3], [NAN, 1, 2, 3], [1, 2, NAN, 3]])
def test_degenerate_amax_keeps_previous_scale(history):
    h, s = update(history, scale=2.0)
    assert s == 2.0
    assert h[0] == 0 and len(h) == 4


def test_nan_in_window_freezes_scale_until_it_rolls_out():
    # Policy (TE's PyTorch path): torch.max propagates NaN, so the scale is kept while the NaN is in the window.
    state = DelayedScalingState(3)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3)
    scales = []
    for amax in [4.0, NAN, 2.0, 2.0, 2.0]:
        state.record(torch.tensor(amax))
        state.update(448.0, recipe)
        scales.append(float(state.scale))
    assert scales == [112.0, 112.0, 112.0, 112.0, 224.0]


def test_tiny_amax_gives_fp32_max_not_inf():
    h, s = update([1e-40, 0, 0, 0])
    assert math.isfinite(s) and s == F32_MAX


def test_state_starts_at_scale_one_and_zero_history():
    s = DelayedScalingState(5)
    assert float(s.scale) == 1.0 and s.amax_history.tolist() == [0.0] * 5
    assert s.scale.dtype == torch.float32 and s.amax_history.dtype == torch.float32


def test_zero_history_keeps_scale_two():
    s = DelayedScalingState(4)
    s.scale.fill_(2.0)
    s.update(448.0, DelayedScaling(amax_history_len=4))
    assert float(s.scale) == 2.0


def test_micro_batches_are_max_reduced_into_one_entry():
    s = DelayedScalingState(4)
    for amax in (3.0, 7.0, 5.0):  # three micro-batches of one step
        s.record(torch.tensor(amax))
    assert s.amax_history.tolist() == [7.0, 0, 0, 0]
    s.update(448.0, DelayedScaling(amax_history_len=4))
    assert s.amax_history.tolist() == [0, 0, 0, 7.0] and float(s.scale) == 64.0


def test_callable_algorithms_are_used():
    seen = {}

    def mean_amax(history):
        return history.mean()

    def sf(amax, scale, fp8_max, recipe):
        seen["recipe"] = recipe
        return torch.as_tensor(fp8_max / float(amax) / 4)

    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=mean_amax, scaling_factor_compute_algo=sf)
    s = DelayedScalingState(4)
    s.amax_history.copy_(torch.tensor([4.0, 2.0, 2.0, 0.0]))
    s.update(448.0, recipe)
    assert float(s.scale) == 448.0 / 2.0 / 4 and seen["recipe"] is recipe


@settings(max_examples=150, deadline=None, database=None)
@given(history=st.lists(st.one_of(st.floats(0, 1e6, width=32), st.sampled_from([0.0, INF, NAN, 1e-40, 3e38])),
                        min_size=1, max_size=8),
       scale=st.floats(0.0009765625, 1048576.0, width=32), margin=st.integers(-2, 4),
       algo=st.sampled_from(["max", "most_recent"]), fmt=st.sampled_from([448.0, 57344.0]))
def test_update_matches_te_oracle(history, scale, margin, algo, fmt):
    h, s = amax_and_scale_update(torch.tensor(history, dtype=torch.float32), torch.tensor(scale), fmt, margin, algo)
    want_h, want_s = te_update(np.array(history, np.float32), scale, fmt, margin, algo)
    np.testing.assert_array_equal(h.numpy(), want_h)
    assert float(s) == float(want_s)


@pytest.mark.parametrize("margin, want", [(0, 56.0), (1, 28.0)])
def test_module_with_amax_8_every_step(margin, want):
    # History length 4, "max", margin 0 -> scale 448 / 8 = 56; margin 1 halves it.
    recipe = DelayedScaling(margin=margin, amax_history_len=4, amax_compute_algo="max")
    layer = Float8Linear(16, 16, recipe=recipe)
    x = torch.full((4, 16), 8.0)
    x[0, 0] = -8.0
    for step in range(6):
        with fp8_autocast(fp8_recipe=recipe):
            layer(x).sum().backward()
        assert float(layer.scaling_state["input"].scale) == want
    assert layer.scaling_state["input"].amax_history.tolist() == [0.0, 8.0, 8.0, 8.0]
