"""The numba kernels of ``mpcourse.core.quant.kernels.fused`` equal, bit for bit, the torch rules they replace.

``fused`` holds compiled loops that ``fastpath``'s quantizers take for 2-D float32 CPU tensors: ``block_amax`` (max |x| per
block, NaN propagating) and the FP8 quantizer (``quantize_fp8``: y = x *
mult or x / mult per block, its FP8 code by round to nearest even with saturation, and the FP32 copy
float32(code) * dequant). Their arithmetic is written out by hand on FP32 bit patterns, so every case a cast or
a reduction can get wrong is checked here against an oracle run side by side on the same input:

1. The E4M3 cast inside the quantizer (block = the whole tensor, mult = dequant = 1) against torch's own
   ``y.clamp(-448, 448).to(torch.float8_e4m3fn)`` on every E4M3 value, every midpoint between neighbours (the
   subnormal range and 464, between 448 and the 480 E4M3 does not have, included), the FP32 numbers one ulp
   either side of each, signed zeros, infinities, NaNs of both signs, FP32 subnormals and extremes, and a few
   million random FP32 bit patterns (E5M2 the same way); then the multiply or divide
   by random non-power-of-two block multipliers and the FP32 copy times a random non-power-of-two ``dequant``,
   against the same few torch operations.
2. ``blocks.block_amax`` through the kernel against the torch rule (``jit.COMPILED`` forced False) and the
   plain reduction, for every block shape the recipes use, with NaN, +-inf, -0.0, huge and subnormal values.
3. ``quantize_fp32_scaled`` and ``quantize_mx`` with ``keep_fp32=True`` (the kernel) against the forced torch rule:
   data bytes, scale_inv bits and the kept FP32 copy, which must also be ``dequantize(torch.float32)``'s bits.
4. A learner's scale rule (negative, non-power-of-two scales) and ``mx_shared_exponent`` through both paths
   (a NaN code's sign aside: see that test).
5. A transposed (non-contiguous) float32 input takes the path scaled's own predicate names (block_amax: the
   kernel), bfloat16 input the rule (no kernel called), and each gives the bits of its reference; keep_fp32=False,
   E5M2 and the MX FP4 format give the forced rule's bits too.
6. The per-tensor paths: ``tensor.to_float8`` (E4M3 and E5M2, any shape, saturating) and ``upcast.fp8_to_float32``
   (with and without a scale, row-major and transposed codes) through the kernels against the forced torch rule.
7. ``dequantize_fp8`` on every code against torch's upcast times
   the multiplier, and ``quantize_e2m1`` (NVFP4, nearest and stochastic) against the forced rule.

Where a test compares the kernel with the rule it also checks, with a spy, that the kernel ran (and that the
forced rule did not call it), so a routing change cannot make the comparison vacuous.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from mpcourse.core.quant.rules import blockwise, mx, nvfp4, scaled, tensor
from mpcourse.core.quant.kernels import blocks, fp8_passes, jit, loops, nvfp4_passes, nvfp4_quant  # noqa: E402
from mpcourse.core.quant.rules.scaled import block_view, resolve_block  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("the compiled passes are off (numba missing or MPCOURSE_FUSED=0)", allow_module_level=True)

E4M3 = torch.float8_e4m3fn
INF, NAN = float("inf"), float("nan")
F32_MAX, F32_TINY, F32_SUB_MIN = 3.4028234663852886e38, 2.0 ** -126, 2.0 ** -149
AMAX_BLOCKS = [(1, 128), (128, 1), (128, 128), (1, -1), (-1, 1), (-1, -1), (1, 32), (32, 1), (1, 16), (16, 1), (16, 16)]
FP32_SCALED_BLOCKS = [(1, 128), (128, 1), (128, 128), (1, -1), (-1, 1), (-1, -1)]
MX_BLOCKS = [(1, 32), (32, 1)]


# ------------------------------------------------------------------------------------------------ helpers
def _f32(bits) -> torch.Tensor:
    """float32 tensor of the given IEEE bit patterns (Python ints, any sign convention)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _first_mismatches(bad: torch.Tensor, *named) -> str:
    idx = bad.reshape(-1).nonzero().squeeze(1)[:8]
    rows = []
    for i in idx.tolist():
        parts = []
        for name, t in named:
            v = t.reshape(-1)[i]
            if t.dtype == torch.float32:
                parts.append(f"{name}={v.item()!r} (0x{v.view(torch.int32).item() & 0xFFFFFFFF:08x})")
            else:
                parts.append(f"{name}=0x{int(v.view(torch.uint8)) if t.element_size() == 1 else int(v):02x}")
        rows.append(f"  [{i}] " + ", ".join(parts))
    return f"{int(bad.sum())} of {bad.numel()} differ; first:\n" + "\n".join(rows)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, *context) -> None:
    """float32 got and want have the same shape, NaN in the same places (any payload or sign) and the same bits
    everywhere else (so -0.0 differs from 0.0). ``context``: (name, tensor) pairs shown for the first mismatches."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, (got.dtype, want.dtype, got.shape,
                                                                                  want.shape)
    gi, wi = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    if torch.equal(gi, wi):
        return
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = (gn != wn) | (~gn & ~wn & (gi != wi))
    assert not bool(bad.any()), _first_mismatches(bad, *context, ("got", got), ("want", want))


def assert_codes_equal(got: torch.Tensor, want: torch.Tensor, *context, nan_sign: bool = True) -> None:
    """float8_e4m3fn got and want hold the same bytes (``nan_sign=False``: a NaN code, 0x7F or 0xFF, may stand for
    the other)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    bad = g != w
    if not nan_sign:
        bad &= ~(((g & 0x7F) == 0x7F) & ((w & 0x7F) == 0x7F))
    assert not bool(bad.any()), _first_mismatches(bad, *context, ("got", got), ("want", want))


