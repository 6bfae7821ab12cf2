"""The graders of lessons 07-08 (mpcourse.course.grading.fp8): they pass the library's functions and small references
written as a learner would, and reject plausible wrong implementations with a message that names the mistake.

Planted bugs: E4M3's max used on the E5M2 branch (scale and clamp), a zero amax giving an inf scale, no FP32-max
cap, the margin multiplying, no saturation, always E4M3, rolling before taking the max, most_recent read
after the roll, overwriting slot 0 instead of max-reducing, 'max' over the newest entry only, slot 0 not zeroed.
"""
import math

import pytest
import torch

from mpcourse.core.quant import amax_and_scale_update, compute_scale, quantize, to_float8
from mpcourse.course.grading import GradingError
from mpcourse.course.grading import fp8 as grading

FP32_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------------------------------------
# oracle facts (independent of the graders' code paths)
# ----------------------------------------------------------------------------------------------------------
def test_oracle_facts():
    assert grading.te_scales(5.0, 448.0) == {float(torch.tensor(448.0) / torch.tensor(5.0))}
    assert grading.te_scales(1.0, 57344.0) == {57344.0} and grading.te_scales(1.0, 448.0) == {448.0}
    assert grading.te_scales(0.0, 448.0) == grading.te_scales(math.nan, 448.0) == {1.0}
    assert grading.te_scales(1e-40, 448.0) == {FP32_MAX}
    h, s = grading.te_delayed_update([5.0, 1, 2, 3], 1.0, 0.0, 448.0, 0)          # TE's worked example
    assert h == [0, 2, 3, 5] and {round(v, 4) for v in s} == {89.6}
    assert {round(v, 4) for v in grading.te_delayed_update([5.0, 1, 2, 3], 1.0, 0.0, 448.0, 1)[1]} == {44.8}
    bits = grading.ml_quantize(torch.tensor([448.0, 464.0, 465.0, 1000.0]).numpy(), 1.0, 448.0)
    assert torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).float().tolist() == [448, 448, 448, 448]


# ----------------------------------------------------------------------------------------------------------
# compute_scale
# ----------------------------------------------------------------------------------------------------------
def scale_ref(amax, fp8_max, margin=0):
    """A learner's version: Python float numerator (reciprocal-then-multiply in torch, TE's PyTorch path)."""
    s = fp8_max / amax / 2.0 ** margin
    s = torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(s))
    return torch.where(torch.isinf(s), torch.full_like(s, FP32_MAX), s)


@pytest.mark.parametrize("fn", [compute_scale, scale_ref], ids=["library", "learner"])
def test_compute_scale_passes(fn, capsys):
    grading.check_compute_scale(fn)
    assert capsys.readouterr().out.startswith("PASS compute_scale:")


def test_compute_scale_rejects_e4m3_max_on_e5m2():
    with pytest.raises(GradingError, match=r"E5M2.*\n.*\n.*hint: you used E4M3's 448"):
        grading.check_compute_scale(lambda a, m, k=0: scale_ref(a, 448.0, k))


def test_compute_scale_rejects_inf_for_zero_amax():
    def no_zero_rule(amax, fp8_max, margin=0):
        return torch.full_like(amax, fp8_max) / amax / 2.0 ** margin
    with pytest.raises(GradingError, match=r"amax=0\.0.*\n.*expected scale 1\.0.*got inf\n.*carries no information"):
        grading.check_compute_scale(no_zero_rule)


def test_compute_scale_rejects_missing_fp32_cap():
    def no_cap(amax, fp8_max, margin=0):
        s = torch.full_like(amax, fp8_max) / amax / 2.0 ** margin
        return torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(s))
    with pytest.raises(GradingError, match=r"amax=1e-40.*\n.*got inf\n.*largest FP32"):
        grading.check_compute_scale(no_cap)


def test_compute_scale_rejects_margin_multiplying():
    with pytest.raises(GradingError, match=r"margin=1\n.*44\.79.*got 179\.19.*\n.*margin -1 instead of 1"):
        grading.check_compute_scale(lambda a, m, k=0: scale_ref(a, m, -k))


