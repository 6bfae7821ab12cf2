"""Scaled FP8 casts (mpcourse.core.quant.rules.tensor) against ml_dtypes and torch.finfo, plus saturation/tie regression cases.

Oracles: ml_dtypes' OCP conversions (float8_e4m3fn, float8_e5m2; non-saturating, round-to-nearest-even),
torch.finfo, and Transformer Engine's published scale rules (transformer_engine/pytorch/quantization.py
``_default_sf_compute``; common/recipe/recipe_common.cuh ``compute_scale_from_amax``).
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.quant import (FP32_MAX, Float8Tensor, Format, compute_amax, compute_scale, fp8_dtype, fp8_format_name,
                          fp8_max, quantize_current, round_down_to_power_of_2, to_float8)

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
NAN = float("nan")
INF = float("inf")


def oracle_quantize(x: np.ndarray, fmt: str, scale: float, saturate: bool) -> np.ndarray:
    """ml_dtypes reference: fp32 product, optional clip, OCP cast. Returns the FP8 values as float32."""
    y = x.astype(np.float32) * np.float32(scale)
    if saturate:
        top = np.float32(float(ml_dtypes.finfo(ML[fmt]).max))
        y = np.clip(y, -top, top)  # np.clip keeps NaN
    return y.astype(ML[fmt]).astype(np.float32)


def probe_values(fmt: str) -> np.ndarray:
    """Every finite FP8 value of ``fmt``, the midpoints between neighbours (round-to-even ties), values one
    fp32 ulp either side of each, and values beyond the range, +-inf and NaN."""
    grid = np.arange(256, dtype=np.uint8).view(ML[fmt]).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])  # sorted, -max .. max
    mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2
    mids = mids.astype(np.float32)
    top = grid[-1]
    beyond = np.array([top * 1.03, top * 1.0625, top * 1.07, top * 2, 1e30, INF, NAN], np.float32)
    vals = np.concatenate([grid, mids, np.nextafter(mids, np.float32(INF)), np.nextafter(mids, np.float32(-INF)),
                           beyond, -beyond])
    return vals.astype(np.float32)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as values, NaN == NaN, and the sign of zero checked."""
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | ((a == b) & (np.signbit(a) == np.signbit(b)))))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False])
def test_cast_matches_ml_dtypes_on_every_value_and_tie(fmt, saturate):
    x = probe_values(fmt)
    got = to_float8(torch.from_numpy(x), fmt, 1.0, saturate=saturate).data.float().numpy()
    assert same(got, oracle_quantize(x, fmt, 1.0, saturate))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 3.0, 0.4375, 89.6, 57344.0 / 1.3])