def torch_rule(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernels off (``jit.COMPILED`` False): the torch rule."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "COMPILED", False)
        assert not jit.takes(torch.zeros(2, 2))
        return fn(*args, **kwargs)


def kernel_quantize(x, block, mult, divide, dequant, fp8_format="e4m3"):
    """The FP8 quantize kernel: (codes, float32 copy)."""
    return fp8_passes.quantize_fp8(x, block, mult, divide, dequant, fp8_format=fp8_format)


@pytest.fixture
def calls(monkeypatch):
    """Counts of the kernels' calls through ``scaled``: "block_amax" and "quantize" (the FP8 quantizer). A kernel
    called from inside another is not counted twice."""
    count = {"block_amax": 0, "quantize": 0}
    depth = [0]
    for name in ("block_amax", "quantize_fp8"):
        real, key = getattr(fp8_passes, name), "block_amax" if name == "block_amax" else "quantize"

        def spy(*args, _real=real, _key=key, **kwargs):
            count[_key] += depth[0] == 0
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(fp8_passes, name, spy)
    return count


def _expand(s: torch.Tensor, x: torch.Tensor, block) -> torch.Tensor:
    """(M/r, K/c) block values repeated over their blocks: (M, K)."""
    r, c = block
    return s.repeat_interleave(r, 0).repeat_interleave(c, 1).reshape(x.shape)


# ------------------------------------------------------------------------------------------------ 1. the E4M3 cast
# per format: (torch dtype, max, the value past max it does not have, codes of the finite non-negative values,
# NaN test on a code byte)
FP8_FORMATS = {
    "e4m3": (E4M3, 448.0, 480.0, 0x7F, lambda b: (b & 0x7F) == 0x7F),
    "e5m2": (torch.float8_e5m2, 57344.0, 65536.0, 0x7C, lambda b: (b & 0x7F) > 0x7C),
}


def _fp8_cases(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, every midpoint between neighbours (and between max and the next power-of-two
    step past it: 464 for E4M3), one FP32 ulp either side of each, the FP32 specials, subnormals and extremes, of
    both signs (1-D float32)."""
    dtype, top, past, n_codes, _ = FP8_FORMATS[fmt]
    values = torch.arange(n_codes, dtype=torch.int32).to(torch.uint8).view(dtype).float()   # 0 .. max, increasing
    assert values[-1] == top and bool((values[1:] > values[:-1]).all())
    grid = torch.cat([values, torch.tensor([past])]).double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()                       # exact in FP32 (a few significant bits)
    assert float(mids[-1]) == (top + past) / 2 and float(mids[0]) == float(values[1]) / 2
    edges = torch.cat([values, mids, values[1:2] / 2, torch.tensor([top, past, 2 * past, 2.0 ** -6, 2.0 ** -14])])
    up, down = torch.nextafter(edges, torch.tensor(INF)), torch.nextafter(edges, torch.tensor(-INF))
    sub = torch.randint(1, 1 << 23, (2000,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    special = torch.cat([
        torch.tensor([0.0, INF, NAN, F32_MAX, F32_TINY, F32_SUB_MIN, 1e30, 1e-30, 2.0 ** -127]),
        _f32([0x007FFFFF, 0x00400000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FBFFFFF]),   # subnormals; NaN payloads
        sub.view(torch.float32)])
    x = torch.cat([edges, up, down, special])
    return torch.cat([x, -x])


def _cast_by_kernel(x: torch.Tensor, shape, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """The quantize kernel on x reshaped to ``shape``, one block of it all, multiplier and dequant 1: (codes, copy)."""
    one = torch.ones(1, 1)
    data, copy = kernel_quantize(x.reshape(shape), tuple(shape), one, False, one, fp8_format=fmt)
    return data.reshape(-1), copy.reshape(-1)


def _check_cast(x: torch.Tensor, shape, fmt: str = "e4m3") -> None:
    dtype, top, _, _, is_nan_code = FP8_FORMATS[fmt]
    got, copy = _cast_by_kernel(x, shape, fmt)
    want = x.clamp(-top, top).to(dtype)
    nan = torch.isnan(x)
    assert_codes_equal(got[~nan], want[~nan], ("x", x[~nan]))
    assert bool(is_nan_code(got[nan].view(torch.uint8)).all()), "NaN input without a NaN code"
    assert_bits_equal(copy, got.float(), ("x", x))                     # the copy is the code's value (times 1)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", ["row", "column"])
def test_fp8_cast_equals_torch_on_every_value_midpoint_and_neighbour(shape, fmt):
    """Ties go to the even code (a kernel that rounds them up or away fails here), 464 and above saturate to 448,
    subnormal midpoints round to even multiples of 2^-9, -0.0 keeps its sign (E5M2: the same at 57344 and 2^-16).
    ``row``: a (1, n) block, the kernel's loop over blocks; ``column``: (n, 1), one multiplier per element."""
    x = _fp8_cases(fmt)
    _check_cast(x, (1, x.numel()) if shape == "row" else (x.numel(), 1), fmt)
    if fmt == "e4m3":
        got, _ = _cast_by_kernel(torch.tensor([464.0, -464.0, 2.0 ** -10, 1.0625, 0.0]), (1, 5))
        assert got.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x00, 0x38, 0x00]   # a sanity anchor


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cast_equals_torch_on_random_fp32_bit_patterns(fmt):
    g = torch.Generator().manual_seed(2)
    n = 1 << 22 if fmt == "e4m3" else 1 << 20
    x = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    near = torch.randn(n // 4, generator=g) * FP8_FORMATS[fmt][1] / 2   # the format's range, densely
    _check_cast(torch.cat([x, near]), (n // 1024 * 5 // 4, 1024), fmt)


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("block", [(1, 32), (32, 1), (16, 16), (1, 1)])
def test_quantize_kernel_scales_casts_and_dequantizes_as_torch(block, divide):
    """Random non-power-of-two multipliers (negative, tiny and huge ones too): codes = cast(sat(x * mult)) (or x /
    mult), one FP32 rounding per product as in torch; the copy = float32(code) * dequant, also rounded once."""
    g = torch.Generator().manual_seed(3)
    M, K = 128, 256
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-8, 9, (M, 1), generator=g).float())
    x[0, :8] = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1e-45, F32_MAX, -3e38])
    r, c = block
    shape = (M // r, K // c)
    mult = torch.exp(torch.empty(shape).uniform_(-6, 6, generator=g))
    mult = mult * torch.where(torch.rand(shape, generator=g) < 0.2, -1.0, 1.0)
    dequant = torch.exp(torch.empty(shape).uniform_(-30, 30, generator=g)) * torch.where(
        torch.rand(shape, generator=g) < 0.2, -1.0, 1.0)
    mult.view(-1)[:6] = torch.tensor([1e-40, 3e38, 0.3712, -1.7, 2.0 ** -130, 1e30])
    dequant.view(-1)[:6] = torch.tensor([1e-40, 3e38, 0.3712, -1.7, 2.0 ** -140, 1e35])
    for t in (mult, dequant):                                          # products really round (2^-130, 2^-140 aside)
        assert int((torch.frexp(t)[0].abs() == 0.5).sum()) <= 1
    data, copy = kernel_quantize(x, block, mult, divide, dequant)
    m = _expand(mult, x, block)
    y = x / m if divide else x * m
    want = y.clamp(-448, 448).to(E4M3)
    assert data.dtype == E4M3 and copy.dtype == torch.float32 and data.shape == copy.shape == x.shape
    nan = torch.isnan(y)
    assert_codes_equal(data[~nan], want[~nan], ("y", y[~nan]))
    assert bool(((data[nan].view(torch.uint8) & 0x7F) == 0x7F).all())
    assert_bits_equal(copy, data.float() * _expand(dequant, x, block), ("y", y))


# ------------------------------------------------------------------------------------------------ 2. block amax
def _special_matrix(M: int, K: int, seed: int, nan: bool = True, inf: bool = True) -> torch.Tensor:
    """(M, K) float32 of random magnitudes with the values a reduction or a cast can get wrong, spread over blocks:
    NaN of both signs, +-inf, a 128x128 (or smaller) region of +-0.0 and one of FP32 subnormals, huge values,
    values beyond 448 next to 448 (MX floor saturates them), and ties (midpoints between E4M3 values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-12, 13, (M // 16, 1, K // 16, 1), generator=g)
                                                    .float()).expand(M // 16, 16, K // 16, 16).reshape(M, K)
    h, w = M // 2, K // 2
    x[h:, w:] = 0.0                                   # zero blocks, signed zeros in half of them
    x[h:h + h // 2, w:] = -0.0
    sub = torch.randint(1, 1 << 23, (M - h, 16), generator=g, dtype=torch.int32).view(torch.float32)
    x[h:, :16] = sub * torch.where(torch.rand(M - h, 16, generator=g) < 0.5, -1.0, 1.0)   # exact: FP32 subnormals
    x[h + 1, 1] = 1e-45                               # FP32 subnormals (and a block of only them)
    x[3, w - 1] = 3e38                                # huge
    x[4, w + 3] = -F32_MAX
    x[30, :32] = 448.0                                # 448 * 31 + 1000: MX floor saturates 1000 / 2 = 500
    x[30, 31] = 1000.0
    x[31, :32] = torch.tensor([448.0, 1.0625, -1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 15 * 2.0 ** -10, 0.0703125,
                               -13.0, 14.5, 304.0, 416.0, -440.0] + [0.5] * 20)     # ties at scale 1
    if inf:
        x[7, 2] = INF
        x[h - 1, 20] = -INF
        x[7, 3] = 1000.0                              # beyond 448 in the inf block (scale 1): saturates
    if nan:
        x[5, 7] = NAN
        x[9, K - 1] = _f32([0xFFC00001])[0]           # a negative NaN with a payload
    return x


def _boundary_matrix(M: int, K: int, seed: int) -> torch.Tensor:
    """(M, K) float32 whose 16x16 tiles take, in order, the amaxes where the scale rules change behaviour: 0 beside
    2^-149, every power of two from 2^-149 to 2^127 with its FP32 neighbours one ulp either side (subnormals, the
    E8M0 clamp at 2^-127, the smallest normals), the amaxes whose fp8_max / amax overflows FP32 (E4M3, E5M2) and
    MX's and NVFP4's thresholds, each tile holding its amax and amax times fractions of both signs."""
    p = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    top = torch.tensor([448.0, 57344.0, 6.0, 2688.0])
    thresholds = torch.cat([top / F32_MAX, top * 2.0 ** -127, top * 2.0 ** -126, 2688.0 * torch.tensor(
        [2.0 ** -121, 2.0 ** -122, 2.0 ** -126])])
    base = torch.cat([p, thresholds, torch.tensor([1e-36, 1e-40, 1e-45])])
    amax = torch.cat([torch.zeros(1), torch.stack([torch.nextafter(base, base / 2), base,
                                                   torch.nextafter(base, base * 2)], 1).flatten()])
    amax = amax[torch.isfinite(amax) & (amax >= 0)].sort().values
    tiles = amax.repeat((M // 16) * (K // 16) // amax.numel() + 1)[:(M // 16) * (K // 16)].reshape(M // 16, K // 16)
    g = torch.Generator().manual_seed(seed)
    frac = torch.rand(16, 16, generator=g) * 1.98 - 0.99
    frac[0, 0], frac[0, 1], frac[0, 2], frac[0, 3] = 1.0, -1.0, 0.0, -0.0
    return (tiles[:, None, :, None] * frac[None, :, None, :]).reshape(M, K).contiguous()


def _amax_cases():
    yield _boundary_matrix(256, 384, 27)
    for M, K in ((256, 384), (128, 128)):
        for nan, inf in ((True, True), (False, True), (False, False)):
            yield _special_matrix(M, K, seed=M + K + 2 * nan + inf, nan=nan, inf=inf)


@pytest.mark.parametrize("block", AMAX_BLOCKS, ids=str)
def test_block_amax_kernel_equals_the_torch_rule(block, calls):
    for x in _amax_cases():
        b = resolve_block(x.shape, block)
        got = blocks.block_amax(x, block)              # the kernel (it resolves -1 itself)
        assert calls["block_amax"] > 0
        n = calls["block_amax"]
        want = torch_rule(blocks.block_amax, x, b)     # the rule takes a resolved block
        assert calls["block_amax"] == n                # the forced rule did not call the kernel
        plain = block_view(x.abs(), b).amax(dim=(1, 3))
        assert_bits_equal(got, want)
        assert_bits_equal(got, plain)
        assert got.shape == (x.shape[0] // b[0], x.shape[1] // b[1])
        assert not bool(torch.signbit(got).any())     # -0.0 blocks give +0.0
        # the injected NaNs (not the inf) really reach the result: it can tell NaN from inf
        assert bool(torch.isnan(x).any()) == bool(torch.isnan(got).any())


# ------------------------------------------------------------------------------------------------ 3. the quantizers
def _ties_matrix(M: int, K: int, seed: int) -> torch.Tensor:
    """Every block of 16 or more along a dimension has amax exactly 448 (scale 1, or 2^-margin, in every rule), the
    other elements are E4M3 midpoints (ties) of random sign, the subnormal ones included."""
    values = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(E4M3).float().double()
    mids = ((values[1:] + values[:-1]) / 2).float()                   # < 448
    g = torch.Generator().manual_seed(seed)
    x = mids[torch.randint(0, mids.numel(), (M, K), generator=g)]
    x = x * torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
    x[::16, :] = 448.0
    x[:, ::16] = -448.0
    return x


def _quant_cases():
    yield _special_matrix(256, 384, 21)
    yield _special_matrix(128, 128, 22, nan=False)
    yield _ties_matrix(256, 384, 23)
    yield _special_matrix(256, 128, 24, nan=False, inf=False) * 1e-36   # tiny blocks: huge or subnormal scales
    yield _boundary_matrix(256, 384, 25)                                  # every boundary amax, a tile each


N_QUANT_CASES = 5


def _check_same(got: scaled.ScaledTensor, want: scaled.ScaledTensor, x: torch.Tensor, nan_sign: bool = True) -> None:
    """Same data bytes, scale_inv bits, block, orig_dtype; got's kept copy is the rule's dequantize(float32) (run with
    the kernels off: ``dequantize`` may take one too) and got's own ``dequantize(torch.float32)``."""
    assert got.block == want.block and got.orig_dtype == want.orig_dtype and got.elem_format == want.elem_format
    assert got.scale_inv.dtype == want.scale_inv.dtype and got.scale_inv.shape == want.scale_inv.shape
    assert_codes_equal(got.data, want.data, ("x", x), nan_sign=nan_sign)
    if got.scale_inv.dtype == torch.float32:
        assert_bits_equal(got.scale_inv, want.scale_inv)
    else:
        assert torch.equal(got.scale_inv.view(torch.uint8), want.scale_inv.view(torch.uint8))
    assert got.dequantized is not None and got.dequantized.dtype == torch.float32
    assert_bits_equal(got.dequantized, torch_rule(want.dequantize, torch.float32), ("x", x))
    assert_bits_equal(got.dequantized, got.dequantize(torch.float32), ("x", x))


@pytest.mark.parametrize("power_2_scale", [True, False])
@pytest.mark.parametrize("block", FP32_SCALED_BLOCKS + [(1, 32), (16, 16)], ids=str)
def test_quantize_fp32_scaled_kernel_equals_the_torch_rule(block, power_2_scale, calls):
    for x in _quant_cases():
        for margin in (0, 1):
            for eps in (0.0, 1e-3):
                kw = dict(margin=margin, power_2_scale=power_2_scale, amax_epsilon=eps, keep_fp32=True)
                n = calls["quantize"]
                got = blocks.quantize_fp32_scaled(x, block, "e4m3", **kw)
                assert calls["quantize"] == n + 1
                want = torch_rule(blocks.quantize_fp32_scaled, x, block, "e4m3", **kw)
                assert calls["quantize"] == n + 1
                _check_same(got, want, x)


@pytest.mark.parametrize("edges", ["course", "torchao"])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("block", MX_BLOCKS, ids=str)
def test_quantize_mx_kernel_equals_the_torch_rule(block, rule, edges, calls):
    """The kernel's x / 2^k (2^-127, an FP32-subnormal divisor, included) and under ``edges="torchao"`` torchao's
    divisor there, against the forced rule; and the forced rule against ``mx.quantize_mx`` itself."""
    saturated = 0
    for x in _quant_cases():
        n = calls["quantize"]
        got = blocks.quantize_mx(x, block, "e4m3", rule, keep_fp32=True, edges=edges)
        assert calls["quantize"] == n + 1
        want = torch_rule(blocks.quantize_mx, x, block, "e4m3", rule, keep_fp32=True, edges=edges)
        assert calls["quantize"] == n + 1
        _check_same(got, want, x)
        rule_st = mx.quantize_mx(x, block, "e4m3", rule, edges=edges)
        assert_codes_equal(got.data, rule_st.data, ("x", x))
        assert torch.equal(got.scale_inv.view(torch.uint8), rule_st.scale_inv.view(torch.uint8))
        saturated += int(((got.data.view(torch.uint8) & 0x7F) == 0x7E).sum())
    assert saturated > 0                              # the 448 codes are there (floor: 1000 / 2 saturates)


# ------------------------------------------------------------------------------------------ 4. a learner's functions
LEARNER_SCALES = {
    "negative": lambda amax, top, margin: -(top / amax) / 2 ** margin,          # forgot a sign: -inf at amax 0
    "non_pow2": lambda amax, top, margin: top / amax * 0.77,                    # inf at amax 0
    "constant": lambda amax, top, margin: torch.full_like(amax, 0.3712),
    "mixed_sign": lambda amax, top, margin: torch.where(amax > 1, -0.61, 3.3) * torch.ones_like(amax),
    "tiny_negative": lambda amax, top, margin: torch.full_like(amax, -2.0 ** -125),
}


@pytest.mark.parametrize("power_2_scale", [False, True])
@pytest.mark.parametrize("name", list(LEARNER_SCALES))
def test_learner_compute_scale_matches_the_torch_rule(name, power_2_scale, calls):
    """Everything bit for bit, except the sign of a NaN code that a NaN scale puts in a block: a learner's scale
    computed from a NaN amax carries that NaN's sign into x * scale, and the amaxes differ there (the kernel's |x|
    max is +NaN; torch's amax over a (128, 1) block of |x| is -NaN, 0xFFFFFFFF, on torch 2.13's CPU), so the
    rule writes 0x7F where the kernel writes 0xFF, or the other way round; both are E4M3's NaN."""
    fn = LEARNER_SCALES[name]
    for x in _quant_cases():
        for block in ((1, 128), (128, 1), (-1, -1)):
            got = _learner_fp32_scaled(x, block, fn, power_2_scale)
            want = torch_rule(_learner_fp32_scaled, x, block, fn, power_2_scale)
            _check_same(got, want, x, nan_sign=False)
    assert calls["quantize"] == 3 * N_QUANT_CASES


def _learner_fp32_scaled(x, block, fn, power_2_scale, keep_fp32=True):
    """The engine's path for a learner's scale rule on FP32-scaled blocks: its scales into ``encode_fp32_scaled``."""
    b = resolve_block(x.shape, block)
    scale = torch.as_tensor(fn(blocks.block_amax(x, b), 448.0, 0), dtype=torch.float32)
    scale = tensor.round_down_to_power_of_2(scale) if power_2_scale else scale
    return blocks.encode_fp32_scaled(x, b, "e4m3", scale, keep_fp32)


def _learner_mx(x, block, fn, keep_fp32=True):
    """The engine's path for a learner's ``mx_shared_exponent``: its exponents into ``encode_mx``."""
    b = resolve_block(x.shape, block)
    amax = blocks.block_amax(x, b)
    k = fn(amax.flatten(), "e4m3").reshape(amax.shape)
    return blocks.encode_mx(x, b, "e4m3", amax, torch.exp2(k.double()).float(), keep_fp32)


def test_learner_exponent_fn_that_saturates_matches_the_torch_rule(calls):
    from mpcourse.core.quant.rules.mx import mx_shared_exponent
    def fn(amax, elem):                               # 2^3 too small: blocks saturate
        return (mx_shared_exponent(amax, elem, "floor") - 3).clamp(min=-127)
    for x in _quant_cases():
        for block in MX_BLOCKS:
            got = _learner_mx(x, block, fn)
            want = torch_rule(_learner_mx, x, block, fn)
            _check_same(got, want, x)
            b = resolve_block(x.shape, block)
            amax = scaled.block_amax(x, b)                                    # the rules
            rule = mx.encode_mx(x, b, "e4m3", amax, fn(amax.flatten(), "e4m3").reshape(amax.shape))
            assert_codes_equal(got.data, rule.data, ("x", x))
    assert calls["quantize"] == N_QUANT_CASES * 2


# ------------------------------------------------------------------------------------------------ 5. layouts and paths
def _quantizer_takes_kernel(x: torch.Tensor) -> bool:
    """Whether scaled's quantizers send x (keep_fp32, E4M3) to the kernel: ``scaled._fused(x)`` where scaled has that
    predicate (contiguous x only), else ``jit.takes(x)``."""
    return bool(blocks.fuses(x))


def test_transposed_input_takes_the_right_path_and_matches(calls):
    """A transposed float32 view: block_amax takes the kernel (which reads a contiguous copy); the quantizers take
    whichever path scaled's predicate names for it, and either way give the rule's bits and those of the
    contiguous copy (whose data and FP32 copy are row-major like it)."""
    base = _special_matrix(384, 256, 31)
    xt = base.t()                                                     # (256, 384), not contiguous
    assert not xt.is_contiguous() and jit.takes(xt)
    for block in ((1, 128), (128, 1), (32, 1), (-1, 1)):
        n = calls["block_amax"]
        got = blocks.block_amax(xt, block)
        assert calls["block_amax"] == n + 1
        b = resolve_block(xt.shape, block)
        assert_bits_equal(got, torch_rule(blocks.block_amax, xt, b))
        assert_bits_equal(got, blocks.block_amax(xt.contiguous(), block))
    for q, block, kw in ((blocks.quantize_fp32_scaled, (1, 128), dict(fp8_format="e4m3")),
                         (blocks.quantize_fp32_scaled, (128, 128), dict(fp8_format="e4m3", power_2_scale=True)),
                         (blocks.quantize_mx, (1, 32), dict(elem="e4m3", rule="rceil")),
                         (blocks.quantize_mx, (32, 1), dict(elem="e4m3", rule="floor"))):
        n = calls["quantize"]
        got = q(xt, block, keep_fp32=True, **kw)
        assert calls["quantize"] == n + _quantizer_takes_kernel(xt)
        want = torch_rule(q, xt, block, keep_fp32=True, **kw)
        contiguous = q(xt.contiguous(), block, keep_fp32=True, **kw)  # the kernel
        assert calls["quantize"] == n + _quantizer_takes_kernel(xt) + 1
        _check_same(contiguous, want, xt)
        assert_codes_equal(got.data, want.data, ("x", xt))
        assert torch.equal(got.scale_inv.float().view(torch.int32), want.scale_inv.float().view(torch.int32))
        assert_bits_equal(got.dequantize_fp32(), contiguous.dequantized, ("x", xt))


def test_bfloat16_input_takes_the_torch_rule_and_other_formats_match_it(calls):
    """bfloat16 (not the kernels' dtype) runs the rule (no kernel called), and its results are the kernel's on the
    exact float32 copy, orig_dtype aside. keep_fp32=False, E5M2 and the MX FP6/FP4 formats give the forced rule's
    bits too (whichever path they take), and keep_fp32 changes no data bit."""
    x32 = _special_matrix(256, 384, 41).bfloat16().float()
    xb = x32.bfloat16()
    assert not jit.takes(xb)
    for i, block in enumerate(((1, 128), (16, 1), (-1, -1))):
        b = resolve_block(xb.shape, block)
        got = blocks.block_amax(xb, b)
        assert calls["block_amax"] == i                               # the rule
        assert_bits_equal(got, blocks.block_amax(x32, b))             # the kernel
        assert calls["block_amax"] == i + 1
    for q, block, kw in ((blocks.quantize_fp32_scaled, (1, 128), dict(fp8_format="e4m3")),
                         (blocks.quantize_fp32_scaled, (-1, -1), dict(fp8_format="e4m3", power_2_scale=True)),
                         (blocks.quantize_mx, (1, 32), dict(elem="e4m3", rule="rceil")),
                         (blocks.quantize_mx, (32, 1), dict(elem="e4m3", rule="floor"))):
        n_amax, n = calls["block_amax"], calls["quantize"]
        got = q(xb, block, keep_fp32=True, **kw)
        assert calls["quantize"] == n and calls["block_amax"] == n_amax
        assert got.orig_dtype == torch.bfloat16 and got.dequantize().dtype == torch.bfloat16
        ref = q(x32, block, keep_fp32=True, **kw)                     # the kernel
        assert calls["quantize"] == n + 1
        assert_codes_equal(got.data, ref.data, ("x", x32))
        assert torch.equal(got.scale_inv.float().view(torch.int32), ref.scale_inv.float().view(torch.int32))
        assert_bits_equal(ref.dequantized, got.dequantize_fp32(), ("x", x32))
    for q, block, kw in ((blocks.quantize_fp32_scaled, (1, 128), dict(fp8_format="e4m3", keep_fp32=False)),
                         (blocks.quantize_fp32_scaled, (1, 128), dict(fp8_format="e5m2", keep_fp32=True)),
                         (blocks.quantize_fp32_scaled, (-1, 1), dict(fp8_format="e5m2", keep_fp32=False)),
                         (blocks.quantize_mx, (1, 32), dict(elem="e4m3", keep_fp32=False)),
                         (blocks.quantize_mx, (1, 32), dict(elem="e5m2", keep_fp32=True)),
                         (blocks.quantize_mx, (32, 1), dict(elem="e2m1", keep_fp32=True))):
        st = q(x32, block, **kw)
        want = torch_rule(q, x32, block, **kw)
        assert_codes_equal(st.data, want.data, ("x", x32))
        assert torch.equal(st.scale_inv.float().view(torch.int32), want.scale_inv.float().view(torch.int32))
        assert_bits_equal(st.dequantize_fp32(), torch_rule(want.dequantize, torch.float32), ("x", x32))
        other = q(x32, block, **{**kw, "keep_fp32": not kw["keep_fp32"]})
        assert_codes_equal(st.data, other.data, ("x", x32))


# ------------------------------------------------------------------------------------------------ dequantize, NVFP4
@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("block", [(1, 32), (32, 1), (16, 16)])
def test_dequantize_kernel_equals_torch_upcast_times_the_multiplier(dtype, block):
    """``fp8_passes.dequantize_fp8`` (``ScaledTensor.dequantize``'s and ``upcast.fp8_to_float32``'s pass): float32(code) * mult per block, against torch's own upcast times the multiplier, on every code (both
    NaN signs, E5M2's inf) and multipliers that are subnormal, non-power-of-two, huge, inf, 0, NaN or negative."""
    codes = torch.arange(64 * 128, dtype=torch.int64).remainder(256).to(torch.uint8)
    data = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(51))].reshape(64, 128)
    data = data.view(dtype)
    r, c = block
    n = (64 // r) * (128 // c)
    special = torch.tensor([2.0 ** -149, 3e-41, 0.3712, 2.0 ** 119, 2.0 ** 120, F32_MAX, INF, 0.0, NAN, -0.3712,
                            -F32_MAX, -INF, -0.0, 1e-30, 7.77e20])
    g = torch.Generator().manual_seed(52)
    m = torch.cat([special, torch.exp(torch.empty(n).uniform_(-60, 60, generator=g))])[:n].reshape(64 // r, 128 // c)
    got = fp8_passes.dequantize_fp8(data, block, m)
    assert_bits_equal(got, data.float() * _expand(m, data, block), ("code", data))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)])
