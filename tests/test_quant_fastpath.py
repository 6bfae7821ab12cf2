"""The fused fast paths of ``mpcourse.core.quant.fastpath`` equal the rules they replace, bit for bit.

Rules: torch's own float8 -> float32 cast, ``torch._scaled_mm`` on a CPU, ``formats.round_to(..., "e2m1",
saturate=True)`` (itself checked against ml_dtypes in tests/test_formats_mx.py), and the block layer's
re-quantization of a 2-D weight block.
"""
import pytest
import torch

from mpcourse.core.formats import round_to
from mpcourse.core.quant import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, Float8RowwiseScaling
from mpcourse.core.quant.block_gemm import scaled_gemm
from mpcourse.core.quant.block_linear import same_both_axes
from mpcourse.core.quant.fastpath import cpu_scaled_mm, fp8_to_float32, round_e2m1
from mpcourse.core.quant.scaled import quantize_fp32_scaled

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same FP32 bit patterns; NaN only where the other has NaN (payloads may differ)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(torch.where(na, 0, a.view(torch.int32)),
                                               torch.where(nb, 0, b.view(torch.int32)))


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_upcast_equals_torch_cast_on_every_code_and_layout(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    assert bits_equal(fp8_to_float32(codes), codes.float())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (48, 80), generator=g, dtype=torch.int32).to(torch.uint8).view(dtype)
    for t in (x, x.t(), x[:, ::2]):
        out = fp8_to_float32(t)
        assert bits_equal(out, t.float()) and out.shape == t.shape
    assert fp8_to_float32(x.t()).stride() == x.t().float().stride()      # a column-major operand stays one
    s = torch.tensor(0.3712)                                             # not a power of two: products round
    assert bits_equal(fp8_to_float32(x, s), x.float() * s)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [0.3712, 2.0 ** -140, 3e-41, 1e-38, 1e30, 2.0 ** 120, 3e38, float("inf"), 0.0])
def test_fp8_upcast_with_a_scale_rounds_each_product_once(dtype, scale):
    """float32(code) * scale for every code: the E4M3 path folds its 2^8 into the scale, which must stay exact for
    FP32-subnormal scales and fall back to two multiplies where 2^8 * scale overflows (2^120, 3e38); an infinite
    or zero scale gives the rule's inf, NaN (0 * inf) and signed zeros."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    s = torch.tensor(scale, dtype=torch.float32)
    assert bits_equal(fp8_to_float32(codes, s), codes.float() * s)
    assert bits_equal(fp8_to_float32(codes.reshape(16, 16).t(), s), codes.reshape(16, 16).t().float() * s)


def test_fp8_upcast_keeps_e4m3_nan_of_either_sign_only_where_it_is():
    """E4M3's NaN codes (0x7F, 0xFF) would read as +-1.875 * 2^8 through FP16 bits: each sign alone is found."""
    base = torch.full((1000,), 0x38, dtype=torch.uint8)                   # 1.0
    for nan_code in (0x7F, 0xFF):
        t = base.clone()
        t[[3, 777]] = nan_code
        x = t.view(torch.float8_e4m3fn)
        out = fp8_to_float32(x)
        assert bits_equal(out, x.float()) and int(out.isnan().sum()) == 2
    assert not fp8_to_float32(base.view(torch.float8_e4m3fn)).isnan().any()
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        fp8_to_float32(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("mkn", [(1024, 128, 384), (1024, 512, 128), (384, 1024, 128), (128, 1024, 512), (33, 17, 5)])
def test_cpu_scaled_mm_equals_torch_scaled_mm(mkn, out_dtype):
    M, K, N = mkn
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(M, K, generator=g) * 40).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, generator=g) * 900).to(torch.float8_e5m2).t()           # (K, N) column-major
    sa, sb = torch.tensor(0.0371), torch.tensor(3.3)
    ref = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert torch.equal(cpu_scaled_mm(a, b, sa, sb, out_dtype), ref)
    a_col = a.t().contiguous().t()                                                  # a column-major A too
    assert torch.equal(cpu_scaled_mm(a_col, b, sa, sb, out_dtype),
                       torch._scaled_mm(a_col, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype))
    b_row = b.contiguous()                                                          # row-major B too
    assert torch.equal(cpu_scaled_mm(a, b_row, sa, sb, out_dtype),
                       torch._scaled_mm(a, b_row.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype))


def _e2m1_cases() -> torch.Tensor:
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, 8, 1e30, float("inf"),
                         float("nan"), 1e-45, 1e-40, 2.0 ** -126, 0.125, 5.9, 6.1, 2.0 ** -40, 2.0 ** -39, 2.0 ** -62])
    up, down = torch.nextafter(grid, torch.tensor(float("inf"))), torch.nextafter(grid, torch.tensor(0.0))
    g = torch.Generator().manual_seed(2)
    every_bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (100_000,), generator=g, dtype=torch.int64).int().view(torch.float32)
    x = torch.cat([grid, up, down, torch.randn(50_000, generator=g) * 3, torch.rand(50_000, generator=g) * 8,
                   torch.randn(5_000, generator=g) * 1e-20, every_bits])
    return torch.cat([x, -x])


