"""The fused fast paths of ``mpcourse.core.quant.kernels.fastpath`` equal the rules they replace, bit for bit.

Rules: torch's own float8 -> float32 cast, ``torch._scaled_mm`` on a CPU, ``formats.round_to(..., "e2m1",
saturate=True)`` (itself checked against ml_dtypes in tests/core/test_formats_mx.py), and the block layer's
re-quantization of a 2-D weight block.
"""
import pytest
import torch

from mpcourse.core.formats import round_to
from mpcourse.core.quant import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Float8RowwiseScaling
from mpcourse.core.quant.layers.block_gemm import scaled_gemm
from mpcourse.core.quant.layers.block_linear import same_both_axes
from mpcourse.core.quant import engine
from mpcourse.core.quant.kernels.blocks import quantize_fp32_scaled
from mpcourse.core.quant.kernels.e2m1 import round_e2m1
from mpcourse.core.quant.kernels.upcast import cpu_scaled_mm, fp8_to_float32
from mpcourse.core.quant.rules.mx import mx_shared_exponent

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_role(recipe, role, x, axis, wgrad=False, keep_fp32=False, functions=None):
    """``role``'s tensor x under ``recipe``, quantized along ``axis`` by the engine's quantizer with the kernels
    bound (whatever MPCOURSE_FUSED says: the kept FP32 copy is theirs)."""
    return engine.quantizer(recipe.with_functions(functions), role, kernels=True)(x, axis, wgrad, keep_fp32)


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
        w0, w1 = quantize_role(recipe, "weight", w, 0), quantize_role(recipe, "weight", w, 1)
        assert torch.equal(w0.data.view(torch.uint8), w1.data.view(torch.uint8))
        assert torch.equal(w0.scale_inv.float(), w1.scale_inv.float()) and w0.block == w1.block


def test_auto_gemm_on_cpu_equals_f_scaled_mm_for_the_kinds_it_takes():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1024, 512, generator=g), torch.randn(128, 512, generator=g) * 0.02
    for block in ((-1, -1), (1, -1)):
        a, b = quantize_fp32_scaled(x, block), quantize_fp32_scaled(w, block)
        assert torch.equal(scaled_gemm(a, b.t()), scaled_gemm(a, b.t(), route="native"))


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
    from mpcourse.core.quant.rules.tensor import compute_amax
    x = _edge_matrix(16, 128, 5)
    cases = [x, x[:, 40:], x[4:6, 48:80], -torch.zeros(7), x.t(), torch.randn(33, 7) * 1e-40, x[1:2, 16:32]]
    for t in cases:
        t = t.to(dtype)
        fast, rule = compute_amax(t), t.abs().amax().float()
        assert bits_equal(fast.reshape(1), rule.reshape(1)) and fast.shape == () and fast.dtype == torch.float32
    assert compute_amax(torch.zeros(0, 4, dtype=dtype)) == 0