def test_quantize_nvfp4_kernel_equals_the_torch_rule(block, rounding, calls):
    """``nvfp4_passes.quantize_e2m1`` (nearest) and ``nvfp4_passes.quantize_e2m1_drawing`` (stochastic: the rule's draws, drawn
    inside the kernel) through ``quantize_nvfp4(..., keep_fp32=True)`` against the forced rule with the same
    generator seed: data bytes, both scales, the copy."""
    name = "quantize_e2m1" if rounding == "nearest" else "quantize_e2m1_drawing"
    real, count = getattr(nvfp4_passes, name), [0]

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nvfp4_passes, name, spy)
        tiny = [_boundary_matrix(128, 128, 63) / float(_boundary_matrix(128, 128, 63).abs().max()) * t
                for t in (1e-30, 1e-33, 1e-36, 2.0 ** -127, 1e-40, 1e-45)]      # t below 2^-121, floored at 2^-126
        for x in (_special_matrix(256, 384, 61, nan=False, inf=False), _ties_matrix(128, 128, 62) / 64,
                  torch.zeros(64, 128), _boundary_matrix(128, 128, 64), *tiny):
            got = nvfp4_quant.quantize_nvfp4(x, block, rounding=rounding, generator=torch.Generator().manual_seed(7),
                                        keep_fp32=True)
            want = torch_rule(nvfp4_quant.quantize_nvfp4, x, block, rounding=rounding,
                              generator=torch.Generator().manual_seed(7), keep_fp32=True)
            assert_codes_equal(got.data, want.data, ("x", x))
            assert torch.equal(got.scale_inv.view(torch.uint8), want.scale_inv.view(torch.uint8))
            assert_bits_equal(got.tensor_scale_inv.reshape(1), want.tensor_scale_inv.reshape(1))
            assert got.dequantized is not None
            assert_bits_equal(got.dequantized, torch_rule(want.dequantize, torch.float32), ("x", x))
    assert count[0] == 10


