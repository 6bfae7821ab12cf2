"""Compiled CPU kernels (numba) for the emulated FP8 / MX / NVFP4 steps, each equal bit for bit to a torch rule.

The rules stay in torch, written for reading (``scaled.block_amax``, ``quantize_fp32_scaled``, ``quantize_mx``,
``quantize_nvfp4``, ``ScaledTensor.dequantize``, ``tensor.quantize``, ``fastpath.fp8_to_float32``); each is a
chain of eager passes over memory (|x|, the block max, the scaled copy, the cast, the upcast times each block's
multiplier: about 50 bytes of traffic per element). Here the same arithmetic runs in one loop per pass that
the rule cannot avoid, reading x and writing the codes (and the FP32 copy an emulated GEMM reads) once:

* ``block_amax(x, block)``: max |x| of each (r, c) block. On the FP32 bit patterns with the sign cleared,
  integer order is float order for numbers and every NaN lies above +inf, so an integer max is the float max
  with NaN propagating (torch's ``amax``); a max is exact in any order, and the integer one vectorizes.
* ``quantize_fp8(x, block, mult, divide, dequant, fp8_format)``: per element y = x * mult (``divide``: x / mult,
  MX's rule) in FP32, one rounding as in torch; its E4M3 / E5M2 code (``_round_fp8``, with ``_fp8_params``' constants from ``formats``); and, with
  ``dequant`` (each block's dequantization multiplier), the FP32 copy float32(code) * dequant, the product
  ``ScaledTensor.dequantize`` forms.
* ``quantize_e2m1(x, block, mult, dequant, draws)``: NVFP4's element step, ``fastpath.round_e2m1`` to nearest
  or stochastically from the rule's own random draws (``torch.randint(0, 2**62)``, drawn in torch).
* ``dequantize_fp8(data, block, mult)``: float32(code) * mult, the upcast of ``fastpath.fp8_to_float32`` and
  ``ScaledTensor.dequantize``.
* ``pow2_scale`` and ``rceil_scale_inv``: ``fastpath``'s scale rules on the grid of blocks, in one call instead of
  seven small torch ops (10-25 us each on this CPU: by cProfile about a tenth of an ``fp8-block`` step).

The FP8 cast (OCP FP8: E4M3 "fn" has no inf, S.1111.111 is NaN, max 448; E5M2 max 57344), for |y|'s FP32 bits a:
    NaN                              -> a NaN code (0x7F)
    |y| >= max (inf included)        -> max: saturation, as the quantizers clamp first
    min_normal <= |y| < max          -> drop 20 (E4M3) / 21 (E5M2) of FP32's 23 mantissa bits, to nearest even:
                                        (a + half - 1 + odd) with the low bits cleared, exponent rebiased
    |y| < min_normal (subnormal)     -> |y| / min_subnormal (exact) rounded to an integer, to nearest even, by adding
                                        and subtracting 2^23 in FP32; that integer is the code
    and the sign bit copied in. All 2^32 FP32 bit patterns were checked against torch's cast for both formats
(``tests/core/quant/kernels/test_quant_fused.py`` keeps every FP8 midpoint, its neighbours, the specials and random patterns, and checks
each kernel against its torch rule on tensors with NaN, inf, signed zeros and ties, for every block shape).

Compiled once per machine (``cache=True``: a few seconds the first time, then loaded from numba's cache) and used
when numba imports (``AVAILABLE``): ``fastpath`` decides once, at import, whether to call these passes
(``fastpath.COMPILED``) and per call whether a tensor fits them. With the library's switch off
(``mpcourse.core.kernels_switch.ENABLED``: ``MPCOURSE_FUSED=0``) numba is not even imported (the torch rules run: the
same bits, slower).
Single-threaded: ``mpcourse compare`` runs one 1-thread worker per core. Measured with
``benchmarks/bench_block_recipes.py``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...formats import FORMATS
from ...kernels_switch import ENABLED

try:
    if not ENABLED:
        raise ImportError("turned off by MPCOURSE_FUSED=0")
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
except ImportError:  # numba missing (or turned off): the torch rules run
    numba = None

AVAILABLE = numba is not None     # the passes below exist; which calls take them is fastpath's choice


_TYPESTR = {torch.float32: "<f4", torch.int32: "<i4", torch.uint8: "|u1", torch.int64: "<i8"}


class _Memory:
    """A tensor's memory as NumPy's array interface describes it (address, shape, dtype): nothing else."""
    __slots__ = ("__array_interface__",)

    def __init__(self, t: torch.Tensor):
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": _TYPESTR[t.dtype], "version": 3}


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of contiguous CPU tensor t's memory, made from its address: ``t.numpy()`` would mark t's
    storage as not resizable, and FSDP2 frees a gathered parameter by resizing its storage to 0. t must stay
    alive while the view is used (the wrappers below hold it)."""
    assert t.is_contiguous() and t.device.type == "cpu", "fused takes contiguous CPU tensors"
    return np.asarray(_Memory(t))