def test_block_amax_1x16_pooling_equals_the_reduction():
    from mpcourse.core.quant.kernels.blocks import block_amax
    from mpcourse.core.quant.rules.scaled import block_view
    for x in (_edge_matrix(32, 256, 6), _edge_matrix(16, 128, 7)[:, :16].contiguous(), _edge_matrix(48, 128, 8).bfloat16()):
        rule = block_view(x.float().abs(), (1, 16)).amax(dim=(1, 3))
        fast = block_amax(x, (1, 16))
        assert bits_equal(fast, rule) and fast.shape == rule.shape
        assert bits_equal(block_amax(x.t().contiguous().t(), (1, 16)), rule)      # a transposed view: the rule


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)])
def test_nvfp4_tensor_amax_from_the_block_maxima_is_the_tensor_amax(block):
    from mpcourse.core.quant.kernels.nvfp4_quant import quantize_nvfp4
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
    """The CPU backward (no layout copies of W and x, dy^T from its transposed codes) equals the fp8_gemm route bit for bit;
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
    from mpcourse.core.quant.kernels import nvfp4_quant
    from mpcourse.core.quant.rules import hadamard
    from mpcourse.core.quant.rules.hadamard import random_hadamard
    M, K = mk
    x = _edge_matrix(max(M, 16), max(K, 128), 11)[:M, :K].contiguous() * 5
    x[0:16, 0] = torch.tensor([1e4] + [1e-2] * 15)                  # an outlier spread over its group
    for seed in (0, 3):
        rule = torch.einsum("ij,gjk->gik", random_hadamard(16, seed), x.reshape(M // 16, 16, K)).reshape(M, K)
        fast = nvfp4_quant.rht(x, seed)
        assert bits_equal(fast, rule) and bits_equal(hadamard.rht(x, seed), rule)
        assert bits_equal(nvfp4_quant.rht(x.bfloat16(), seed), torch.einsum(
            "ij,gjk->gik", random_hadamard(16, seed), x.bfloat16().float().reshape(M // 16, 16, K)).reshape(M, K))


@pytest.mark.parametrize("mk", [(32, 8), (48, 5), (16, 1), (256, 7), (64, 48)])
@pytest.mark.parametrize("scale", [1.0, 1e-36, 1e-40, 2.0 ** -140])
def test_rht_kernel_equals_the_rule_on_narrow_and_tiny_tensors(mk, scale):
    """Shapes where an einsum of the same matrices sums in another order (K < 12) and inputs whose products with
    +-1/4 are FP32 subnormals (rounded, or not, before they are added): the kernel is the rule's own batched GEMM,
    so the bits agree; both are within FP32 rounding of the float64 transform."""
    from mpcourse.core.quant.kernels import nvfp4_quant
    from mpcourse.core.quant.rules import hadamard
    from mpcourse.core.quant.rules.hadamard import random_hadamard
    M, K = mk
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(K)) * scale).float()
    x[:16, 0] = 0.0                                                  # an all-zero column group
    for seed in (0, 3):
        rule = hadamard.rht(x, seed)
        assert bits_equal(nvfp4_quant.rht(x, seed), rule)
        exact = (random_hadamard(16, seed).double() @ x.double().reshape(M // 16, 16, K)).reshape(M, K)
        bound = 2.0 ** -20 * (x.double().abs().reshape(M // 16, 16, K).sum(1, keepdim=True) / 4).expand(
            M // 16, 16, K).reshape(M, K) + 16 * 2.0 ** -149
        assert bool(((rule.double() - exact).abs() <= bound).all())


# ------------------------------------------------------------------ the quantizers' kept FP32 copy and their scale rules
def _amax_cases() -> torch.Tensor:
    """Block amaxes the scale rules can get wrong: zero and -0, FP32 subnormals, every power of two and its
    neighbours (the RCEIL and power-of-two boundaries), tiny values whose reciprocal overflows, FP32 max, inf,
    NaN, and random values over the whole range."""
    p = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    near = torch.cat([p, torch.nextafter(p, p * 2), torch.nextafter(p, p / 2)])
    fmts = torch.tensor([448.0, 57344.0, 6.0, 7.5, 28.0])
    special = torch.tensor([0.0, -0.0, 1e-45, 3e-39, 1.1754942e-38, 1e-37, 3.4028235e38, float("inf"), float("nan")])
    rand = torch.exp(torch.empty(4000).uniform_(-100, 88, generator=torch.Generator().manual_seed(12)))
    mult = torch.cat([(fmts[:, None] * q[None, :]).flatten() for q in (p[::17], torch.nextafter(p[::17], p[::17] * 2))])
    return torch.cat([near, special, rand, mult, fmts]).float()


def test_pow2_scale_equals_compute_scale_with_power_of_two_scales():
    from mpcourse.core.quant.kernels.blocks import pow2_scale
    from mpcourse.core.quant.rules.tensor import compute_scale
    a = _amax_cases()
    a = a[~(a < 0)]                                   # amaxes are >= 0 (or NaN); -0.0 stays in
    for top in (448.0, 57344.0):
        fast, rule = pow2_scale(a, top), compute_scale(a, top, 0, None, True)
        assert bits_equal(fast, rule), top
        assert bits_equal(pow2_scale(a.reshape(-1, 1)[:64], top), rule.reshape(-1, 1)[:64])   # shape kept


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1", "e2m3", "e3m2"])
def test_rceil_scale_inv_is_two_to_the_rules_exponent(elem):
    """2^k from the bits equals exp2 of mx_shared_exponent's k (RCEIL) on every boundary; NaN is the caller's."""
    from mpcourse.core.formats import FORMATS
    from mpcourse.core.quant.kernels.blocks import rceil_scale_inv
    a = _amax_cases()
    a = a[~torch.isnan(a) & ~(a < 0)]
    rule = torch.exp2(mx_shared_exponent(a, elem, "rceil").double()).float()
    assert bits_equal(rceil_scale_inv(a, elem), rule)


def test_e4m3_cast_without_the_clamp_changes_no_bit_where_the_flag_says_so():
    """Where torch's E4M3 cast saturates (the import-time check), clamping first changes no bit, on a sweep of the
    whole FP32 range; the check itself tells E5M2 (which overflows to inf) apart."""
    from mpcourse.core.quant.kernels.per_tensor import E4M3_CAST_SATURATES, _cast_saturates
    g = torch.Generator().manual_seed(13)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200000,), generator=g, dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), torch.linspace(-1000, 1000, 100001)])
    same = torch.equal(v.to(torch.float8_e4m3fn).view(torch.uint8),
                       v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert same == E4M3_CAST_SATURATES
    assert not _cast_saturates(torch.float8_e5m2, 57344.0)


def test_the_clamped_and_unclamped_e4m3_casts_quantize_alike(monkeypatch):
    """The quantizers give the same bits with the flag off (clamp, then cast) as with it on."""
    from mpcourse.core.quant.kernels import blocks, per_tensor
    x = _edge_matrix(64, 256, 14) * 1e3
    x[9, :] = 3e38
    import mpcourse.core.quant.rules.tensor as tensor
    saturates = per_tensor.E4M3_CAST_SATURATES
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(per_tensor, "E4M3_CAST_SATURATES", flag and saturates)
        q = [blocks.quantize_fp32_scaled(x, (1, 128)), blocks.quantize_mx(x, (1, 32), "e4m3", "floor"),
             blocks.quantize_mx(x, (32, 1), "e4m3", "rceil"), blocks.quantize_fp32_scaled(x, (-1, -1)),
             per_tensor.to_float8(x, "e4m3", 2.0 ** 20), per_tensor.to_float8(x, "e4m3", 0.37),
             tensor.to_float8(x, "e4m3", 0.37)]
        outs.append([t.data.view(torch.uint8) for t in q])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def _code_grid(dtype, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(64, 128) float8 data holding every code (NaN codes included) and a block multiplier per block with the
    values 2^8 folding can get wrong: FP32 subnormals, 2^119 and above (2^8 * m overflows), FP32 max, inf, 0, NaN."""
    codes = torch.arange(64 * 128, dtype=torch.int64).remainder(256).to(torch.uint8)
    data = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(15))].reshape(64, 128)
    r, c = block
    n = (64 // r) * (128 // c)
    special = torch.tensor([2.0 ** -149, 3e-41, 2.0 ** -126, 0.3712, 1.0, 2.0 ** 118, 2.0 ** 119, 2.0 ** 120,
                            3.4028235e38, float("inf"), 0.0, float("nan"), -2.0 ** 120, -0.3712, -3.4028235e38,
                            -float("inf"), -0.0])   # negative: a learner's scales may be (the seams let them through)
    m = torch.cat([special, torch.exp2(torch.randint(-60, 60, (n,), generator=torch.Generator().manual_seed(16))
                                       .float())])[:n]
    return data.view(dtype), m.reshape(64 // r, 128 // c)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block", [(1, 32), (32, 1), (1, 16), (16, 16), (1, 128), (64, 128), (1, 4)])
@pytest.mark.parametrize("mults", ["folded", "overflow", "all"])
def test_fp8_blocks_to_float32_equals_the_dequantize_rule(dtype, block, mults):
    """folded: every 2^8 * m exact; overflow: finite m whose 2^8 * m overflows (the two-multiply order); all: inf
    and NaN multipliers too."""
    from mpcourse.core.quant.kernels.upcast import fp8_blocks_to_float32
    from mpcourse.core.quant.rules.scaled import ScaledTensor
    data, m = _code_grid(dtype, block)
    if mults != "all":
        m = torch.where(torch.isfinite(m) & ((m.abs() < 2.0 ** 119) | (mults == "overflow")), m, 1.0)
    rule = ScaledTensor(data, m, block, "e4m3" if dtype == torch.float8_e4m3fn else "e5m2").dequantize(
        torch.float32)
    out = torch.full((64, 128), 7.0)                                    # a scratch buffer, overwritten
    fast = fp8_blocks_to_float32(data, m, block, out)
    assert bits_equal(fast, rule) and fast.data_ptr() == out.data_ptr()
    assert bits_equal(fp8_blocks_to_float32(data, m, block), rule)      # without a buffer
    if dtype == torch.float8_e4m3fn:                                    # nan_free skips the search: NaN codes stay
        fast = fp8_blocks_to_float32(data, m, block, nan_free=True)     # the +-1.875 * 2^-8 they read as
        nan_codes = (data.view(torch.uint8) & 0x7F) == 0x7F
        assert bits_equal(fast[~nan_codes], rule[~nan_codes]) and not fast[nan_codes & (m.isfinite() &
               (m != 0)).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)].isnan().any()
    with pytest.raises(TypeError, match="contiguous 2-D"):
        fp8_blocks_to_float32(data.t(), m.t(), block[::-1])


def _keep_cases():
    x = _edge_matrix(256, 256, 17) * 0.05
    x[200:, :] *= 1e-30                                                  # blocks near the bottom of the range
    return [x, torch.randn(256, 128, generator=torch.Generator().manual_seed(18)).bfloat16(),
            torch.zeros(128, 256), x.t().contiguous().t()]


@pytest.mark.parametrize("recipe", [Float8RowwiseScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                                    MXFP8BlockScaling(scale_rule="floor"), MXFP8BlockScaling(fp8_format=Format.HYBRID), NVFP4BlockScaling(),
                                    NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)])
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_kept_fp32_copy_equals_dequantize_and_the_quantization_is_unchanged(recipe, role):
    """quantize(keep_fp32=True) holds the same data and scales as without, and its float32 copy (and that of its
    transpose) is dequantize(float32) bit for bit, NaN and inf blocks included."""
    for x in _keep_cases():
        for axis in (0, 1):
            torch.manual_seed(0)
            plain = quantize_role(recipe, role, x, axis, wgrad=True)
            torch.manual_seed(0)
            kept = quantize_role(recipe, role, x, axis, wgrad=True, keep_fp32=True)
            # kept for a contiguous x (the layer's operands); a transposed view may take dequantize when asked
            assert plain.dequantized is None and (kept.dequantized is not None or not x.is_contiguous())
            assert torch.equal(plain.data.view(torch.uint8), kept.data.view(torch.uint8))
            assert bits_equal(plain.scale_inv.float(), kept.scale_inv.float())
            assert bits_equal(kept.dequantize_fp32(), kept.dequantize(torch.float32))
            assert bits_equal(kept.dequantize_fp32(), plain.dequantize_fp32())
            assert bits_equal(kept.t().dequantize_fp32(), plain.t().dequantize(torch.float32))
            assert kept.t().dequantize_fp32().stride() == plain.t().dequantize(torch.float32).stride()


