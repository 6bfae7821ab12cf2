"""The lesson-09 grader: the reference diagnosis passes every stored and synthetic run; planted wrong ones fail."""
import pytest

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.diagnosis import CAUSES, check_diagnose, real_cases, synthetic_cases, synthetic_log


def reference(log):
    n = len(log["loss"])
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > n / 2:
        return "scale_too_high"
    bad = next((i for i, v in enumerate(log["loss"]) if v is None), None)
    if bad is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(bad)):
            return "gradient_overflow"
        return "optimizer_state"
    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > 0.04 and sum(log["grad_zero_fraction"]) / n > 0.1:
        return "gradient_underflow"
    return "healthy"


def any_inf_grad_is_overflow(log):          # looks at the broken step's own gradients too
    if any(v is None for v in log["loss"]):
        return "gradient_overflow" if any(g is None for g in log["grad_amax"]) else "optimizer_state"
    return reference(log)


def no_scaler_rule(log):                     # never asks how many steps the scaler skipped
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > len(log["loss"]) / 2:
        return "healthy"
    return reference(log)


def wrong_names(log):
    return {"gradient_underflow": "underflow"}.get(reference(log), reference(log))


def test_reference_passes(capsys):
    check_diagnose(reference)
    out = capsys.readouterr().out
    assert out.startswith("PASS diagnose:") and "real runs" in out


def test_every_cause_has_real_and_synthetic_cases():
    real = {c for _, _, c in real_cases()}
    assert real == set(CAUSES), f"the stored real runs lack {set(CAUSES) - real}"
    assert {c for _, _, c in synthetic_cases()} == set(CAUSES)


def test_synthetic_logs_are_deterministic_and_well_formed():
    import random
    a, b = synthetic_log("healthy", random.Random(3)), synthetic_log("healthy", random.Random(3))
    assert a == b
    for _, log, _ in synthetic_cases():
        n = len(log["loss"])
        assert all(len(log[k]) == n for k in ("skipped", "loss_scale", "grad_amax", "grad_zero_fraction"))
    with pytest.raises(ValueError, match="unknown cause"):
        synthetic_log("bad luck", random.Random(0))


@pytest.mark.parametrize("bad, message", [
    (any_inf_grad_is_overflow, "is 'optimizer_state', you said 'gradient_overflow'"),
    (no_scaler_rule, "is 'scale_too_high', you said 'healthy'"),
    (wrong_names, "return one of"),
    (lambda log: "healthy", "you said 'healthy'"),
])
def test_planted_bugs_fail(bad, message):
    with pytest.raises(GradingError, match=message):
        check_diagnose(bad)


def test_stub_fails():
    def diagnose(log):
        raise NotImplementedError
    with pytest.raises(GradingError, match="not implemented"):
        check_diagnose(diagnose)


def test_a_function_that_mutates_the_log_does_not_change_the_cases():
    def greedy(log):
        log["loss"].clear()
        return "healthy"
    with pytest.raises(GradingError):
        check_diagnose(greedy)
    assert all(len(log["loss"]) for _, log, _ in synthetic_cases() + real_cases())