def test_round_e2m1_nearest_equals_the_rule():
    x = _e2m1_cases()
    fast, rule = round_e2m1(x), round_to(x, "e2m1", saturate=True)
    assert bits_equal(fast, rule)
    assert torch.equal(fast.to(torch.float8_e4m3fn).view(torch.uint8), rule.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.signbit(round_e2m1(torch.tensor([-0.0, -0.1]))).all()              # -0.0 stays -0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_round_e2m1_stochastic_draws_and_rounds_as_the_rule(seed):
    x = _e2m1_cases()
    fast = round_e2m1(x, "stochastic", torch.Generator().manual_seed(seed))
    rule = round_to(x, "e2m1", rounding="stochastic", saturate=True, generator=torch.Generator().manual_seed(seed))
    assert bits_equal(fast, rule)
    torch.manual_seed(seed)                                                         # the global generator too
    fast = round_e2m1(x, "stochastic")
    after_fast = torch.get_rng_state()
    torch.manual_seed(seed)
    rule = round_to(x, "e2m1", rounding="stochastic", saturate=True)
    assert bits_equal(fast, rule) and torch.equal(after_fast, torch.get_rng_state())


def test_round_e2m1_stochastic_below_2_to_the_minus_9_carries_as_the_rule():
    """|y| < 2^-9 takes the fast path's second branch (32 or more dropped bits, the draw's high word): values that
    round up to 0.5 now and then, FP32 subnormals, zeros, and a transposed (non-contiguous) input."""
    g = torch.Generator().manual_seed(12)
    tiny = torch.rand(200_000, generator=g) * (2.0 ** -9 - 2.0 ** -12) + 2.0 ** -12
    x = torch.cat([tiny, -tiny[:1000], torch.rand(1000, generator=g) * 2.0 ** -126, torch.zeros(100),
                   torch.full((50,), 2.0 ** -9), torch.full((50,), 2.0 ** -9).nextafter(torch.tensor(0.0))])
    fast = round_e2m1(x, "stochastic", torch.Generator().manual_seed(4))
    rule = round_to(x, "e2m1", rounding="stochastic", saturate=True, generator=torch.Generator().manual_seed(4))
    assert bits_equal(fast, rule) and int((rule != 0).sum()) > 100        # the carry branch is taken
    m = x[:200_000].reshape(400, 500).t()                                   # (500, 400), a transposed view
    fast = round_e2m1(m, "stochastic", torch.Generator().manual_seed(5))
    rule = round_to(m, "e2m1", rounding="stochastic", saturate=True, generator=torch.Generator().manual_seed(5))
    assert bits_equal(fast, rule)


def test_round_e2m1_refuses_what_it_does_not_cover():
    with pytest.raises(TypeError, match="float32"):
        round_e2m1(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="nearest"):
        round_e2m1(torch.ones(2), "toward_zero")


@pytest.mark.parametrize("recipe, same", [(Float8BlockScaling(), True), (NVFP4BlockScaling(), True),
                                          (NVFP4BlockScaling(disable_2d_quantization=True), False),
                                          (MXFP8BlockScaling(), False), (Float8RowwiseScaling(), False)])
def test_weight_copy_is_kept_only_where_both_axes_quantize_alike(recipe, same):
    assert same_both_axes(recipe, "weight") is same
    assert not same_both_axes(recipe, "grad_output")
    if same:   # the reuse is exact: Q(W, 0) and Q(W, 1) hold the same bits
        w = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)) * 0.02
        w0, w1 = recipe.quantize("weight", w, 0), recipe.quantize("weight", w, 1)
        assert torch.equal(w0.data.view(torch.uint8), w1.data.view(torch.uint8))
        assert torch.equal(w0.scale_inv.float(), w1.scale_inv.float()) and w0.block == w1.block


def test_auto_gemm_on_cpu_equals_f_scaled_mm_for_the_kinds_it_takes():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1024, 512, generator=g), torch.randn(128, 512, generator=g) * 0.02
    for block in ((-1, -1), (1, -1)):
        a, b = quantize_fp32_scaled(x, block), quantize_fp32_scaled(w, block)
        assert torch.equal(scaled_gemm(a, b.t()), scaled_gemm(a, b.t(), backend="native"))


