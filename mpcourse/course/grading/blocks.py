"""Graders for lesson 09 (finer-grained scaling): a block quantizer, the MX shared-scale rule, NVFP4's two levels.

Oracles, none of them ``mpcourse.core.quant``: NumPy FP32 arithmetic and ``ml_dtypes`` casts
(``float8_e4m3fn``, ``float4_e2m1fn``), transcribing the published rules:

* ``check_block_quantize``: Transformer Engine ``Float8BlockScaling`` / DeepSeek-V3 (arXiv 2412.19437, 3.3.1):
  per block, ``scale = 448 / amax`` (one FP32 division), FP32 max where that overflows (TE's cap), rounded *down*
  to a power of two; an amax of 0, inf or NaN gives 1 (TE's ``compute_scale`` rule, ``core/quant/rules/tensor.py``); then
  ``e4m3(clip(x * scale, -448, 448))``; the returned ``scale_inv`` is ``1 / scale``. Constructed blocks: amaxes
  whose ``448 / amax`` is one FP32 ulp below a power of two (``floor(log2)`` in FP32 rounds up there), amaxes whose
  ``448 / amax`` overflows FP32, zero, +-inf and NaN blocks.
* ``check_columnwise_quantize``: the columnwise copy Transformer Engine's ``Float8BlockScaling`` quantizes for
  the backward pass: x^T (K, M) in 1x128 tiles (128x1 blocks of x), from the high-precision source; the same
  oracle as ``check_block_quantize`` on x^T.
* ``check_mx_shared_exponent``: OCP MX v1.0 section 6.3, ``k = floor(log2(amax)) - emax_elem`` read from the
  FP32 exponent, clamped to E8M0's [-127, 127] (the floor rule torchao calls ``FLOOR``); amax 0 gives -127,
  amax inf takes inf's exponent field (255): k = 128 - emax_elem, as torchao's ``to_mx``.
* ``check_mx_quantize``: the whole MXFP8 block (floor rule, E4M3 elements, torchao ``to_mx`` FLOOR): scale byte,
  elements and dequantized values, with the edges lesson 09 states (zero, subnormal, inf and NaN blocks).
* ``check_nvfp4_scales``: NVFP4 (torchao ``nvfp4_quantize`` with a per-tensor scale): ``t = amax / (448 * 6)``
  per tensor (one FP32 division; at least 2^-126, FP32's smallest normal, for a non-zero tensor: the library's
  floor, ``core/quant/rules/nvfp4.py``), ``s_b = e4m3(clip((amax_b / 6) / t, 2^-6, 448))`` per 16 elements, in that
  FP32 order, and 0 (the block flushed whole) where t < 2^-121 and (amax_b / 6) / t < 2^-6. Constructed blocks:
  block maxima whose quotient lies within a few FP32 ulps of an E4M3 rounding midpoint, chosen (by a search in
  IEEE FP32 and FP64 arithmetic) where another order of the same operations, FP64, or a detour through BF16/FP16
  rounds to another E4M3 code; a tensor amax where ``amax / 448 / 6`` and ``amax / 2688`` differ; two tiny
  tensors (t at its floor 2^-126, and t between 2^-126 and 2^-121) with blocks to flush.
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


def block_scale_oracle(amax: np.ndarray) -> np.ndarray:
    """TE's rule: 448 / amax in FP32, FP32 max where it overflows, rounded down to a power of two; 1 where amax is
    0, inf or NaN."""
    amax = amax.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = np.float32(E4M3_MAX) / amax
    scale = np.minimum(np.where(np.isnan(scale), np.float32(1.0), scale), np.float32(FORMATS["fp32"].max))
    usable = (amax > 0) & np.isfinite(amax)
    return np.where(usable, _pow2_floor(np.where(usable, scale, np.float32(1.0))), np.float32(1.0)).astype(np.float32)


def block_quantize_oracle(x: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.numpy().astype(np.float32)
    M, K = a.shape
    r, c = (M if block[0] == -1 else block[0]), (K if block[1] == -1 else block[1])
    amax = np.abs(a.reshape(M // r, r, K // c, c)).max(axis=(1, 3))     # NaN propagates
    scale = block_scale_oracle(amax)
    with np.errstate(invalid="ignore", over="ignore"):
        y = a.reshape(M // r, r, K // c, c) * scale[:, None, :, None].astype(np.float32)
        data = np.clip(y, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(M, K)
    return torch.from_numpy(data), torch.from_numpy((np.float32(1.0) / scale).astype(np.float32))


def near_pow2_amaxes(n_values=range(2, 40, 3)) -> list[float]:
    """FP32 amaxes whose FP32 quotient 448 / amax is one ulp below 2^n: floor(log2) of it in FP32 rounds up to n
    (the exact floor is n - 1). Found by checking IEEE FP32 division near 448 / (2^n - ulp)."""
    out = []
    for n in n_values:
        target = np.nextafter(np.float32(2.0 ** n), np.float32(0.0))
        a = (np.float32(E4M3_MAX) / target).view(np.int32) + np.arange(-4, 5, dtype=np.int32)
        hit = a.view(np.float32)[np.float32(E4M3_MAX) / a.view(np.float32) == target]
        out.append(float(hit[0]))
    return out


def _edge_blocks(seed: int = 3) -> torch.Tensor:
    """(256, 256): block (0, 0) of 128x128 holds the near-power-of-two amaxes on its diagonal (so every 1x128 and
    128x1 block there has one as its max), block (0, 1) is zero, block (1, 0) is tiny (448 / amax overflows FP32:
    amaxes 1e-38 and the subnormal 1e-40), block (1, 1) holds +inf, -inf and a NaN in different rows/columns."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(256, 256, generator=g) - 0.5) * 1e-10
    below = torch.tensor(near_pow2_amaxes())
    i = torch.arange(128)
    x[:128, :128] *= below.min() * 1e9
    x[i, i] = below[i % len(below)] * torch.where(i % 2 == 0, 1.0, -1.0)
    x[:128, 128:] = 0.0
    x[128:192, :128] = (torch.rand(64, 128, generator=g) - 0.5) * 2e-38
    x[192:, :128] = (torch.rand(64, 128, generator=g) - 0.5) * 2e-40
    x[130, 140], x[200, 250], x[250, 130] = float("inf"), -float("inf"), float("nan")
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def check_block_quantize(fn) -> None:
    """Grade ``fn(x: (M, K) float32, block: (rows, cols)) -> (data (M, K) float8_e4m3fn, scale_inv (M/rows, K/cols)
    float32)`` for 1x128 tiles, 128x1 and 128x128 blocks, bit for bit, constructed edges included."""
    n = 0
    for block in ((1, 128), (128, 128), (128, 1)):
        for what, x in _cases() + [("constructed edges (near-power-of-two, tiny, zero, inf, NaN amaxes)",
                                    _edge_blocks())]:
            out = call("block_quantize", fn, x.clone(), block)
            if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
                raise GradingError("FAIL block_quantize: return a tuple (data, scale_inv) of two torch tensors, got "
                                   f"{type(out).__name__}")
            data, scale_inv = out
            want_data, want_inv = block_quantize_oracle(x, block)
            if tuple(scale_inv.shape) != tuple(want_inv.shape):
                raise GradingError(f"FAIL block_quantize {block} on {what}: scale_inv has shape {tuple(scale_inv.shape)}"
                                   f", expected {tuple(want_inv.shape)} (one scale per {block[0]}x{block[1]} block)")
            if scale_inv.dtype != torch.float32:
                raise GradingError(f"FAIL block_quantize: scale_inv must be torch.float32, got {scale_inv.dtype}")
            bad = ~_same(scale_inv, want_inv)
            if bad.any():
                i = tuple(bad.nonzero()[0].tolist())
                r0, c0 = (x.shape[0] // want_inv.shape[0]), (x.shape[1] // want_inv.shape[1])
                blk = x[i[0] * r0:(i[0] + 1) * r0, i[1] * c0:(i[1] + 1) * c0]
                amax = float(blk.abs().max())
                got, want = float(scale_inv[i]), float(want_inv[i])
                if amax != amax or amax in (0.0, float("inf")):
                    hint = (f" a block whose amax is {amax} takes scale 1 (scale_inv 1): 448 / amax is not a usable "
                            "scale there")
                elif float(np.float32(E4M3_MAX) / np.float32(amax)) == float("inf"):
                    hint = (" 448 / amax overflows FP32 here (inf): cap it at FP32's max (torch.finfo(torch.float32)"
                            ".max) before rounding down, which gives 2^127")
                elif got * 2 == want:
                    hint = (f" amax {amax!r}: 448 / amax in FP32 is one ulp below a power of two, and floor(log2) "
                            "computed in FP32 rounds up there: round down exactly (keep the FP32 exponent bits)")
                elif want != 0 and float(np.log2(abs(got))) % 1:
                    hint = " the scale must be a power of two (round 448 / amax DOWN)"
                else:
                    hint = " scale = 448 / amax in FP32, rounded DOWN to a power of two; scale_inv = 1 / scale"
                raise GradingError(f"FAIL block_quantize {block} on {what}: block {i} scale_inv {got!r}, expected "
                                   f"{want!r};{hint}")
            if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != tuple(x.shape):
                raise GradingError(f"FAIL block_quantize: data must be torch.float8_e4m3fn of shape {tuple(x.shape)},"
                                   f" got {data.dtype} {tuple(data.shape)}")
            bad = ~_same(data.float(), want_data)
            if bad.any():
                i = tuple(bad.nonzero()[0].tolist())
                hint = (" an infinite element saturates to +-448: clamp x * scale to [-448, 448] before the cast"
                        if x[i].isinf() else
                        " multiply by the block's scale in FP32, clamp to +-448, then cast")
                raise GradingError(f"FAIL block_quantize {block} on {what}: element {i} (x = {float(x[i])!r}) gives "
                                   f"{float(data[i].float())!r}, expected {float(want_data[i])!r};{hint}")
            n += 1
    verdict("block_quantize", f"{n} cases (1x128, 128x1, 128x128; zero, tiny, inf, NaN and near-power-of-two "
                              "amaxes) agree bit for bit with ml_dtypes")


EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
BELOW = float(np.nextafter(np.float32(256.0), np.float32(0.0)))      # one FP32 ulp below 2^8


def mx_exponent_oracle(amax: torch.Tensor, elem: str) -> torch.Tensor:
    a = amax.numpy().astype(np.float32)
    e = ((a.view(np.int32) >> 23) & 0xFF).astype(np.int64) - 127       # inf: 255 - 127 = 128; 0: -127
    return torch.from_numpy(np.clip(e - EMAX[elem], -127, 127))


def _mx_amaxes() -> torch.Tensor:
    pow2 = torch.exp2(torch.arange(-100, 101, 7, dtype=torch.float32))
    below = torch.nextafter(pow2, torch.zeros_like(pow2))              # one ulp below each power of two
    ordinary = torch.tensor([448.0, 1000.0, 1.0, 0.75, 6.0, 7.0, 3e38, 1e-30, 2.0 ** -126, 255.9, 256.0, 512.0,
                             57344.0])
    return torch.cat([below, ordinary, torch.logspace(-30, 30, 200, base=2.0), torch.tensor([0.0]),
                      torch.tensor([1e-40, 1e-45, 2.0 ** -127]), torch.tensor([float("inf")])])


def _mx_hint(a: float, g: int, w: int, elem: str, only_below: bool) -> str:
    if a == 0.0:
        return (" an all-zero block takes k = -127 (E8M0's smallest scale). log2(0) is -inf, and casting -inf to an "
                "integer is undefined (it gave a huge value here): read floor(log2) from the FP32 exponent field, "
                "whose value for 0 is 0, or treat amax 0 on its own")
    if np.isinf(a):
        return (f" an infinite amax takes the exponent field of inf (255, so floor(log2) = 128) and k = 128 - "
                f"{EMAX[elem]} = {w}; log2(inf) = inf cannot be cast to an integer")
    if g == w + 1 and only_below:
        return (f" floor(log2(amax)) was computed in floating point: one FP32 ulp below a power of two "
                f"(amax {a!r}) log2 rounds up to the integer, so the floor is one too high. Read it exactly from "
                "the FP32 exponent field (bits 23..30 of amax.view(torch.int32), minus the bias 127)")
    if g == w + 1:
        return (" the floor rule rounds log2(amax) DOWN, then subtracts the element's emax "
                f"({EMAX[elem]} for {elem})")
    if w == -127:
        return " k below E8M0's range clamps to -127 (the subnormal amaxes and 2^-127 land there)"
    return ""


def check_mx_shared_exponent(fn) -> None:
    """Grade ``fn(amax: (n,) float32, elem: "e4m3" | "e5m2" | "e2m1") -> (n,) int64`` (the floor rule): amaxes
    one FP32 ulp below powers of two, zero, subnormal and infinite amaxes included."""
    amax = _mx_amaxes()
    for elem in ("e4m3", "e5m2", "e2m1"):
        got = call("mx_shared_exponent", fn, amax.clone(), elem)
        if not isinstance(got, torch.Tensor):
            raise GradingError(f"FAIL mx_shared_exponent({elem}): return a torch tensor of int64, got "
                               f"{type(got).__name__}")
        if got.dtype != torch.int64:
            raise GradingError(f"FAIL mx_shared_exponent({elem}): the exponents must be integers of dtype torch.int64"
                               f" (4, not 4.0), got {got.dtype}" + (": call .long()" if got.dtype in
                               (torch.int32, torch.int16, torch.int8, torch.uint8) else ""))
        if tuple(got.shape) != tuple(amax.shape):
            raise GradingError(f"FAIL mx_shared_exponent({elem}): one exponent per amax, shape {tuple(amax.shape)}, "
                               f"got {tuple(got.shape)}")
        want = mx_exponent_oracle(amax, elem)
        bad = got != want
        if bad.any():
            below = (torch.frexp(amax.double()).mantissa > 0.9999) & torch.isfinite(amax)   # one ulp below 2^n
            ordinary = bad & ~below & torch.isfinite(amax) & (amax > 0)
            only_below = not bool(ordinary.any()) and bool((bad & below).any())  # floor(log2) in floating point
            i = int((bad & below if only_below else ordinary if ordinary.any() else bad).nonzero()[0])
            a, g, w = float(amax[i]), int(got[i]), int(want[i])
            raise GradingError(f"FAIL mx_shared_exponent({elem}): amax {a!r} gives {g}, expected {w};"
                               f"{_mx_hint(a, g, w, elem, only_below)}")
    verdict("mx_shared_exponent", f"{3 * amax.numel()} amaxes x formats agree with the OCP MX floor rule")


def mx_quantize_oracle(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale bytes (M, K/32) uint8, elements (M, K) float32, dequantized (M, K) float32): torchao's FLOOR rule."""
    a = x.numpy().astype(np.float32)
    M, K = a.shape
    v = a.reshape(M, K // 32, 32)
    amax = np.abs(v).max(axis=2)                                        # NaN propagates
    k = mx_exponent_oracle(torch.from_numpy(np.where(np.isnan(amax), np.float32(1.0), amax)), "e4m3").numpy()
    nan = np.isnan(amax)
    byte = np.where(nan, 255, k + 127).astype(np.uint8)
    divisor = np.where(k == -127, np.float32(2.0 ** -126), np.ldexp(np.float32(1.0), k).astype(np.float32))
    divisor = np.where(nan, np.float32(np.nan), divisor).astype(np.float32)
    with np.errstate(invalid="ignore"):
        y = np.clip(v / divisor[:, :, None], -E4M3_MAX, E4M3_MAX)
    elems = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = np.where(nan, np.float32(np.nan), np.ldexp(np.float64(1.0), k)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        dq = (elems * scale[:, :, None]).astype(np.float32)
    return byte, elems.reshape(M, K), dq.reshape(M, K)


def _mx_blocks(seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(12, 64, generator=g) * torch.logspace(-4, 4, 12, base=2.0)[:, None]
    what = ["random"] * 12
    rows[0, :32] = 0.0; what[0] = "an all-zero block"
    rows[1, :32] = 1e-40; what[1] = "a subnormal block (amax 1e-40)"
    rows[2, :32] = 2.0 ** -120; what[2] = "a tiny block (amax 2^-120, k clamps to -127)"
    rows[3, 5] = BELOW; what[3] = f"a block with amax one ulp below 256 ({BELOW!r})"
    rows[4, 40] = float("inf"); what[4] = "a block holding +inf"
    rows[5, 2] = -float("inf"); what[5] = "a block holding -inf"
    rows[6, 33] = float("nan"); what[6] = "a block holding a NaN"
    rows[7, :32] = torch.tensor([448.0] * 31 + [1000.0]); what[7] = "[448] * 31 + [1000] (the block max saturates)"
    return rows, what


def check_mx_quantize(quantize, dequantize) -> None:
    """Grade ``quantize(x: (M, K) float32) -> (scale (M, K/32) float8_e8m0fnu, data (M, K) float8_e4m3fn)`` and
    ``dequantize(scale, data) -> (M, K) float32``: MXFP8 with the floor rule, bit for bit, edges included."""
    x, what = _mx_blocks()
    scale, data = call("mx_quantize", quantize, x.clone())
    want_byte, want_elems, want_dq = mx_quantize_oracle(x)
    M, K = x.shape
    if scale.dtype != torch.float8_e8m0fnu or tuple(scale.shape) != (M, K // 32):
        raise GradingError(f"FAIL mx_quantize: scale must be float8_e8m0fnu of shape {(M, K // 32)}, got "
                           f"{scale.dtype} {tuple(scale.shape)}")
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (M, K):
        raise GradingError(f"FAIL mx_quantize: data must be float8_e4m3fn of shape {(M, K)}, got {data.dtype} "
                           f"{tuple(data.shape)}")
    got_byte = scale.view(torch.uint8).numpy()
    bad = got_byte != want_byte
    if bad.any():
        r, b = (int(i) for i in np.argwhere(bad)[0])
        g, w = int(got_byte[r, b]), int(want_byte[r, b])
        hint = (" a block holding a NaN takes the NaN scale, E8M0 byte 0xFF (255), whatever its other values"
                if w == 255 else
                " an all-zero or tiny block takes E8M0 byte 0 (2^-127)" if w == 0 else
                " an infinite amax: floor(log2) from inf's exponent field is 128, k = 128 - 8 = 120 (byte 247)"
                if w == 247 and g != 247 else
                f" the byte is k + 127 with k = floor(log2(amax)) - 8 (byte {g} is k = {g - 127})")
        raise GradingError(f"FAIL mx_quantize on {what[r]}: block ({r}, {b}) has scale byte {g}, expected {w};{hint}")
    got_elems = data.float().numpy()
    bad = ~((got_elems == want_elems) & (np.signbit(got_elems) == np.signbit(want_elems))
            | (np.isnan(got_elems) & np.isnan(want_elems)))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        g, w, xv = float(got_elems[r, c]), float(want_elems[r, c]), float(x[r, c])
        hint = (" every element of a block holding a NaN is NaN (the NaN scale makes the block NaN)"
                if np.isnan(w) else
                " an infinite element saturates to +-448: clamp x / 2^k to [-448, 448] before the cast"
                if np.isinf(xv) else
                " where k = -127, divide by 2^-126 (FP32's smallest normal), as torchao's floor rule does, "
                "not by 2^-127" if want_byte[r, c // 32] == 0 else
                " divide by 2^k in FP32, clamp to [-448, 448], then cast to float8_e4m3fn (round to nearest even)")
        raise GradingError(f"FAIL mx_quantize on {what[r]}: element ({r}, {c}) (x = {xv!r}) gives {g!r}, "
                           f"expected {w!r};{hint}")
    dq = call("mx_dequantize", dequantize, scale.clone(), data.clone())
    if not isinstance(dq, torch.Tensor) or dq.dtype != torch.float32 or tuple(dq.shape) != (M, K):
        raise GradingError(f"FAIL mx_dequantize: return a torch.float32 tensor of shape {(M, K)}, got "
                           f"{getattr(dq, 'dtype', type(dq).__name__)} {tuple(getattr(dq, 'shape', ()))}")
    dq = dq.numpy()
    bad = ~((dq == want_dq) | (np.isnan(dq) & np.isnan(want_dq)))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        hint = (" a NaN scale (byte 0xFF) dequantizes the whole block to NaN" if np.isnan(want_dq[r, c]) else
                " an E8M0 byte b means 2^(b - 127); byte 0 is 2^-127, an FP32 subnormal (not 0)"
                if want_byte[r, c // 32] == 0 else " dequantize = element * 2^k, in FP32")
        raise GradingError(f"FAIL mx_dequantize on {what[r]}: element ({r}, {c}) gives {float(dq[r, c])!r}, "
                           f"expected {float(want_dq[r, c])!r};{hint}")
    verdict("mx_quantize", f"{M * K // 32} blocks (zero, subnormal, ulp-below, +-inf, NaN, saturating) agree bit "
                           "for bit with the floor rule")


def columnwise_oracle(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    return block_quantize_oracle(x.t().contiguous(), (1, tile))


def check_columnwise_quantize(fn) -> None:
    """Grade ``fn(x: (M, K) float32) -> (data_t (K, M) float8_e4m3fn, scale_inv_t (K, M/128) float32)``: the
    columnwise copy, x^T in 1x128 tiles (power-of-two scales), quantized from the source x, bit for bit."""
    n = 0
    for what, x in _cases(2) + [("constructed edges (near-power-of-two, tiny, zero, inf, NaN amaxes)", _edge_blocks())]:
        M, K = x.shape
        data, scale_inv = call("columnwise_quantize", fn, x.clone())
        want_data, want_inv = columnwise_oracle(x)
        rw_data, rw_inv = block_quantize_oracle(x, (1, 128))
        if tuple(scale_inv.shape) != tuple(want_inv.shape) or tuple(data.shape) != (K, M):
            if tuple(scale_inv.shape) == tuple(rw_inv.t().shape) and torch.equal(scale_inv.float(), rw_inv.t()):
                hint = (" these are the rowwise copy's scales (1x128 tiles along K of x), transposed: the columnwise "
                        "copy has one scale per 128 elements along M (the tokens) of each column")
            elif tuple(data.shape) == (M, K) and torch.equal(data.float().t(), want_data):
                hint = " the values are right: store the copy transposed, x^T (K, M) in 1x128 tiles"
            else:
                hint = " store the copy transposed: x^T (K, M) in 1x128 tiles, one scale per 128 elements along M"
            raise GradingError(f"FAIL columnwise_quantize on {what}: data {tuple(data.shape)}, scale_inv "
                               f"{tuple(scale_inv.shape)}, expected ({K}, {M}) and {tuple(want_inv.shape)};{hint}")
        if data.dtype != torch.float8_e4m3fn:
            raise GradingError(f"FAIL columnwise_quantize: data must be torch.float8_e4m3fn, got {data.dtype}")
        if scale_inv.dtype != torch.float32:
            raise GradingError(f"FAIL columnwise_quantize: scale_inv must be torch.float32, got {scale_inv.dtype}")
        if _same(data.float(), want_data).all() and _same(scale_inv, want_inv).all():
            n += 1
            continue
        rw_dq = (rw_data.reshape(M, K // 128, 128) * rw_inv[:, :, None]).reshape(M, K)
        twice = columnwise_oracle(rw_dq)
        if torch.equal(data.float(), twice[0]) and torch.equal(scale_inv.float(), twice[1]):
            raise GradingError(f"FAIL columnwise_quantize on {what}: your copy was re-quantized from the dequantized "
                               "rowwise copy (two roundings, the rowwise flushes kept); quantize x^T from the "
                               "high-precision source x")
        if tuple(want_inv.shape) == tuple(rw_inv.t().shape) and torch.equal(scale_inv.float(), rw_inv.t()):
            raise GradingError(f"FAIL columnwise_quantize on {what}: your scales are the rowwise copy's (1x128 tiles "
                               "along K of x) transposed; the columnwise copy scales 128 consecutive elements along M "
                               "(a column of x, a row of x^T)")
        bad = ~_same(data.float(), want_data) | ~_same(scale_inv.float(), want_inv).repeat_interleave(128, 1)
        i = tuple(bad.nonzero()[0].tolist())
        raise GradingError(f"FAIL columnwise_quantize on {what}: x^T element {i} gives {float(data[i].float())!r} "
                           f"with scale_inv {float(scale_inv[i[0], i[1] // 128])!r}, expected "
                           f"{float(want_data[i])!r} with {float(want_inv[i[0], i[1] // 128])!r}: the same rule as "
                           "block_quantize, on 1x128 tiles of x^T")
    verdict("columnwise_quantize", f"{n} cases agree bit for bit with the 128x1 rule on the source")


NVFP4_MIN_T = np.float32(2.0 ** -126)   # the library's floor on the tensor decode scale (core/quant/rules/nvfp4.py)
NVFP4_TINY_T = np.float32(2.0 ** -121)  # below it the library flushes the blocks E4M3's normal scales cannot reach


def nvfp4_tensor_oracle(amax: np.float32) -> np.float32:
    t = np.float32(amax) / np.float32(E4M3_MAX * E2M1_MAX)               # one FP32 division by 2688
    return np.float32(NVFP4_MIN_T) if (amax > 0 and t < NVFP4_MIN_T) else np.float32(t)


def nvfp4_block_oracle(amax_b: np.ndarray, t: np.float32) -> np.ndarray:
    """E4M3 block scales as float32: e4m3(clip((amax_b / 6) / t, 2^-6, 448)), each step one FP32 operation; 0 where
    t < 2^-121 and the quotient is below 2^-6 (the block flushed whole)."""
    v = (amax_b.astype(np.float32) / np.float32(E2M1_MAX)) / np.float32(t)
    q = np.clip(v, np.float32(2.0 ** -6), np.float32(E4M3_MAX)).astype(np.float32)
    if 0 < t < NVFP4_TINY_T:
        q = np.where(v < np.float32(2.0 ** -6), np.float32(0.0), q).astype(np.float32)
    return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def nvfp4_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.numpy().astype(np.float32)
    M, K = a.shape
    t = nvfp4_tensor_oracle(np.float32(np.abs(a).max()))
    amax_b = np.abs(a.reshape(M, K // 16, 16)).max(axis=2)
    return torch.tensor(t), torch.from_numpy(nvfp4_block_oracle(amax_b, t))


def _e4m3(v) -> np.ndarray:
    v = np.clip(np.asarray(v), 2.0 ** -6, E4M3_MAX)
    return v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def nvfp4_near_midpoints(amax: float = 1000.0) -> torch.Tensor:
    """(64, 256) with tensor amax ``amax`` (row 0, block 0) whose other blocks' maxima put (amax_b / 6) / t within a
    few FP32 ulps of an E4M3 rounding midpoint, kept where another way of computing the scale gives another E4M3
    code: amax_b / (6 t), (amax_b / t) / 6, amax_b * (1 / t) / 6, amax_b * 448 / amax, FP64 arithmetic, or a detour
    through BF16 or FP16 before the E4M3 cast. Every candidate is checked in IEEE arithmetic (NumPy FP32 and FP64
    operations are correctly rounded)."""
    f = np.float32
    A = f(amax)
    t = nvfp4_tensor_oracle(A)
    codes = np.unique(_e4m3(np.float32(2.0) ** np.linspace(-6, np.log2(448), 4000).astype(np.float32)))
    mids = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    mids = mids[(mids > 2.0 ** -6) & (mids < 440)]
    base = (mids * f(6) * t).astype(np.float32)
    cand = (base.view(np.int32)[:, None] + np.arange(-12, 13, dtype=np.int32)[None, :]).ravel().view(np.float32)
    cand = cand[(cand > 0) & (cand < A)]
    ref = nvfp4_block_oracle(cand, t)
    q32 = (cand / f(6)) / t
    variants = [
        cand / (f(6) * t),
        (cand / t) / f(6),
        (cand * (f(1) / t)) / f(6),
        (cand * f(E4M3_MAX)) / A,
        cand.astype(np.float64) / 6 / np.float64(t),
        cand.astype(np.float64) / 6 / (np.float64(A) / 2688),
        q32.astype(ml_dtypes.bfloat16).astype(np.float32),
        q32.astype(np.float16).astype(np.float32),
    ]
    chosen: list[float] = []
    for v in variants:
        hit = cand[_e4m3(v) != ref]
        chosen += hit[:: max(1, len(hit) // 6)][:6].tolist()
    chosen = sorted(set(chosen))
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(64, 256, generator=g) * 0.5 + 0.1) * torch.rand(64, 16, 1, generator=g).repeat_interleave(16, 2) \
        .reshape(64, 256)
    blocks = x.reshape(64 * 16, 16)
    blocks[0, 3] = float(A)
    for j, b in enumerate(chosen[: 64 * 16 - 1]):
        blocks[j + 1] = blocks[j + 1] / blocks[j + 1].abs().max() * b * 0.999
        blocks[j + 1, j % 16] = -b if j % 3 == 0 else b
    return blocks.reshape(64, 256)


def _nvfp4_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    tiny = torch.randn(16, 64, generator=g) * 1e-36               # amax / 2688 below 2^-126: t = 2^-126
    tiny[3, :16] = 0.0                                            # flushed whole: scale 0
    tiny[5, 16:32] *= 1e-4                                        # ~1e-40: below E4M3's normal scales too
    band = torch.randn(16, 64, generator=g) * 1e-34               # t = amax / 2688, between 2^-126 and 2^-121
    band[2, :16] *= 1e-4
    return (_cases(1) + [("block maxima next to E4M3 rounding midpoints (tensor amax 1000)", nvfp4_near_midpoints()),
                         ("block maxima next to E4M3 rounding midpoints (tensor amax 3.3)", nvfp4_near_midpoints(3.3)),
                         ("a tiny tensor (amax ~4e-36: amax / 2688 < 2^-126)", tiny),
                         ("a tiny tensor (amax ~4e-34: 2^-126 < amax / 2688 < 2^-121)", band)])


def check_nvfp4_scales(fn) -> None:
    """Grade ``fn(x: (M, K) float32) -> (tensor_scale_inv () float32, block_scales (M, K/16) float8_e4m3fn)``."""
    for what, x in _nvfp4_cases():
        out = call("nvfp4_scales", fn, x.clone())
        if not (isinstance(out, tuple) and len(out) == 2):
            raise GradingError(f"FAIL nvfp4_scales: return a tuple (t, s), got {type(out).__name__}")
        t, s = out
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != ():
            raise GradingError("FAIL nvfp4_scales: the tensor scale t must be a torch.float32 tensor of shape (), got "
                               f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}"
                               " (a Python float is computed in FP64 and loses the dtype)")
        want_t, want_s = nvfp4_oracle(x)
        if float(t) != float(want_t):
            amax = float(x.abs().max())
            hint = (" for a non-zero tensor whose amax / 2688 falls below 2^-126, t = 2^-126 (FP32's smallest "
                    "normal: t is never subnormal)"
                    if float(want_t) == 2.0 ** -126 else
                    " compute amax / 2688 as ONE FP32 division (amax / 448 / 6 rounds twice)"
                    if float(want_t) == float(np.float32(amax) / np.float32(2688)) else "")
            raise GradingError(f"FAIL nvfp4_scales on {what}: tensor scale {float(t)!r}, expected {float(want_t)!r} "
                               f"= amax / (448 * 6): the largest block scale must land at E4M3's max;{hint}")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float8_e4m3fn or tuple(s.shape) != tuple(want_s.shape):
            raise GradingError(f"FAIL nvfp4_scales: block scales must be float8_e4m3fn of shape {tuple(want_s.shape)}, "
                               f"got {getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
        bad = s.float() != want_s
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            amax_b = float(x.reshape(x.shape[0], -1, 16)[i[0], i[1]].abs().max())
            if float(want_s[i]) == 0 or float(s[i].float()) == 0:
                raise GradingError(f"FAIL nvfp4_scales on {what}: block {i} (amax_b {amax_b!r}) scale "
                                   f"{float(s[i].float())!r}, expected {float(want_s[i])!r}: where t < 2^-121, a block "
                                   "whose (amax_b / 6) / t falls below 2^-6 gets scale 0 (flushed whole), and only "
                                   "there")
            raise GradingError(f"FAIL nvfp4_scales on {what}: block {i} (amax_b {amax_b!r}) scale "
                               f"{float(s[i].float())!r}, expected {float(want_s[i])!r} = e4m3(clamp((amax_b / 6) / t, "
                               "2^-6, 448)): in FP32, in that order (divide by 6, then by t), cast once to E4M3")
    verdict("nvfp4_scales", "tensor and block scales agree bit for bit with ml_dtypes, blocks next to E4M3 "
                            "rounding midpoints included")