def test_scaled_cast_matches_ml_dtypes_random(fmt, scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4000) * np.exp(rng.uniform(-12, 12, 4000))).astype(np.float32)
    got = to_float8(torch.from_numpy(x), fmt, scale).data.float().numpy()
    assert same(got, oracle_quantize(x, fmt, scale, True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_upcast_exactly(dtype):
    x = (torch.randn(500) * 30).to(dtype)
    got = to_float8(x, "e4m3", 2.0)
    want = oracle_quantize(x.float().numpy(), "e4m3", 2.0, True)
    assert same(got.data.float().numpy(), want) and got.orig_dtype == dtype


def test_format_table_matches_finfo_and_ml_dtypes():
    assert fp8_max("e4m3") == 448.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert fp8_max("e5m2") == 57344.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)
    assert fp8_dtype("e4m3fn") is torch.float8_e4m3fn and fp8_dtype(torch.float8_e5m2) is torch.float8_e5m2
    assert fp8_format_name(Format.E4M3) == "e4m3" and fp8_format_name("E5M2") == "e5m2"
    with pytest.raises(ValueError, match="HYBRID"):
        fp8_format_name(Format.HYBRID)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_format_name("e3m4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8_format_name(torch.float16)


# -- regression cases: saturation and ties (OCP FP8 spec) ---------------------------------------------------

def test_e4m3_overflow_saturating_and_not():
    # 448 is the largest E4M3; 464 is the tie between 448 and the missing 480 and rounds to even (448);
    # 465 rounds past the range: NaN without saturation (E4M3 has no inf), 448 with it. NaN stays NaN.
    x = torch.tensor([448.0, 464.0, 465.0, 1000.0, -1000.0, NAN])
    sat = to_float8(x, "e4m3", 1.0, saturate=True).dequantize()
    raw = to_float8(x, "e4m3", 1.0, saturate=False).dequantize()
    assert sat[:5].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0] and math.isnan(sat[5])
    assert raw[:2].tolist() == [448.0, 448.0] and bool(torch.isnan(raw[2:]).all())
    # the same answers from the independent oracle
    assert same(sat.numpy(), oracle_quantize(x.numpy(), "e4m3", 1.0, True))
    assert same(raw.numpy(), oracle_quantize(x.numpy(), "e4m3", 1.0, False))


def test_e5m2_overflow_saturating_and_not():
    # 61440 is the tie between 57344 (odd mantissa) and 65536: round-to-even goes up and overflows.
    x = torch.tensor([57344.0, 58000.0, 61439.0, 61440.0])
    raw = to_float8(x, "e5m2", 1.0, saturate=False).dequantize().tolist()
    sat = to_float8(x, "e5m2", 1.0, saturate=True).dequantize().tolist()
    assert raw == [57344.0, 57344.0, 57344.0, INF]
    assert sat == [57344.0] * 4
    assert same(np.array(raw, np.float32), oracle_quantize(x.numpy(), "e5m2", 1.0, False))


def test_infinities_saturate_or_overflow():
    x = torch.tensor([INF, -INF])
    assert to_float8(x, "e4m3", 1.0).dequantize().tolist() == [448.0, -448.0]
    assert to_float8(x, "e5m2", 1.0).dequantize().tolist() == [57344.0, -57344.0]
    assert to_float8(x, "e5m2", 1.0, saturate=False).dequantize().tolist() == [INF, -INF]
    assert bool(torch.isnan(to_float8(x, "e4m3", 1.0, saturate=False).dequantize()).all())


def test_scale_for_amax_one_is_the_format_max():
    # Catches the E4M3 max used on the E5M2 branch (scale 448 for a gradient would waste 7 binades).
    assert float(compute_scale(1.0, fp8_max("e5m2"))) == 57344.0
    assert float(compute_scale(1.0, fp8_max("e4m3"))) == 448.0
    assert float(compute_scale(1.0, "e5m2")) == float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)
    g = torch.tensor([1.0, -0.5])
    assert float(quantize_current(g, Format.HYBRID.bwd).scale_inv) == np.float32(1 / 57344)
    assert float(quantize_current(g, Format.HYBRID.fwd).scale_inv) == np.float32(1 / 448)


def test_all_zero_tensor_current_scaling_gives_zeros_not_nan():
    x8 = quantize_current(torch.zeros(4, 4), "e4m3")
    assert float(x8.scale_inv) == 1.0  # TE Float8CurrentScaling: zero amax -> scale 1.0
    assert torch.equal(x8.data.float(), torch.zeros(4, 4))
    assert torch.equal(x8.dequantize(), torch.zeros(4, 4))


def test_small_gradient_lost_in_e4m3_survives_in_e5m2():
    g = torch.tensor([1000.0, 0.001])
    e4 = quantize_current(g, "e4m3").dequantize()
    e5 = quantize_current(g, "e5m2").dequantize()
    assert e4[1].item() == 0.0  # 0.001 * 448/1000 = 4.5e-4 is below half of E4M3's 2^-9
    want = oracle_quantize(np.float32([0.001]), "e5m2", np.float32(57344) / np.float32(1000), True)[0] \
        * (np.float32(1) / (np.float32(57344) / np.float32(1000)))
    assert e5[1].item() == pytest.approx(float(want), rel=1e-6) and 9.4e-4 < e5[1].item() < 9.6e-4
    assert e5[0].item() == pytest.approx(1000.0, rel=1e-6) and e4[0].item() == pytest.approx(1000.0, rel=1e-6)
    assert Format.HYBRID.bwd == "e5m2" and Format.HYBRID.fwd == "e4m3"


# -- compute_scale: Transformer Engine's rules ---------------------------------------------------------

