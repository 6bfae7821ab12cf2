"""The compiled CPU loops (numba) of the emulated FP8 / MX / NVFP4 steps, each equal bit for bit to a torch rule.

Imported only where numba is (``jit.AVAILABLE``); called through ``fp8_passes`` and ``nvfp4_passes``, which hand
them tensors' memory. The rules stay in torch, written for reading; each is a chain of eager passes over memory
(|x|, the block max, the scaled copy, the cast, the upcast times each block's multiplier: about 50 bytes of traffic
per element). Here the same arithmetic runs in one loop per pass that the rule cannot avoid:

* ``amax_bits``: ``scaled.block_amax`` (and ``tensor.compute_amax``, one block). On the FP32 bit patterns with the
  sign cleared, integer order is float order for numbers and every NaN lies above +inf, so an integer max is the
  float max with NaN propagating (torch's ``amax``); a max is exact in any order, and the integer one vectorizes.
* ``QUANTIZE``: the saturating FP8 cast of ``tensor.to_float8`` (``tensor.quantize``), ``blockwise.encode_fp32_scaled``
  and ``mx.encode_mx`` (y = x * mult, or x / mult for MX, one FP32 rounding as in torch, then ``_round_fp8``), with
  the FP32 copy ``ScaledTensor.dequantize`` forms where asked.
* ``e2m1_nearest``, ``e2m1_stochastic``, ``e2m1_drawing``: ``nvfp4.encode_nvfp4``'s element step (the rounding of
  ``formats.round_to(y, "e2m1", saturate=True)``, to nearest or stochastically from the rule's draws
  ``torch.randint(0, 2**62)``, given or drawn in the loop from the generator's MT19937 words, ``mt_words``).
* ``nvfp4_scale_loop``: ``nvfp4.two_level_scales``' two scale levels and ``nvfp4.encode_multipliers``.
* ``DEQUANTIZE``: ``ScaledTensor.dequantize`` to float32 and ``tensor.fp8_to_float32``: each code read as the top
  bits of an FP16 number and converted by the CPU's FP16 -> FP32 instruction (a vectorized loop).
* ``pow2_scale_loop``, ``rceil_scale_inv_loop``: ``tensor.compute_scale`` with power-of-two scales and 2^k of MX's
  RCEIL exponent (``mx.mx_shared_exponent``), in one call instead of seven small torch ops.

The FP8 cast (OCP FP8: E4M3 "fn" has no inf, S.1111.111 is NaN, max 448; E5M2 max 57344), for |y|'s FP32 bits a:
    NaN                              -> a NaN code (0x7F)
    |y| >= max (inf included)        -> max: saturation, as the quantizers clamp first
    min_normal <= |y| < max          -> drop 20 (E4M3) / 21 (E5M2) of FP32's 23 mantissa bits, to nearest even:
                                        (a + half - 1 + odd) with the low bits cleared, exponent rebiased
    |y| < min_normal (subnormal)     -> |y| / min_subnormal (exact) rounded to an integer, to nearest even, by adding
                                        and subtracting 2^23 in FP32; that integer is the code
    and the sign bit copied in. All 2^32 FP32 bit patterns were checked against torch's cast for both formats
(``benchmarks/check_fused_casts.py``; ``tests/core/quant/kernels/test_quant_fused.py`` keeps every FP8 midpoint, its
neighbours, the specials and random patterns, and checks each kernel against its torch rule on tensors with NaN,
inf, signed zeros and ties, for every block shape).

The loops are written so LLVM vectorizes them (AVX-512 here): per row, either one multiplier per element (c = 1)
or one per block of c read once; indices from ``range`` (numba's negative-index wraparound check on an index it
cannot prove non-negative, or a per-element choice of the block index, keeps the loop scalar), and no inlined
helper that stores into arrays (the same). Written the other way the E2M1 kernel took 0.7 ms on a 1024 x 512
tensor in (1, 16) blocks and 4.4 ms in (16, 1) blocks; written so, 0.3 ms in either (one thread).

Compiled once per machine (``cache=True``: a few seconds the first time, then loaded from numba's cache, which is
keyed by this file's path and stamp). Every loop and every inlined helper it calls lives in this one file on
purpose: numba checks only the stamp of the file a cached function is defined in, so a helper in another module
could change without its callers being compiled again. Single-threaded: ``mpcourse compare`` runs one 1-thread
worker per core. Measured with ``benchmarks/bench_block_recipes.py`` and ``benchmarks/bench_step_ratio.py``.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...formats import FORMATS


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
def amax_bits(xb, r, c, out):
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

QUANTIZE = {(name, divide, keep): _make_quantize(name, divide, keep)
             for name in ("e4m3", "e5m2") for divide in (False, True) for keep in (False, True)}

_SIX = np.float32(FORMATS["e2m1"].max)

@numba.njit(inline="always", **_JIT)
def _round_e2m1(y, r, stochastic):
    """float32 y rounded to E2M1 (saturating at 6) as ``e2m1.round_e2m1`` rounds it: to nearest even, or
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