def test_compute_scale_stub_fails_helpfully():
    def stub(amax, fp8_max, margin=0):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(GradingError, match="not implemented yet"):
        grading.check_compute_scale(stub)


# ----------------------------------------------------------------------------------------------------------
# quantize
# ----------------------------------------------------------------------------------------------------------
DTYPE = {448.0: torch.float8_e4m3fn, 57344.0: torch.float8_e5m2}


def quantize_ref(x, scale, fp8_max):
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(DTYPE[fp8_max])


@pytest.mark.parametrize("fn", [quantize_ref, quantize, lambda x, s, m: to_float8(x, DTYPE[m], s).data],
                         ids=["learner", "library", "library_to_float8"])
def test_quantize_passes(fn, capsys):
    grading.check_quantize(fn)
    assert capsys.readouterr().out.startswith("PASS quantize:")


def test_quantize_rejects_e4m3_max_on_e5m2():
    def clamp_448(x, scale, fp8_max):
        return (x.float() * scale).clamp(-448.0, 448.0).to(DTYPE[fp8_max])
    with pytest.raises(GradingError, match=r"E5M2.*\n.*x=57344\.0.*expected 57344\.0.*got 448\.0.*\n"
                                           r".*hint: you clamped to E4M3's 448 on the E5M2 branch"):
        grading.check_quantize(clamp_448)


def test_quantize_rejects_always_e4m3():
    with pytest.raises(GradingError, match=r"fp8_max=57344 should give a torch\.float8_e5m2 tensor"):
        grading.check_quantize(lambda x, s, m: (x * s).clamp(-m, m).to(torch.float8_e4m3fn))


def test_quantize_rejects_no_saturation():
    """Without the clamp torch 2.13 saturates E4M3 by itself but not E5M2 (61440 -> inf)."""
    with pytest.raises(GradingError, match=r"x=61440\.0.*expected 57344\.0.*got inf.*\n.*hint: x \* scale = "
                                           r"61440\.0: clamp to \[-fp8_max, fp8_max\]"):
        grading.check_quantize(lambda x, s, m: (x.float() * s).to(DTYPE[m]))


# ----------------------------------------------------------------------------------------------------------
# delayed update
# ----------------------------------------------------------------------------------------------------------
def update_lib(history, scale, amax, fp8_max, margin=0, algo="max"):
    h = history.clone()
    h[0] = torch.maximum(h[0], amax)
    return amax_and_scale_update(h, scale, fp8_max, margin, algo)


def update_ref(history, scale, amax, fp8_max, margin=0, algo="max", *, roll_first=False, overwrite=False,
               zero_gives_inf=False, newest_only=False):
    """A learner's version, with switches for the planted bugs."""
    h = history.clone()
    h[0] = amax if overwrite else torch.maximum(h[0], amax)
    if roll_first:
        h = torch.roll(h, -1)
        h[0] = 0.0
    a = h[0] if (algo == "most_recent" or newest_only) else h.max()
    if not roll_first:
        h = torch.roll(h, -1)
        h[0] = 0.0
    new = torch.full_like(a, fp8_max) / a / 2.0 ** margin
    if not zero_gives_inf:
        new = torch.where((a > 0) & torch.isfinite(a), new, scale)
    new = torch.where(torch.isinf(new) & (a > 0), torch.full_like(new, FP32_MAX), new)
    return h, new


@pytest.mark.parametrize("fn", [update_lib, update_ref], ids=["library", "learner"])
def test_update_passes(fn, capsys):
    grading.check_delayed_update(fn)
    assert capsys.readouterr().out.startswith("PASS delayed_update:")


def test_update_rejects_rolling_before_the_max():
    with pytest.raises(GradingError, match=r"the oldest entry is the largest.*\n.*\n.*scale 49\.77.*\n.*scale "
                                           r"89\.59.*\n.*hint: you rolled before taking the amax"):
        grading.check_delayed_update(lambda *a: update_ref(*a, roll_first=True))


