"""Oracle tests for the MX formats in mpcourse.core.formats: E8M0, FP6 E2M3 / E3M2, FP4 E2M1.

Oracle: ml_dtypes (float8_e8m0fnu, float6_e2m3fn, float6_e3m2fn, float4_e2m1fn), run side by side
on every bit pattern, every midpoint between neighbours (the ties), one FP32 ulp either side of each
midpoint, signed zeros, infs, FP32 subnormals and random FP32 bit patterns. Regression cases cite
the OCP Microscaling Formats (MX) v1.0 spec, section 5.
"""
import functools
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.formats import FORMATS, all_values, decode, encode, from_bits, get_format, neighbours, round_to, ulp

MX = ["e8m0", "e2m3", "e3m2", "e2m1"]
NP = {"e8m0": ml_dtypes.float8_e8m0fnu, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn,
      "e2m1": ml_dtypes.float4_e2m1fn}
INF, NAN = math.inf, math.nan


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def ml_cast(x: torch.Tensor, name: str) -> torch.Tensor:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(x.numpy().astype(NP[name]).astype(np.float32))


def ml_table(name: str) -> torch.Tensor:
    """Value of every bit pattern as ml_dtypes reads it (sub-byte formats sit in the low bits of a byte)."""
    bits = FORMATS[name].bits
    return torch.from_numpy(np.arange(2 ** bits, dtype=np.uint8).view(NP[name]).astype(np.float32))


def assert_same(got, want, x, what):
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(torch.int32) != want.view(torch.int32)))
    if bad.any():
        i = bad.nonzero().flatten()[:6]
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches, e.g. x={x[i].tolist()} got {got[i].tolist()} "
                             f"want {want[i].tolist()}")


@functools.lru_cache(maxsize=None)
def pool(name: str) -> torch.Tensor:
    parts = [f32([0.0, -0.0, INF, -INF, 3.4028234663852886e38, -3.4028234663852886e38, 2.0 ** -149, 2.0 ** -126,
                  2.0 ** -127, 2.0 ** -128, 1.0, -1.0])]
    t = ml_table(name)
    parts.append(t[~torch.isnan(t)])
    v = torch.unique(t[torch.isfinite(t)]).double()
    v = v[v >= 0]
    top = v[-1] + (v[-1] - v[-2]) / 2 if name != "e8m0" else v[-1] * 1.5   # the overflow tie
    mids = torch.cat([(v[1:] + v[:-1]) / 2, top[None]]).float()          # exact in float32
    for m in (mids, torch.nextafter(mids, f32(INF)), torch.nextafter(mids, f32(0.0))):
        parts += [m, -m]
    g = torch.Generator().manual_seed(0)
    sub = torch.randint(1, 2 ** 23, (20_000,), generator=g, dtype=torch.int32).view(torch.float32)
    parts += [sub, -sub]
    rnd = torch.randint(-2 ** 31, 2 ** 31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    parts.append(rnd.view(torch.float32))
    x = torch.cat(parts)
    return x[~torch.isnan(x)]   # NaN inputs are tested on their own: ml_dtypes turns NaN into -0 in fp4/fp6


@pytest.mark.parametrize("name", MX)
def test_fields_match_ml_dtypes_finfo(name):
    f, fi = get_format(name), ml_dtypes.finfo(NP[name])
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (fi.bits, fi.nexp, fi.nmant)
    assert f.max == float(fi.max)
    assert f.min_normal == float(fi.smallest_normal)
    assert f.min_subnormal == float(fi.smallest_subnormal)
    assert f.eps == float(fi.eps)
    assert not f.has_inf
    assert f.emax == fi.maxexp - 1   # 2^maxexp is the first power of two past max


@pytest.mark.parametrize("name,dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2),
                                        ("fp16", "float16"), ("bf16", ml_dtypes.bfloat16)])
def test_emax_of_the_fp8_and_16_bit_formats(name, dtype):
    """OCP MX v1.0 table 1's emax_elem: 8 for E4M3, 15 for E5M2 (and FP16's 15, BF16's 127)."""
    assert get_format(name).emax == ml_dtypes.finfo(dtype).maxexp - 1


def test_fields_from_the_ocp_mx_spec():
    """OCP MX v1.0 tables 1-4: maxima, NaN and inf encodings, signedness."""
    e2m1, e8m0 = get_format("fp4"), get_format("float8_e8m0fnu")
    assert (e2m1.max, e2m1.min_subnormal, e2m1.nan, e2m1.signed) == (6.0, 0.5, "none", True)
    assert (get_format("e2m3").max, get_format("e3m2").max) == (7.5, 28.0)
    assert (e8m0.max, e8m0.min_subnormal, e8m0.bias, e8m0.signed, e8m0.has_zero) == (2.0 ** 127, 2.0 ** -127, 127,
                                                                                    False, False)


@pytest.mark.parametrize("name", MX)
def test_every_bit_pattern(name):
    f = FORMATS[name]
    got, want = all_values(f), ml_table(name)
    assert_same(got, want, torch.arange(2 ** f.bits).float(), f"{name} from_bits")
    finite = ~torch.isnan(got)
    codes = torch.arange(2 ** f.bits)[finite]
    assert torch.equal(encode(got[finite], f), codes), f"{name}: encode(from_bits(c)) != c"


@pytest.mark.parametrize("name", MX)
@pytest.mark.parametrize("saturate", [False, True])
def test_round_to_matches_ml_dtypes_everywhere(name, saturate):
    x = pool(name)
    want = ml_cast(x, name)
    if saturate and name == "e8m0":   # ml_dtypes does not saturate E8M0: overflow (and inf) is NaN there
        want = torch.where(torch.isnan(want) & (x > 0), 2.0 ** 127, want)
    assert_same(round_to(x, name, saturate=saturate), want, x, f"{name} round_to(saturate={saturate})")


