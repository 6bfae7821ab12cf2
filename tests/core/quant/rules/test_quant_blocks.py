"""Finer-grained scaling (mpcourse.core.quant scaled / block_recipes / block_gemm) against independent oracles.

Oracles: torchao 0.18's MX code (``to_mx``, FLOOR and RCEIL), its ``nvfp4_quantize`` and its rowwise
``Float8Linear`` (emulate=True), all run on CPU side by side; ``torch.nn.functional.scaled_mm`` (TensorWise and
RowWise on CPU; BlockWise on Hopper, GPU-marked); dequantize-then-FP32-GEMM; Transformer Engine's published
recipe defaults (``transformer_engine/common/recipe/__init__.py``). Cases from the OCP MX v1.0 spec and the
DeepSeek-V3 report (arXiv 2412.19437) are cited where they appear.
"""
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

from mpcourse.core.formats import all_values
from mpcourse.core.quant import (CurrentScaling, Float8BlockScaling, Float8RowwiseScaling, Format, MXFP8BlockScaling,
                                 NVFP4BlockScaling, accumulator_model_gemm, convert_to_float8_training, emulated_gemm,
                                 quantize_fp32_scaled, quantize_mx, quantize_nvfp4, scaled_gemm)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    ao_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    ao_float8 = pytest.importorskip("torchao.float8")


def spread(M=64, K=256, seed=0):
    """Values over 12 binades, some NaN-free outliers: exercises every scale path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-6, 6, K, base=2.0)
    x[5, 7] = 3e4
    x[9, :32] = 0.0   # an all-zero block
    return x


def fp4_values(packed: torch.Tensor, shape) -> torch.Tensor:
    return ao_kernels.f4_unpacked_to_f32(ao_kernels.unpack_uint4(packed)).reshape(shape)


@pytest.mark.parametrize("rule,mode", [("floor", "FLOOR"), ("rceil", "RCEIL")])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
def test_mx_matches_torchao_to_mx_bit_for_bit(rule, mode, elem):
    x = spread()
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}[elem]
    if elem == "e2m1" and rule == "rceil":
        pytest.skip("torchao's RCEIL path is for MXFP8")
    scale, data = mx_tensor.to_mx(x, dtype, 32, getattr(mx_tensor.ScaleCalculationMode, mode))
    q = quantize_mx(x, (1, 32), elem, rule)
    assert torch.equal(q.scale_inv.view(torch.uint8), scale.view(torch.uint8).reshape(64, 8))
    want = fp4_values(data, x.shape) if elem == "e2m1" else data.float()
    assert torch.equal(q.data.float(), want)


def test_mx_floor_rule_saturates_the_block_max_rceil_does_not():
    """OCP MX floor rule: [448 x 31, 1000] shares 2^(floor(log2 1000) - 8) = 2, and 1000 / 2 = 500 saturates to
    448 (dequantized 896): the known weakness RCEIL (torchao) and TE's MXFP8 avoid (scale 4: 1000 -> 1024)."""
    x = torch.tensor([[448.0] * 31 + [1000.0]])
    floor, rceil = quantize_mx(x, (1, 32), "e4m3", "floor"), quantize_mx(x, (1, 32), "e4m3", "rceil")
    assert float(floor.scale_inv.float()) == 2.0 and float(floor.dequantize()[0, 31]) == 896.0
    assert float(rceil.scale_inv.float()) == 4.0 and float(rceil.dequantize()[0, 31]) == 1024.0
    assert MXFP8BlockScaling().scale_rule == "rceil"   # the library's policy


def test_mx_shared_exponent_refuses_what_is_not_an_element_format():
    from mpcourse.core.quant import mx_shared_exponent
    for elem, rule in (("fp32", "floor"), ("bf16", "rceil"), ("e8m0", "floor")):
        with pytest.raises(ValueError, match="element format must be one of"):
            mx_shared_exponent(torch.ones(4), elem, rule)
    with pytest.raises(ValueError, match="rule must be one of"):
        mx_shared_exponent(torch.ones(4), "e4m3", "ceil")


def test_nvfp4_matches_torchao_nvfp4_quantize_bit_for_bit():
    x = spread(seed=1)
    t = nvfp4.per_tensor_amax_to_scale(x.abs().amax())
    scale, data = nvfp4.nvfp4_quantize(x, 16, t)
    q = quantize_nvfp4(x)
    assert torch.equal(q.tensor_scale_inv, t)
    assert torch.equal(q.scale_inv.view(torch.uint8), scale.view(torch.uint8).reshape(64, 16))
    assert torch.equal(q.data.float(), fp4_values(data, x.shape))
    assert set(q.data.float().unique().tolist()) <= set(all_values("e2m1").tolist())


