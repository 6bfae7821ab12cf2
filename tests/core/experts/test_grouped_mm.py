"""The experts' grouped GEMM (mpcourse.core.experts.grouped_mm) in every format, forward and backward, against:

* a per-expert loop of the course's dense layer on the same tokens: ``Float8Linear`` under the format's block recipe
  (inside its ``quant.autocast`` region) or ``nn.functional.linear`` under ``torch.autocast`` (inside the tensor-core
  emulation) for the high-precision formats, each expert's tokens zero-padded to the dense layer's token multiple;
* dequantize-then-``torch._grouped_mm``: every operand quantized in one call over the whole padded tensor (blocks
  along the tokens stay inside a group because the layout's alignment is a multiple of the block), dequantized,
  then one FP32 ``torch._grouped_mm`` with the padded group ends;
* torchao 0.18: ``_to_mxfp8_then_scaled_grouped_mm(..., kernel_preference=KernelPreference.EMULATED)`` forward and
  backward, its BF16 grouped GEMM computed as a tensor core computes it (exact products, FP32 sums, one rounding:
  its operands are dequantized MXFP8 values, exact in BF16); the rowwise path, whose Triton kernels do not run on a
  CPU, through torchao's own PyTorch reference quantizers (``tensor_to_scale``, ``torch_to_float8_per_group_colwise``,
  ``torch_to_3d_rowwise_float8_transpose_rhs``).
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpcourse.core import quant
from mpcourse.core.emulation import tensor_cores
from mpcourse.core.experts import GROUPED_FORMATS, grouped_mm, pad_groups, token_groups, unpad_groups
from mpcourse.core.experts import expert_gemms
from rule_quantize import quantize
from mpcourse.core.quant.block_recipes import token_multiple

K, N = 128, 256                                   # multiples of 128: every format's blocks divide them
COUNTS = [40, 0, 130, 7]                          # uneven, one expert without tokens, sizes off every alignment
QUANTIZED = [f for f, g in GROUPED_FORMATS.items() if g.quantized]
HIGH = [f for f, g in GROUPED_FORMATS.items() if not g.quantized]


def operands(fmt, counts=COUNTS, dtype=torch.float32, seed=0):
    """(x padded, w, dy padded, groups): tokens with a spread of magnitudes, padding rows zero."""
    gen = torch.Generator().manual_seed(seed)
    g = token_groups(torch.tensor(counts), GROUPED_FORMATS[fmt].alignment)
    x = torch.randn(sum(counts), K, generator=gen) * torch.logspace(-3, 3, K, base=2.0)
    dy = torch.randn(sum(counts), N, generator=gen) * 1e-3
    w = torch.randn(len(counts), N, K, generator=gen) * 0.05
    return pad_groups(x, g).to(dtype), w.to(dtype), pad_groups(dy, g), g


def ours(fmt, x, w, dy, g, out_dtype=None):
    """(y, dx, dw) of ``grouped_mm`` (inside the tensor-core emulation, as the training loop runs)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with tensor_cores(True):
        y = grouped_mm(x, w, g, fmt, out_dtype)
        y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


def dense_expert(fmt, x_e, w_e, dy_e, need=(True, True)):
    """(y, dx, dW) of the course's dense layer (bias-free) on one expert's tokens, the gradients ``need`` asks for."""
    f = GROUPED_FORMATS[fmt]
    x_e, w_e = x_e.clone().requires_grad_(need[0]), w_e.clone().requires_grad_(need[1])
    if f.quantized:
        layer = quant.convert_to_float8_training(nn.Sequential(nn.Linear(K, N, bias=False)), recipe=f.recipe)[0]
        layer.weight = nn.Parameter(w_e, requires_grad=need[1])
        with quant.autocast(enabled=True, recipe=f.recipe):
            y = layer(x_e)
        y.backward(dy_e)
        return y.detach(), x_e.grad, layer.weight.grad
    with tensor_cores(True), torch.autocast("cpu", dtype=f.dtype, enabled=f.dtype != torch.float32):
        y = F.linear(x_e, w_e)
    with tensor_cores(True):
        y.backward(dy_e.to(y.dtype))
    return y.detach(), x_e.grad, w_e.grad


