"""Lesson 01's graders: pass on reference implementations built on the library (mpcourse.core.formats.round_to), reject
planted plausible mistakes with a message that names the first wrong case."""
import pytest
import torch

from mpcourse.core.formats import round_to
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.fp16 import (NORMAL, OVERFLOW, SUBNORMAL, ZERO, check_fp16_fate, check_is_update_lost,
                                   fate_cases, fate_oracle)


def lib_fate(x):
    r = round_to(x, "fp16")                                            # library rounding, not torch's cast
    out = torch.full(x.shape, NORMAL, dtype=torch.int64)
    out[r == 0] = ZERO
    out[(r != 0) & (r.abs() < 2.0**-14)] = SUBNORMAL
    out[r.isinf()] = OVERFLOW
    return out


def lib_lost(w, dw):
    return (dw != 0) & (round_to(w.float() + dw.float(), "fp16") == w.float())


def test_reference_fate_passes(capsys):
    check_fp16_fate(lib_fate)
    out = capsys.readouterr().out
    assert out.startswith("PASS fp16_fate:") and "agree with torch .to(torch.float16)" in out


def test_reference_update_lost_passes(capsys):
    check_is_update_lost(lib_lost)
    assert capsys.readouterr().out.startswith("PASS is_update_lost:")


def test_fate_cases_cover_every_fate_and_the_edges():
    x = fate_cases()
    fates = fate_oracle(x)
    assert set(fates.tolist()) == {ZERO, SUBNORMAL, NORMAL, OVERFLOW}
    edges = torch.tensor([2.0**-25, 2.0**-14 - 2.0**-25, 65520.0, 65519.99609375])
    assert torch.isin(edges, x).all()
    # the oracle's own facts (IEEE binary16): 2**-25 ties to 0, just above rounds to 2**-24; 65520 overflows
    assert fate_oracle(edges).tolist() == [ZERO, NORMAL, OVERFLOW, NORMAL]


def _plain_thresholds(x):                 # compares x, not its rounding: wrong at every boundary
    a = x.abs()
    out = torch.full(x.shape, NORMAL, dtype=torch.int64)
    out[a < 2.0**-24] = ZERO
    out[(a >= 2.0**-24) & (a < 2.0**-14)] = SUBNORMAL
    out[a > 65504] = OVERFLOW
    return out


def _only_underflow_wrong(x):             # right except: everything below 2**-24 flushed
    out = fate_oracle(x)
    out[x.abs() < 2.0**-24] = ZERO
    return out


def _overflow_at_max(x):
    out = fate_oracle(x)
    out[x.abs() > 65504] = OVERFLOW
    return out


@pytest.mark.parametrize("fn,expect", [
    (_plain_thresholds, "round UP to 2\\*\\*-14"),
    (_only_underflow_wrong, "round UP to 2\\*\\*-24"),
    (_overflow_at_max, "rounds DOWN to 65504"),
    (lambda x: x.half(), "integer codes"),
    (lambda x: fate_oracle(x)[:-1], "expected shape"),
])
def test_fate_rejects_planted_mistakes(fn, expect):
    with pytest.raises(GradingError, match=expect):
        check_fp16_fate(fn)


def _rule_of_thumb(w, dw):
    return (dw != 0) & (w.float().abs() / dw.float().abs() >= 2048)


def _half_spacing_above(w, dw):           # forgets ties and the smaller spacing below a power of two
    up = torch.nextafter(w, torch.full_like(w, float("inf"))).float() - w.float()
    return (dw != 0) & (dw.float().abs() < up.abs() / 2)


@pytest.mark.parametrize("fn,expect", [
    (_rule_of_thumb, "rule of thumb"),
    (_half_spacing_above, "first wrong case: w = "),
    (lambda w, dw: (w + dw) == w, "dw = 0 is not a lost update"),
    (lambda w, dw: ((w + dw) == w).int(), "bool tensor"),
])
def test_update_lost_rejects_planted_mistakes(fn, expect):
    with pytest.raises(GradingError, match=expect):
        check_is_update_lost(fn)


def test_stub_gives_a_helpful_error():
    def fp16_fate(x):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(GradingError, match="not implemented yet"):
        check_fp16_fate(fp16_fate)