# ------------------------------------------------------------------------------------------------ NVFP4: draws, scales
def test_the_mt19937_reading_is_checked_and_holds_on_this_torch():
    """``quantize_e2m1_drawing`` reads torch's generator state; its check against ``torch.randint`` passed here
    (else every stochastic NVFP4 cast would silently take the slower path)."""
    assert nvfp4_passes._mt_matches_torch()


@pytest.mark.parametrize("seed", [0, 1, 2 ** 40 + 3])
def test_draws62_equals_torch_randint_and_leaves_the_generator_where_torch_does(seed):
    """``nvfp4_passes.draws62(n, g)`` against ``torch.randint(0, 2**62, (n,), generator=g)`` on twin generators, for
    sizes that end one word short of, exactly at and one past a twist (312 draws are 624 words), none, a run
    across several twists; after other draws (``rand``, and ``randn`` whose cached normal sample must survive
    the state's round trip), the generators' states and their next draws of every kind are equal."""
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for g in (ours, theirs):
        torch.rand(5, generator=g)
        torch.randn(1, generator=g, dtype=torch.float64)     # leaves a cached normal sample in the state
    for n in (0, 1, 310, 1, 1, 312, 313, 0, 5000, 624):
        assert torch.equal(nvfp4_passes.draws62(n, ours), torch.randint(0, 2 ** 62, (n,), generator=theirs)), n
        assert torch.equal(ours.get_state(), theirs.get_state()), n
    assert torch.equal(torch.randn(3, generator=ours, dtype=torch.float64),
                       torch.randn(3, generator=theirs, dtype=torch.float64))
    assert torch.equal(torch.randint(0, 2 ** 62, (7,), generator=ours),
                       torch.randint(0, 2 ** 62, (7,), generator=theirs))


