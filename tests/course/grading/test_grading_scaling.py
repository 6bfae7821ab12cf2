"""The graders of lessons 03-04 (mpcourse.course.grading.scaling): they pass correct implementations and reject
plausible wrong ones with a message that points at the mistake.

Correct implementations: small references written here (as a learner would), and the library where it has
the piece (mpcourse.core.scaling.DynamicLossScaler drives update_scale). Planted bugs: growth one step late (on the
(growth_interval+1)-th clean step), growth without the FP32 finiteness check at 2**127, backoff without
resetting the tracker, a scale off by one power of two, ``<`` instead of ``<=``, division instead of
multiplication by inv_scale, isinf instead of isfinite, FP16 gradients accepted or half-modified before the
refusal.
"""
import math

import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading import scaling as grading
from mpcourse.core.scaling import DynamicLossScaler

FP32_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------------------------------------
# choose_loss_scale
# ----------------------------------------------------------------------------------------------------------
def choose_ref(grad_abs_max, fmt_max=65504.0, margin=0):
    if not (math.isfinite(grad_abs_max) and grad_abs_max > 0):
        raise ValueError(f"grad_abs_max must be positive and finite, got {grad_abs_max}")
    k = math.floor(math.log2(fmt_max / (grad_abs_max * 2.0 ** margin)))
    s = 2.0 ** k
    while s * grad_abs_max * 2.0 ** margin > fmt_max:          # log2 may land just above an integer
        s /= 2
    while 2 * s * grad_abs_max * 2.0 ** margin <= fmt_max:
        s *= 2
    return s


def test_choose_passes_reference(capsys):
    grading.check_choose_loss_scale(choose_ref)
    assert capsys.readouterr().out.startswith("PASS choose_loss_scale:")


def test_choose_oracle_facts():
    assert grading.exact_loss_scale(0.428) == 2.0 ** 17
    assert grading.exact_loss_scale(1.0) == 2.0 ** 15
    assert grading.exact_loss_scale(65504.0 / 65536) == 2.0 ** 16      # equality allowed
    assert grading.exact_loss_scale(1e5) == 0.5
    assert grading.exact_loss_scale(12.5, 448.0) == 32.0
    assert grading.exact_loss_scale(3.0, margin=3) == 2.0 ** 11       # 2**11 * 3 * 8 = 49152


def test_choose_rejects_one_power_too_large():
    def ceil_version(g, fmt_max=65504.0, margin=0):
        choose_ref(g)                                                    # same errors
        return 2.0 ** math.ceil(math.log2(fmt_max / (g * 2.0 ** margin)))
    with pytest.raises(GradingError, match=r"one power of two too large.*would overflow"):
        grading.check_choose_loss_scale(ceil_version)


def test_choose_rejects_one_power_too_small():
    def minus_one(g, fmt_max=65504.0, margin=0):
        return choose_ref(g, fmt_max, margin) / 2
    with pytest.raises(GradingError, match=r"(?s)case 1 of .*one power of two too small"):
        grading.check_choose_loss_scale(minus_one)


def test_choose_rejects_strict_inequality_at_the_boundary():
    def strict(g, fmt_max=65504.0, margin=0):
        s = choose_ref(g, fmt_max, margin)
        return s / 2 if s * g * 2.0 ** margin == fmt_max else s
    with pytest.raises(GradingError, match=r"(?s)grad_abs_max=0\.99951171875.*equality is allowed"):
        grading.check_choose_loss_scale(strict)


def test_choose_rejects_ignored_margin_and_non_powers_of_two():
    with pytest.raises(GradingError, match=r"(?s)margin=3.*off by a factor 2\*\*\+3"):
        grading.check_choose_loss_scale(lambda g, fmt_max=65504.0, margin=0: choose_ref(g, fmt_max, 0))
    with pytest.raises(GradingError, match="is not a power of two"):
        grading.check_choose_loss_scale(lambda g, fmt_max=65504.0, margin=0: fmt_max / g / 2.0 ** margin)


def test_choose_float64_boundaries_are_graded():
    cases = grading.boundary_cases()
    assert any(float(torch.tensor(g, dtype=torch.float32)) != g for g, _, _ in cases)     # not float32 values
    for g, fmt_max, margin in cases:                          # the oracle at each boundary, by hand
        s = grading.exact_loss_scale(g, fmt_max, margin)
        assert s * g * 2.0 ** margin <= fmt_max < 2 * s * g * 2.0 ** margin
    assert len(grading.choose_cases()) == 312                 # the verdict the lesson stores names this count


