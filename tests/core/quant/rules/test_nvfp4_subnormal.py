"""NVFP4 at FP32-subnormal amaxes: every block the two scales can represent decodes within the format's error,
every block they cannot is flushed whole (``nvfp4.quantize_nvfp4``'s docstring states the rule and why).

Oracle, written here from the rule's statement and nothing of the library: float64 arithmetic of the two-level
scale and ml_dtypes' E4M3 and E2M1 casts (round to nearest even, saturated by hand):

    t   = max(float32(amax / 2688), 2^-126)           the tensor decode scale, never an FP32 subnormal
    v_b = amax_b / 6 / t                              the block decode scale the block asks for
    s_b = e4m3(min(v_b, 448)) where v_b >= 2^-6       E4M3's normal range: the block is represented
        = 0 (the block flushed whole)  where v_b < 2^-6 and t < 2^-121
    q   = e2m1(clip(x / (s_b t), -6, 6)),  decoded q * s_b * t

Planted tensors: amax 1e-38, 3e-39 (where two normal scales still represent the block: before the fix they lost up
to a third of a block's maximum and all of some blocks, some values flushed and others not), 1e-40 and 1e-45 (where
they cannot: flushed whole), 1e-34 (between 2688 * 2^-126 and 2688 * 2^-121: t = amax / 2688, an encode multiplier
up to 2^132, past FP32), and a tensor of mixed blocks. The rule and both kernels (``fastpath``'s torch body and
``fused``'s numba pass) are held to the oracle bit for bit; normal-range tensors are held to the rule as it was.
"""
from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.quant.kernels import jit, nvfp4_quant
from mpcourse.core.quant.rules import nvfp4

E2M1, E4M3 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn


def planted(amaxes, seed=0, block=16):
    """(n, 2 * block) float32: row i holds two blocks of 16 along K, each of amax ``amaxes[i]`` (its first element),
    the rest amax times fractions of both signs in (-1, 1) (so 1e-45's blocks hold 0 and +-2^-149)."""
    g = np.random.default_rng(seed)
    rows = []
    for a in amaxes:
        f = g.uniform(-1, 1, 2 * block)
        f[0] = f[block] = 1.0
        rows.append((np.float64(a) * f).astype(np.float32))
    return np.stack(rows)


TENSORS = {
    "amax 1e-38": planted([1e-38, 0.7e-38, 0.4e-38, 0.2e-38]),
    "amax 3e-39": planted([3e-39, 2e-39, 1.5e-39, 3e-39]),
    "amax 1e-40": planted([1e-40, 0.5e-40, 1e-40, 0.8e-40]),
    "amax 1e-45": planted([1e-45, 1e-45, 3e-45, 1e-45]),
    "amax 1e-34": planted([1e-34, 1e-35, 1e-37, 3e-39]),
    "mixed blocks": planted([1e-38, 3e-39, 1e-40, 1e-45, 0.0, 2.0 ** -126, 5e-39, 1.2e-39]),
}