def test_draws62_from_the_default_generator():
    """With no generator, the draws are the default generator's (as ``torch.randint`` without one)."""
    torch.manual_seed(123)
    want, after = torch.randint(0, 2 ** 62, (1000,)), torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(nvfp4_passes.draws62(1000), want)
    assert torch.equal(torch.rand(4), after)


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_quantize_e2m1_drawing_equals_the_kernel_on_torch_randint_draws(block, layout):
    """``quantize_e2m1_drawing(x, ..., g)`` against ``quantize_e2m1(x, ..., torch.randint(0, 2**62, x.shape, g))``
    (the rule's draws, then the kernel already checked against the rule): codes, the FP32 copy and the
    generator's state after, on tensors with NaN, +-inf, +-0, FP32 subnormals and ties, with block multipliers
    that are 0, subnormal, huge and non-powers of two, row-major or a transposed view; with a generator and
    with the default one."""
    g0 = torch.Generator().manual_seed(41)
    for x in (_special_matrix(256, 384, 42), _ties_matrix(128, 128, 43) / 64, torch.zeros(64, 128),
              _boundary_matrix(128, 128, 44)):
        if layout == "transposed":
            x = x.t().contiguous().t() if x.shape[0] == x.shape[1] else x.reshape(x.shape[1], x.shape[0]).t()
        M, K = x.shape
        r, c = block
        mult = torch.exp(torch.empty(M // r, K // c).uniform_(-30, 30, generator=g0))
        mult.view(-1)[:4] = torch.tensor([0.0, 1e-40, 3e30, 0.3712])
        dq = torch.exp(torch.empty(M // r, K // c).uniform_(-30, 30, generator=g0))
        for seed in (3, 4):
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            torch.randint(0, 5, (seed * 101,), generator=ours)
            torch.randint(0, 5, (seed * 101,), generator=theirs)
            got = nvfp4_passes.quantize_e2m1_drawing(x, block, mult, dq, ours)
            want = nvfp4_passes.quantize_e2m1(x, block, mult, dq, torch.randint(0, 2 ** 62, x.shape, generator=theirs))
            assert_codes_equal(got[0], want[0], ("x", x))
            assert_bits_equal(got[1], want[1], ("x", x))
            assert torch.equal(ours.get_state(), theirs.get_state())
        torch.manual_seed(5)
        got = nvfp4_passes.quantize_e2m1_drawing(x, block, mult, dq)
        after = torch.rand(2)
        torch.manual_seed(5)
        want = nvfp4_passes.quantize_e2m1(x, block, mult, dq, torch.randint(0, 2 ** 62, x.shape))
        assert_codes_equal(got[0], want[0], ("x", x))
        assert_bits_equal(got[1], want[1], ("x", x))
        assert torch.equal(torch.rand(2), after)


def test_quantize_e2m1_drawing_falls_back_to_torch_randint_where_the_check_fails(monkeypatch):
    """Where the state reading does not match torch (another torch's layout), the draws come from
    ``torch.randint``: the same bits, the same generator state."""
    monkeypatch.setattr(nvfp4_passes, "_MT_CHECKED", [False])
    x, ones = _special_matrix(128, 128, 45, nan=False), torch.ones(128, 8)
    ours, theirs = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    got = nvfp4_passes.quantize_e2m1_drawing(x, (1, 16), ones, ones, ours)
    want = nvfp4_passes.quantize_e2m1(x, (1, 16), ones, ones, torch.randint(0, 2 ** 62, x.shape, generator=theirs))
    assert_codes_equal(got[0], want[0])
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_the_kernels_closures_hold_only_numbers_so_numbas_cache_finds_them():
    """numba's on-disk cache keys a closure's compiled code by its pickled cell contents: a cell holding a jitted
    function pickles differently in every process, so the kernel would be compiled again (seconds) at every start
    and another copy written to the cache. Each specialized kernel closes over flags and constants only."""
    kernels = [*loops.QUANTIZE.values(), *loops.DEQUANTIZE.values(), loops.e2m1_nearest, loops.e2m1_stochastic,
               loops.e2m1_drawing]
    for k in kernels:
        cells = [c.cell_contents for c in (k.py_func.__closure__ or ())]
        assert all(isinstance(v, (bool, int, float, str, np.number)) for v in cells), (k.py_func.__qualname__, cells)


def _nvfp4_amax_grid() -> torch.Tensor:
    """(64, 32) float32 block amaxes where NVFP4's scale rules change behaviour: 0, FP32 subnormals, the
    thresholds around 6 * 2^-6 * t (the block-scale floor) and 6 * 448 * t (its cap), one ulp either side,
    E4M3 ties of amax / 6 / t, a tensor max 2688 (t = 1), large and tiny values."""
    g = torch.Generator().manual_seed(47)
    base = torch.tensor([0.0, F32_SUB_MIN, 1e-40, F32_TINY, 6 * 2.0 ** -6, 6 * 448.0, 2688.0, 6 * 1.0625,
                         6 * 1.1875, 6 * 0.0703125, 6 * 2.0 ** -9, 6 * 3 * 2.0 ** -10, 6 * 464.0, 1e30, 1.0])
    edges = torch.cat([base, torch.nextafter(base, torch.tensor(INF)), torch.nextafter(base, torch.tensor(0.0))])
    rest = torch.exp(torch.empty(64 * 32 - edges.numel()).uniform_(-80, 7.8, generator=g))
    a = torch.cat([edges, rest]).clamp(max=2688.0)
    return a[torch.randperm(a.numel(), generator=g)].reshape(64, 32)


@pytest.mark.parametrize("edges", ["course", "torchao"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -100, 2.0 ** -125, 1e-45, 0.0, 2.0 ** 100])
def test_nvfp4_block_scales_kernel_equals_the_rule(edges, scale):
    """``nvfp4_quant.nvfp4_block_scales`` through ``nvfp4_passes.nvfp4_scale_pass`` against the rule: t and s from
    ``nvfp4.two_level_scales`` on a tensor whose block amaxes are the grid (one element per block holds its amax),
    recip and mult as ``nvfp4.encode_multipliers`` and ``ScaledTensor.block_scale_inv`` form them from those; the
    grid scaled so t is ordinary, below 2^-121 (course: pre-shifted, blocks flushed), floored at 2^-126 (course),
    subnormal (torchao), 0 and large; with
    ``tensor_amax`` given (0, inf, NaN, a value), a grid holding inf or NaN, and a transposed grid."""
    amax = _nvfp4_amax_grid() * scale
    grids = [amax, amax.t()]
    if scale == 1.0:
        with_inf, with_nan = amax.clone(), amax.clone()
        with_inf[3, 4], with_nan[5, 6] = INF, NAN
        grids += [with_inf, with_nan]
    for a in grids:
        x = torch.zeros(a.shape[0], a.shape[1] * 16)
        x[:, ::16] = a                                       # block (1, 16) j holds amax a[:, j]
        for given in (None, 0.0, INF, NAN, 1234.5):
            t_k, s_k, recip, mult = nvfp4_quant.nvfp4_block_scales(a, given, edges)
            t, s = nvfp4.two_level_scales(x, (1, 16), given, edges)                  # the rule
            assert_bits_equal(t_k.reshape(1), t.reshape(1))
            assert_codes_equal(s_k, s, ("amax", a))
            assert_bits_equal(recip, nvfp4.encode_multipliers(t, s, edges)[0], ("amax", a))
            st = scaled.ScaledTensor(torch.zeros(x.shape, dtype=E4M3), s, (1, 16), "e2m1", t)
            assert_bits_equal(mult, st.block_scale_inv(), ("amax", a))
            for k, w in zip((recip, mult), nvfp4_quant.nvfp4_multipliers(t, s, edges)):   # the torch multipliers
                assert_bits_equal(k, w)


def test_nvfp4_block_scales_kernel_runs_and_empty_grids_take_the_rule(monkeypatch):
    """The kernel is what ``quantize_nvfp4`` calls on a CPU (a spy counts it); an empty tensor's empty grid
    takes the torch body, as the rule does (t = 0, nothing to scale)."""
    real, count = nvfp4_passes.nvfp4_scale_pass, [0]

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(nvfp4_passes, "nvfp4_scale_pass", spy)
    nvfp4_quant.quantize_nvfp4(torch.randn(32, 64), (1, 16), keep_fp32=True)
    assert count[0] == 1
    got = nvfp4_quant.quantize_nvfp4(torch.zeros(0, 64), (1, 16))
    want = nvfp4.quantize_nvfp4(torch.zeros(0, 64), (1, 16))
    assert count[0] == 1 and got.data.shape == want.data.shape == (0, 64)
    assert_bits_equal(got.tensor_scale_inv.reshape(1), want.tensor_scale_inv.reshape(1))


# ------------------------------------------------------------------------------------------------ per tensor
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.3712, 2.0 ** -20, 7.77e20])
def test_per_tensor_quantize_kernel_equals_the_torch_rule(fmt, scale):
    """``per_tensor.to_float8`` (the per-tensor recipes' cast, saturating) through ``fp8_passes.quantize_fp8`` against the
    forced torch rule (clamp, then torch's cast), for a 3-D and a 2-D float32 tensor with every special value,
    and scales that push values past the format's max (and FP32's: to inf) or into its subnormals."""
    from mpcourse.core.quant.kernels.per_tensor import to_float8
    real, count = fp8_passes.quantize_fp8, [0]

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    x2 = _special_matrix(128, 256, 71)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_passes, "quantize_fp8", spy)
        for x in (x2.reshape(4, 32, 256), x2):
            got = to_float8(x, fmt, scale)
            want = torch_rule(tensor.to_float8, x, fmt, scale)           # the rule
            g, w = got.data.view(torch.uint8), want.data.view(torch.uint8)
            nan = torch.isnan(want.data.float())
            assert torch.isnan(got.data.float()[nan]).all()                       # NaN: a NaN code
            assert torch.equal(g[~nan], w[~nan]), int((g != w)[~nan].sum())
            assert_bits_equal(got.scale_inv.reshape(1), want.scale_inv.reshape(1))
    assert count[0] == 2


@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [None, 0.3712, 2.0 ** 120])
def test_fp8_upcast_kernel_equals_the_torch_rule(dtype, scale):
    """``upcast.fp8_to_float32`` (the per-tensor GEMMs' upcast) through ``fp8_passes.dequantize_fp8`` against the forced
    rule and against torch's own upcast times the scale: every code, row-major, transposed and 3-D codes; the
    result keeps the codes' layout."""
    from mpcourse.core.quant.kernels.upcast import fp8_to_float32
    codes = torch.arange(96 * 64, dtype=torch.int64).remainder(256).to(torch.uint8)
    data = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(81))].view(dtype)
    s = None if scale is None else torch.tensor(scale)
    for d in (data.reshape(96, 64), data.reshape(64, 96).t(), data.reshape(4, 24, 64)):
        got = fp8_to_float32(d, s)
        want = torch_rule(fp8_to_float32, d, s)
        assert got.stride() == want.stride()
        assert_bits_equal(got, want)
        assert_bits_equal(got, d.float() if s is None else d.float() * s)


