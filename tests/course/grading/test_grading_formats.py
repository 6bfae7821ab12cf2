"""Lesson 00's graders: they pass the library's own implementation and reject plausible wrong ones
with a message that points at the first wrong case."""
import math

import pytest
import torch

from mpcourse.core import formats
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.formats import check_decode, check_round_bf16, check_round_fp16, rounding_cases


def test_library_implementation_passes(capsys):
    check_round_bf16(lambda x: formats.round_to(x, "bf16"))
    check_round_fp16(lambda x: formats.round_to(x, "fp16"))
    # The library's from_bits, evaluated once per format over all patterns, then looked up.
    tables = {(5, 10): "fp16", (8, 7): "bf16", (5, 2): "e5m2"}
    tables = {k: formats.all_values(v).tolist() for k, v in tables.items()}
    check_decode(lambda b, e, m: tables[(e, m)][b])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["PASS round_to_bf16", "PASS round_to_fp16", "PASS decode"]


def round_half_up_bf16(x):
    """Plausible bug: add half an ULP and truncate (ties always away from zero, not to even)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = ((bits + 0x8000) & 0xFFFF0000)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(x.isnan(), x, out)


def test_round_half_up_is_rejected_at_a_tie():
    with pytest.raises(GradingError) as e:
        check_round_bf16(round_half_up_bf16)
    msg = str(e.value)
    assert "FAIL round_to_bf16" in msg and "a tie, exactly halfway" in msg and "round half to even" in msg


def test_fp16_without_subnormals_is_rejected():
    def flush_subnormals(x):
        y = x.to(torch.float16).float()
        return torch.where(y.abs() < 2**-14, torch.zeros_like(y) * x.sign(), y)
    with pytest.raises(GradingError, match="FAIL round_to_fp16"):
        check_round_fp16(flush_subnormals)


def test_fp16_saturating_instead_of_overflowing_is_rejected():
    with pytest.raises(GradingError, match="overflows to inf"):
        check_round_fp16(lambda x: x.clamp(-65504, 65504).to(torch.float16).float())


def test_wrong_dtype_shape_and_stub_are_explained():
    with pytest.raises(GradingError, match="float32"):
        check_round_bf16(lambda x: x.to(torch.bfloat16))
    with pytest.raises(GradingError, match="shape"):
        check_round_bf16(lambda x: x.to(torch.bfloat16).float()[:-1])

    def stub(x):
        raise NotImplementedError("exercise")
    with pytest.raises(GradingError, match="not implemented yet"):
        check_round_fp16(stub)


def ieee_decode(bits, e, m):
    """Independent reference: the IEEE 754 field formula, in Python floats."""
    sign = -1.0 if bits >> (e + m) & 1 else 1.0
    field, mant, bias = bits >> m & (2**e - 1), bits & (2**m - 1), 2 ** (e - 1) - 1
    if field == 2**e - 1:
        return sign * math.inf if mant == 0 else math.nan
    if field == 0:
        return sign * mant * 2.0 ** (1 - bias - m)
    return sign * (1 + mant / 2**m) * 2.0 ** (field - bias)


def test_decode_that_forgets_subnormals_or_negative_zero_is_rejected():
    check_decode(ieee_decode)                                   # the reference passes

    def no_subnormals(bits, e, m):
        return 0.0 if bits >> m & (2**e - 1) == 0 else ieee_decode(bits, e, m)
    with pytest.raises(GradingError, match="subnormal"):
        check_decode(no_subnormals)
    with pytest.raises(GradingError, match="-0.0"):
        check_decode(lambda b, e, m: abs(ieee_decode(b, e, m)))


def test_cases_cover_ties_specials_and_overflow_threshold():
    cases = rounding_cases("fp16")
    assert 65520.0 in cases.tolist() and 1.0 + 2**-11 in cases.tolist()      # overflow tie, tie after 1
    assert cases.isnan().any() and cases.isinf().any() and (cases == 0).any()
    assert len(cases) == len(rounding_cases("fp16"))                         # deterministic
    assert torch.equal(cases.nan_to_num(), rounding_cases("fp16").nan_to_num())
    assert math.isfinite(float(cases[cases.isfinite()].abs().max()))


def bf16_bit_rounding_no_nan_guard(x):
    """Planted bug: the classic bit trick (bits + 0x7FFF + lsb, truncate) applied to NaNs too."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = torch.where(out >= 2**32, out - 2**32, out)                          # the carry out of bit 31 wraps
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return out


@pytest.mark.parametrize("payload, becomes", [(0x7F800001, "inf"), (0x7FFFFFFF, "-0.0"), (0xFFFFFFFF, "0.0")])
def test_nan_payloads_carried_into_inf_or_zero_are_rejected(payload, becomes):
    """Each payload alone fails the grader, deterministically (the cases always hold it)."""
    signed = payload - 2**32 if payload >= 2**31 else payload
    def only_this_payload_wrong(x):
        hit = x.view(torch.int32) == signed
        return torch.where(hit, bf16_bit_rounding_no_nan_guard(x), x.to(torch.bfloat16).float())
    assert float(bf16_bit_rounding_no_nan_guard(torch.tensor([signed], dtype=torch.int32).view(torch.float32))) \
        == float(becomes)
    with pytest.raises(GradingError, match="FAIL round_to_bf16"):
        check_round_bf16(only_this_payload_wrong)
