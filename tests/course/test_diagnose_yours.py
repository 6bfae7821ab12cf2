"""Lesson 12's last cell: fresh runs with a known cause, read by the grader's rule and by the learner's."""
from __future__ import annotations

import pytest
import torch

from mpcourse.course.diagnose_yours import SETTINGS, diagnose_yours, fresh_log
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.diagnosis import check_diagnose, reference_diagnose


def test_the_graders_rule_passes_its_own_grader_and_a_constant_does_not():
    check_diagnose(reference_diagnose)                      # every stored real run and every synthetic one
    with pytest.raises(GradingError):
        check_diagnose(lambda log: "healthy")


@pytest.mark.slow
def test_the_fresh_runs_show_the_cause_they_were_built_for():
    for name, s in SETTINGS.items():
        log = fresh_log(name)
        assert reference_diagnose(log) == s.cause, (name, log["final_train_loss"], log["reference_loss"])
    under = fresh_log("underflow")
    assert under["final_train_loss"] > 1.08 * under["reference_loss"]           # far from the 4% threshold
    assert sum(under["grad_zero_fraction"]) / len(under["loss"]) > 0.3            # far from 10%
    spike = fresh_log("spike")["fp8_saturated"]
    assert spike.index(max(spike)) == 12 and max(spike) > 0.05                    # far from 1%, on step 12


@pytest.mark.parametrize("fn,words", [
    (lambda log: "fine", "returned 'fine'; return one of healthy"),
    (lambda log: log["no such key"], "your diagnose raised KeyError"),
    (None, "defines no function diagnose(log)"),
])
def test_a_diagnose_that_cannot_be_compared_is_one_line_naming_it(fn, words):
    lines: list[str] = []
    (d,) = diagnose_yours({} if fn is None else {"diagnose": fn}, ["underflow", "healthy"], echo=lines.append)
    assert d.yours is None and not d.identical and words in d.verdict(), d.verdict()
    assert lines[0].splitlines()[-1].startswith("diagnose [yours]: ") and "Traceback" not in lines[0]


def test_a_different_verdict_names_the_run():
    (d,) = diagnose_yours({"diagnose": lambda log: "healthy"}, ["underflow", "healthy"], echo=None)
    assert d.difference == "first at fp16-master x 2**-12, you said 'healthy' (library 'gradient_underflow')"


def test_bad_arguments_are_refused_before_training():
    with pytest.raises(ValueError, match="non-empty list"):
        diagnose_yours({}, "underflow")
    with pytest.raises(KeyError, match="unknown setting"):
        diagnose_yours({}, ["forward_overflow"])


# -- the amax spike's plant and the saturated fraction (mpcourse.experiment.ablations.failures) --------------------
def _history(recipe, spike, steps=14):
    """A short seeded run of ``recipe`` (steps 0..steps-1, the spike on step 12) logged as the settings are."""
    from dataclasses import replace

    from mpcourse.course import diagnose_yours as dy
    return dy._run(recipe, 1.0, replace(dy.YOURS_CONFIG, steps=steps), spike)["history"]


def test_clamped_counts_what_the_saturating_cast_clamps_on_constructed_values():
    from mpcourse.experiment.ablations.failures import clamped
    above = float(torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)))     # one FP32 ulp above E4M3's max
    x = torch.tensor([448.0, above, 464.0, -above, -448.0, 1e30, float("inf"), float("-inf"), float("nan"), 0.0])
    assert clamped(x, 1.0, 448.0) == 6                          # above, 464, -above, 1e30, +-inf; not 448, NaN, 0
    assert clamped(x / 2, 2.0, 448.0) == 6                      # the product x * scale is what is compared
    assert clamped(torch.tensor([57344.0, 57345.0, 61440.0]), 1.0, 57344.0) == 2       # E5M2's max
    assert clamped(torch.tensor([447.9, 200.0], dtype=torch.bfloat16), 2.0, 448.0) == 1  # read in FP32 first


def test_the_saturation_counter_reads_delayed_scaling_casts_at_the_scale_in_force():
    from mpcourse.core.quant import CurrentScaling, DelayedScaling, convert_to_float8_training
    from mpcourse.core.quant.region import autocast
    from mpcourse.experiment.ablations.failures import SaturationCounter

    class R:                                                  # the one attribute the counter reads of a recipe
        def __init__(self, model):
            self.model = model

    for recipe, want in ((DelayedScaling(), 2 / (8 * 4 + 4 * 4 + 8 * 4)), (CurrentScaling(), None)):
        torch.manual_seed(0)
        model = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(4, 4)), recipe=recipe)
        counter = SaturationCounter(R(model))
        x = torch.rand(8, 4) * 0.1
        x[0, 0], x[3, 2] = 500.0, -1000.0                     # the first step casts at scale 1: |x| > 448 clamps
        with autocast(enabled=True, recipe=recipe):
            y = model(x)
        y.sum().backward()
        assert counter()["fp8_saturated"] == want                # inputs 32, weights 16, output gradients 32
        assert counter()["fp8_saturated"] is None                # read afresh: nothing cast since


def test_the_amax_spike_plant_refuses_what_would_change_fp32():
    from mpcourse.experiment.ablations.failures import plant_amax_spike
    with pytest.raises(ValueError, match="power of two"):
        plant_amax_spike(torch.nn.Module(), factor=100.0)
    with pytest.raises(ValueError, match="counts training steps from 0"):
        plant_amax_spike(torch.nn.Module(), step=-1)


@pytest.mark.slow
def test_the_spike_changes_no_bit_of_fp32_or_current_scaling_and_clamps_under_delayed_scaling():
    for recipe in ("fp32", "fp8-current"):
        plain, hit = _history(recipe, False), _history(recipe, True)
        assert [h["loss"] for h in plain] == [h["loss"] for h in hit], recipe
        assert [h["weight_amax"] for h in plain] == [h["weight_amax"] for h in hit], recipe
        assert all(h["fp8_saturated"] is None for h in hit), recipe             # no delayed-scaling cast
    plain, hit = _history("fp8-delayed", False), _history("fp8-delayed", True)
    assert [h["loss"] for h in plain[:12]] == [h["loss"] for h in hit[:12]]     # the same run until step 12
    sat = [h["fp8_saturated"] for h in hit]
    assert sat[12] > 0.1 and max(sat[:12] + sat[13:]) < 0.002                   # one step clamps 10%: the spike
    assert max(h["fp8_saturated"] for h in plain) < 0.002                       # delayed scaling's usual lag