# ------------------------------------------------------------------------------------------------ scale rules
def test_scale_rule_kernels_equal_the_torch_fast_paths_and_the_rules():
    """``blocks.pow2_scale`` and ``blocks.rceil_scale_inv`` through ``fused`` against their torch bodies (forced)
    and the rules they stand for (``compute_scale(..., power_2_scale=True)``, 2^k of ``mx_shared_exponent``), on
    amaxes that are 0, -0, subnormal, tiny (scale inf -> 2^127), ordinary, E4M3 and FP32 maxima, inf and NaN."""
    from mpcourse.core.quant.kernels.blocks import pow2_scale, rceil_scale_inv
    from mpcourse.core.quant.rules.tensor import compute_scale
    g = torch.Generator().manual_seed(91)
    amax = torch.cat([torch.tensor([0.0, -0.0, F32_SUB_MIN, 1e-40, F32_TINY, 1e-30, 1e-3, 0.5, 1.0, 447.9, 448.0,
                                    448.1, 6.0, 5.99, 57344.0, 1e30, F32_MAX, INF, NAN]),
                      torch.exp(torch.empty(4000).uniform_(-100, 88, generator=g))]).reshape(-1, 1).repeat(1, 3)
    for top in (448.0, 57344.0):
        got = pow2_scale(amax, top)
        assert_bits_equal(got, torch_rule(pow2_scale, amax, top))
        assert_bits_equal(got, compute_scale(amax, top, 0, None, True))
    finite = ~torch.isnan(amax)
    for elem, top in (("e4m3", 448.0), ("e2m1", 6.0)):
        got = rceil_scale_inv(amax, elem)
        assert_bits_equal(got[finite], torch_rule(rceil_scale_inv, amax, elem)[finite])
        k = mx.mx_shared_exponent(amax[finite], elem, "rceil")
        assert_bits_equal(got[finite], torch.exp2(k.double()).float())


