"""Tiny, subnormal and boundary amaxes: no scale rule turns a finite input into NaN, and every block decodes within
its element format's error wherever its scale can represent it.

The policies under test (each rule's docstring states its own, with its source):

* Per-tensor FP8 (current and delayed) and FP32 block scales (rowwise, 1x128, 128x128; power-of-two or not):
  Transformer Engine's ``compute_scale_from_amax``: scale = fp8_max / amax in FP32, FP32 max where that division
  overflows (amax below fp8_max / FP32 max, about 1.3e-36 for E4M3), 1 for amax 0, inf or NaN; a power-of-two
  scale keeps that scale's exponent (2^127 at the cap).
* MX (E4M3, E5M2, E2M1, E2M3, E3M2 elements; FLOOR and RCEIL): OCP MX v1.0 section 6.3, elements x / 2^k for every
  shared exponent k, 2^-127 included. ``edges="torchao"`` keeps torchao's divisor where k = -127 (2^-126 under
  FLOOR, 1 under RCEIL): the library's behaviour, against which the torchao oracle tests run.
* NVFP4: the FP32 tensor decode scale t = amax / (448 * 6) is kept at or above 2^-126, FP32's smallest normal
  (amax > 0); below t = 2^-121, where an encode multiplier 1 / (s t) can pass FP32's max, x is pre-shifted by 2^6
  (exact) and a block whose scale falls below E4M3's smallest normal is flushed whole (s = 0).
  ``edges="torchao"``: torchao 0.18's unclamped t (whose 1 / t overflows below amax ~ 1e-35).

Each test builds blocks whose amaxes sit on the boundaries: FP32 subnormals and the smallest normals, every power
of two in those ranges and one FP32 ulp either side, the amax whose fp8_max / amax overflows FP32, the amaxes
where the E8M0 exponent clamps at -127 (scale underflow) and where NVFP4's block scale leaves E4M3's normal range,
FP32 max, an all-zero block next to a tiny non-zero one. Three things are checked on every block:

1. the bits: data, scales and dequantized values equal an oracle that transcribes the stated rule in NumPy FP32
   arithmetic with ml_dtypes' casts (E4M3, E5M2, E2M1, E2M3, E3M2, E8M0), never the library's code;
2. the error: |dequantized - x| is at most the error of rounding x / u to the element format (to nearest, saturating
   at its max), times the block's decode multiplier u, with a 2^-16 |x| slack for the FP32 roundings of the
   multipliers; no NaN anywhere;
3. the placement, wherever the scale can represent the block: its amax lands in the element format's top binade
   (RCEIL, power-of-two scales: (max / 2, max]; FLOOR: [2^emax, 2^(emax + 1)); FP32 scales and NVFP4: at max,
   within the scale's own rounding), so the block keeps the format's full precision.

And every kernel (``fastpath``'s torch bodies and ``fused``'s numba passes) gives the rule's bits on these inputs.
An end-to-end check trains one step of a ``Float8Linear`` under every recipe on an input of amax ~ 1e-36.
"""
from __future__ import annotations

import contextlib
import copy
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.formats import FORMATS
from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling, Format,
                                 MXFP8BlockScaling, NVFP4BlockScaling, PerDirectionBlockScaling,
                                 convert_to_float8_training)
from mpcourse.core import kernels_switch
from mpcourse.core.quant.kernels import blocks, jit, nvfp4_quant, per_tensor, upcast
from mpcourse.core.quant.rules import blockwise, hadamard, mx, nvfp4, tensor
from mpcourse.core.quant.rules.delayed import amax_and_scale_update

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn,
      "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
MX_ELEMS = ["e4m3", "e5m2", "e2m1", "e2m3", "e3m2"]
NVFP4_TOP = FORMATS["e4m3"].max * FORMATS["e2m1"].max          # 2688: t = amax / 2688


# ------------------------------------------------------------------------------------------------ inputs
def _f32(v: float) -> float:
    return float(np.float32(v))


def _with_ulps(v: float) -> list[float]:
    """v (rounded to FP32) and its FP32 neighbours one ulp below and above."""
    t = torch.tensor(v, dtype=torch.float32)
    return [float(torch.nextafter(t, torch.tensor(0.0))), float(t), float(torch.nextafter(t, torch.tensor(math.inf)))]


def boundary_amaxes(top: float, emax: int) -> np.ndarray:
    """Sorted FP32 amaxes, 0 first: the powers of two where FP32, E8M0 and the scale rules change behaviour
    (subnormals 2^-149 .. 2^-127, the smallest normals, 2^-121 .. 2^-116, some normal ones, the top), each with its
    neighbours one ulp either side; the amax at which top / amax overflows FP32; the amaxes where an E8M0 exponent
    clamps at -127 (RCEIL: amax / top = 2^-127, 2^-126; FLOOR: amax = 2^(emax - 127)); NVFP4's thresholds
    (2688 * 2^-121, 2^-122, 2^-126, 2688 / FP32 max); 1e-36, 1e-40, 1e-45; FP32 max."""
    exps = [-149, -148, -146, -140, -136, -133, -131, -130, -129, -128, -127, -126, -125, -124, -122, -121, -120,
            -119, -118, -117, -116, -100, -64, -20, -9, -6, -1, 0, 1, 8, 15, 64, 119, 120, 126, 127]
    vals = [v for e in exps for v in _with_ulps(2.0 ** e)]
    t = torch.tensor(top, dtype=torch.float32)
    specials = [float(t / torch.tensor(F32_MAX)), top * 2.0 ** -127, top * 2.0 ** -126, 2.0 ** (emax - 127),
                NVFP4_TOP * 2.0 ** -121, NVFP4_TOP * 2.0 ** -122, NVFP4_TOP * 2.0 ** -126, NVFP4_TOP / F32_MAX,
                1e-36, 1e-40, 1e-45, top, F32_MAX]
    vals += [v for s in specials for v in _with_ulps(_f32(s))]
    a = np.array(sorted({v for v in vals if 0 < v < math.inf}), dtype=np.float32)
    return np.concatenate([np.zeros(1, np.float32), a])