def _edge_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """(rows, cols) fp32: random values plus the edge cases a reduction can get wrong, each in its own 16-block."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, 5] = float("nan")                    # NaN inside a block
    x[1, 16:32] = float("nan")                # an all-NaN block
    x[2, 17] = float("inf")
    x[3, 32] = -float("inf")
    x[4, 48:64] = 0.0                         # amax 0
    x[5, 64:80] = -0.0                        # amax 0 from signed zeros
    x[6, 80:96] = 1e-45                       # FP32 subnormals
    x[7, 96:112] = -3.0                       # all equal
    return x


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_compute_amax_equals_abs_then_amax(dtype):
    from mpcourse.core.quant.tensor import compute_amax
    x = _edge_matrix(16, 128, 5)
    cases = [x, x[:, 40:], x[4:6, 48:80], -torch.zeros(7), x.t(), torch.randn(33, 7) * 1e-40, x[1:2, 16:32]]
    for t in cases:
        t = t.to(dtype)
        fast, rule = compute_amax(t), t.abs().amax().float()
        assert bits_equal(fast.reshape(1), rule.reshape(1)) and fast.shape == () and fast.dtype == torch.float32
    assert compute_amax(torch.zeros(0, 4, dtype=dtype)) == 0


def test_block_amax_1x16_pooling_equals_the_reduction():
    from mpcourse.core.quant.scaled import block_amax, block_view
    for x in (_edge_matrix(32, 256, 6), _edge_matrix(16, 128, 7)[:, :16].contiguous(), _edge_matrix(48, 128, 8).bfloat16()):
        rule = block_view(x.float().abs(), (1, 16)).amax(dim=(1, 3))
        fast = block_amax(x, (1, 16))
        assert bits_equal(fast, rule) and fast.shape == rule.shape
        assert bits_equal(block_amax(x.t().contiguous().t(), (1, 16)), rule)      # a transposed view: the rule


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)])
def test_nvfp4_tensor_amax_from_the_block_maxima_is_the_tensor_amax(block):
    from mpcourse.core.quant.scaled import quantize_nvfp4
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(9)) * 3
    x[5, 7] = 40.0
    for t in (x, torch.zeros_like(x), x.bfloat16()):
        a, b = quantize_nvfp4(t, block), quantize_nvfp4(t, block, tensor_amax=t.abs().amax())
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale_inv.view(torch.uint8), b.scale_inv.view(torch.uint8))
        assert bits_equal(a.tensor_scale_inv.reshape(1), b.tensor_scale_inv.reshape(1))


@pytest.mark.parametrize("recipe", ["current", "delayed_e4m3"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_cpu_backward_equals_the_fp8_gemm_path(recipe, x_dtype):
    """The CPU backward (each operand upcast once, no layout copies) equals the fp8_gemm route bit for bit;
    pad_inner_dim=True on aligned shapes takes that route and pads nothing."""
    from mpcourse.core.quant import CurrentScaling, DelayedScaling, Float8Linear, Format
    rec = CurrentScaling(fp8_format=Format.HYBRID) if recipe == "current" else DelayedScaling(fp8_format=Format.E4M3)
    grads = []
    for pad in (False, True):
        g = torch.Generator().manual_seed(10)
        layer = Float8Linear(128, 384, recipe=rec, pad_inner_dim=pad)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(384, 128, generator=g) * 0.05)
            layer.bias.copy_(torch.randn(384, generator=g))
        x = (torch.randn(4, 64, 128, generator=g) * 3).to(x_dtype).requires_grad_(True)
        for _ in range(2):                                   # delayed scaling: a second step with real scales
            layer.zero_grad(); x.grad = None
            y = layer(x)
            (y.float() * torch.linspace(-1, 1, 384)).sum().backward()
        grads.append((y.detach().float(), x.grad.float(), layer.weight.grad, layer.bias.grad))
    for a, b in zip(*grads):
        assert bits_equal(a, b)


@pytest.mark.parametrize("mk", [(1024, 128), (1024, 384), (1024, 512), (64, 48), (16, 16)])
def test_rht_batched_matmul_equals_the_einsum_rule(mk):
    from mpcourse.core.quant.block_recipes import random_hadamard
    M, K = mk
    x = _edge_matrix(max(M, 16), max(K, 128), 11)[:M, :K].contiguous() * 5
    x[0:16, 0] = torch.tensor([1e4] + [1e-2] * 15)                  # an outlier spread over its group
    for seed in (0, 3):
        rule = torch.einsum("ij,gjk->gik", random_hadamard(16, seed), x.reshape(M // 16, 16, K)).reshape(M, K)
        fast = NVFP4BlockScaling(rht_seed=seed).rht(x)
        assert bits_equal(fast, rule)
        assert bits_equal(NVFP4BlockScaling(rht_seed=seed).rht(x.bfloat16()), torch.einsum(
            "ij,gjk->gik", random_hadamard(16, seed), x.bfloat16().float().reshape(M // 16, 16, K)).reshape(M, K))