def test_per_tensor_amax_kernel_equals_the_torch_rule():
    """``tensor.compute_amax`` through ``fp8_passes.block_amax`` (one block: the whole tensor) against its torch body
    (forced) on 1-D, 2-D and 3-D tensors with and without NaN, inf, -0.0 only, and subnormals only."""
    from mpcourse.core.quant.kernels.per_tensor import compute_amax
    x = _special_matrix(128, 256, 93)
    cases = [x, x.reshape(4, 32, 256), x.reshape(-1), torch.full((8, 16), -0.0), torch.full((3, 5), F32_SUB_MIN),
             _special_matrix(128, 256, 94, nan=False), _special_matrix(128, 256, 95, nan=False, inf=False)]
    for t in cases:
        got, want = compute_amax(t), torch_rule(compute_amax, t)
        assert got.shape == want.shape == ()
        assert_bits_equal(got.reshape(1), want.reshape(1))
        assert_bits_equal(got.reshape(1), tensor.compute_amax(t).reshape(1))      # the rule


def test_block_scales_of_the_wrong_shape_are_refused():
    """The kernels index without bounds checks: a learner's scale rule that returns one scale per row instead of
    per block, or a grid of the wrong shape handed to a kernel, gets a ValueError naming the shape."""
    x = torch.randn(128, 256)
    with pytest.raises(ValueError, match="one per block"):
        _learner_fp32_scaled(x, (1, 128), lambda a, top, m: (top / a).amax(dim=1), False)   # (128,), not (128, 2)
    with pytest.raises(ValueError, match="one per block"):
        fp8_passes.quantize_fp8(x, (1, 128), torch.ones(128, 1), False, torch.ones(128, 2))
    with pytest.raises(ValueError, match="does not divide"):
        fp8_passes.block_amax(x, (1, 100))
    with pytest.raises(ValueError, match="one per block"):
        fp8_passes.dequantize_fp8(torch.zeros(128, 256, dtype=E4M3), (16, 16), torch.ones(16, 8))


