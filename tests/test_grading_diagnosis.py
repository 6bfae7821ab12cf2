"""The lesson-12 grader: the reference diagnosis passes every stored and synthetic run; planted wrong ones fail,
each with a hint that names its fault."""
import pytest

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.diagnosis import (CAUSES, DISTRACTORS, SYNTHETIC_ONLY, check_diagnose, real_cases,
                                               reference_diagnose, synthetic_cases, synthetic_log)


def reference(log):                          # written out again here: the oracle the planted bugs deviate from
    n = len(log["loss"])
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > n / 2:
        return "scale_too_high"
    bad = next((i for i, v in enumerate(log["loss"]) if v is None), None)
    if bad is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(bad)):
            return "gradient_overflow"
        if any(log["weight_amax"][j] is None for j in range(bad)):
            return "optimizer_state"
        return "forward_overflow"
    if any(s is not None and s > 0.01 for s in log["fp8_saturated"]):
        return "fp8_amax_spike"
    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > 0.04 and sum(log["grad_zero_fraction"]) / n > 0.1:
        return "gradient_underflow"
    return "healthy"


def _finite_part(log, underflow):
    """The reference, with the finite-run branch replaced by ``underflow(log) -> bool``."""
    r = reference(log)
    if r in ("gradient_underflow", "healthy"):
        return "gradient_underflow" if underflow(log) else "healthy"
    return r


# -- planted wrong diagnoses: each a mistake a learner makes ------------------------------------------------------
def zeros_alone_is_underflow(log):           # never separates the two underflow symptoms: zeros only
    return _finite_part(log, lambda l: sum(l["grad_zero_fraction"]) / len(l["loss"]) > 0.1)


def gap_alone_is_underflow(log):             # never separates them the other way: a loss above reference only
    return _finite_part(log, lambda l: l["final_train_loss"] / l["reference_loss"] - 1 > 0.04)


def any_exact_zero_is_underflow(log):        # treats any exact zero as underflow
    return _finite_part(log, lambda l: any(z > 0 for z in l["grad_zero_fraction"]))


def any_loss_above_reference_is_underflow(log):   # no margin, no zeros: any loss above the reference
    return _finite_part(log, lambda l: l["final_train_loss"] > l["reference_loss"])


def one_skip_is_overflow_death(log):         # reads a skipped step's inf gradient as the overflow that killed it
    r = reference(log)
    if r == "optimizer_state" and any(log["skipped"]):
        return "gradient_overflow"
    return r


def any_inf_grad_is_overflow(log):           # looks at the broken step's own gradients too
    if any(v is None for v in log["loss"]):
        return "gradient_overflow" if any(g is None for g in log["grad_amax"]) else "optimizer_state"
    return reference(log)


def no_skip_count(log):                      # never asks how many steps the scaler skipped
    if log["loss_scale"][0] is not None and sum(log["skipped"]) > len(log["loss"]) / 2:
        return "healthy"
    return reference(log)


def falling_scale_is_too_high(log):          # reads the scale instead of the skips: a backed-off scale is "too high"
    if log["loss_scale"][0] is not None and log["loss_scale"][-1] < log["loss_scale"][0]:
        return "scale_too_high"
    return reference(log)


def never_reads_weights(log):                # a non-finite loss without an unskipped inf gradient: always the optimizer
    r = reference(log)
    return "optimizer_state" if r == "forward_overflow" else r


def every_silent_death_is_forward(log):      # never reads weight_amax: no inf gradient means the forward
    r = reference(log)
    return "forward_overflow" if r == "optimizer_state" else r


def ignores_fp8_saturation(log):             # never reads fp8_saturated
    r = reference({**log, "fp8_saturated": [None] * len(log["loss"])})
    return r


def any_saturation_is_a_spike(log):          # delayed scaling's usual lag of a few clamped elements called a spike
    if any(s for s in log["fp8_saturated"] if s is not None) and not any(v is None for v in log["loss"]):
        return "fp8_amax_spike"
    return reference(log)


def wrong_names(log):
    return {"gradient_underflow": "underflow"}.get(reference(log), reference(log))