def oracle(x: np.ndarray, block=(1, 16)):
    """(t, s (blocks), q (elements), decoded (float64)) of the rule as the module docstring states it."""
    r, c = block
    M, K = x.shape
    xb = x.astype(np.float64).reshape(M // r, r, K // c, c)
    amax_b = np.abs(xb).max(axis=(1, 3))
    t = max(float(np.float32(np.abs(x).max() / 2688.0)), 2.0 ** -126)
    v = amax_b / 6.0 / t
    flush = (v < 2.0 ** -6) & (t < 2.0 ** -121)
    s = np.where(flush, 0.0, np.minimum(np.maximum(v, 2.0 ** -6), 448.0).astype(E4M3).astype(np.float64))
    unit = (s * t)[:, None, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(unit > 0, xb / unit, 0.0)
    q = np.clip(y, -6, 6).astype(E2M1).astype(np.float64)
    # decoded as FP32 computes it: float32(s) * t and then q times that, each product exact in float64 (4 + 24 and
    # 2 + 24 significant bits) and rounded once to FP32 by NumPy (subnormal results included)
    unit32 = unit.astype(np.float32).astype(np.float64)
    deq32 = (q * unit32).astype(np.float32).astype(np.float64).reshape(M, K)
    return t, s, q.reshape(M, K), deq32, (q * unit).reshape(M, K), amax_b, flush


@contextlib.contextmanager
def kernels(mode: str):
    if mode == "numba" and not jit.AVAILABLE:
        pytest.skip("numba is not installed (or MPCOURSE_FUSED=0): the compiled kernels are off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "COMPILED", mode == "numba")
        yield


def modes():
    """The kernel modes this process can run: ``fastpath``'s torch bodies, and ``fused``'s numba passes where numba
    imports (not under MPCOURSE_FUSED=0)."""
    return ("torch", "numba") if jit.AVAILABLE else ("torch",)


def quantizers():
    yield "rule", lambda x, **kw: nvfp4.quantize_nvfp4(x, **kw)
    for mode in modes():
        for keep in (False, True):
            def fast(x, mode=mode, keep=keep, **kw):
                with kernels(mode):
                    return nvfp4_quant.quantize_nvfp4(x, keep_fp32=keep, **kw)
            yield f"fastpath {mode} keep={keep}", fast


@pytest.mark.parametrize("name", list(TENSORS))
def test_subnormal_tensors_against_the_float64_oracle(name):
    x = TENSORS[name]
    t, s, q, deq, exact, amax_b, flush = oracle(x)
    # the FP32 decode rounds by at most 2^-17 of a value (2^-149 absolute below 2^-126); exact where t = 2^-126
    assert np.all(np.abs(deq - exact) <= 2.0 ** -17 * np.abs(exact) + 2.0 ** -149)
    if t == 2.0 ** -126:
        assert np.array_equal(deq, exact)
    for who, quantize in quantizers():
        got = quantize(torch.from_numpy(x))
        what = f"{name} ({who})"
        assert float(got.tensor_scale_inv) == t, what
        assert np.array_equal(got.scale_inv.float().numpy().astype(np.float64), s), what
        assert np.array_equal(got.data.float().numpy().astype(np.float64), q), what
        d = got.dequantize(torch.float32).numpy().astype(np.float64)
        assert np.isfinite(d).all(), what
        assert np.array_equal(d, deq), what
        kept = got.dequantized
        assert kept is None or np.array_equal(kept.numpy().astype(np.float64), deq), what


@pytest.mark.parametrize("name", list(TENSORS))
def test_represented_blocks_keep_their_maximum_and_the_others_are_flushed_whole(name):
    """Where the block scale lands in E4M3's normal range the block's maximum decodes within E4M3's rounding of the
    scale (at most 1/16 of it: 6 s t is within 2^-4 of amax_b) and every element within half an E2M1 step of s t;
    elsewhere (t at FP32's smallest normal and s below E4M3's) the whole block decodes to zeros, its scale 0."""
    x = TENSORS[name]
    got = nvfp4.quantize_nvfp4(torch.from_numpy(x))
    d = got.dequantize(torch.float32).numpy().astype(np.float64).reshape(x.shape[0], -1, 16)
    xb = x.astype(np.float64).reshape(d.shape)
    unit = got.block_scale_inv().numpy().astype(np.float64)
    amax_b = np.abs(xb).max(axis=2)
    kept = got.scale_inv.float().numpy() > 0
    assert np.all(np.abs(np.abs(d).max(axis=2)[kept] - amax_b[kept]) <= amax_b[kept] / 16), name
    y = np.abs(xb) / np.where(unit > 0, unit, 1.0)[:, :, None]
    half_step = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0)) * unit[:, :, None]
    assert np.all((np.abs(d - xb) <= half_step)[kept]), name
    assert np.all(d[~kept] == 0), name
    if name in ("amax 1e-38", "amax 3e-39"):
        assert kept.all()                                       # two normal scales represent every such block
    if name in ("amax 1e-40", "amax 1e-45"):
        assert not kept.any()                                   # none can: s t >= 2^-132 > amax_b / 6


def test_flushed_blocks_keep_their_zeros_signed_and_stochastic_rounding_draws_nothing_into_them():
    x = torch.from_numpy(TENSORS["mixed blocks"])
    near = nvfp4.quantize_nvfp4(x)
    flushed = (near.scale_inv.float() == 0).repeat_interleave(16, 1)
    assert flushed.any() and (~flushed).any()
    assert torch.equal(torch.signbit(near.data.float())[flushed], torch.signbit(x)[flushed])
    sr = nvfp4.quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(sr.data.float()[flushed].abs(), torch.zeros(int(flushed.sum())))
    for mode in modes():
        with kernels(mode):
            fast = nvfp4_quant.quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(0),
                                           keep_fp32=True)
        assert torch.equal(fast.data.view(torch.uint8), sr.data.view(torch.uint8)), mode


@pytest.mark.parametrize("block", [(16, 1), (16, 16)], ids=str)
def test_column_and_2d_blocks_follow_the_same_rule(block):
    x = np.ascontiguousarray(np.concatenate([TENSORS["mixed blocks"]] * 2, axis=0).T)   # (32, 16): 16-row blocks
    x = np.ascontiguousarray(np.concatenate([x] * 2, axis=1)) if block == (16, 16) else x
    t, s, q, deq, _, _, _ = oracle(x, block)
    for who, quantize in quantizers():
        got = quantize(torch.from_numpy(x), block=block)
        assert float(got.tensor_scale_inv) == t and np.array_equal(got.scale_inv.float().numpy(), s), who
        assert np.array_equal(got.dequantize(torch.float32).numpy().astype(np.float64), deq), who


def test_a_learners_scales_and_a_delayed_tensor_amax_take_the_same_encoding():
    """``encode_nvfp4`` (the engine's path for a learner's lesson 09 scales) from the rule's own (t, s) gives the
    rule's bits, the kernel's too; a tiny delayed ``tensor_amax`` with a block far above it saturates, never NaN."""
    x = torch.from_numpy(TENSORS["amax 1e-34"])
    t, s = nvfp4.two_level_scales(x)
    want = nvfp4.quantize_nvfp4(x)
    got = nvfp4.encode_nvfp4(x, (1, 16), t, s)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    for mode in modes():
        with kernels(mode):
            fast = nvfp4_quant.encode_nvfp4(x, (1, 16), t, s, keep_fp32=True)
        assert torch.equal(fast.data.view(torch.uint8), want.data.view(torch.uint8)), mode
    big = torch.ones(2, 16) * 1e30
    q = nvfp4.quantize_nvfp4(big, tensor_amax=torch.tensor(1e-40))
    assert float(q.tensor_scale_inv) == 2.0 ** -126 and torch.isfinite(q.dequantize()).all()
    assert torch.equal(q.data.float().abs(), torch.full((2, 16), 6.0))