def test_the_kernels_leave_their_tensors_resizable():
    """The kernels read and write tensors through NumPy views made from addresses, not ``Tensor.numpy()``, which
    would mark the storage as not resizable: FSDP2 frees each gathered parameter by resizing its storage to 0
    (``free_storage``), and a weight quantized by the kernels must still allow that."""
    w = torch.randn(128, 256)
    codes, copy = fp8_passes.quantize_fp8(w, (1, 128), torch.ones(128, 2), False, torch.ones(128, 2))
    amax = fp8_passes.block_amax(w, (128, 128))
    up = fp8_passes.dequantize_fp8(codes, (1, 128), torch.ones(128, 2))
    for t in (w, codes, copy, amax, up):
        t.untyped_storage().resize_(0)                   # raises "not resizable" after t.numpy()
        assert t.untyped_storage().size() == 0


def test_the_views_of_memory_follow_its_contents_shape_and_dtype():
    """``jit.np_view`` hands out one NumPy view per (address, shape, dtype): a view reads the memory as it is now (the
    kernel sees new contents written in place, and a new tensor at a freed tensor's address), another shape or
    dtype at the same address gets its own view, and a non-contiguous tensor is refused."""
    buf = torch.zeros(2 * 64 * 64)
    x = buf[:4096].view(64, 64)
    for v in (1.0, -3.5, 2.0 ** -140, 7.0):
        x.fill_(v)
        assert float(fp8_passes.block_amax(x, (64, 64))) == abs(v)
        assert_bits_equal(fp8_passes.block_amax(buf.view(64, 128), (64, 128)).reshape(1), torch.tensor([abs(v)]))
    assert jit.np_view(x).dtype == np.float32 and jit.np_view(x.view(torch.int32)).dtype == np.int32
    assert jit.np_view(buf.view(64, 128)).shape == (64, 128) and jit.np_view(x).shape == (64, 64)
    for i in range(50):                                  # new tensors, often at a freed one's address
        y = torch.full((32, 48), float(i))
        assert float(fp8_passes.block_amax(y, (32, 48))) == i
        del y
    with pytest.raises(AssertionError, match="contiguous"):
        jit.np_view(buf.view(64, 128).t())


@pytest.mark.slow
def test_torch_compile_traces_the_torch_rules():
    """Inside ``torch.compile``'s tracing the kernels step aside (``jit.takes`` is False there): a compiled
    function that quantizes gives the kernels' bits without tracing into them."""
    x = _special_matrix(128, 256, 97, nan=False, inf=False)
    f = torch.compile(lambda t: blocks.quantize_mx(t, (1, 32), rule="rceil", keep_fp32=True).dequantize_fp32(),
                      backend="eager", fullgraph=False)
    assert_bits_equal(f(x), blocks.quantize_mx(x, (1, 32), rule="rceil", keep_fp32=True).dequantize_fp32())