@numba.njit(inline="always", **_JIT)
def _draw_at(ri, w, j, stochastic, draw):
    """Element j's draw: from the row's engine words w (``draw``: torch's random64(), first word << 32 | second
    word, mod 2^62), or the given draws ri (``stochastic``), or 0 (nearest)."""
    if draw:
        return (np.int64(w[2 * j] & _U32(0x3FFFFFFF)) << 32) | np.int64(w[2 * j + 1])
    return ri[j] if stochastic else np.int64(0)

def _make_e2m1(stochastic: bool, draw: bool = False):
    """The NVFP4 element kernel: q = e2m1(x * mult), its E4M3-container code and the copy q * dequant; with
    ``draw`` the stochastic rounding's draws come from the generator's MT19937 words (``mt_words``), as
    ``torch.randint(0, 2**62)`` forms them, instead of from a tensor of draws."""
    @numba.njit(**_JIT)
    def kernel(x, r_, c, mult, dequant, draws, state, pos, codes, out):
        # x: (M, K) f32; mult, dequant: (M/r, K/c) f32; draws: (M, K) int64 (stochastic, not draw);
        # state: (624,) int64 MT19937 words, pos: (left, next) int64 (draw); codes uint8; out f32
        M, K = x.shape
        words = state.astype(np.uint32) if draw else np.empty(1, np.uint32)   # 32-bit working copy
        w = np.empty(2 * K if draw else 1, np.uint32)                         # one row's words
        for i in range(M):
            xi, qi, oi, ri = x[i], codes[i], out[i], draws[i if stochastic and not draw else 0]
            si, di = mult[i // r_], dequant[i // r_]
            if draw:
                mt_words(words, pos, w)                   # the row's 2K words, in the rule's order
            # (the element's steps are written out in both loops: an inlined function that stores into the
            # arrays keeps LLVM from vectorizing the loop, 20x slower)
            if c == 1:                                     # a multiplier per element of the row
                for j in range(K):
                    v = _round_e2m1(xi[j] * si[j], _draw_at(ri, w, j, stochastic, draw), stochastic)
                    q, v8 = _round_e4m3(v)                 # exact: every E2M1 value is an E4M3 value
                    qi[j] = np.uint8(q)
                    oi[j] = v8 * di[j]
            else:                                          # one per c elements, read once per block
                for bj in range(K // c):
                    s, d = si[bj], di[bj]
                    for jj in range(c):
                        j = bj * c + jj
                        v = _round_e2m1(xi[j] * s, _draw_at(ri, w, j, stochastic, draw), stochastic)
                        q, v8 = _round_e4m3(v)
                        qi[j] = np.uint8(q)
                        oi[j] = v8 * d
        if draw:
            for t in range(624):
                state[t] = np.int64(words[t])
    return kernel

# at::mt19937 (ATen/core/MT19937RNGEngine.h), the engine of torch's CPU generator: 624 32-bit words; each output
# is the next word, tempered; when they are used up the state is regenerated ("twisted") in place
_U32 = np.uint32
_MT_UPPER, _MT_LOWER, _MT_A = _U32(0x80000000), _U32(0x7FFFFFFF), _U32(0x9908B0DF)
_MT_B, _MT_C = _U32(0x9D2C5680), _U32(0xEFC60000)

@numba.njit(**_JIT)
def _mt_twist(s):
    # s: (624,) uint32, regenerated in place (MT19937 with n = 624, m = 397)
    for p in range(227):
        y = (s[p] & _MT_UPPER) | (s[p + 1] & _MT_LOWER)
        s[p] = s[p + 397] ^ (y >> _U32(1)) ^ ((s[p + 1] & _U32(1)) * _MT_A)
    for p in range(227, 623):
        y = (s[p] & _MT_UPPER) | (s[p + 1] & _MT_LOWER)
        s[p] = s[p - 227] ^ (y >> _U32(1)) ^ ((s[p + 1] & _U32(1)) * _MT_A)
    y = (s[623] & _MT_UPPER) | (s[0] & _MT_LOWER)
    s[623] = s[396] ^ (y >> _U32(1)) ^ ((s[0] & _U32(1)) * _MT_A)

@numba.njit(**_JIT)
def mt_words(s, pos, w):
    # w: (n,) uint32 := the engine's next n outputs. s: (624,) uint32 state; pos: (left, next) int64, as torch
    # keeps them: an output first decrements left and twists when it reaches 0 (then left = 624, next = 0),
    # then returns word next (tempered) and increments next; so left - 1 words are there before a twist
    left, nxt = pos[0], pos[1]
    n, f = w.shape[0], 0
    while f < n:
        if left == 1:
            _mt_twist(s)
            left, nxt = 625, 0
        k = min(left - 1, n - f)
        src, dst = s[nxt:nxt + k], w[f:f + k]
        for t in range(k):
            y = src[t]
            y ^= y >> _U32(11)
            y ^= (y << _U32(7)) & _MT_B
            y ^= (y << _U32(15)) & _MT_C
            y ^= y >> _U32(18)
            dst[t] = y
        f, nxt, left = f + k, nxt + k, left - k
    pos[0], pos[1] = left, nxt

e2m1_nearest, e2m1_stochastic, e2m1_drawing = _make_e2m1(False), _make_e2m1(True), _make_e2m1(True, True)

_EXP, _TOP_POW2, _INF = _I32(0x7F800000), _I32(0x7F000000), np.float32(np.inf)

@numba.njit(**_JIT)
def pow2_scale_loop(amax, top, out):
    # amax, out: (n,) f32; top: f32. blocks.pow2_scale's rule, element by element
    for i in range(amax.shape[0]):
        a = amax[i]
        p = min(_I32(_f32_bits(top / a) & _EXP), _TOP_POW2)          # 2^floor(log2(top / amax)), <= 2^127
        out[i] = _bits_f32(p) if (a > 0 and a < _INF) else np.float32(1.0)

@numba.njit(**_JIT)
def rceil_scale_inv_loop(amax, elem_max, out):
    # amax, out: (n,) f32; elem_max: f32. blocks.rceil_scale_inv's rule, element by element
    for i in range(amax.shape[0]):
        b = _f32_bits(amax[i] / elem_max)
        up = min(_I32(_I32(b + _I32(0x7FFFFF)) & _EXP), _TOP_POW2)   # 2^ceil(log2 d), int32 wrap as torch's
        out[i] = _bits_f32(_I32(0x400000) if b <= _I32(0x400000) else up)

_NV_T_DIV = np.float32(FORMATS["e4m3"].max * FORMATS["e2m1"].max)    # 2688: t = amax / (448 * 6)
_NV_T_MIN = np.float32(2.0 ** -126)                                 # nvfp4.NVFP4_MIN_TENSOR_SCALE_INV
_NV_T_TINY = np.float32(2.0 ** -121)                                # nvfp4.NVFP4_TINY_TENSOR_SCALE_INV
_NV_PRE = np.float32(2.0 ** 6)                                      # nvfp4.NVFP4_ENCODE_PRESHIFT
_NV_S_MIN, _NV_S_MAX = np.float32(FORMATS["e4m3"].min_normal), np.float32(FORMATS["e4m3"].max)

@numba.njit(**_JIT)
def nvfp4_scale_loop(amax, given, use_given, course, t_out, codes, recip, mult):
    # amax: (n,) f32 block amaxes; given: (1,) f32 the tensor amax (use_given) ; course: the course's t floor,
    # pre-shift and flush. t_out (1,) f32; codes (n,) uint8 the E4M3 block scales; recip, mult (n,) f32.
    # nvfp4_quant.nvfp4_block_scales
    if use_given:
        at = given[0]
    else:                                                # max |amax|, NaN propagating (block_amax's bits max)
        m = _I32(0)
        for i in range(amax.shape[0]):
            m = max(m, _I32(_f32_bits(amax[i]) & _MASK))
        at = _bits_f32(m)
    t = at / _NV_T_DIV
    if course and at > 0 and t < _NV_T_MIN:
        t = _NV_T_MIN
    tiny = course and t > 0 and t < _NV_T_TINY           # nvfp4.tiny_tensor (NaN: False)
    safe = t if t > 0 else np.float32(1.0)               # NaN: 1, as torch.where(t > 0, t, 1)
    inv = np.float32(1.0) / safe
    if tiny:
        inv = inv / _NV_PRE                              # exact: the encode multiplies x by _NV_PRE first
    for i in range(amax.shape[0]):
        v = (amax[i] / _SIX) / safe
        if tiny and v < _NV_S_MIN:                       # flushed whole: scale 0, multipliers 0
            codes[i] = np.uint8(0)
            recip[i] = np.float32(0.0)
            mult[i] = np.float32(0.0) * t
            continue
        v = _NV_S_MIN if v < _NV_S_MIN else v            # torch.clamp; NaN stays NaN
        v = _NV_S_MAX if v > _NV_S_MAX else v
        q, sf = _round_e4m3(v)                           # the E4M3 scale and its value
        codes[i] = np.uint8(q)
        recip[i] = inv / sf
        mult[i] = sf * t
    t_out[0] = t

@intrinsic
def _f16_bits_f32(typingctx, h):
    """The float32 value of the IEEE half-precision number whose bits are the int16 h (exact: every FP16 number
    is an FP32 number); LLVM turns a loop of these into F16C / AVX-512 conversions (vcvtph2ps)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen

@numba.njit(inline="always", **_JIT)
def _decode_fp8(code, shift, factor, top):
    """float32(code) for a uint8 FP8 code read through FP16 bits (``_make_dequantize`` says how; its constants
    are arguments, so the kernels close over numbers only: see ``_make_e2m1``)."""
    b = _I32(code)
    mag, sign = b & _I32(0x7F), b & _I32(0x80)
    v = _f16_bits_f32(np.int16(_I32(mag << shift) | _I32(sign << _I32(8)))) * factor
    return _bits_f32(_f32_bits(_NAN) | _I32(sign << _I32(24))) if mag > top else v

def _make_dequantize(name: str):
    """float32(code) * mult per block for FP8 format ``name``'s codes (E2M1 values in an E4M3 container too).

    A code is read as the top bits of an FP16 number (``upcast.fp8_to_float32``'s reading): its 7 magnitude
    bits shifted to FP16's exponent and mantissa fields (E5M2: by 8, FP16's own top byte; E4M3: by 7, which
    holds 2^-8 times the value, subnormals too), its sign to FP16's; the exact FP16 -> FP32 conversion, times
    2^(15 - bias) (exact), is float32(code). E5M2's inf comes through; the NaN codes (E4M3 S.1111.111, E5M2
    exponent all ones with a mantissa) become FP32's quiet NaN with the code's sign. Then one FP32 product
    with the multiplier, as ``ScaledTensor.dequantize`` rounds it."""
    f = FORMATS[name]
    shift = _I32(10 - f.mantissa_bits)
    factor = np.float32(2.0 ** (15 - f.bias))
    top = _I32(0x7E if f.nan == "all_ones" else 0x7C)            # the largest non-NaN magnitude code
    assert f.exponent_bits <= 5 and f.nan in ("all_ones", "ieee"), name

    @numba.njit(**_JIT)
    def kernel(codes, r, c, mult, out):
        # codes: (M, K) uint8; mult: (M/r, K/c) f32; out: (M, K) f32 := float32(code) * mult
        M, K = codes.shape
        for i in range(M):
            ci, oi, mi = codes[i], out[i], mult[i // r]
            if c == 1:                                     # a multiplier per element of the row
                for j in range(K):
                    oi[j] = _decode_fp8(ci[j], shift, factor, top) * mi[j]
            else:                                          # one per c elements, read once per block
                for bj in range(K // c):
                    mb = mi[bj]
                    for jj in range(c):
                        j = bj * c + jj
                        oi[j] = _decode_fp8(ci[j], shift, factor, top) * mb
    return kernel

DEQUANTIZE = {name: _make_dequantize(name) for name in ("e4m3", "e5m2")}
