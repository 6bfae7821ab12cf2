"""Graders for lesson 09 (finer-grained scaling): a block quantizer, the MX shared-scale rule, NVFP4's two levels.

Oracles, none of them ``mpcourse.core.quant``: NumPy FP32 arithmetic and ``ml_dtypes`` casts
(``float8_e4m3fn``, ``float4_e2m1fn``), transcribing the published rules:

* ``check_block_quantize``: Transformer Engine ``Float8BlockScaling`` / DeepSeek-V3 (arXiv 2412.19437, 3.3.1):
  per block, ``scale = 448 / amax`` in FP32 rounded *down* to a power of two (amax 0 gives 1), then
  ``e4m3(clip(x * scale, -448, 448))``; the returned ``scale_inv`` is ``1 / scale``.
* ``check_mx_shared_exponent``: OCP MX v1.0 section 6.3, ``k = floor(log2(amax)) - emax_elem`` read from the
  FP32 exponent, clamped to E8M0's [-127, 127] (the floor rule torchao calls ``FLOOR``).
* ``check_nvfp4_scales``: NVFP4 (torchao ``nvfp4_quantize`` with a per-tensor scale): ``t = amax / (448 * 6)``
  per tensor, ``s_b = e4m3(clip(amax_b / 6 / t, 2^-6, 448))`` per 16 elements.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from ...core.formats import FORMATS
from . import GradingError, call, verdict

E4M3_MAX = FORMATS["e4m3"].max
E2M1_MAX = FORMATS["e2m1"].max


def _cases(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(256, 256, generator=g) * torch.logspace(-8, 8, 256, base=2.0)
    outlier = (torch.rand(256, 256, generator=g) + 0.5) * 1e-2
    outlier[3, 130] = 1e4
    zeros = torch.randn(128, 256, generator=g)
    zeros[:, :128] = 0.0
    return [("values over 16 binades", wide), ("one 1e4 outlier among ~1e-2", outlier),
            ("all-zero blocks", zeros)]


def _pow2_floor(v: np.ndarray) -> np.ndarray:
    m, e = np.frexp(v.astype(np.float64))
    return np.ldexp(np.ones_like(m), e - 1).astype(np.float32)


def block_quantize_oracle(x: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.numpy().astype(np.float32)
    M, K = a.shape
    r, c = (M if block[0] == -1 else block[0]), (K if block[1] == -1 else block[1])
    amax = np.abs(a.reshape(M // r, r, K // c, c)).max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        scale = np.float32(E4M3_MAX) / amax
    scale = np.where(amax > 0, _pow2_floor(np.minimum(scale, np.float32(FORMATS["fp32"].max))), np.float32(1.0))
    y = a.reshape(M // r, r, K // c, c) * scale[:, None, :, None].astype(np.float32)
    data = np.clip(y, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(M, K)
    return torch.from_numpy(data), torch.from_numpy((np.float32(1.0) / scale).astype(np.float32))


def check_block_quantize(fn) -> None:
    """Grade ``fn(x: (M, K) float32, block: (rows, cols)) -> (data (M, K) float8_e4m3fn, scale_inv (M/rows, K/cols)
    float32)`` for 1x128 tiles and 128x128 blocks, bit for bit."""
    n = 0
    for block in ((1, 128), (128, 128), (128, 1)):
        for what, x in _cases():
            data, scale_inv = call("block_quantize", fn, x.clone(), block)
            want_data, want_inv = block_quantize_oracle(x, block)
            if tuple(scale_inv.shape) != tuple(want_inv.shape):
                raise GradingError(f"FAIL block_quantize {block} on {what}: scale_inv has shape {tuple(scale_inv.shape)}"
                                   f", expected {tuple(want_inv.shape)} (one scale per {block[0]}x{block[1]} block)")
            bad = ~((scale_inv.float() == want_inv) | (scale_inv.float().isnan() & want_inv.isnan()))
            if bad.any():
                i = tuple(bad.nonzero()[0].tolist())
                got, want = float(scale_inv[i]), float(want_inv[i])
                hint = (" the scale must be a power of two (round 448 / amax DOWN)" if want != 0 and
                        float(np.log2(abs(got))) % 1 else
                        " an all-zero block takes scale 1" if want == 1.0 else "")
                raise GradingError(f"FAIL block_quantize {block} on {what}: block {i} scale_inv {got!r}, expected "
                                   f"{want!r};{hint}")
            if data.dtype != torch.float8_e4m3fn:
                raise GradingError(f"FAIL block_quantize: data must be torch.float8_e4m3fn, got {data.dtype}")
            bad = data.float() != want_data
            if bad.any():
                i = tuple(bad.nonzero()[0].tolist())
                raise GradingError(f"FAIL block_quantize {block} on {what}: element {i} (x = {float(x[i])!r}) gives "
                                   f"{float(data[i].float())!r}, expected {float(want_data[i])!r}: multiply by the "
                                   "block's scale in FP32, clamp to +-448, then cast")
            n += 1
    verdict("block_quantize", f"{n} cases (1x128, 128x1, 128x128) agree bit for bit with ml_dtypes")


EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}


def mx_exponent_oracle(amax: torch.Tensor, elem: str) -> torch.Tensor:
    a = amax.numpy().astype(np.float32)
    e = ((a.view(np.int32) >> 23) & 0xFF).astype(np.int64) - 127
    return torch.from_numpy(np.clip(e - EMAX[elem], -127, 127))


def check_mx_shared_exponent(fn) -> None:
    """Grade ``fn(amax: (n,) float32, elem: "e4m3" | "e5m2" | "e2m1") -> (n,) int64`` (the floor rule)."""
    amax = torch.tensor([448.0, 1000.0, 1.0, 0.75, 6.0, 7.0, 3e38, 1e-30, 2.0 ** -126, 255.9, 256.0, 512.0,
                         57344.0, 0.0, 1e-40])
    amax = torch.cat([amax, torch.logspace(-30, 30, 200, base=2.0)])
    for elem in ("e4m3", "e5m2", "e2m1"):
        got = torch.as_tensor(call("mx_shared_exponent", fn, amax.clone(), elem)).long()
        want = mx_exponent_oracle(amax, elem)
        bad = got != want
        if bad.any():
            i = int(bad.nonzero()[0])
            a, g, w = float(amax[i]), int(got[i]), int(want[i])
            hint = (" the floor rule rounds log2(amax) DOWN, then subtracts the element's emax "
                    f"({EMAX[elem]} for {elem})" if g == w + 1 else
                    " clamp to E8M0's range [-127, 127]" if abs(w) == 127 else "")
            raise GradingError(f"FAIL mx_shared_exponent({elem}): amax {a!r} gives {g}, expected {w};{hint}")
    verdict("mx_shared_exponent", f"{3 * amax.numel()} amaxes x formats agree with the OCP MX floor rule")


def nvfp4_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.numpy().astype(np.float32)
    M, K = a.shape
    t = np.float32(np.abs(a).max()) / np.float32(E4M3_MAX * E2M1_MAX)
    amax_b = np.abs(a.reshape(M, K // 16, 16)).max(axis=2)
    s = np.clip((amax_b / np.float32(E2M1_MAX)) / t, np.float32(2.0 ** -6), np.float32(E4M3_MAX))
    return torch.tensor(t), torch.from_numpy(s.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def check_nvfp4_scales(fn) -> None:
    """Grade ``fn(x: (M, K) float32) -> (tensor_scale_inv () float32, block_scales (M, K/16) float8_e4m3fn)``."""
    for what, x in _cases(1)[:2]:
        t, s = call("nvfp4_scales", fn, x.clone())
        want_t, want_s = nvfp4_oracle(x)
        if float(t) != float(want_t):
            raise GradingError(f"FAIL nvfp4_scales on {what}: tensor scale {float(t)!r}, expected {float(want_t)!r} "
                               "= amax / (448 * 6): the largest block scale must land at E4M3's max")
        if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != tuple(want_s.shape):
            raise GradingError(f"FAIL nvfp4_scales: block scales must be float8_e4m3fn of shape {tuple(want_s.shape)}, "
                               f"got {s.dtype} {tuple(s.shape)}")
        bad = s.float() != want_s
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            raise GradingError(f"FAIL nvfp4_scales on {what}: block {i} scale {float(s[i].float())!r}, expected "
                               f"{float(want_s[i])!r} = e4m3(clamp(amax_block / 6 / tensor_scale, 2^-6, 448))")
    verdict("nvfp4_scales", "tensor and block scales agree bit for bit with ml_dtypes")
