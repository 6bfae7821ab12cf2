"""The FP8 GEMM and layer on a CUDA GPU (compute capability 8.9+) against the CPU, where torch._scaled_mm is exact.

On the CPU ``torch._scaled_mm`` computes ``(float32(A) * scale_a) @ (float32(B) * scale_b)`` in FP32 (see
``tests/core/quant/layers/test_fp8_linear.py``), so the CPU is the oracle: cuBLASLt's FP8 GEMM must agree to FP32 accumulation
error, ``|err| <= c * K * 2**-24 * (|A| @ |B|)`` elementwise, and with fast accumulation (the forward GEMM, as
torchao uses it) to a looser bound; every amax and scale must be identical bit for bit (they are exact maxima
and correctly rounded FP32 divisions on both devices).

Marked ``gpu``: skipped without CUDA. ``benchmarks/gpu_suite.py`` runs them on a lent GPU. To rehearse the test
code itself on a CPU, set ``MPCOURSE_GPU_TESTS_DEVICE=cpu`` (the CUDA-only layout/alignment checks then skip).
"""
import copy
import os

import pytest
import torch
import torch.nn as nn

from mpcourse.core.quant import DelayedScaling, CurrentScaling, Float8Linear, fp8_autocast, fp8_gemm, quantize_current

DEVICE = os.environ.get("MPCOURSE_GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.is_available()
                       and torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores (8.9+)"),
]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA-only rule")


def _bound(a8, b8, rel):
    """Elementwise error bound ``rel * (|A| @ |B|)`` from the dequantized operands, in FP32 on the CPU."""
    a = a8.dequantize(torch.float32).cpu().abs()
    b = b8.dequantize(torch.float32).cpu().abs()
    return rel * (a @ b) + 1e-30


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("fmt_b", ["e4m3", "e5m2"])
def test_fp8_gemm_matches_the_exact_cpu_gemm(fast_accum, fmt_b):
    g = torch.Generator().manual_seed(0)
    M, K, N = 64, 256, 48
    a = torch.randn(M, K, generator=g) * 3
    b = torch.randn(N, K, generator=g) * 0.05
    a8, b8 = quantize_current(a, "e4m3"), quantize_current(b, fmt_b)
    want = fp8_gemm(a8, b8.t(), torch.float32)  # CPU: exact FP32 arithmetic on the dequantized operands
    to = lambda q: type(q)(q.data.to(DEVICE), q.scale_inv.to(DEVICE), q.orig_dtype)
    got = fp8_gemm(to(a8), to(b8).t(), torch.float32, use_fast_accum=fast_accum).cpu()
    rel = 2.0 ** -10 if fast_accum else 4 * K * 2.0 ** -24
    assert ((got - want).abs() <= _bound(a8, b8.t(), rel)).all()
    got_bf16 = fp8_gemm(to(a8), to(b8).t(), torch.bfloat16).cpu()  # one rounding of the FP32 result
    assert ((got_bf16.float() - want).abs() <= want.abs() * 2.0 ** -8 + _bound(a8, b8.t(), rel)).all()


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_the_gpu_matches_the_cpu_layer(recipe, dtype):
    torch.manual_seed(0)
    cpu = Float8Linear(128, 64, recipe=recipe)
    dev = copy.deepcopy(cpu).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = (torch.randn(32, 128, generator=g) * (step + 1)).to(dtype)
        gy = (torch.randn(32, 64, generator=g) * 1e-3).to(dtype)  # fixed gradients: their amaxes are exact
        outs = []
        for layer in (cpu, dev):
            xl = x.to(layer.weight.device).clone().requires_grad_(True)  # a leaf of its own per layer
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(xl)
            y.backward(gy.to(y.device))
            outs.append([t.detach().float().cpu().clone() for t in (y, xl.grad, layer.weight.grad, layer.bias.grad)])
            layer.weight.grad = layer.bias.grad = None
        (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = outs
        scale = lambda t: t.abs().amax().clamp_min(1e-30)
        rel_out = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -9  # output rounding + fast accumulation
        assert (y1 - y0).abs().amax() <= rel_out * scale(y0) * 8
        assert (dx1 - dx0).abs().amax() <= rel_out * scale(dx0) * 8
        assert (dw1 - dw0).abs().amax() <= 2.0 ** -12 * scale(dw0) * 8
        assert torch.equal(db1, db0) or (db1 - db0).abs().amax() <= 1e-6 * scale(db0)
        for role, s in cpu.scaling_state.items():  # delayed scaling: the same scales, bit for bit
            assert torch.equal(s.scale, dev.scaling_state[role].scale.cpu()), role
            assert torch.equal(s.amax_history, dev.scaling_state[role].amax_history.cpu()), role


@cuda_only
def test_cuda_alignment_rule_and_exact_padding():
    torch.manual_seed(0)
    layer = Float8Linear(24, 40, recipe=CurrentScaling()).to(DEVICE)  # 24, 40: not multiples of 16
    with pytest.raises(ValueError, match="pad_inner_dim"):
        layer(torch.randn(8, 24, device=DEVICE))
    padded = Float8Linear.from_float(nn.Linear(24, 40), recipe=CurrentScaling(), pad_inner_dim=True)
    ref = copy.deepcopy(padded)
    padded.to(DEVICE)
    x = torch.randn(10, 24)
    got, want = padded(x.to(DEVICE)).cpu(), ref(x)
    assert ((got - want).abs() <= 2.0 ** -9 * want.abs().amax() * 8).all()


@cuda_only
def test_cuda_refuses_e5m2_times_e5m2_before_cublas():
    a8 = quantize_current(torch.randn(16, 16, device=DEVICE), "e5m2")
    b8 = quantize_current(torch.randn(16, 16, device=DEVICE), "e5m2")
    with pytest.raises(ValueError, match="E4M3"):
        fp8_gemm(a8, b8.t(), torch.float32)