def test_rowwise_linear_matches_torchao_rowwise_float8linear_bit_for_bit():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 128))
    cfg = dataclasses.replace(ao_float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    ao = ao_float8.convert_to_float8_training(copy.deepcopy(ref), config=cfg)
    ours = convert_to_float8_training(copy.deepcopy(ref), recipe=Float8RowwiseScaling())
    x, gy = torch.randn(64, 256), torch.randn(64, 128) * 1e-2
    outs = []
    for m in (ours, ao):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.backward(gy)
        outs.append((y.detach(), xx.grad, m[0].weight.grad, m[0].bias.grad))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_one_outlier_tile_flushes_only_its_tile():
    """A 1x128 tile with one 1e4 among values near 1e-2: per-tensor E4M3 flushes most small values, the 1x128
    tile flushes only that tile's, rowwise only that row's (DeepSeek-V3 3.3.1's motivation for fine tiles)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(256, 512, generator=g) + 0.5) * 1e-2
    x[3, 130] = 1e4
    flushed = {}
    for name, block in {"tensor": (-1, -1), "row": (1, -1), "tile": (1, 128)}.items():
        q = quantize_fp32_scaled(x, block, "e4m3", power_2_scale=True).dequantize()
        flushed[name] = (q == 0) & (x != 0)
    assert flushed["tensor"].float().mean() > 0.9
    assert flushed["row"].sum(1).nonzero().flatten().tolist() == [3]
    tile = flushed["tile"][3, 128:256].clone()
    assert not tile[2] and tile.sum() == 127 and int(flushed["tile"].sum()) == 127   # all but the outlier


def block_pairs():
    return {"tensorwise": ((-1, -1), (-1, -1)), "rowwise": ((1, -1), (1, -1)), "1x128x128x128": ((1, 128), (128, 128)),
            "mx": "mx", "nvfp4": "nvfp4"}


@pytest.mark.parametrize("name", list(block_pairs()))
def test_scaled_gemm_equals_dequantize_then_fp32_gemm(name):
    x, w = spread(128, 256, 2), spread(256, 256, 3)[:, :256]
    pair = block_pairs()[name]
    if pair == "mx":
        a, b = quantize_mx(x), quantize_mx(w)
    elif pair == "nvfp4":
        a, b = quantize_nvfp4(x), quantize_nvfp4(w, (16, 16))
    else:
        a, b = quantize_fp32_scaled(x, pair[0]), quantize_fp32_scaled(w, pair[1])
    y = scaled_gemm(a, b.t())
    assert torch.equal(y, a.dequantize() @ b.dequantize().t())


@pytest.mark.parametrize("blocks", [((-1, -1), (-1, -1)), ((1, -1), (1, -1))])
def test_cpu_scaled_mm_tensorwise_and_rowwise_equal_the_emulation(blocks):
    a = quantize_fp32_scaled(spread(64, 256, 4), blocks[0])
    b = quantize_fp32_scaled(spread(96, 256, 5), blocks[1]).t()
    assert torch.equal(scaled_gemm(a, b, route="native"), scaled_gemm(a, b, route="emulate"))
    with pytest.raises(RuntimeError, match="emulate"):
        scaled_gemm(quantize_mx(spread()), quantize_mx(spread(64, 256, 1)).t(), route="native")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="F.scaled_mm BlockWise1x128 x BlockWise128x128 needs a Hopper GPU (SM 9.0)")
def test_blockwise_emulation_matches_scaled_mm_on_hopper():
    x, w = spread(256, 512, 6).cuda(), spread(384, 512, 7).cuda()
    a, b = quantize_fp32_scaled(x, (1, 128), power_2_scale=True), quantize_fp32_scaled(w, (128, 128), power_2_scale=True)
    native = scaled_gemm(a, b.t(), torch.float32, route="native")
    emulated = scaled_gemm(a, b.t(), torch.float32, route="emulate")
    torch.testing.assert_close(native, emulated, rtol=1e-5, atol=1e-3 * float(emulated.abs().max()))


def test_accumulator_model_error_grows_with_k_and_promotion_bounds_it():
    """DeepSeek-V3 3.3.2: ~14-bit accumulation loses accuracy as K grows; promoting every 128 restores it."""
    g = torch.Generator().manual_seed(0)
    errs = {}
    for K in (256, 4096):
        a, b = torch.rand(8, K, generator=g), torch.rand(K, 8, generator=g)
        exact = a.double() @ b.double()
        for promote in (None, 128):
            y = accumulator_model_gemm(a, b, promote_every=promote).double()
            errs[K, promote] = float(((y - exact).abs() / exact).mean())
    assert errs[4096, None] > 4 * errs[256, None]
    assert errs[4096, 128] < errs[4096, None] / 5


def test_bits_per_element():
    x = spread(128, 256)
    assert quantize_mx(x).bits_per_element == 8.25
    assert quantize_nvfp4(x).bits_per_element == 4.5 + 32 / x.numel()


def test_te_recipe_defaults_and_refusals():
    r = Float8BlockScaling()
    assert (r.fp8_format, r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim, r.power_2_scales) \
        == (Format.E4M3, 1, 2, 1, True)
    with pytest.raises(ValueError, match="2D by 2D"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="attention"):
        Float8BlockScaling(fp8_dpa=True)
    m = MXFP8BlockScaling()
    assert (m.margin, m.fp8_format) == (0, Format.E4M3)
    n = NVFP4BlockScaling()
    assert (n.disable_rht, n.disable_stochastic_rounding, n.disable_2d_quantization) == (False, False, False)


def test_backward_requantizes_along_each_contraction_dim():
    """1x128 forward tiles of x become 128x1 tiles for the weight gradient; 2-D weight blocks are shared."""
    from mpcourse.core.quant.engine import quantizers
    from mpcourse.core.quant.rules.hadamard import rht
    r, x = quantizers(Float8BlockScaling()), spread(256, 256)
    assert r["input"](x, 1).block == (1, 128) and r["input"](x, 0).block == (128, 1)
    assert r["weight"](x, 0).block == r["weight"](x, 1).block == (128, 128)
    n = quantizers(NVFP4BlockScaling())
    assert torch.equal(n["weight"](x, 0).dequantize(), n["weight"](x, 1).dequantize())
    h = rht(x)   # orthogonal along M: h^T h == x^T x up to rounding
    torch.testing.assert_close(h.t() @ h, x.t() @ x, rtol=1e-4, atol=1e-2)


def test_shapes_a_block_cannot_take_raise_a_clear_error():
    with pytest.raises(ValueError, match="pad the dimension"):
        quantize_fp32_scaled(torch.randn(4, 100), (1, 128))
    with pytest.raises(ValueError, match="2-D"):
        quantize_mx(torch.randn(2, 4, 32))
    quantize_fp32_scaled(torch.randn(3, 100), (1, -1))   # rowwise takes any shape


@pytest.mark.parametrize("recipe", [Float8RowwiseScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                                    NVFP4BlockScaling(disable_stochastic_rounding=True), CurrentScaling()])
def test_linear_layer_under_each_recipe_is_close_to_fp32(recipe):
    torch.manual_seed(0)
    ref = nn.Linear(256, 128)
    lin = convert_to_float8_training(nn.Sequential(copy.deepcopy(ref)), recipe=recipe)
    x = torch.randn(128, 256)
    y, yr = lin(x), ref(x)
    tol = 0.3 if isinstance(recipe, NVFP4BlockScaling) else 0.08
    assert float((y - yr).norm() / yr.norm()) < tol


@pytest.mark.parametrize("rule,mode", [("floor", "FLOOR"), ("rceil", "RCEIL")])
def test_mx_edge_blocks_match_torchao(rule, mode):
    """Lesson 09's stated edges: all-zero, subnormal, one ulp below a power of two, +-inf and NaN blocks. With
    ``edges="torchao"`` (torchao's divisor where k = -127: the subnormal and 2^-120 rows), scale bytes and dequantized
    values equal torchao's; elements too, except a NaN block's under FLOOR (torchao writes x / inf there, the library
    NaN: both dequantize to NaN). The default departs on those two tiny rows only (tests/core/quant/test_quant_tiny_amax.py)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 32, generator=g)
    x[0] = 0.0
    x[1] = 1e-40
    x[2, 5] = float(torch.nextafter(torch.tensor(256.0), torch.tensor(0.0)))
    x[3, 0], x[4, 9], x[5, 1] = float("inf"), -float("inf"), float("nan")
    x[6] = 2.0 ** -120
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, getattr(mx_tensor.ScaleCalculationMode, mode))
    q = quantize_mx(x, (1, 32), "e4m3", rule, edges="torchao")
    assert torch.equal(q.scale_inv.view(torch.uint8).flatten(), scale.view(torch.uint8).flatten())
    want_dq = mx_tensor.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(q.dequantize().nan_to_num(7.0), want_dq.nan_to_num(7.0))
    assert bool(q.dequantize()[5].isnan().all()) and bool(q.data[5].float().isnan().all())
    rows = [0, 1, 2, 3, 4, 6, 7] if rule == "floor" else list(range(8))
    assert torch.equal(q.data.float()[rows].nan_to_num(7.0), data.float()[rows].nan_to_num(7.0))
    default = quantize_mx(x, (1, 32), "e4m3", rule)
    same = [0, 2, 3, 4, 5, 7]                     # the default's OCP divisor 2^-127 changes the tiny rows 1 and 6 only
    assert torch.equal(default.data.view(torch.uint8)[same], q.data.view(torch.uint8)[same])
    assert not torch.equal(default.data.view(torch.uint8)[[1, 6]], q.data.view(torch.uint8)[[1, 6]])