def te_scale_rule(amax: np.ndarray, prev: np.ndarray, fp8_max: float, margin: int) -> np.ndarray:
    """TE _default_sf_compute, written out in numpy float32 as the oracle."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        sf = (np.float32(fp8_max) / amax.astype(np.float32)) / np.float32(2.0 ** margin)
    sf = np.where(amax > 0, sf, prev)
    sf = np.where(np.isfinite(amax), sf, prev)
    return np.where(np.isinf(sf), np.finfo(np.float32).max, sf).astype(np.float32)


@pytest.mark.parametrize("margin", [0, 1, 3, -1])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_compute_scale_matches_te_rule(margin, fmt):
    amax = np.float32([1.0, 5.0, 3.3, 1e-3, 1e-30, 1e-40, 0.0, INF, NAN, 3e38, 448.0, 57344.0, 2 ** -149])
    prev = np.full_like(amax, 2.0)
    got = compute_scale(torch.from_numpy(amax), fp8_max(fmt), margin, prev_scale=torch.from_numpy(prev)).numpy()
    assert np.array_equal(got, te_scale_rule(amax, prev, fp8_max(fmt), margin))


def test_compute_scale_degenerate_amax():
    for bad in (0.0, INF, NAN):
        assert float(compute_scale(bad, 448.0, prev_scale=2.0)) == 2.0  # delayed: keep the previous scale
        assert float(compute_scale(bad, 448.0)) == 1.0  # current scaling: 1.0
    tiny = compute_scale(1e-40, 448.0)
    assert math.isfinite(float(tiny)) and float(tiny) == FP32_MAX
    assert float(compute_scale(5.0, 448.0, margin=1)) == pytest.approx(44.8, rel=1e-7)
    with pytest.raises(TypeError, match="margin"):
        compute_scale(1.0, 448.0, margin=0.5)


def test_power_of_two_scales_round_down():
    s = round_down_to_power_of_2(torch.tensor([89.6, 1.0, 0.75, FP32_MAX]))
    assert s.tolist() == [64.0, 1.0, 0.5, 2.0 ** 127]
    x8 = quantize_current(torch.tensor([3.0, -1.0]), "e4m3", power_2_scale=True)
    assert float(x8.scale_inv) == 1 / 128  # 448 / 3 = 149.3 -> 128


def test_amax_epsilon_floors_the_amax():
    x8 = quantize_current(torch.zeros(3), "e4m3", amax_epsilon=1e-2)
    assert float(x8.scale_inv) == pytest.approx(1e-2 / 448, rel=1e-6)
    assert torch.equal(x8.dequantize(), torch.zeros(3))


# -- Float8Tensor and quantize's contract ----------------------------------------------------------------

def test_dequantize_inverts_power_of_two_scales_exactly():
    x = torch.tensor([[1.5, -3.0], [0.25, 6.0]])
    x8 = to_float8(x, "e4m3", 16.0)
    assert x8.data.dtype == torch.float8_e4m3fn and x8.scale_inv.shape == () and x8.scale_inv.dtype == torch.float32
    assert torch.equal(x8.dequantize(), x) and torch.equal(x8.t().dequantize(), x.t())
    assert x8.dequantize(torch.bfloat16).dtype == torch.bfloat16 and x8.fp8_format == "e4m3"


def test_nan_propagates_into_data_and_amax():
    x = torch.tensor([1.0, NAN])
    assert math.isnan(float(compute_amax(x)))
    x8 = quantize_current(x, "e4m3")  # NaN amax -> scale 1.0; the NaN stays visible
    assert float(x8.scale_inv) == 1.0 and math.isnan(float(x8.dequantize()[1]))
    assert float(compute_amax(torch.empty(0))) == 0.0


def test_bad_inputs_raise_with_the_fix():
    with pytest.raises(TypeError, match="dequantize"):
        to_float8(torch.zeros(2, dtype=torch.float8_e4m3fn), "e4m3", 1.0)
    with pytest.raises(TypeError):
        to_float8(torch.zeros(2, dtype=torch.int32), "e4m3", 1.0)
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="compute_scale"):
            to_float8(torch.ones(2), "e4m3", bad)
    with pytest.raises(ValueError, match="one scale"):
        to_float8(torch.ones(2), "e4m3", torch.ones(2))
    with pytest.raises(TypeError, match="float8"):
        Float8Tensor(torch.ones(2), torch.tensor(1.0))
    with pytest.raises(TypeError, match="scale_inv"):
        Float8Tensor(torch.ones(2).to(torch.float8_e4m3fn), torch.tensor(1.0, dtype=torch.float64))


def test_accepts_mpcourse_formats_descriptions():
    formats = pytest.importorskip("mpcourse.core.formats")
    for name in ("e4m3", "e5m2"):
        assert fp8_format_name(formats.FORMATS[name]) == name
        assert fp8_max(formats.FORMATS[name]) == formats.FORMATS[name].max
        assert fp8_dtype(formats.FORMATS[name]) is formats.FORMATS[name].torch_dtype
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8_format_name(formats.FORMATS["fp16"])


def test_huge_margin_never_gives_a_zero_scale():
    """Review finding: (448 / 1) / 2**200 underflows FP32 to 0; the policy clamps to the smallest normal."""
    from mpcourse.core.quant.rules.tensor import compute_scale
    s = compute_scale(1.0, "e4m3", margin=200)
    assert float(s) == torch.finfo(torch.float32).tiny
    assert float(compute_scale(1.0, "e4m3", margin=1)) == 224.0          # ordinary margins untouched
