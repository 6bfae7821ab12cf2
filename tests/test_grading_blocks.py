"""Lesson 09's graders: pass on the library's implementations, fail on planted bugs with a helpful message."""
import pytest
import torch

from mpcourse.core.quant import mx_shared_exponent, quantize_fp32_scaled, quantize_nvfp4
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.blocks import check_block_quantize, check_mx_shared_exponent, check_nvfp4_scales


def lib_block(x, block):
    q = quantize_fp32_scaled(x, block, "e4m3", power_2_scale=True)
    return q.data, q.scale_inv


def lib_nvfp4(x):
    q = quantize_nvfp4(x)
    return q.tensor_scale_inv, q.scale_inv


def test_library_passes(capsys):
    check_block_quantize(lib_block)
    check_mx_shared_exponent(lambda a, e: mx_shared_exponent(a, e, "floor"))
    check_nvfp4_scales(lib_nvfp4)
    assert capsys.readouterr().out.count("PASS") == 3


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
