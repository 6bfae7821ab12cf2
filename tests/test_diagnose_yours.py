"""Lesson 12's last cell: fresh runs with a known cause, read by the grader's rule and by the learner's."""
from __future__ import annotations

import pytest

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