PLANTED = [
    (zeros_alone_is_underflow, "is 'healthy', you said 'gradient_underflow'", "many exact zeros alone are not underflow"),
    (gap_alone_is_underflow, "is 'healthy', you said 'gradient_underflow'", "a final loss above the reference alone"),
    (any_exact_zero_is_underflow, "is 'healthy', you said 'gradient_underflow'", "not underflow"),
    (any_loss_above_reference_is_underflow, "is 'healthy', you said 'gradient_underflow'", "not underflow"),
    (one_skip_is_overflow_death, "is 'optimizer_state', you said 'gradient_overflow'", "SKIPPED step never reached"),
    (any_inf_grad_is_overflow, "is 'optimizer_state', you said 'gradient_overflow'", "SKIPPED step never reached"),
    (no_skip_count, "is 'scale_too_high', you said 'healthy'", "count the skipped steps"),
    (falling_scale_is_too_high, "is 'healthy', you said 'scale_too_high'", "do not read the scale's fall"),
    (never_reads_weights, "is 'forward_overflow', you said 'optimizer_state'", "the forward itself overflowed"),
    (every_silent_death_is_forward, "is 'optimizer_state', you said 'forward_overflow'", "look at weight_amax"),
    (ignores_fp8_saturation, "is 'fp8_amax_spike', you said ", "look at fp8_saturated"),
    (any_saturation_is_a_spike, "is 'healthy', you said 'fp8_amax_spike'", "delayed scaling's usual lag"),
    (wrong_names, "return one of", ""),
    (lambda log: "healthy", "you said 'healthy'", ""),
]


@pytest.mark.parametrize("bad, message, hint", PLANTED, ids=[getattr(b, "__name__", "const") for b, _, _ in PLANTED])
def test_planted_bugs_fail_with_a_hint_naming_the_fault(bad, message, hint):
    with pytest.raises(GradingError, match=message) as e:
        check_diagnose(bad)
    assert hint in str(e.value), str(e.value)


def test_reference_passes_and_agrees_with_the_library_rule(capsys):
    check_diagnose(reference)
    out = capsys.readouterr().out
    assert out.startswith("PASS diagnose:") and "real runs" in out
    for _, log, _ in real_cases() + synthetic_cases():
        assert reference(log) == reference_diagnose(log)


def test_every_cause_has_real_and_synthetic_cases():
    real = {c for _, _, c in real_cases()}
    assert real == set(CAUSES) - set(SYNTHETIC_ONLY), f"the stored real runs lack {set(CAUSES) - real}"
    assert {c for _, _, c in synthetic_cases()} == set(CAUSES)
    names = [n for n, _, c in real_cases() + synthetic_cases() if c in SYNTHETIC_ONLY]
    assert names and all(n.startswith("synthetic ") for n in names)      # labelled as such


def test_distractors_are_present_and_far_from_the_thresholds():
    import random
    rng = random.Random(5)
    for _ in range(20):
        z = synthetic_log("zeros_but_healthy", rng)
        assert sum(z["grad_zero_fraction"]) / len(z["loss"]) > 0.3
        assert abs(z["final_train_loss"] / z["reference_loss"] - 1) < 0.016
        g = synthetic_log("gap_without_zeros", rng)
        assert g["final_train_loss"] / g["reference_loss"] - 1 > 0.079 and max(g["grad_zero_fraction"]) < 0.005
        s = synthetic_log("skip_then_optimizer_state", rng)
        k = s["loss"].index(None)
        assert any(s["skipped"][:k]) and s["weight_amax"][k - 1] is None
    assert set(DISTRACTORS.values()) <= set(CAUSES)


def test_synthetic_logs_are_deterministic_and_well_formed():
    import random
    a, b = synthetic_log("healthy", random.Random(3)), synthetic_log("healthy", random.Random(3))
    assert a == b
    keys = ("skipped", "loss_scale", "grad_amax", "grad_zero_fraction", "weight_amax", "fp8_saturated")
    for _, log, _ in synthetic_cases() + real_cases():
        n = len(log["loss"])
        assert all(len(log[k]) == n for k in keys)
    with pytest.raises(ValueError, match="unknown cause"):
        synthetic_log("bad luck", random.Random(0))


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