@pytest.mark.parametrize("fmt", list(GROUPED_FORMATS))
def test_every_format_equals_the_dense_layer_per_expert_bit_for_bit(fmt):
    """Forward and input gradient from the dense layer on the expert's tokens; weight gradient from the dense layer
    on the tokens zero-padded to its token multiple (its blocks along M), as ``expert_gemms.wgrad`` pads them. (The
    row counts match so that the FP32 GEMMs have the same shapes: on AVX2 their bits depend on the row count.)"""
    x, w, dy, g = operands(fmt)
    y, dx, dw = ours(fmt, x, w, dy, g)
    f = GROUPED_FORMATS[fmt]
    m = token_multiple(f.recipe) if f.quantized else 1
    for e, (s, n) in enumerate(g.spans()):
        if n == 0:
            assert not dw[e].any()
            continue
        rows = -(-n // m) * m
        pad = lambda t: torch.cat([t[s:s + n], t.new_zeros(rows - n, t.shape[1])])
        y_e, dx_e, _ = dense_expert(fmt, x[s:s + n], w[e], dy[s:s + n], need=(True, False))
        _, _, dw_e = dense_expert(fmt, pad(x), w[e], pad(dy), need=(False, True))
        assert torch.equal(y[s:s + n], y_e), f"{fmt}: expert {e}'s output"
        assert torch.equal(dx[s:s + n], dx_e), f"{fmt}: expert {e}'s input gradient"
        assert torch.equal(dw[e], dw_e), f"{fmt}: expert {e}'s weight gradient"
    assert (y.dtype, dx.dtype, dw.dtype) == (f.dtype or torch.float32, torch.float32, torch.float32)
    assert not y[~g.real_rows].any() and not dx[~g.real_rows].any()


def dequantized_whole(fmt, t, role, axis, g):
    """``t`` (grouped as ``g`` says) quantized by the format's dense rule in ONE call over the whole tensor,
    dequantized (FP32). Rowwise along the tokens takes one scale per column of a whole dimension: group by group."""
    f = GROUPED_FORMATS[fmt]
    if fmt == "fp8-rowwise" and axis == 0:
        out = torch.zeros_like(t, dtype=torch.float32)
        for s, n in g.spans():
            if n:
                out[s:s + n] = quantize(t[s:s + n], f, role, 0).dequantize(torch.float32)
        return out
    return quantize(t, f, role, axis).dequantize(torch.float32)


def relayout(t, g, g2):
    """Rows of ``t`` grouped as ``g`` regrouped as ``g2`` (the same counts, another alignment)."""
    return pad_groups(unpad_groups(t, g), g2)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_every_direction_equals_dequantize_then_torch_grouped_mm(fmt):
    """Forward and input gradient over the tokens without padding; the weight gradient over the groups padded to
    the format's block along the tokens (1 for rowwise, 32 for MXFP8, 128 for 1x128 tiles), so that each FP32
    GEMM has the row count ``expert_gemms`` gives it."""
    x, w, dy, g = operands(fmt)
    y, dx, dw = ours(fmt, x, w, dy, g)
    f = GROUPED_FORMATS[fmt]
    bare, blocked = token_groups(g.counts, 1), token_groups(g.counts, token_multiple(f.recipe))
    wq1 = torch.stack([quantize(w_e, f, "weight", 1).dequantize(torch.float32) for w_e in w])
    wq0 = torch.stack([quantize(w_e, f, "weight", 0).dequantize(torch.float32) for w_e in w])
    xb, dyb = relayout(x, g, bare), relayout(dy, g, bare)
    want_y = torch._grouped_mm(dequantized_whole(fmt, xb, "input", 1, bare), wq1.transpose(-2, -1), offs=bare.offs)
    want_dx = torch._grouped_mm(dequantized_whole(fmt, dyb, "grad_output", 1, bare), wq0, offs=bare.offs)
    xk, dyk = relayout(x, g, blocked), relayout(dy, g, blocked)
    want_dw = torch._grouped_mm(dequantized_whole(fmt, dyk, "grad_output", 0, blocked).t(),
                                dequantized_whole(fmt, xk, "input", 0, blocked), offs=blocked.padded_offs)  # (E, N, K)
    assert torch.equal(unpad_groups(y, g), want_y) and torch.equal(unpad_groups(dx, g), want_dx)
    assert torch.equal(dw, want_dw)
    assert not y[~g.real_rows].any() and not dx[~g.real_rows].any()


@pytest.mark.parametrize("fmt", HIGH)
def test_high_precision_equals_torch_grouped_mm_and_is_emulated(fmt):
    """FP32: ``torch._grouped_mm`` itself. BF16/FP16: the tensor-core rule, FP32 ``_grouped_mm`` of the upcast
    operands rounded once (the emulation's counter shows the GEMMs went through it)."""
    from mpcourse.core.emulation import emulated_calls

    dt = GROUPED_FORMATS[fmt].dtype
    x, w, dy, g = operands(fmt, dtype=dt)
    before = emulated_calls()
    y, dx, dw = ours(fmt, x, w, dy, g)
    assert emulated_calls() - before == (0 if dt == torch.float32 else 9)   # 3 experts with tokens x 3 GEMMs
    bare = token_groups(g.counts, 1)
    xb, dyb, up = unpad_groups(x, g).float(), unpad_groups(dy, g).to(dt).float(), (lambda t: t.float())
    want_y = torch._grouped_mm(xb, up(w).transpose(-2, -1), offs=bare.offs).to(dt)
    want_dx = torch._grouped_mm(dyb, up(w), offs=bare.offs).to(dt)
    want_dw = torch._grouped_mm(dyb.t(), xb, offs=bare.offs).to(dt)
    assert torch.equal(unpad_groups(y, g), want_y) and torch.equal(unpad_groups(dx, g), want_dx)
    assert torch.equal(dw, want_dw)


# ------------------------------------------------------------------------------------------------ torchao
def _moe_training():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao.prototype.moe_training",
                                   reason="torchao 0.18 (prototype.moe_training) is not importable here")