def test_choose_rejects_rounding_the_input_to_float32():
    def via_float32(g, fmt_max=65504.0, margin=0):            # right on every float32 input
        return choose_ref(float(torch.tensor(g, dtype=torch.float32)), fmt_max, margin)
    with pytest.raises(GradingError, match=r"(?s)grad_abs_max=0\.49975585937500006, .*one power of two too large"):
        grading.check_choose_loss_scale(via_float32)


def test_choose_rejects_log2_without_the_exact_check():
    def log2_only(g, fmt_max=65504.0, margin=0):
        choose_ref(g)
        return 2.0 ** math.floor(math.log2(fmt_max / (g * 2.0 ** margin)))
    with pytest.raises(GradingError, match=r"one power of two too large"):
        grading.check_choose_loss_scale(log2_only)


def test_choose_requires_value_error_on_bad_max():
    def no_check(g, fmt_max=65504.0, margin=0):
        return choose_ref(g, fmt_max, margin) if g > 0 and math.isfinite(g) else 1.0
    with pytest.raises(GradingError, match=r"grad_abs_max=0\.0 should raise ValueError"):
        grading.check_choose_loss_scale(no_check)


def test_choose_stub_gives_guidance():
    def stub(g, fmt_max=65504.0, margin=0):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(GradingError, match="not implemented yet.*YOUR CODE HERE"):
        grading.check_choose_loss_scale(stub)


# ----------------------------------------------------------------------------------------------------------
# unscale_grads_
# ----------------------------------------------------------------------------------------------------------
def unscale_ref(grads, scale):
    for g in grads:
        if g.dtype != torch.float32:
            raise ValueError(f"unscale FP32 master gradients, got {g.dtype}: use master weights")
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()   # fp32 ()
    found_inf = False
    for g in grads:
        found_inf |= not bool(torch.isfinite(g).all())
        g.mul_(inv_scale)
    return found_inf


def test_unscale_passes_reference(capsys):
    grading.check_unscale_grads(unscale_ref)
    assert capsys.readouterr().out.startswith("PASS unscale_grads_:")


def test_unscale_rejects_division():
    def divide(grads, scale):
        found = unscale_ref([g.clone() for g in grads], 1.0)
        for g in grads:
            g.div_(scale)
        return found
    with pytest.raises(GradingError, match=r"(?s)scale 3000 .*multiply by inv_scale"):
        grading.check_unscale_grads(divide)


def test_unscale_rejects_isinf_only():
    def isinf_only(grads, scale):
        unscale_ref(grads, scale)
        return any(bool(g.isinf().any()) for g in grads)
    with pytest.raises(GradingError, match=r"(?s)one NaN.*returned found_inf=False, expected True.*isinf misses NaN"):
        grading.check_unscale_grads(isinf_only)


