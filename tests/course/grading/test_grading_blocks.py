"""Lesson 09's graders: pass on the library's implementations, fail on planted bugs with a hint naming the fault."""
import pytest
import torch

from mpcourse.core.quant import mx_shared_exponent, quantize_fp32_scaled, quantize_mx, quantize_nvfp4
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.blocks import (check_block_quantize, check_columnwise_quantize, check_mx_quantize,
                                            check_mx_shared_exponent, check_nvfp4_scales)

EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}


def lib_block(x, block):
    q = quantize_fp32_scaled(x, block, "e4m3", power_2_scale=True)
    return q.data, q.scale_inv


def lib_nvfp4(x):
    q = quantize_nvfp4(x)
    return q.tensor_scale_inv, q.scale_inv


def lib_columnwise(x):
    return lib_block(x.t().contiguous(), (1, 128))


def lib_mx_quantize(x):   # the exercise grades torchao's FLOOR to_mx: its divisor 2^-126 where k = -127
    q = quantize_mx(x, (1, 32), "e4m3", "floor", edges="torchao")
    return q.scale_inv, q.data


def mx_dequantize(scale, data):
    M, K = data.shape
    return (data.float().reshape(M, K // 32, 32) * scale.float()[:, :, None]).reshape(M, K)


def test_library_passes(capsys):
    check_block_quantize(lib_block)
    check_columnwise_quantize(lib_columnwise)
    check_mx_shared_exponent(lambda a, e: mx_shared_exponent(a, e, "floor"))
    check_mx_quantize(lib_mx_quantize, mx_dequantize)
    check_nvfp4_scales(lib_nvfp4)
    assert capsys.readouterr().out.count("PASS") == 5


def test_planted_bugs_fail():
    def no_pow2(x, block):
        q = quantize_fp32_scaled(x, block, "e4m3", power_2_scale=False)
        return q.data, q.scale_inv
    with pytest.raises(GradingError, match="power of two"):
        check_block_quantize(no_pow2)
    with pytest.raises(GradingError, match="rounds log2"):
        check_mx_shared_exponent(lambda a, e: mx_shared_exponent(a, e, "rceil"))
    with pytest.raises(GradingError, match="tensor scale"):
        check_nvfp4_scales(lambda x: (x.abs().amax() / 448, quantize_nvfp4(x).scale_inv))
    with pytest.raises(GradingError, match="not implemented"):
        check_block_quantize(lambda x, b: (_ for _ in ()).throw(NotImplementedError()))


# --- mx_shared_exponent: the floor(log2) mistakes ---

def fp32_log2(amax, elem):                 # floor(log2) in FP32: one ulp below 2^n rounds up to n
    return (torch.floor(torch.log2(amax)).long() - EMAX[elem]).clamp(-127, 127)


def fp64_log2(amax, elem):                 # exact on normals, but log2(0) = -inf cast to an integer
    return (torch.floor(torch.log2(amax.double())).long() - EMAX[elem]).clamp(-127, 127)


def inf_clamped(amax, elem):               # right everywhere except inf, taken as E8M0's top
    k = fp64_log2(amax, elem)
    k = torch.where(amax == 0, -127, k)
    return torch.where(torch.isinf(amax), 127, k)


def float_exponents(amax, elem):           # returns floats
    return torch.floor(torch.log2(amax.double())) - EMAX[elem]


@pytest.mark.parametrize("bug,hint", [
    (fp32_log2, "computed in floating point: one FP32 ulp below a power of two"),
    (fp64_log2, "log2\\(0\\) is -inf, and casting -inf to an integer is undefined"),
    (inf_clamped, "infinite amax takes the exponent field of inf"),
    (float_exponents, "must be integers"),
])
def test_mx_shared_exponent_bugs_named(bug, hint):
    with pytest.raises(GradingError, match=hint):
        check_mx_shared_exponent(bug)


# --- mx_quantize: the whole block, edges ---

def _lib_k(x):
    M, K = x.shape
    amax = x.abs().reshape(M, K // 32, 32).amax(2)
    return amax, mx_shared_exponent(amax, "e4m3", "floor")


def nan_block_not_nan_scale(x):            # the NaN block keeps a finite scale
    amax, k = _lib_k(x)
    scale = torch.exp2(k.double()).float()
    y = (x.reshape(*k.shape, 32) / scale[:, :, None]).clamp(-448, 448)
    return scale.to(torch.float8_e8m0fnu), y.reshape(x.shape).to(torch.float8_e4m3fn)


def nan_elements_kept_finite(x):           # NaN scale, but the other elements of the block cast normally
    s, d = lib_mx_quantize(x)
    amax, k = _lib_k(x)
    y = (x.reshape(*k.shape, 32) / torch.where(k == -127, 2.0 ** -126, torch.exp2(k.double()).float())[:, :, None])
    return s, y.clamp(-448, 448).reshape(x.shape).to(torch.float8_e4m3fn)


def inf_not_saturated(x):                  # no clamp before the cast: inf stays out of range
    s, d = lib_mx_quantize(x)
    inf = torch.isinf(x)
    return s, torch.where(inf, torch.tensor(float("nan")), d.float()).to(torch.float8_e4m3fn)


def divides_by_2_minus_127(x):             # the OCP divisor where torchao's floor rule uses 2^-126
    amax, k = _lib_k(x)
    scale = torch.where(torch.isnan(amax), float("nan"), torch.exp2(k.double()).float())
    y = (x.reshape(*k.shape, 32) / scale[:, :, None]).clamp(-448, 448)
    return scale.to(torch.float8_e8m0fnu), y.reshape(x.shape).to(torch.float8_e4m3fn)


def dequantize_zero_scale(scale, data):    # E8M0 byte 0 read as 0
    s = torch.where(scale.view(torch.uint8) == 0, 0.0, scale.float())
    M, K = data.shape
    return (data.float().reshape(M, K // 32, 32) * s[:, :, None]).reshape(M, K)


@pytest.mark.parametrize("quantize,dequantize,hint", [
    (nan_block_not_nan_scale, mx_dequantize, "NaN scale, E8M0 byte 0xFF"),
    (nan_elements_kept_finite, mx_dequantize, "every element of a block holding a NaN is NaN"),
    (inf_not_saturated, mx_dequantize, "infinite element saturates to \\+-448"),
    (divides_by_2_minus_127, mx_dequantize, "divide by 2\\^-126"),
    (lib_mx_quantize, dequantize_zero_scale, "byte 0 is 2\\^-127"),
])
def test_mx_quantize_bugs_named(quantize, dequantize, hint):
    with pytest.raises(GradingError, match=hint):
        check_mx_quantize(quantize, dequantize)


# --- columnwise_quantize: orientation and source ---

def rowwise_transposed(x):                 # the rowwise copy (1x128 along K), transposed
    d, s = lib_block(x, (1, 128))
    return d.t().contiguous(), s.t().contiguous()


def from_dequantized_rowwise(x):           # quantized twice: from the dequantized rowwise copy
    d, s = lib_block(x, (1, 128))
    M, K = x.shape
    dq = (d.float().reshape(M, K // 128, 128) * s[:, :, None]).reshape(M, K)
    return lib_columnwise(dq)


def not_transposed(x):                     # 128x1 blocks of x, stored untransposed
    return lib_block(x, (128, 1))


@pytest.mark.parametrize("bug,hint", [
    (rowwise_transposed, "rowwise copy.s scales \\(1x128 tiles along K"),
    (from_dequantized_rowwise, "re-quantized from the dequantized rowwise copy"),
    (not_transposed, "store the copy transposed"),
])
def test_columnwise_bugs_named(bug, hint):
    with pytest.raises(GradingError, match=hint):
        check_columnwise_quantize(bug)


# --- the constructed edges: each bug below passed the graders before they had these cases ---

def fp32_log2_pow2(x, block):              # scale rounded down with floor(log2) in FP32
    M, K = x.shape
    r, c = block
    amax = x.reshape(M // r, r, K // c, c).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (x.reshape(M // r, r, K // c, c) * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return data.reshape(M, K), scale.reciprocal()


def inf_amax_scale_zero(x, block):         # amax inf: 448 / inf = 0 kept (the old exercise solution)
    d, s = lib_block(x, block)
    M, K = x.shape
    r, c = block
    amax = x.reshape(M // r, r, K // c, c).abs().amax(dim=(1, 3))
    return d, torch.where(torch.isinf(amax), torch.tensor(float("inf")), s)


def nvfp4_other_order(x):                  # amax_b / (6 t) instead of (amax_b / 6) / t
    t, _ = lib_nvfp4(x)
    amax_b = x.reshape(x.shape[0], -1, 16).abs().amax(2)
    return t, (amax_b / (6.0 * t)).clamp(2.0 ** -6, 448).to(torch.float8_e4m3fn)


def nvfp4_fp64(x):                         # the block scales computed in FP64
    t, _ = lib_nvfp4(x)
    amax_b = x.reshape(x.shape[0], -1, 16).abs().amax(2).double()
    return t, (amax_b / 6.0 / t.double()).clamp(2.0 ** -6, 448).float().to(torch.float8_e4m3fn)


def nvfp4_python_float(x):                 # t as a Python float
    t, s = lib_nvfp4(x)
    return float(t), s


def nvfp4_no_floor(x):                     # t = amax / 2688 even below 2^-126 (subnormal)
    t = x.abs().amax() / 2688.0
    amax_b = x.reshape(x.shape[0], -1, 16).abs().amax(2)
    return t, (amax_b / 6.0 / torch.where(t > 0, t, 1.0)).clamp(2.0 ** -6, 448).to(torch.float8_e4m3fn)


def nvfp4_no_flush(x):                     # the floor, but the 2^-6 clamp in tiny tensors too (no s = 0)
    t = x.abs().amax() / 2688.0
    t = torch.where(t < 2.0 ** -126, torch.tensor(2.0 ** -126), t)
    amax_b = x.reshape(x.shape[0], -1, 16).abs().amax(2)
    return t, ((amax_b / 6.0) / t).clamp(2.0 ** -6, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("check,bug,hint", [
    (check_block_quantize, fp32_log2_pow2, "one ulp below a power of two"),
    (check_block_quantize, inf_amax_scale_zero, "amax is inf takes scale 1"),
    (check_nvfp4_scales, nvfp4_other_order, "in that order"),
    (check_nvfp4_scales, nvfp4_fp64, "in that order"),
    (check_nvfp4_scales, nvfp4_python_float, "torch.float32 tensor of shape \\(\\)"),
    (check_nvfp4_scales, nvfp4_no_floor, "2\\^-126 .*never subnormal"),
    (check_nvfp4_scales, nvfp4_no_flush, "gets scale 0 \\(flushed whole\\)"),
    (check_mx_shared_exponent, lambda a, e: mx_shared_exponent(a, e, "floor").int(), "dtype torch.int64"),
])
def test_constructed_edges_catch(check, bug, hint):
    with pytest.raises(GradingError, match=hint):
        check(bug)


def test_near_pow2_amaxes_are_one_ulp_below():
    """The constructed amaxes do what the grader says: 448 / amax in FP32 is the float just below 2^n, and FP32
    log2 of it rounds up to n for n >= 5 (checked against exact rational arithmetic)."""
    from fractions import Fraction
    import numpy as np
    from mpcourse.course.grading.blocks import near_pow2_amaxes
    for a in near_pow2_amaxes():
        q = np.float32(448.0) / np.float32(a)
        n = round(float(np.log2(np.float64(q))))
        assert Fraction(float(q)) == Fraction(2) ** n - Fraction(2) ** (n - 24)
        assert abs(Fraction(448) / Fraction(a) - Fraction(float(q))) <= Fraction(2) ** (n - 25)   # correctly rounded
        if n >= 5:                      # below 4, FP32 log2 keeps n - 2^-24/ln 2 apart from n
            assert float(torch.log2(torch.tensor(q))) == n


def test_nvfp4_midpoint_blocks_separate_the_orders():
    """Each alternative order really lands on another E4M3 code for some block of the constructed tensor."""
    from mpcourse.course.grading.blocks import nvfp4_near_midpoints
    for amax in (1000.0, 3.3):
        x = nvfp4_near_midpoints(amax)
        t, s = lib_nvfp4(x)
        amax_b = x.reshape(x.shape[0], -1, 16).abs().amax(2)
        for other in (amax_b / (6.0 * t), (amax_b / t) / 6.0, (amax_b.double() / 6.0 / t.double()).float()):
            assert (other.clamp(2.0 ** -6, 448).to(torch.float8_e4m3fn).float() != s.float()).any()