class EmulatedGroupedMM(TorchDispatchMode):
    """``aten._grouped_mm`` on low-precision CPU operands as a tensor core computes it: upcast exactly, FP32 sums
    (``torch._grouped_mm`` in FP32), one rounding to the output dtype; every other op unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.float32:
            a, b, offs = args[0], args[1], (args[2] if len(args) > 2 else kwargs.pop("offs", None))
            out_dtype = kwargs.pop("out_dtype", None) or a.dtype
            return torch._grouped_mm(a.float(), b.float(), offs=offs).to(out_dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("counts", [[32, 64, 0, 96], [64, 32, 32, 128], [5, 37, 0, 70]])
def test_mxfp8_equals_torchao_emulated_forward_and_backward_bit_for_bit(counts):
    """Groups of multiples of 32 as they are; other sizes through torchao's own padding
    (``pad_token_groups_for_grouped_mm=True``), compared on the tokens (torchao unpads its outputs)."""
    moe = _moe_training()
    from torchao.quantization.quantize_.common import KernelPreference

    x, w, dy, g = operands("mxfp8", counts, dtype=torch.bfloat16)
    dy = dy.bfloat16()
    pad = any(n % 32 for n in counts)
    xa = (unpad_groups(x, g) if pad else x).clone().requires_grad_(True)
    wa = w.clone().requires_grad_(True)
    with EmulatedGroupedMM():
        ya = moe._to_mxfp8_then_scaled_grouped_mm(xa, wa.transpose(-2, -1), g.offs if pad else g.padded_offs,
                                                  out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=pad,
                                                  kernel_preference=KernelPreference.EMULATED)
        ya.backward(unpad_groups(dy, g) if pad else dy)
    y, dx, dw = ours("mxfp8", x, w, dy, g, out_dtype=torch.bfloat16)
    if pad:
        y, dx = unpad_groups(y, g), unpad_groups(dx, g)
    assert torch.equal(y, ya.detach())
    assert torch.equal(dx, xa.grad)
    assert torch.equal(dw, wa.grad)


def test_rowwise_equals_torchao_reference_quantizers_bit_for_bit():
    """torchao's rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``) runs Triton kernels; its PyTorch
    reference quantizers give the operands it computes with: A per token, B_t per expert per output column (over
    K), dy per token, B per expert per input column (over N, ``torch_to_3d_rowwise_float8_transpose_rhs``), and in
    the weight gradient dy and A per expert group per column (``torch_to_float8_per_group_colwise``). Every group
    holds tokens: torchao's reference raises on an empty one (an amax over an empty dimension); the course's gives
    that expert a zero weight gradient (``test_upstream_bugs.py``)."""
    _moe_training()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training import utils as ao

    x, w, dy, g = operands("fp8-rowwise", [48, 16, 112, 32])         # multiples of 16: torchao's requirement
    e4m3 = torch.float8_e4m3fn

    def rows(t, dim):                                               # torchao's axiswise cast, dequantized
        s = tensor_to_scale(t, e4m3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.float() * s, e4m3).float() / s

    def per_group(t):
        data, scales = ao.torch_to_float8_per_group_colwise(t, g.padded_offs, e4m3, round_scales_to_power_of_2=True)
        col = torch.cat([scales.reshape(-1, t.shape[1])[e].expand(n, -1)
                         for e, n in enumerate(torch.diff(g.padded_offs, prepend=g.padded_offs.new_zeros(1)).tolist())])
        return data.float() / col

    b_t = w.transpose(-2, -1)                                       # (E, K, N) per-expert column-major
    b_dgrad, b_scales = ao.torch_to_3d_rowwise_float8_transpose_rhs(b_t, e4m3, round_scales_to_power_of_2=True)
    want_y = torch._grouped_mm(rows(x, -1), rows(b_t, -2), offs=g.padded_offs)
    want_dx = torch._grouped_mm(rows(dy, -1), b_dgrad.float() / b_scales, offs=g.padded_offs)   # (E, N, K)
    want_dw = torch._grouped_mm(per_group(dy).t(), per_group(x), offs=g.padded_offs)
    y, dx, dw = ours("fp8-rowwise", x, w, dy, g)
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx) and torch.equal(dw, want_dw)


# ------------------------------------------------------------------------------------------------ edges
def test_expert_gemms_pad_the_weight_gradient_group_to_its_block():
    """wgrad pads an expert's tokens with zero rows to the block along M (32 MXFP8, 128 1x128 tiles); a group of
    any size trains, and its dW equals the one from tokens padded by hand."""
    f = GROUPED_FORMATS["mxfp8"]
    dy, x = torch.randn(37, N), torch.randn(37, K)
    got = expert_gemms.wgrad(dy, x, f, torch.float32, N, K)
    pad = lambda t: torch.cat([t, t.new_zeros(27, t.shape[1])])
    want = expert_gemms.wgrad(pad(dy), pad(x), f, torch.float32, N, K)
    assert torch.equal(got, want) and expert_gemms.pad_rows(x, 32).shape == (64, K)


def test_bad_operands_are_refused_with_the_fix():
    x, w, dy, g = operands("fp32")
    with pytest.raises(ValueError, match="pad x with grouping.pad_groups"):
        grouped_mm(x[:-1], w, g)
    with pytest.raises(ValueError, match="flatten the tokens"):
        grouped_mm(x[None], w, g)
    with pytest.raises(ValueError, match="K = 128"):
        grouped_mm(x[:, :64], w, g)
    with pytest.raises(ValueError, match="use one of fp32, bf16"):
        grouped_mm(x, w, g, "fp8-tensorwise")
    with pytest.raises(ValueError, match="leave out_dtype as None"):
        grouped_mm(x, w, g, "bf16", torch.float32)