FRACTIONS = [1.0, -1.0, 0.0, -0.0, 0.5, -0.75, 1 / 7, -(2.0 ** -10), 2.0 ** -20, 0.999, -0.3, 0.0625, 1 - 2.0 ** -24,
             0.6, -0.126, 2.0 ** -3]


def blocks_of(amaxes: np.ndarray, block: tuple[int, int], per_row: int = 4, seed: int = 0) -> np.ndarray:
    """(M, K) float32 whose (r, c) blocks have the given amaxes, in order along the rows of the block grid
    (``per_row`` blocks per grid row; the last row is filled with the first amaxes again, so each amax's block sits
    beside its neighbours': 0 beside 2^-149). A block holds its amax at its first element and amax * fraction
    elsewhere (fractions of both signs, signed zeros, 1 - 2^-24, small powers of two, random ones), so its max |x|
    is exactly its amax."""
    r, c = block
    n = len(amaxes)
    gm = -(-n // per_row)
    a = np.resize(np.asarray(amaxes, np.float32), gm * per_row).reshape(gm, per_row)
    frac = np.random.default_rng(seed).uniform(-0.99, 0.99, r * c).astype(np.float32)
    frac[:min(len(FRACTIONS), r * c)] = FRACTIONS[:r * c]
    x = a[:, None, :, None] * frac.reshape(r, c)[None, :, None, :]          # float32 products
    return np.ascontiguousarray(x.reshape(gm * r, per_row * c), dtype=np.float32)


# ------------------------------------------------------------------------------------------------ oracles
def cast(y: np.ndarray, elem: str) -> np.ndarray:
    """FP32 y saturated to +-max and cast to ``elem`` by ml_dtypes (round to nearest even), as float32."""
    top = F32(FORMATS[elem].max)
    with np.errstate(invalid="ignore"):
        return np.clip(y, -top, top).astype(ML[elem]).astype(np.float32)


def block_amax(x: np.ndarray, block) -> np.ndarray:
    r, c = block
    M, K = x.shape
    return np.abs(x).reshape(M // r, r, K // c, c).max(axis=(1, 3))


def per_block(v: np.ndarray, x_shape, block) -> np.ndarray:
    """(M/r, K/c) block values repeated over their blocks: (M, K)."""
    r, c = block
    return np.repeat(np.repeat(v, r, axis=0), c, axis=1).reshape(x_shape)


def fp32_scale_oracle(amax: np.ndarray, top: float, power_2: bool) -> np.ndarray:
    """Transformer Engine's ``compute_scale_from_amax`` (margin 0) in NumPy FP32: top / amax, FP32 max where that
    overflows, 1 where amax is 0, inf or NaN; a power-of-two scale keeps the exponent bits."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(top) / amax
    s = np.where((amax > 0) & np.isfinite(amax), s, F32(1.0))
    s = np.where(np.isinf(s), F32(F32_MAX), s).astype(np.float32)
    if power_2:
        s = (s.view(np.int32) & np.int32(0x7F800000)).view(np.float32)
    return s


def fp32_scaled_oracle(x: np.ndarray, block, fmt: str, power_2: bool):
    """(codes as float32, scale_inv, dequantized) of FP8 with one FP32 scale per block."""
    s = fp32_scale_oracle(block_amax(x, block), FORMATS[fmt].max, power_2)
    q = cast((x * per_block(s, x.shape, block)).astype(np.float32), fmt)
    inv = (F32(1.0) / s).astype(np.float32)
    with np.errstate(over="ignore"):                                        # at the top of FP32: inf, as FP32 does
        return q, inv, (q * per_block(inv, x.shape, block)).astype(np.float32)


def mx_exponent_oracle(amax: np.ndarray, elem: str, rule: str) -> np.ndarray:
    """k per block, exactly: FLOOR floor(log2 amax) - emax_elem (amax 0: the exponent field 0), RCEIL
    ceil(log2 d) of the FP32 quotient d = amax / elem max (d 0: -127); clamped to E8M0's [-127, 127]."""
    f = FORMATS[elem]
    with np.errstate(over="ignore"):
        d = (np.asarray(amax, np.float32) / F32(f.max)).astype(np.float32)
    out = []
    for a, q in zip(np.asarray(amax, np.float32).ravel().tolist(), d.ravel().tolist()):
        if rule == "floor":
            k = -127 - f.emax if a == 0 else 128 - f.emax if math.isinf(a) else math.frexp(a)[1] - 1 - f.emax
        else:
            m, e = math.frexp(q) if 0 < q < math.inf else (0.5, 0)
            k = -127 if q == 0 else 128 if math.isinf(q) else (e - 1 if m == 0.5 else e)
        out.append(min(max(k, -127), 127))
    return np.array(out, dtype=np.int64).reshape(np.shape(amax))


def mx_oracle(x: np.ndarray, block, elem: str, rule: str, edges: str = "course"):
    """(elements, E8M0 bytes, dequantized, k unclamped-below?) of MX: elements cast(x / divisor) in FP32, the divisor
    2^k (``edges="torchao"``: 2^-126 FLOOR / 1 RCEIL where k = -127), dequantized element * 2^k."""
    k = mx_exponent_oracle(block_amax(x, block), elem, rule)
    scale = np.ldexp(np.float64(1.0), k).astype(np.float32)                 # 2^-127 is an FP32 subnormal: exact
    div = scale
    if edges == "torchao":
        div = np.where(k == -127, F32(2.0 ** -126 if rule == "floor" else 1.0), scale).astype(np.float32)
    q = cast((x / per_block(div, x.shape, block)).astype(np.float32), elem)
    with np.errstate(over="ignore"):
        return q, (k + 127).astype(np.uint8), (q * per_block(scale, x.shape, block)).astype(np.float32), scale


def nvfp4_oracle(x: np.ndarray, block, edges: str = "course"):
    """(elements, t, block scales, dequantized, decode multipliers) of NVFP4 in NumPy FP32: t = amax / 2688 (kept
    >= 2^-126 for amax > 0 unless ``edges="torchao"``), v = (amax_b / 6) / t, s = e4m3(clip(v, 2^-6, 448)) (t = 0: 1)
    but 0 where t < 2^-121 and v < 2^-6 (course); elements e2m1((x * pre) * (((1 / t) / pre) / s)) (0 where s = 0;
    pre = 2^6 where t < 2^-121, course, else 1), decoded element * (s * t)."""
    amax_b = block_amax(x, block)
    t = F32(amax_b.max()) / F32(NVFP4_TOP) if amax_b.size else F32(0.0)
    if edges == "course" and amax_b.max() > 0 and t < F32(2.0 ** -126):
        t = F32(2.0 ** -126)
    tiny = edges == "course" and 0 < t < F32(2.0 ** -121)
    pre = F32(64.0) if tiny else F32(1.0)
    safe = t if t > 0 else F32(1.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        v = ((amax_b / F32(6.0)) / safe).astype(np.float32)
        s = cast(np.clip(v, F32(2.0 ** -6), F32(448.0)).astype(np.float32), "e4m3")
        if tiny:
            s = np.where(v < F32(2.0 ** -6), F32(0.0), s).astype(np.float32)
        recip = (((F32(1.0) / safe) / pre) / s).astype(np.float32)
        recip = np.where(s == 0, F32(0.0), recip).astype(np.float32)
        q = cast(((x * pre).astype(np.float32) * per_block(recip, x.shape, block)).astype(np.float32), "e2m1")
        m = (s * t).astype(np.float32)
        return q, t, s, (q * per_block(m, x.shape, block)).astype(np.float32), m


# ------------------------------------------------------------------------------------------------ checks
def assert_same(got, want, what: str) -> None:
    """float32 arrays of the same bits (signed zeros told apart), NaN only where the other has NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.int32) != want.view(np.int32)))
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {int(bad.sum())} differ; first at {tuple(i)}: got {got[tuple(i)]!r}, "
                             f"want {want[tuple(i)]!r}")


FP32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103        # an FP32 product at or above this rounds to inf


def assert_within_format_error(x, deq, unit, q, elem: str, what: str) -> None:
    """|deq - x| <= the error of rounding x / unit to ``elem`` (nearest, saturating at its max) times ``unit``, plus
    2^-16 |x| (the FP32 roundings of the scaled copy and of the multipliers) and 2^-149 (an FP32-subnormal result).
    x, deq, unit, q: arrays of one shape (unit: each element's decode multiplier, > 0; q: its element value).
    No NaN anywhere; inf only where the decoded product q * unit itself is past FP32's range (an element rounded up
    to 2^128 / unit at the very top of FP32: the one value FP32 cannot hold), as FP32 arithmetic rounds it."""
    f = FORMATS[elem]
    x, deq, unit, q = (np.asarray(v, np.float64) for v in (x, deq, unit, q))
    assert not np.isnan(deq).any(), f"{what}: {int(np.isnan(deq).sum())} NaN dequantized values"
    over = np.abs(q) * unit >= FP32_OVERFLOW                     # exact in float64: q has at most 4 bits
    assert np.array_equal(np.isinf(deq), over), f"{what}: inf where the decoded product is an FP32 number"
    y = np.abs(x) / unit
    e = np.frexp(np.maximum(y, f.min_normal))[1]                # y in [2^(e-1), 2^e)
    step = np.ldexp(1.0, e - 1 - f.mantissa_bits)
    err = np.where(y > f.max, y - f.max, step / 2) * unit
    bad = ~(np.abs(deq - x) <= err + 2.0 ** -16 * np.abs(x) + 2.0 ** -149) & ~over
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements beyond {elem}'s error; first {i}: x {x[i]!r}, "
                             f"dequantized {deq[i]!r}, decode multiplier {unit[i]!r}, bound {err[i]!r}")


@contextlib.contextmanager
def kernels(mode: str):
    """``fastpath``'s quantizers as they run: "numba" (``fused``'s compiled passes, where numba imports) or "torch"
    (``fused`` off: ``fastpath``'s torch bodies)."""
    if mode == "numba" and not jit.AVAILABLE:
        pytest.skip("numba is not installed (or MPCOURSE_FUSED=0): the compiled kernels are off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "COMPILED", mode == "numba")
        yield


KERNELS = ["numba", "torch"]


def assert_st_equal(got, want, what: str, mode: str = "torch") -> None:
    """Two ScaledTensors (or Float8Tensors) with the same data bytes, scale bits and dequantized bits (the rule's
    ``dequantize``, the kept FP32 copy if any, and ``upcast.dequantize`` run in kernel ``mode``)."""
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), f"{what}: data bytes differ"
    assert torch.equal(got.scale_inv.reshape(-1).view(torch.uint8), want.scale_inv.reshape(-1).view(torch.uint8)), \
        f"{what}: scale_inv differs"
    if getattr(want, "tensor_scale_inv", None) is not None:
        assert torch.equal(got.tensor_scale_inv.view(torch.int32), want.tensor_scale_inv.view(torch.int32)), what
    with kernels_off():
        ref = want.dequantize(torch.float32)
    assert_same(got.dequantize(torch.float32), ref, f"{what}: dequantize")
    kept = getattr(got, "dequantized", None)
    if kept is not None:
        assert_same(kept, ref, f"{what}: the kept FP32 copy")
    if hasattr(got, "block"):
        with kernels(mode):
            assert_same(upcast.dequantize(got, torch.float32), ref, f"{what}: upcast.dequantize ({mode})")


@contextlib.contextmanager
def kernels_off():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "COMPILED", False)
        yield


# ------------------------------------------------------------------------------------------------ per tensor
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_current_scaling_on_boundary_amaxes(fmt, power_2):
    top = FORMATS[fmt].max
    for amax in boundary_amaxes(top, FORMATS[fmt].emax).tolist():
        x = (np.float32(amax) * np.array(FRACTIONS, np.float32)).astype(np.float32).reshape(1, -1)
        q, inv, deq = fp32_scaled_oracle(x, (1, x.shape[1]), fmt, power_2)
        xt = torch.from_numpy(x)
        rule = tensor.quantize_current(xt, fmt, power_2_scale=power_2)
        what = f"{fmt} amax {amax!r}"
        assert_same(rule.data.float(), q, what)
        assert_same(rule.scale_inv.reshape(1, 1), inv, what)
        assert_same(rule.dequantize(), deq, what)
        assert_within_format_error(x, deq, np.broadcast_to(inv, x.shape), q, fmt, what)
        s = fp32_scale_oracle(np.float32(amax), top, power_2)
        if 0 < amax and top / amax <= F32_MAX:                               # the FP32 scale represents it
            y = float(np.float32(amax) * s)
            assert (top / 2 < y <= top) if power_2 else abs(y - top) <= top * 2.0 ** -22, (what, y)
        for mode in KERNELS:
            with kernels(mode):
                amax_k = per_tensor.compute_amax(xt)
                fast = per_tensor.to_float8(xt, fmt, tensor.compute_scale(amax_k, top, 0, None, power_2))
            assert_st_equal(fast, rule, f"{what} ({mode})", mode)


def test_delayed_scaling_keeps_a_tiny_amax_history_finite():
    """An amax history of tiny values gives TE's capped scale (FP32 max), and the next steps' casts, with the
    delayed scale, of a tiny tensor and of a normal one (which saturates) hold no NaN."""
    for amax in (1e-45, 1e-40, 2.0 ** -127, 1e-37, 1.3e-36, 1e-36):
        hist = torch.tensor([amax, 0.0, 0.0, 0.0])
        _, scale = amax_and_scale_update(hist, torch.tensor(1.0), 448.0)
        want = fp32_scale_oracle(np.float32(amax), 448.0, False)
        assert float(scale) == float(want) and math.isfinite(float(scale)), amax
        for x in (torch.tensor([[amax, -amax / 3, 0.0, amax * 0.999]]), torch.tensor([[1.0, -2.0, 0.0, 3e-3]])):
            x8 = tensor.to_float8(x, "e4m3", scale)
            assert not bool(x8.dequantize().isnan().any()) and not bool(x8.data.float().isnan().any())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp32_scales_of_an_infinite_amax_are_one(fmt):
    """TE's rule for an infinite amax (per tensor and per FP32-scaled block): scale 1, so the inf saturates to
    +-fp8_max and decodes finite, the finite values are cast at scale 1; other blocks keep their own scales."""
    top = FORMATS[fmt].max
    x = torch.tensor([[math.inf, -1.5, 0.0, 3e-3] * 32, [1.0, -2.0, 0.5, 0.25] * 32])      # (2, 128)
    for power_2 in (False, True):
        q = tensor.quantize_current(x[:1], fmt, power_2_scale=power_2)
        assert float(q.scale_inv) == 1.0 and float(q.data[0, 0].float()) == top
        b = blockwise.quantize_fp32_scaled(x, (1, 128), fmt, power_2_scale=power_2)
        assert float(b.scale_inv[0, 0]) == 1.0 and float(b.scale_inv[1, 0]) == float(
            1 / fp32_scale_oracle(np.float32(2.0), top, power_2))
        d = b.dequantize()
        assert torch.isfinite(d).all() and float(d[0, 0]) == top and float(d[0, 1]) == -1.5
        for mode in KERNELS:
            with kernels(mode):
                fast = blocks.quantize_fp32_scaled(x, (1, 128), fmt, power_2_scale=power_2, keep_fp32=True)
            assert_st_equal(fast, b, f"{fmt} {mode}", mode)


# ------------------------------------------------------------------------------------------------ FP32 block scales
FP32_BLOCKS = [(1, -1), (1, 128), (128, 1), (128, 128)]


def _fp32_block_case(block):
    amaxes = boundary_amaxes(448.0, 8)
    if block == (1, -1):
        return blocks_of(amaxes, (1, 64), per_row=1), (1, 64)
    if block == (128, 128):
        return blocks_of(amaxes[::3], block, per_row=6), block
    return blocks_of(amaxes, block, per_row=4 if block[1] > 1 else 16), block


@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("block", FP32_BLOCKS, ids=str)
def test_fp32_block_scales_on_boundary_amaxes(block, power_2):
    x, b = _fp32_block_case(block)
    q, inv, deq = fp32_scaled_oracle(x, b, "e4m3", power_2)
    xt = torch.from_numpy(x)
    rule = blockwise.quantize_fp32_scaled(xt, block, "e4m3", power_2_scale=power_2)
    assert_same(rule.data.float(), q, f"{block} data")
    assert_same(rule.scale_inv, inv, f"{block} scale_inv")
    assert_same(rule.dequantize(), deq, f"{block} dequantized")
    assert_within_format_error(x, deq, per_block(inv, x.shape, b), q, "e4m3", f"{block}")
    amax = block_amax(x, b)
    s = fp32_scale_oracle(amax, 448.0, power_2)
    with np.errstate(divide="ignore", over="ignore"):
        ok = (amax > 0) & np.isfinite(F32(448.0) / amax)                 # where the FP32 scale represents it
    y = (amax * s)[ok]
    assert ((224 < y) & (y <= 448)).all() if power_2 else (np.abs(y - 448) <= 448 * 2.0 ** -22).all()
    for mode in KERNELS:
        for keep in (False, True):
            with kernels(mode):
                fast = blocks.quantize_fp32_scaled(xt, block, "e4m3", power_2_scale=power_2, keep_fp32=keep)
            assert_st_equal(fast, rule, f"{block} {mode} keep={keep}", mode)


def test_a_tiny_block_beside_an_all_zero_block_decodes_to_itself_in_every_rule():
    """The issue's case, by hand: an all-zero block and a block of 2^-130 side by side (2^-128 where the element
    format's smallest step needs it: MXFP4's and NVFP4's smallest non-zero value is 0.5 * 2^-127). FP32 scales
    (capped at FP32 max: 2^-130 * FP32 max is just below 1/4, which E4M3 rounds to 1/4), MX under FLOOR and RCEIL
    (OCP: 2^-130 / 2^-127 = 1/8) and NVFP4 give the zero block back as zeros and the tiny block exactly; for NVFP4
    the tiny block is 6 * 2^-132 (t = 2^-126, FP32's smallest normal, and s = 2^-6, E4M3's: the smallest decode
    multiplier two normal scales make), its zero neighbour flushed whole (s = 0), and a block of 2^-128 (scale
    1/24, rounded by E4M3) within E4M3's rounding of itself."""
    def pair(v):
        x = torch.zeros(32, 64)
        x[:, 32:] = v
        return x

    x = pair(2.0 ** -130)
    for p2 in (False, True):
        assert torch.equal(blockwise.quantize_fp32_scaled(x, (1, 32), power_2_scale=p2).dequantize(), x), p2
    for rule in ("floor", "rceil"):
        for elem in MX_ELEMS:
            xe = pair(2.0 ** -128) if elem == "e2m1" else x
            assert torch.equal(mx.quantize_mx(xe, (1, 32), elem, rule).dequantize(), xe), (rule, elem)
    x = pair(6 * 2.0 ** -132)
    for block in ((1, 16), (16, 1), (16, 16)):
        q = nvfp4.quantize_nvfp4(x, block)
        assert float(q.tensor_scale_inv) == 2.0 ** -126
        assert torch.equal(q.dequantize(), x), block
        assert float(q.scale_inv.float().min()) == 0 and float(q.scale_inv.float().max()) == 2.0 ** -6
        d = nvfp4.quantize_nvfp4(pair(2.0 ** -128), block).dequantize()
        assert float((d - pair(2.0 ** -128)).abs().max()) <= 2.0 ** -128 / 16, block


# ------------------------------------------------------------------------------------------------ MX
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elem", MX_ELEMS)
@pytest.mark.parametrize("block", [(1, 32), (32, 1)], ids=str)
def test_mx_on_boundary_amaxes(block, elem, rule):
    f = FORMATS[elem]
    x = blocks_of(boundary_amaxes(f.max, f.emax), block, per_row=4 if block[1] > 1 else 16)
    q, byte, deq, scale = mx_oracle(x, block, elem, rule)
    xt = torch.from_numpy(x)
    got = mx.quantize_mx(xt, block, elem, rule)
    what = f"MX {elem} {rule} {block}"
    assert_same(got.data.float(), q, f"{what} elements")
    assert torch.equal(got.scale_inv.view(torch.uint8), torch.from_numpy(byte)), f"{what} E8M0 bytes"
    assert np.array_equal(np.asarray(got.scale_inv.float()), scale.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert_same(got.dequantize(), deq, f"{what} dequantized")
    assert_within_format_error(x, deq, per_block(scale, x.shape, block), q, elem, what)
    # where E8M0 represents the exponent the rule asks for (k >= -127 before the clamp), the block amax lands in
    # the element format's top binade: floor [2^emax, 2^(emax+1)), rceil (max / 2, max]
    amax = block_amax(x, block).astype(np.float64)
    unclamped = amax >= (2.0 ** (f.emax - 127) if rule == "floor" else f.max * 2.0 ** -127 * (1 + 2.0 ** -22))
    y = (amax / scale)[unclamped]
    if rule == "floor":
        assert ((2.0 ** f.emax <= y) & (y < 2.0 ** (f.emax + 1))).all(), what
    else:
        assert ((f.max / 2 < y) & (y <= f.max * (1 + 2.0 ** -22))).all(), what
    for mode in KERNELS:
        for keep in (False, True):
            with kernels(mode):
                fast = blocks.quantize_mx(xt, block, elem, rule, keep_fp32=keep)
            assert_st_equal(fast, got, f"{what} {mode} keep={keep}", mode)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elem", MX_ELEMS)
def test_mx_torchao_edges_keep_torchaos_divisor_where_k_is_minus_127(elem, rule):
    """``edges="torchao"``: the library's divisor where k = -127 (torchao ``to_mx``: 2^-126 under FLOOR, TE's and
    torchao's RCEIL 1), bit for bit with the oracle, rule and kernels; elsewhere the same bits as the default."""
    f = FORMATS[elem]
    x = blocks_of(boundary_amaxes(f.max, f.emax), (1, 32))
    q, byte, deq, _ = mx_oracle(x, (1, 32), elem, rule, edges="torchao")
    xt = torch.from_numpy(x)
    got = mx.quantize_mx(xt, (1, 32), elem, rule, edges="torchao")
    assert_same(got.data.float(), q, "elements")
    assert torch.equal(got.scale_inv.view(torch.uint8), torch.from_numpy(byte))
    assert_same(got.dequantize(), deq, "dequantized")
    default = mx.quantize_mx(xt, (1, 32), elem, rule)
    same = torch.from_numpy(byte != 0).repeat_interleave(32, 1)
    assert torch.equal(got.data.view(torch.uint8)[same], default.data.view(torch.uint8)[same])
    for mode in KERNELS:
        with kernels(mode):
            fast = blocks.quantize_mx(xt, (1, 32), elem, rule, keep_fp32=True, edges="torchao")
        assert_st_equal(fast, got, f"{mode}", mode)
    if elem in ("e4m3", "e5m2"):   # the difference the default makes on MXFP8: a block of 2^-130
        tiny = torch.full((1, 32), 2.0 ** -130)
        lib = mx.quantize_mx(tiny, (1, 32), elem, rule, edges="torchao").dequantize()
        assert torch.equal(mx.quantize_mx(tiny, (1, 32), elem, rule).dequantize(), tiny)
        assert torch.equal(lib, tiny / 2 if rule == "floor" else torch.zeros_like(tiny)), lib[0, 0]


def test_mx_infinite_amax_takes_the_scale_its_rule_defines():
    """+-inf in a block (not a finite input, but both rules define its scale): FLOOR reads inf's exponent field
    (k = 128 - emax), RCEIL clamps at 2^127; the inf saturates to +-max and decodes to the FP32 product max * 2^k,
    past FP32 max in every element format (FLOOR: max * 2^(128 - emax) >= 2^128; RCEIL: max * 2^127 with max >= 2),
    so +-inf again; the block's finite elements round at that scale, nothing is NaN; a NaN block stays NaN (E8M0
    0xFF)."""
    x = torch.ones(3, 32)
    x[0, 3], x[1, 5], x[2, 7] = math.inf, -math.inf, math.nan
    for elem in MX_ELEMS:
        f = FORMATS[elem]
        for rule, k in (("floor", 128 - f.emax), ("rceil", 127)):
            for edges in ("course", "torchao"):
                q = mx.quantize_mx(x, (1, 32), elem, rule, edges=edges)
                assert q.scale_inv.view(torch.uint8).flatten().tolist() == [k + 127, k + 127, 255]
                assert float(q.data[0, 3].float()) == f.max and float(q.data[1, 5].float()) == -f.max
                d = q.dequantize()
                assert float(d[0, 3]) == math.inf and float(d[1, 5]) == -math.inf, (elem, rule)
                assert not bool(d[:2].isnan().any()) and bool(d[2].isnan().all())


# ------------------------------------------------------------------------------------------------ NVFP4
def _nvfp4_tensors(block):
    """One (M, K) tensor per tensor amax T (the boundary amaxes for 2688), each with blocks of amax T, 0, T / 2,
    T * 2^-6, T * 2^-20, 2^-130, 2^-149, and the two block amaxes around E4M3's smallest normal block scale
    (amax_b / 6 / t = 2^-6: below it the block scale clamps), all capped at T."""
    for T in boundary_amaxes(NVFP4_TOP, 0)[1:].tolist():
        t = max(tensor_scale(T), 2.0 ** -126)
        edge = _with_ulps(_f32(6 * 2.0 ** -6 * t))
        amaxes = [T, 0.0, T / 2, T * 2.0 ** -6, T * 2.0 ** -20, 2.0 ** -130, 2.0 ** -149, *edge, T * 0.7]
        amaxes = np.array([_f32(a) for a in amaxes if _f32(a) <= T], np.float32)
        yield T, blocks_of(amaxes, block, per_row=4 if block[1] > 1 else 8, seed=len(amaxes))


def tensor_scale(T: float) -> float:
    """torchao's t = amax / 2688 of an FP32 amax, in FP32 (before the course's floor)."""
    return float(F32(T) / F32(NVFP4_TOP))


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)], ids=str)
def test_nvfp4_on_boundary_tensor_amaxes(block):
    for T, x in _nvfp4_tensors(block):
        q, t, s, deq, m = nvfp4_oracle(x, block)
        xt = torch.from_numpy(x)
        got = nvfp4.quantize_nvfp4(xt, block)
        what = f"NVFP4 {block} tensor amax {T!r}"
        assert_same(got.data.float(), q, f"{what} elements")
        assert float(got.tensor_scale_inv) == float(t), what
        assert_same(got.scale_inv.float(), s, f"{what} block scales")
        assert_same(got.dequantize(), deq, f"{what} dequantized")
        kept = per_block(s, x.shape, block) > 0                    # a flushed block (s = 0) decodes to zeros
        assert np.all(deq[~kept] == 0), what
        assert_within_format_error(x[kept], deq[kept], per_block(m, x.shape, block)[kept], q[kept], "e2m1", what)
        # every block whose scale E4M3 represents (amax_b / 6 / t >= 2^-6) lands at E2M1's max 6, within that
        # scale's rounding (half an E4M3 step: 2^-4 relative); where t is not floored the tensor's largest block
        # has E4M3's max 448 as its scale; only below t = 2^-121 are blocks flushed, and only those it cannot reach
        amax_b = block_amax(x, block)
        fits = (amax_b / F32(6.0)) / t >= F32(2.0 ** -6)
        assert np.all(np.abs(amax_b[fits] / m[fits] - 6) <= 6 * 2.0 ** -4 / (1 - 2.0 ** -4)), what
        assert np.array_equal(s == 0, ~fits & (t < F32(2.0 ** -121))), what
        if tensor_scale(T) >= 2.0 ** -126:
            assert np.all(s[amax_b == amax_b.max()] == 448), what
        for mode in KERNELS:
            for keep in (False, True):
                with kernels(mode):
                    fast = nvfp4_quant.quantize_nvfp4(xt, block, keep_fp32=keep)
                assert_st_equal(fast, got, f"{what} {mode} keep={keep}", mode)