if AVAILABLE:
    @intrinsic
    def _f32_bits(typingctx, v):
        """The IEEE bits of a float32 as an int32 (a bitcast: no arithmetic)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.int32(types.float32), codegen

    @intrinsic
    def _bits_f32(typingctx, b):
        """The float32 whose IEEE bits are the int32 b (a bitcast)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    _I32 = np.int32   # numba widens int32 arithmetic with int64 literals to int64: every constant is int32
    _MASK, _SIGN, _INF_BITS = _I32(0x7FFFFFFF), _I32(-2 ** 31), _I32(0x7F800000)
    _TWO23 = np.float32(2.0 ** 23)
    _NAN = np.float32(np.nan)
    _JIT = dict(cache=True, error_model="numpy", boundscheck=False)   # numpy's error model: no checks in the loops

    def _f32(v) -> int:
        return int(np.float32(v).view(np.int32))

    def _fp8_params(name: str) -> tuple:
        """The constants of FP8 format ``name``'s saturating cast, from ``formats`` (see ``_round_fp8``)."""
        f = FORMATS[name]
        drop = 23 - f.mantissa_bits                           # FP32 mantissa bits dropped: 20 (E4M3), 21 (E5M2)
        rebias = (127 - f.bias) << 23                         # exponent 127 -> the format's bias
        return (_I32(drop), _I32((1 << (drop - 1)) - 1), _I32(~((1 << drop) - 1)), _I32(rebias),
                _I32(_f32(f.min_normal)), _I32(_f32(f.max)), np.float32(1 / f.min_subnormal),
                np.float32(f.min_subnormal), _I32((_f32(f.max) - rebias) >> drop), np.float32(f.max))

    @numba.njit(inline="always", **_JIT)
    def _round_fp8(y, drop, half, low, rebias, min_normal, max_bits, sub_up, sub_down, code_max, top):
        """(code, value): float32 y cast to an FP8 format (its ``_fp8_params``), rounded to nearest even,
        saturating at max, NaN -> NaN: the code as int32 (0..255) and its value as float32."""
        b = _f32_bits(y)
        a = _I32(b & _MASK)                                   # |y|'s bits
        sign = _I32(_I32(b >> 24) & _I32(0x80))
        r = _I32(_I32(a + half + _I32(_I32(a >> drop) & _I32(1))) & low)    # normal: to nearest even
        code_n = _I32(_I32(r - rebias) >> drop)
        val_n = _bits_f32(r)
        k = (abs(y) * sub_up + _TWO23) - _TWO23              # subnormal: multiples of min_subnormal, nearest even
        code_s = _I32(k)                                      # (the top one, min_normal's, is code 1 << mbits)
        val_s = k * sub_down
        normal = a >= min_normal
        code = code_n if normal else code_s
        val = val_n if normal else val_s
        big = a >= max_bits                                   # >= max, inf included: saturate
        code = code_max if big else code
        val = top if big else val
        nan = a > _INF_BITS
        code = _I32(0x7F) if nan else code                   # a NaN code of both formats (S.1111.111, S.11111.11)
        val = _NAN if nan else val
        return _I32(sign | code), _bits_f32(_f32_bits(val) | _I32(sign << 24))

    _Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6, _Q7, _Q8, _Q9 = _fp8_params("e4m3")

    @numba.njit(inline="always", **_JIT)
    def _round_e4m3(y):
        return _round_fp8(y, _Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6, _Q7, _Q8, _Q9)

    @numba.njit(**_JIT)
    def _amax_bits(xb, r, c, out):
        # xb: (M, K) int32 bits of x; out: (M/r, K/c) int32, the max of |x|'s bits per block
        M, K = xb.shape
        nb = K // c
        for bi in range(M // r):
            for bj in range(nb):
                out[bi, bj] = 0
            for ii in range(r):
                xi, oi = xb[bi * r + ii], out[bi]            # (K,) and (K/c,) rows
                if c == 1:
                    for j in range(K):
                        oi[j] = max(oi[j], xi[j] & _MASK)
                else:
                    for bj in range(nb):
                        m = np.int32(0)
                        for jj in range(c):
                            m = max(m, xi[np.uint64(bj * c + jj)] & _MASK)   # unsigned: no wraparound check
                        oi[bj] = max(oi[bj], m)

    def _make_quantize(name: str, divide: bool, keep: bool):
        """The FP8 quantize kernel: y = x / mult (MX) or x * mult, cast to ``name``; with ``keep`` also the copy
        float32(code) * dequant. Specialized at compile time."""
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9 = _fp8_params(name)   # numbers: the closure stays cacheable

        @numba.njit(**_JIT)
        def kernel(x, r, c, mult, dequant, codes, out):
            # x: (M, K) f32; mult, dequant: (M/r, K/c) f32; codes: (M, K) uint8; out: (M, K) f32 (if keep)
            M, K = x.shape
            for i in range(M):
                xi, qi, oi = x[i], codes[i], out[i if keep else 0]  # (K,) rows
                si, di = mult[i // r], dequant[i // r]               # (K/c,) the row's block multipliers
                for bj in range(K // c):
                    for jj in range(c):
                        j = np.uint64(bj * c + jj)                   # unsigned: no wraparound check
                        k = np.uint64(bj) if c > 1 else j            # the element's block in this row
                        q, v = _round_fp8(xi[j] / si[k] if divide else xi[j] * si[k], p0, p1, p2, p3, p4, p5, p6, p7, p8, p9)
                        qi[j] = np.uint8(q)
                        if keep:
                            oi[j] = v * di[k]
        return kernel

    _QUANTIZE = {(name, divide, keep): _make_quantize(name, divide, keep)
                 for name in ("e4m3", "e5m2") for divide in (False, True) for keep in (False, True)}

    _SIX = np.float32(FORMATS["e2m1"].max)

    @numba.njit(inline="always", **_JIT)
    def _round_e2m1(y, r, stochastic):
        """float32 y rounded to E2M1 (saturating at 6) as ``fastpath.round_e2m1`` rounds it: to nearest even, or
        stochastically from the rule's draw r (int64 in [0, 2^62))."""
        a = abs(y)
        a = _SIX if a > _SIX else a                          # NaN stays NaN (the compare is false)
        e = _I32(_f32_bits(a) >> 23)                         # FP32 exponent field (NaN: 255)
        if not stochastic:
            ec = min(max(e, _I32(127)), _I32(129))
            magic = _bits_f32(_I32((ec + _I32(22)) << 23))   # Q * 2^23 for Q = 0.5, 1, 2
            mag = (a + magic) - magic                        # one rounding to a multiple of Q, ties to even
        else:
            e1 = max(e, _I32(1))
            sig = np.int64(_f32_bits(a)) - (np.int64(e1 - 1) << 23)     # 24-bit significand (subnormals too)
            d = min(max(149 - e1, 22), 62)                   # low bits to drop
            n = (sig + (r & ((np.int64(1) << d) - 1))) >> d
            q = _bits_f32(_I32((max(e, _I32(127)) - _I32(1)) << 23))    # Q: 0.5, 1 or 2
            mag = np.float32(n) * q + (a - a)                # NaN back in (a - a is 0 elsewhere)
        return _bits_f32(_f32_bits(mag) | (_f32_bits(y) & _SIGN))   # y's sign copied back (-0.0, NaN too)

    def _make_e2m1(stochastic: bool):
        """The NVFP4 element kernel: q = e2m1(x * mult), its E4M3-container code and the copy q * dequant."""
        @numba.njit(**_JIT)
        def kernel(x, r_, c, mult, dequant, draws, codes, out):
            # x: (M, K) f32; mult, dequant: (M/r, K/c) f32; draws: (M, K) int64 (stochastic); codes uint8; out f32
            M, K = x.shape
            for i in range(M):
                xi, qi, oi, ri = x[i], codes[i], out[i], draws[i if stochastic else 0]
                si, di = mult[i // r_], dequant[i // r_]
                for bj in range(K // c):
                    for jj in range(c):
                        j = np.uint64(bj * c + jj)                   # unsigned: no wraparound check
                        k = np.uint64(bj) if c > 1 else j                     # the element's block in this row
                        v = _round_e2m1(xi[j] * si[k], ri[j] if stochastic else np.int64(0), stochastic)
                        q, v8 = _round_e4m3(v)                       # exact: every E2M1 value is an E4M3 value
                        qi[j] = np.uint8(q)
                        oi[j] = v8 * di[k]
        return kernel

    _e2m1_nearest, _e2m1_stochastic = _make_e2m1(False), _make_e2m1(True)

    _EXP, _TOP_POW2, _INF = _I32(0x7F800000), _I32(0x7F000000), np.float32(np.inf)

    @numba.njit(**_JIT)
    def _pow2_scale(amax, top, out):
        # amax, out: (n,) f32; top: f32. fastpath.pow2_scale's rule, element by element
        for i in range(amax.shape[0]):
            a = amax[i]
            p = min(_I32(_f32_bits(top / a) & _EXP), _TOP_POW2)          # 2^floor(log2(top / amax)), <= 2^127
            out[i] = _bits_f32(p) if (a > 0 and a < _INF) else np.float32(1.0)

    @numba.njit(**_JIT)
    def _rceil_scale_inv(amax, elem_max, out):
        # amax, out: (n,) f32; elem_max: f32. fastpath.rceil_scale_inv's rule, element by element
        for i in range(amax.shape[0]):
            b = _f32_bits(amax[i] / elem_max)
            up = min(_I32(_I32(b + _I32(0x7FFFFF)) & _EXP), _TOP_POW2)   # 2^ceil(log2 d), int32 wrap as torch's
            out[i] = _bits_f32(_I32(0x400000) if b <= _I32(0x400000) else up)

    def _make_dequantize(name: str):
        """float32(code) * mult per block for FP8 format ``name``'s codes (E2M1 values in an E4M3 container too)."""
        f = FORMATS[name]
        mbits = _I32(f.mantissa_bits)
        emask, mmask = _I32((1 << f.exponent_bits) - 1), _I32((1 << f.mantissa_bits) - 1)
        rebias, sub = _I32(127 - f.bias), np.float32(f.min_subnormal)
        inf_nan, all_ones = f.nan == "ieee", f.nan == "all_ones"      # E5M2: exponent all ones; E4M3: S.1111.111
        inf = np.float32(np.inf)

        @numba.njit(**_JIT)
        def kernel(codes, r, c, mult, out):
            # codes: (M, K) uint8; mult: (M/r, K/c) f32; out: (M, K) f32 := float32(code) * mult
            M, K = codes.shape
            for i in range(M):
                ci, oi, mi = codes[i], out[i], mult[i // r]
                for bj in range(K // c):
                    for jj in range(c):
                        j = np.uint64(bj * c + jj)
                        b = _I32(ci[j])
                        e, m = _I32(b >> mbits) & emask, b & mmask
                        mag = _bits_f32(_I32(_I32(e + rebias) << 23) | _I32(m << (23 - mbits))) if e > 0 \
                            else np.float32(m) * sub
                        if all_ones:
                            mag = _NAN if (e == emask and m == mmask) else mag
                        if inf_nan:
                            mag = (inf if m == 0 else _NAN) if e == emask else mag
                        oi[j] = _bits_f32(_f32_bits(mag) | _I32(_I32(b & _I32(0x80)) << 24)) \
                            * mi[np.uint64(bj) if c > 1 else j]
        return kernel

    _DEQUANTIZE = {name: _make_dequantize(name) for name in ("e4m3", "e5m2")}

def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``scaled.block_amax(x, block)``: (M/r, K/c) float32 max |x| per resolved block, NaN propagating.
    x: (M, K) float32 on the CPU (``fastpath._takes``)."""
    x = x.detach().contiguous()
    r, c = block
    _grid(x, block)
    out = torch.empty(x.shape[0] // r, x.shape[1] // c, dtype=torch.int32)
    _amax_bits(_np(x.view(torch.int32)), r, c, _np(out))
    return out.view(torch.float32)


_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _grid(x: torch.Tensor, block: tuple[int, int], *grids: torch.Tensor) -> None:
    """ValueError unless ``block`` (r, c) divides x's (M, K) and every grid is (M/r, K/c): the kernels index
    without bounds checks, so a wrong shape (e.g. a learner's scale function returning a flat tensor) is refused
    here, as the rule's broadcast would refuse it."""
    (M, K), (r, c) = x.shape, block
    if r < 1 or c < 1 or M % r or K % c:
        raise ValueError(f"a {r}x{c} block does not divide shape {(M, K)}")
    for g in grids:
        if tuple(g.shape) != (M // r, K // c):
            raise ValueError(f"block scales of shape {tuple(g.shape)} for a {(M, K)} tensor in {r}x{c} blocks: "
                             f"expected {(M // r, K // c)}, one per block")


def quantize_fp8(x: torch.Tensor, block: tuple[int, int], mult: torch.Tensor, divide: bool = False,
                 dequant: Optional[torch.Tensor] = None, fp8_format: str = "e4m3"):
    """(data (M, K) float8, its float32 dequantization or None): ``fp8(saturate(x * mult))`` per block, rounded to
    nearest even (``divide``: x / mult, MX's rule), and with ``dequant`` the copy float32(data) * dequant.
    x: (M, K) float32 on the CPU (``fastpath._takes``); mult, dequant: (M/r, K/c) float32 (the blocks' scales and
    dequantization multipliers); fp8_format "e4m3" or "e5m2"."""
    x = x.detach().contiguous()
    M, K = x.shape
    r, c = block
    keep = dequant is not None
    _grid(x, block, mult, *([dequant] if keep else []))
    codes = torch.empty(M, K, dtype=torch.uint8)
    out = torch.empty(M if keep else 1, K, dtype=torch.float32)
    mult = mult.float().contiguous()                # locals: _np's views need their tensors alive
    dequant = dequant.float().contiguous() if keep else mult
    _QUANTIZE[fp8_format, bool(divide), keep](_np(x), r, c, _np(mult), _np(dequant), _np(codes), _np(out))
    return codes.view(FORMATS[fp8_format].torch_dtype), (out if keep else None)


def quantize_e2m1(x: torch.Tensor, block: tuple[int, int], mult: torch.Tensor, dequant: torch.Tensor,
                  draws: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (M, K) E2M1 values in a float8_e4m3fn container, float32 copy): ``round_e2m1(x * mult)`` per block,
    to nearest even, or stochastically with ``draws`` ((M, K) int64 from ``torch.randint(0, 2**62, ...)``, as the
    rule draws them), and the copy float32(data) * dequant. x: (M, K) float32 on the CPU; mult, dequant:
    (M/r, K/c) float32."""
    x = x.detach().contiguous()
    M, K = x.shape
    r, c = block
    codes = torch.empty(M, K, dtype=torch.uint8)
    out = torch.empty(M, K, dtype=torch.float32)
    _grid(x, block, mult, dequant)
    if draws is not None and draws.numel() != M * K:
        raise ValueError(f"{draws.numel()} random draws for {M * K} elements")
    kernel = _e2m1_nearest if draws is None else _e2m1_stochastic
    d = torch.zeros(1, 1, dtype=torch.int64) if draws is None else draws.reshape(M, K).contiguous()
    mult, dequant = mult.float().contiguous(), dequant.float().contiguous()   # locals, alive for _np's views
    kernel(_np(x), r, c, _np(mult), _np(dequant), _np(d), _np(codes), _np(out))
    return codes.view(torch.float8_e4m3fn), out


def dequantize_fp8(data: torch.Tensor, block: tuple[int, int], mult: torch.Tensor) -> torch.Tensor:
    """``float32(data) * mult`` per block, (M, K) float32: ``ScaledTensor.dequantize``'s rule (and the FP8 upcast
    times a per-tensor scale, ``fastpath.fp8_to_float32``) for contiguous 2-D float8_e4m3fn (E4M3, or E2M1 values
    in that container) or float8_e5m2 ``data`` on the CPU and (M/r, K/c) float32 ``mult``."""
    data, mult = data.contiguous(), mult.float().contiguous()             # locals, alive for _np's views
    M, K = data.shape
    _grid(data, block, mult)
    out = torch.empty(M, K, dtype=torch.float32)
    _DEQUANTIZE[_NAMES[data.dtype]](_np(data.view(torch.uint8)), block[0], block[1], _np(mult), _np(out))
    return out


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``fastpath.pow2_scale(amax, fp8_max)`` for float32 CPU ``amax`` (any shape), one compiled pass."""
    a = amax.contiguous()
    out = torch.empty_like(a)
    _pow2_scale(_np(a.view(-1)), np.float32(fp8_max), _np(out.view(-1)))
    return out


def rceil_scale_inv(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """``fastpath.rceil_scale_inv(amax, elem_max)`` for float32 CPU ``amax`` (any shape), one compiled pass."""
    a = amax.contiguous()
    out = torch.empty_like(a)
    _rceil_scale_inv(_np(a.view(-1)), np.float32(elem_max), _np(out.view(-1)))
    return out
