"""Oracle: torchao's Float8Linear (tensorwise dynamic scaling, emulate=True) against our CurrentScaling(HYBRID).

torchao (pytorch/ao ``torchao/float8``) casts input and weight to E4M3 and the output gradient to E5M2,
each with ``scale = finfo.max / clamp(amax in fp64, min=1e-12)``, and in emulation computes every GEMM
as ``mm(data_a / scale_a, data_b / scale_b)`` in FP32. Our recipe differs only in arithmetic details
(fp32 division for the scale, multiplication by 1/scale to dequantize), so:
* with power-of-two scales both are exact and must agree bit for bit;
* with arbitrary data they agree to FP32 rounding.
Skipped when torchao is not installed (``pip install --no-deps torchao``; 0.18 works with torch 2.13).
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao_float8 = pytest.importorskip("torchao.float8")

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8LinearConfig, Format,  # noqa: E402
                                  convert_to_float8_training)


def _pair(K, N, bias=True):
    ref = nn.Sequential(nn.Linear(K, N, bias=bias))
    ours = convert_to_float8_training(copy.deepcopy(ref), recipe=CurrentScaling(fp8_format=Format.HYBRID))
    ao = torchao_float8.convert_to_float8_training(copy.deepcopy(ref),
                                                   config=torchao_float8.Float8LinearConfig(emulate=True))
    assert type(ao[0]).__name__ == "Float8Linear"
    return ours, ao


def _run(model, x, gy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(gy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _with_amax(t: torch.Tensor, amax: float) -> torch.Tensor:
    t = t.clamp(-amax, amax)
    t[0, 0] = amax
    return t


def test_power_of_two_scales_match_torchao_bit_for_bit():
    torch.manual_seed(0)
    M, K, N = 32, 48, 64
    ours, ao = _pair(K, N)
    w = _with_amax(torch.randn(N, K) * 0.1, 3.5 / 16)  # amaxes 3.5 * 2^k: scales 448 / 3.5 = 128 * 2^-k,
    with torch.no_grad():  # 57344 / 3.5 = 16384 * 2^-k, all powers of two
        for m in (ours, ao):
            m[0].weight.copy_(w)
    x = _with_amax(torch.randn(M, K) * 2, 3.5)
    gy = _with_amax(torch.randn(M, N) * 1e-3, 3.5 / 1024)
    for got, want in zip(_run(ours, x, gy), _run(ao, x, gy)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_data_matches_torchao_to_rounding(dtype):
    torch.manual_seed(1)
    M, K, N = 64, 32, 48
    ours, ao = _pair(K, N)
    ours, ao = ours.to(dtype), ao.to(dtype)
    x, gy = torch.randn(M, K, dtype=dtype) * 5, torch.randn(M, N, dtype=dtype) * 1e-2
    for got, want in zip(_run(ours, x, gy), _run(ao, x, gy)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 * want.float().abs().max().item())


def test_config_keyword_matches_torchao_config_bit_for_bit():
    """torchao's spelling ``config=Float8LinearConfig(round_scales_to_power_of_2=True)`` on both sides:
    power-of-two scales make every cast and GEMM exact, so arbitrary data must agree bit for bit."""
    torch.manual_seed(2)
    M, K, N = 32, 48, 64
    ref = nn.Sequential(nn.Linear(K, N))
    ours = convert_to_float8_training(copy.deepcopy(ref), config=Float8LinearConfig(round_scales_to_power_of_2=True))
    ao = torchao_float8.convert_to_float8_training(
        copy.deepcopy(ref), config=torchao_float8.Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True))
    assert ours[0].recipe == CurrentScaling(fp8_format=Format.HYBRID, use_power_2_scales=True)
    x, gy = torch.randn(M, K) * 3, torch.randn(M, N) * 1e-3
    for got, want in zip(_run(ours, x, gy), _run(ao, x, gy)):
        assert torch.equal(got, want)


def test_config_keyword_equals_the_recipe_it_means_and_refuses_contradictions():
    ref = nn.Sequential(nn.Linear(32, 16))
    a = convert_to_float8_training(copy.deepcopy(ref), config=Float8LinearConfig(pad_inner_dim=True))
    b = convert_to_float8_training(copy.deepcopy(ref), recipe=CurrentScaling(), pad_inner_dim=True)
    assert a[0].recipe == b[0].recipe and a[0].pad_inner_dim and b[0].pad_inner_dim
    x = torch.randn(8, 32)
    assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="one place"):
        convert_to_float8_training(copy.deepcopy(ref), config=Float8LinearConfig(), pad_inner_dim=True)
    with pytest.raises(ValueError, match="use_power_2_scales"):
        convert_to_float8_training(copy.deepcopy(ref), config=Float8LinearConfig(round_scales_to_power_of_2=True),
                                   recipe=DelayedScaling())
    with pytest.raises(TypeError, match="Float8LinearConfig"):
        convert_to_float8_training(copy.deepcopy(ref), config=torchao_float8.Float8LinearConfig())