def _learner_nvfp4_scales(x):
    """A learner's NVFP4 scales that forgot the abs() in the block max: negative E4M3 block scales."""
    t = x.abs().amax() / (448 * 6)
    s = (x.reshape(x.shape[0], -1, 16).amax(-1) / 6 / t).clamp(-448, 448).to(torch.float8_e4m3fn)
    return t, s


@pytest.mark.parametrize("make", [
    lambda: (Float8BlockScaling(power_2_scales=False, amax_epsilon=1e-3), None),
    lambda: (MXFP8BlockScaling(scale_rule="floor"),
             {"mx_shared_exponent": lambda a, e: mx_shared_exponent(a, e, "floor") - 3}),
    lambda: (NVFP4BlockScaling(disable_stochastic_rounding=True), {"nvfp4_scales": _learner_nvfp4_scales}),
])
def test_kept_fp32_copy_with_other_scales_and_a_learners_functions(make):
    """Non-power-of-two scales, an amax epsilon and lesson 09's functions (exponents that saturate blocks,
    negative block scales; a learner's scale with a negative value): the copy is dequantize's bits."""
    from mpcourse.core.quant.kernels.blocks import encode_fp32_scaled
    recipe, functions = make()
    x = _edge_matrix(256, 256, 19).nan_to_num(nan=0.5, posinf=7e4, neginf=-7e4) * 0.05   # the seams refuse NaN scales
    x[7, :] = -3e38
    for role in ("input", "weight"):
        for axis in (0, 1):
            kept = quantize_role(recipe, role, x, axis, keep_fp32=True, functions=functions)
            assert bits_equal(kept.dequantize_fp32(), kept.dequantize(torch.float32))
    xq = encode_fp32_scaled(torch.randn(4, 32), (1, 32), "e4m3", torch.full((4, 1), -2.0 ** -125), keep_fp32=True)
    assert bits_equal(xq.dequantize_fp32(), xq.dequantize(torch.float32))