def test_unscale_rejects_fp16_accepted_or_half_modified():
    def accepts_fp16(grads, scale):
        inv = 1.0 / scale
        found = False
        for g in grads:
            found |= not bool(torch.isfinite(g).all())
            g.mul_(inv)
        return found
    with pytest.raises(GradingError, match=r"(?s)torch.float16 gradients were accepted.*FP32 master"):
        grading.check_unscale_grads(lambda g, s: unscale_ref(g, s) if g[-1].dtype == torch.float32
                                    else accepts_fp16(g, s))

    def modifies_then_refuses(grads, scale):
        found = False
        for g in grads:
            if g.dtype != torch.float32:
                raise ValueError("fp16 gradient: use master weights")
            found |= not bool(torch.isfinite(g).all())
            g.mul_(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
        return found
    with pytest.raises(GradingError, match="some gradients were modified first"):
        grading.check_unscale_grads(modifies_then_refuses)


def test_unscale_rejects_skipping_the_rest_after_inf():
    def stops_early(grads, scale):
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        unscale_ref([g.clone() for g in grads], scale)     # dtype check
        for g in grads:
            if not bool(torch.isfinite(g).all()):
                return True                                 # the remaining gradients stay scaled
            g.mul_(inv)
        return False
    with pytest.raises(GradingError, match=r"(?s)one \+inf.*every gradient is unscaled"):
        grading.check_unscale_grads(stops_early)


# ----------------------------------------------------------------------------------------------------------
# update_scale against torch.amp.GradScaler
# ----------------------------------------------------------------------------------------------------------
def update_ref(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = scale * growth_factor
        return (grown if grown <= FP32_MAX else scale), 0
    return scale, growth_tracker


def update_via_library(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """The library's DynamicLossScaler, loaded with the state and driven through one real iteration."""
    s = DynamicLossScaler(init_scale=1.0, growth_factor=growth_factor, backoff_factor=backoff_factor,
                          growth_interval=growth_interval)
    s.load_state_dict({"scale": scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
                       "growth_interval": growth_interval, "_growth_tracker": growth_tracker})
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.0)
    s.scale(torch.ones(()))
    w.grad = torch.full((1,), math.inf if found_inf else 1.0)
    s.step(opt)
    s.update()
    sd = s.state_dict()
    return sd["scale"], sd["_growth_tracker"]


def test_update_passes_reference(capsys):
    grading.check_update_scale(update_ref)
    out = capsys.readouterr().out
    assert out.startswith("PASS update_scale:") and "4,600 steps" in out


def test_update_passes_library_scaler(capsys):
    grading.check_update_scale(update_via_library)
    assert capsys.readouterr().out.startswith("PASS update_scale:")


def test_oracle_covers_the_edges():
    """The fixed patterns reach the FP32 top (growth refused), go below 1, and grow often: the bugs below
    cannot hide."""
    seen_cap = seen_below_one = grows = 0
    for _, init, gf, bf, gi, steps, p, seed in grading.UPDATE_CONFIGS:
        pattern = tuple(grading.overflow_pattern(steps, p, seed))
        traj = grading.gradscaler_trajectory(init, gf, bf, gi, pattern)
        scales = [init] + [s for s, _ in traj]
        trackers = [0] + [t for _, t in traj]
        for t, f in enumerate(pattern):
            if not f and trackers[t] + 1 == gi:
                grows += scales[t + 1] > scales[t]
                seen_cap += scales[t + 1] == scales[t]
        seen_below_one += min(scales) < 1
        assert min(scales) >= 2.0 ** -60              # FP32 and Python floats agree exactly in this range
    assert seen_cap > 50 and seen_below_one >= 2 and grows > 500


def test_update_rejects_growth_one_step_late():
    def grows_one_step_late(scale, tracker, found_inf, gf, bf, gi):
        if found_inf:
            return scale * bf, 0
        if tracker == gi:                              # growth on the (growth_interval + 1)-th clean step
            return scale * gf, 0
        return scale, tracker + 1
    with pytest.raises(GradingError, match=r"(?s)at step \d+ of 'GradScaler defaults.*not one step later"):
        grading.check_update_scale(grows_one_step_late)


def test_update_rejects_growth_to_inf():
    def no_finiteness_check(scale, tracker, found_inf, gf, bf, gi):
        if found_inf:
            return scale * bf, 0
        if tracker + 1 == gi:
            return scale * gf, 0
        return scale, tracker + 1
    with pytest.raises(GradingError, match=r"(?s)before the step: scale=8\.507059173023462e\+37.*"
                                           r"got scale=3\.402823669209385e\+38.*not finite in FP32"):
        grading.check_update_scale(no_finiteness_check)


def test_update_rejects_backoff_without_tracker_reset():
    def keeps_tracker(scale, tracker, found_inf, gf, bf, gi):
        if found_inf:
            return scale * bf, tracker
        return update_ref(scale, tracker, False, gf, bf, gi)
    with pytest.raises(GradingError, match=r"(?s)found_inf history, oldest first, this step last: .*ovf\n.*"
                                           r"found_inf=True.*resets growth_tracker to 0"):
        grading.check_update_scale(keeps_tracker)


def test_update_rejects_wrong_backoff_and_bad_return():
    with pytest.raises(GradingError, match=r"multiplies the scale by backoff_factor"):
        grading.check_update_scale(lambda s, t, f, gf, bf, gi: (s / 2, 0) if f else update_ref(s, t, f, gf, bf, gi))
    with pytest.raises(GradingError, match=r"return a pair \(scale, growth_tracker\)"):
        grading.check_update_scale(lambda s, t, f, gf, bf, gi: s)


def test_update_failure_names_the_first_wrong_step():
    """A bug that only shows on step 10 (the first overflow of the burst) is reported there, with history."""
    def bug_on_burst(scale, tracker, found_inf, gf, bf, gi):
        out = update_ref(scale, tracker, found_inf, gf, bf, gi)
        return (out[0] * 2, out[1]) if found_inf and scale == 2.0 ** 16 and tracker == 1 else out
    pattern = grading.overflow_pattern(2000, 0.2, 0)
    traj = grading.gradscaler_trajectory(2.0 ** 16, 2.0, 0.5, 3, tuple(pattern))
    states = [(2.0 ** 16, 0)] + list(traj)
    first = next(t for t, f in enumerate(pattern) if f and states[t] == (2.0 ** 16, 1))
    with pytest.raises(GradingError, match=rf"at step {first} of 'GradScaler defaults"):
        grading.check_update_scale(bug_on_burst)
