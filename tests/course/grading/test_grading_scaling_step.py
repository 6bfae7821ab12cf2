"""Lesson 04's whole-step grader (mpcourse.course.grading.scaling_step): it passes a correct step written as a
learner would and rejects planted bugs (stepping on an overflow, clipping before unscaling, an overflow check
on the loss only, no zero_grad, no scale update, a wrong return value) with one line naming the mistake."""
import math

import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.scaling_step import STEP_RUNS, check_scaled_step

FP32_MAX = torch.finfo(torch.float32).max


def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        scale = scale * growth_factor if scale * growth_factor <= FP32_MAX else scale
        growth_tracker = 0
    return scale, growth_tracker


def make_step(*, step_on_overflow=False, clip_first=False, check_loss_only=False, zero_grad=True, update=True,
              ret=lambda found_inf: found_inf):
    """A learner's step; each keyword plants one bug."""
    def scaled_step(loss, optimizer, state, max_norm=1.0, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2000):
        scale = state["scale"]
        (loss * scale).backward()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if clip_first:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        inv_scale = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
        for p in params:
            p.grad.mul_(inv_scale)
        found_inf = not all(bool(torch.isfinite(p.grad).all()) for p in params)
        if check_loss_only:
            found_inf = not bool(torch.isfinite(loss))
        if not found_inf or step_on_overflow:
            if not clip_first:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
        if update:
            state["scale"], state["growth_tracker"] = update_scale(scale, state["growth_tracker"], found_inf,
                                                                  growth_factor, backoff_factor, growth_interval)
        if zero_grad:
            optimizer.zero_grad()
        return ret(found_inf)
    return scaled_step


def test_a_correct_step_passes(capsys):
    check_scaled_step(make_step())
    out = capsys.readouterr().out
    assert out.startswith("PASS scaled_step: 3 runs, 68 steps (14 overflows skipped)")


def test_the_runs_overflow_both_ways():
    """Injected inf/NaN inputs and a scaled backward that overflows by itself: both kinds are in the runs."""
    assert any(inject for *_, inject in STEP_RUNS)
    assert any(not inject and init >= 2.0 ** 100 for _, init, *_, inject in STEP_RUNS)


@pytest.mark.parametrize("bug,match", [
    (dict(step_on_overflow=True),
     r"step 4 of run 'injected inf.*an overflow.*your function called optimizer\.step\(\)"),
    (dict(clip_first=True), r"step 0 of run 'injected.*parameter 0 differs.*clipping before unscaling"),
    # tanh(inf) = 1: the loss is finite, its gradients are NaN
    (dict(check_loss_only=True), r"step 4 of run 'injected.*an overflow.*called optimizer\.step\(\)"),
    (dict(zero_grad=False), r"step 0 of .*gradients are left in \.grad"),
    (dict(update=False), r"step 0 of .*after your step scale=65536\.0, growth_tracker=0; torch\.amp\.GradScaler has "
                         r"scale=65536\.0, growth_tracker=1: call update_scale"),
    (dict(ret=lambda found_inf: None), r"step 0 of .*returned None; return True when the step was skipped"),
], ids=["steps on an overflow", "clips before unscaling", "checks only the loss", "no zero_grad", "no update",
        "returns None"])
def test_a_planted_bug_fails_with_one_line(bug, match):
    with pytest.raises(GradingError, match=f"^FAIL scaled_step: {match}") as e:
        check_scaled_step(make_step(**bug))
    assert "\n" not in str(e.value)


def test_the_stub_says_not_implemented():
    def scaled_step(loss, optimizer, state, max_norm=1.0, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2000):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(GradingError, match="not implemented yet.*YOUR CODE HERE"):
        check_scaled_step(scaled_step)


def test_skipping_a_clean_step_is_named():
    def skips_everything(loss, optimizer, state, *rest):
        (loss * state["scale"]).backward()
        optimizer.zero_grad()
        return True
    with pytest.raises(GradingError, match=r"step 0 of .*no overflow\): your function skipped optimizer\.step\(\)"):
        check_scaled_step(skips_everything)