def test_kept_copy_is_not_carried_by_replace_and_is_freed_before_the_weight_gradient_gemm(monkeypatch):
    """dataclasses.replace starts without the copy (it would be stale); in the layer's backward the input-gradient
    GEMM's FP32 copies (dy along N, W along N) are gone before the weight-gradient GEMM runs."""
    import dataclasses
    import weakref
    from mpcourse.core.quant import Float8Linear
    import mpcourse.core.quant.layers.block_gemm as bg
    kept = quantize_fp32_scaled(torch.randn(64, 128), (1, 128), keep_fp32=True)
    assert kept.dequantized is not None
    assert dataclasses.replace(kept, scale_inv=kept.scale_inv * 2).dequantized is None
    refs, alive_at_call = [], []
    real = bg.emulated_gemm

    def spy(a, b, out_dtype=torch.float32, *, backend=None):
        alive_at_call.append(sum(r() is not None for r in refs))
        for t in (a, b):
            if t.dequantized is not None:
                refs.append(weakref.ref(t.dequantized._base if t.dequantized._base is not None else t.dequantized))
        return real(a, b, out_dtype, backend=backend)

    monkeypatch.setattr(bg, "emulated_gemm", spy)
    layer = Float8Linear(256, 512, bias=False, recipe=MXFP8BlockScaling())
    x = torch.randn(1024, 256, requires_grad=True)
    layer(x).sum().backward()
    # forward: nothing earlier alive; dgrad: the forward's copies are gone; wgrad: the dgrad's copies are gone
    assert alive_at_call == [0, 0, 0], alive_at_call