@pytest.mark.parametrize("name", MX)
def test_neighbours_and_ulp(name):
    x = pool(name)
    x = x[(x.abs() <= FORMATS[name].max) & (x.abs() >= FORMATS[name].min_subnormal)]
    if name == "e8m0":
        x = x[x > 0]
    lo, hi = neighbours(x, name)
    ok = ~torch.isnan(lo)
    assert bool((lo[ok] <= x[ok]).all() and (x[ok] <= hi[ok]).all())
    r = round_to(x, name)
    assert bool(((r == lo) | (r == hi)).all())
    u = ulp(r, name)
    nxt = torch.where(r.abs() < FORMATS[name].max, (r.abs() + u), r.abs())
    assert bool((round_to(nxt, name) == nxt).all()), f"{name}: |r| + ulp is not representable"


@pytest.mark.parametrize("name", ["e2m1", "e2m3", "e3m2"])
def test_stochastic_rounding_gives_a_neighbour_unbiased(name):
    g = torch.Generator().manual_seed(1)
    x = torch.full((200_000,), 2.4 if name != "e3m2" else 9.0)
    r = round_to(x, name, rounding="stochastic", generator=g)
    lo, hi = neighbours(x[:1], name)
    assert set(r.unique().tolist()) == {float(lo), float(hi)}
    assert abs(float(r.double().mean()) - float(x[0])) < 0.01


def test_e8m0_stochastic_rounding_probability():
    g = torch.Generator().manual_seed(2)
    r = round_to(torch.full((100_000,), 3.0), "e8m0", rounding="stochastic", generator=g)  # 2 or 4, p(4) = 1/2
    assert set(r.unique().tolist()) == {2.0, 4.0} and abs(float((r == 4).double().mean()) - 0.5) < 0.01


# ----------------------------------------------------------- cases from public reports (OCP MX v1.0, section 5)
def test_e8m0_extremes_nan_and_no_zero():
    """E8M0: 2^-127 and 2^127 are its extremes, 0xFF is NaN, there is no zero (OCP MX v1.0 table 4)."""
    assert from_bits(0, "e8m0") == 2.0 ** -127 and from_bits(254, "e8m0") == 2.0 ** 127
    assert math.isnan(from_bits(0xFF, "e8m0"))
    assert encode(1.0, "e8m0") == 127 and encode(2.0 ** -127, "e8m0") == 0
    r = round_to(f32([0.0, -0.0, -2.0, 1e-45, 3.0, 2.0 ** 127 * 1.5, INF, NAN]), "e8m0")
    assert math.isnan(r[0]) and math.isnan(r[1]) and math.isnan(r[2])   # no zero, no sign
    assert r[3] == 2.0 ** -127 and r[4] == 4.0 and math.isnan(r[5]) and math.isnan(r[6]) and math.isnan(r[7])
    d = decode(0.25, "e8m0")
    assert (d.exponent, d.code, d.kind, d.bit_string) == (-2, 125, "normal", "01111101")


def test_e8m0_rounds_fp32_subnormals_to_the_nearer_power_of_two():
    """FP32 subnormals x in (2^-127, 2^-126) round to the nearer of 2^-127 and 2^-126 by value, ties up.

    Oracle: exact rational arithmetic (fractions) on every 2^10-th mantissa and the ones around the
    midpoint 1.5 * 2^-127. ml_dtypes 0.7.0 rounds this way (6.3e-39 -> 2^-127); ml_dtypes < 0.7 and
    torch 2.13's cast round the whole interval up, which the last assertion keeps the docs honest about."""
    from fractions import Fraction
    lo, hi = Fraction(1, 2 ** 127), Fraction(1, 2 ** 126)
    mant = sorted(set(range(2 ** 22 + 1, 2 ** 23, 2 ** 10)) | set(range(3 * 2 ** 21 - 3, 3 * 2 ** 21 + 4)))
    x = torch.tensor(mant, dtype=torch.int32).view(torch.float32)
    want = [float(lo) if abs(Fraction(m, 2 ** 149) - lo) < abs(Fraction(m, 2 ** 149) - hi) else float(hi)
            for m in mant]
    assert round_to(x, "e8m0").tolist() == want
    assert round_to(f32([6.3e-39]), "e8m0").item() == 2.0 ** -127   # the case where ml_dtypes 0.6 and 0.7 differ
    if tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2]) >= (0, 7):
        assert_same(round_to(x, "e8m0"), ml_cast(x, "e8m0"), x, "e8m0 subnormal inputs vs ml_dtypes >= 0.7")
    t = x.to(torch.float8_e8m0fnu).float()   # torch's cast: the whole interval up (documented in formats)
    assert bool((t == 2.0 ** -126).all()), "torch's E8M0 cast changed: update the policy text in formats"


def test_e2m1_values_ties_and_saturation():
    """E2M1 holds exactly +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; 5 rounds to 4 (tie to even), 7 saturates to 6."""
    vals = all_values("e2m1")
    assert vals[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6] and vals[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3,
                                                                                       -4, -6]
    r = round_to(f32([5.0, 7.0, -7.0, 100.0, INF, 0.25, 0.75, 2.5, NAN]), "e2m1")
    assert r[:8].tolist() == [4.0, 6.0, -6.0, 6.0, 6.0, 0.0, 1.0, 2.0] and math.isnan(r[8])
    with pytest.raises(ValueError, match="no NaN bit pattern"):
        encode(f32([NAN]), "e2m1")
    assert str(decode(6.0, "e2m1")) == "e2m1 0 11 1 = +1.1b x 2^2 = 6.0 (normal)"