@pytest.mark.parametrize("block", [(1, 16), (16, 1)], ids=str)
def test_nvfp4_torchao_edges_are_torchaos_nvfp4_quantize(block):
    """``edges="torchao"``: torchao 0.18's ``nvfp4_quantize`` with its per-tensor scale, bit for bit, tiny tensors
    included (where its 1 / t overflows and an all-zero block becomes NaN); the default departs only there."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kern = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    tiny_nan = 0
    for T, x in _nvfp4_tensors((1, 16)):
        if tensor_scale(T) == 0:     # t underflows to 0: both modes then encode as an all-zero tensor (torchao: NaN)
            continue
        xt = torch.from_numpy(x)
        ours = nvfp4.quantize_nvfp4(xt, (1, 16), edges="torchao")
        t = nv.per_tensor_amax_to_scale(xt.abs().amax())
        scale, data = nv.nvfp4_quantize(xt, 16, t)
        vals = kern.f4_unpacked_to_f32(kern.unpack_uint4(data)).reshape(x.shape)
        assert torch.equal(ours.tensor_scale_inv.view(torch.int32), t.view(torch.int32)), T
        assert torch.equal(ours.scale_inv.view(torch.uint8), scale.view(torch.uint8).reshape(ours.scale_inv.shape))
        theirs_nan = torch.isnan(xt * ((1.0 / t) / scale.float().reshape(ours.scale_inv.shape)
                                       ).repeat_interleave(16, 1))
        ok = ~theirs_nan          # torchao's packed FP4 has no NaN code: compare where its scaled value is a number
        assert torch.equal(ours.data.float()[ok], vals[ok]), T
        assert torch.equal(ours.data.float().isnan(), theirs_nan), T
        tiny_nan += bool(theirs_nan.any())
        if tensor_scale(T) >= 2.0 ** -121:           # where the default does not floor t, the same bits
            default = nvfp4.quantize_nvfp4(xt, (1, 16))
            assert torch.equal(default.data.view(torch.uint8), ours.data.view(torch.uint8)), T
        with kernels_off():
            assert_st_equal(nvfp4_quant.quantize_nvfp4(xt, (1, 16), edges="torchao"), ours, f"{T}")
    assert tiny_nan > 0                               # the library's NaN on tiny tensors is reproduced


@pytest.mark.parametrize("rht", [False, True])
def test_nvfp4_gradients_stochastic_and_hadamard_on_tiny_tensors(rht):
    """The weight-gradient path (stochastic rounding, with and without the 16x16 random Hadamard transform) on tiny
    tensors with an all-zero block: no NaN, every element within one E2M1 step of its block (stochastic rounding
    goes to either neighbour) or, in a block flushed whole, zero (nothing drawn into it), the kernels equal to the
    rule (the same draws)."""
    for T, x in _nvfp4_tensors((16, 1)):
        xt = torch.from_numpy(x)
        if rht and T > F32_MAX / 4:   # |H x| reaches 4 max|x|: the transform itself overflows FP32 (its docstring)
            continue
        if rht:
            h = hadamard.rht(xt)
            assert torch.equal(nvfp4_quant.rht(xt).view(torch.int32), h.view(torch.int32))
            xt = h
        got = nvfp4.quantize_nvfp4(xt, (16, 1), rounding="stochastic", generator=torch.Generator().manual_seed(1))
        d = got.dequantize()
        m = per_block(got.block_scale_inv().numpy(), xt.shape, (16, 1))
        with np.errstate(invalid="ignore", divide="ignore"):   # 0 / 0: an all-zero tensor; x / 0: a flushed block
            y = xt.abs().numpy() / m
        assert np.isfinite(d.numpy()).all(), T
        flushed = per_block(got.scale_inv.float().numpy(), xt.shape, (16, 1)) == 0
        t = float(got.tensor_scale_inv)
        # flushed: below 6 * 2^-6 * t, up to the FP32 rounding of amax_b / 6 (an FP32 subnormal near 2^-132)
        assert np.all(d.numpy()[flushed] == 0), T
        assert np.all(np.abs(xt.numpy()[flushed]) < 6 * 2.0 ** -6 * t * (1 + 2.0 ** -15)), T
        assert (np.abs(d.numpy() - xt.numpy()) <= np.where(y < 2, 0.5, np.where(y < 4, 1, 2)) * m
                + 2.0 ** -16 * np.abs(xt.numpy()) + 2.0 ** -149)[~flushed].all(), T
        for mode in KERNELS:
            with kernels(mode):
                fast = nvfp4_quant.quantize_nvfp4(xt, (16, 1), rounding="stochastic",
                                               generator=torch.Generator().manual_seed(1), keep_fp32=True)
            assert_st_equal(fast, got, f"{T} {mode}", mode)


def test_nvfp4_infinite_input_is_not_hidden():
    """NVFP4 defines no infinite amax: an inf makes t infinite (torchao's rule too) and every element dequantizes to
    NaN, so the overflow shows in the GEMM instead of passing as a finite value; the default changes nothing here."""
    x = torch.ones(16, 32)
    x[3, 5] = math.inf
    for edges in ("course", "torchao"):
        q = nvfp4.quantize_nvfp4(x, (1, 16), edges=edges)
        assert math.isinf(float(q.tensor_scale_inv)) and bool(q.dequantize().isnan().all())


def test_edges_names_are_checked():
    for call in (lambda: mx.quantize_mx(torch.ones(1, 32), edges="ocp"),
                 lambda: nvfp4.quantize_nvfp4(torch.ones(1, 16), edges="te"),
                 lambda: blocks.quantize_mx(torch.ones(1, 32), edges="spec"),
                 lambda: nvfp4_quant.quantize_nvfp4(torch.ones(1, 16), edges=None)):
        with pytest.raises(ValueError, match="edges must be one of") as err:
            call()
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ end to end
LAYER_RECIPES = {"fp8-current": CurrentScaling(), "fp8-delayed": DelayedScaling(),
                 "fp8-rowwise": Float8RowwiseScaling(), "fp8-block": Float8BlockScaling(),
                 "mxfp8": MXFP8BlockScaling(), "mxfp8-floor": MXFP8BlockScaling(scale_rule="floor"),
                 "mxfp8-hybrid": MXFP8BlockScaling(fp8_format=Format.HYBRID), "nvfp4": NVFP4BlockScaling(),
                 "mxfp8-fwd-nvfp4-bwd": PerDirectionBlockScaling()}


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("name", LAYER_RECIPES)
@pytest.mark.parametrize("scale", [1e-36, 1e-38, 2.0 ** -140])
def test_float8_linear_on_a_tiny_input_gives_no_nan(scale, name, kernels_on):
    """A converted linear layer, forward and backward, on an input of amax ~ scale with an all-zero row block and
    column block: output, input gradient and weight gradient are finite. At amax ~ 1e-36 the scales represent the
    input (FP8: 448 / amax is a finite FP32; MX: most blocks' E8M0 exponents are >= -127; NVFP4: its tensor scale
    is floored at 2^-121), and the output and weight gradient are close to FP32's (not under delayed scaling, whose
    first step casts with the initial scale 1)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))   # a bias would hide the tiny product
    with kernels_switch.flags(enabled=kernels_on):        # the layer's quantizers and GEMMs: kernels or rules
        lin = convert_to_float8_training(copy.deepcopy(ref), recipe=LAYER_RECIPES[name])
    assert lin[0].quantizers["input"].backend.kernels is kernels_on
    x = torch.randn(128, 256) * scale
    x[:32] = 0.0
    x[:, 64:96] = 0.0
    dy = torch.randn(128, 128)
    outs = []
    for m in (lin, ref):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, m[0].weight.grad))
    for got in outs[0]:
        assert torch.isfinite(got).all(), name
    if scale == 1e-36 and name != "fp8-delayed":    # delayed scaling's first step casts with scale 1: flushed
        tol = 0.3 if "nvfp4" in name else 0.1
        (y, _, dw), (yr, _, dwr) = (tuple(t.double() for t in o) for o in outs)   # squares of 1e-36 underflow FP32
        assert float((y - yr).norm() / yr.norm()) < tol, name
        assert float((dw - dwr).norm() / dwr.norm()) < tol, name