def test_update_rejects_most_recent_read_after_the_roll():
    def most_recent_rolled(history, scale, amax, fp8_max, margin=0, algo="max"):
        return update_ref(history, scale, amax, fp8_max, margin, algo, roll_first=algo == "most_recent")
    with pytest.raises(GradingError, match=r"most_recent takes only.*\n.*\n.*scale 89\.59.*\n.*scale 1\.0\n"
                                           r".*hint: you rolled before taking the amax"):
        grading.check_delayed_update(most_recent_rolled)


def test_update_rejects_zero_amax_giving_inf():
    with pytest.raises(GradingError, match=r"all-zero history and amax 0.*\n.*\n.*scale 2\.0\n.*scale inf\n"
                                           r".*hint: this amax is 0, inf or NaN.*keep the previous scale"):
        grading.check_delayed_update(lambda *a: update_ref(*a, zero_gives_inf=True))


def test_update_rejects_overwriting_slot_0():
    with pytest.raises(GradingError, match=r"micro-batches.*\n(.*\n){3}.*hint: slot 0 already held an amax"):
        grading.check_delayed_update(lambda *a: update_ref(*a, overwrite=True))


def test_update_rejects_max_over_the_newest_only():
    with pytest.raises(GradingError, match=r"two steps old.*\n(.*\n){3}.*hint: 'max' takes the "
                                           r"largest amax of the whole window"):
        grading.check_delayed_update(lambda *a: update_ref(*a, newest_only=True))


def test_update_rejects_unzeroed_slot():
    def no_zero(history, scale, amax, fp8_max, margin=0, algo="max"):
        h, s = update_ref(history, scale, amax, fp8_max, margin, algo)
        h[0] = history[1]                                     # rolled, but slot 0 keeps the oldest entry
        return h, s
    with pytest.raises(GradingError, match=r"worked example.*\n(.*\n){3}.*hint: after rolling, zero slot 0"):
        grading.check_delayed_update(no_zero)


def test_update_stub_fails_helpfully():
    def stub(*args):
        raise NotImplementedError
    with pytest.raises(GradingError, match="`stub` is not implemented yet"):
        grading.check_delayed_update(stub)


def test_update_rejects_recording_with_fmax_which_drops_a_nan_amax():
    """Planted bug: torch.fmax ignores NaN, so a NaN amax is never recorded and a scale is computed anyway."""
    def fmax_record(history, scale, amax, fp8_max, margin=0, algo="max"):
        h = history.clone()
        h[0] = torch.fmax(h[0], amax)
        return update_ref(h, scale, torch.zeros_like(amax), fp8_max, margin, algo)
    with pytest.raises(GradingError, match=r"a NaN amax: recorded"):
        grading.check_delayed_update(fmax_record)


def test_update_rejects_a_max_that_skips_nan_entries():
    def nan_blind(history, scale, amax, fp8_max, margin=0, algo="max"):
        h = history.clone()
        h[0] = torch.maximum(h[0], amax)
        finite = h.nan_to_num(nan=0.0)
        a = finite[0] if algo == "most_recent" else finite.max()
        h = torch.roll(h, -1)
        h[0] = 0.0
        new = torch.full_like(a, fp8_max) / a / 2.0 ** margin
        new = torch.where((a > 0) & torch.isfinite(a), new, scale)
        return h, torch.where(torch.isinf(new) & (a > 0), torch.full_like(new, FP32_MAX), new)
    with pytest.raises(GradingError, match=r"NaN"):
        grading.check_delayed_update(nan_blind)


def test_update_rejects_most_recent_reading_the_argument_not_slot_0():
    """Planted bug: most_recent uses this call's amax, forgetting an earlier micro-batch of the same step."""
    def argument_only(history, scale, amax, fp8_max, margin=0, algo="max"):
        if algo != "most_recent":
            return update_ref(history, scale, amax, fp8_max, margin, algo)
        h = history.clone()
        h[0] = amax
        h2, s = update_ref(h, scale, amax, fp8_max, margin, algo)
        h2[-1] = torch.maximum(history[0], amax)                   # records right, reads the argument
        return h2, s
    with pytest.raises(GradingError, match=r"micro-batches of one step under most_recent"):
        grading.check_delayed_update(argument_only)