def test_slow_branches_call_the_rule_they_equal(monkeypatch):
    """Where no compiled pass takes the input (here: ``jit.COMPILED`` off, as without numba), a kernel whose torch
    body would only restate its rule calls the rule itself (a spy on each rule counts the calls) and gives its
    bits: ``to_float8`` (bfloat16 input), ``block_amax`` (1x32 blocks), ``pow2_scale``, ``rceil_scale_inv`` and
    ``quantize_nvfp4``'s two scale levels."""
    from mpcourse.core.quant.kernels import blocks, jit, nvfp4_quant, per_tensor
    from mpcourse.core.quant.rules import mx, nvfp4, scaled, tensor
    monkeypatch.setattr(jit, "COMPILED", False)
    calls = []
    for mod, name in ((tensor, "to_float8"), (scaled, "block_amax"), (tensor, "compute_scale"),
                      (mx, "mx_shared_exponent"), (nvfp4, "two_level_scales")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = _edge_matrix(32, 64, 5)
    q = per_tensor.to_float8(x.bfloat16(), "e4m3", torch.tensor(2.0))
    assert calls == ["to_float8"]
    assert torch.equal(q.data.view(torch.uint8), tensor.to_float8(x.bfloat16(), "e4m3", torch.tensor(2.0)).data.view(torch.uint8))
    amax = blocks.block_amax(x, (1, 32))
    assert calls[-1] == "block_amax" and bits_equal(amax, x.abs().reshape(32, 2, 32).amax(2))
    assert bits_equal(blocks.pow2_scale(amax, 448.0), tensor.compute_scale(amax, 448.0, 0, None, True))
    assert calls[-2:] == ["compute_scale", "compute_scale"]
    k = mx.mx_shared_exponent(amax, "e4m3", "rceil")
    assert bits_equal(blocks.rceil_scale_inv(amax, "e4m3"), torch.exp2(k.double()).float())
    assert calls[-2:] == ["mx_shared_exponent", "mx_shared_exponent"]
    got = nvfp4_quant.quantize_nvfp4(x, (1, 16))
    want = nvfp4.quantize_nvfp4(x, (1, 16))
    assert "two_level_scales" in calls
    assert torch.equal(got.scale_inv.view(torch.uint8), want.scale_inv.view(torch.uint8))
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
