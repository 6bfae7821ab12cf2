"""The block quantizers' kernels (FP32-scaled FP8 blocks and MX), each equal bit for bit to the rule it names.

* ``block_amax(x, block)``: ``scaled.block_amax``.
* ``pow2_scale(amax, fp8_max)`` and ``rceil_scale_inv(amax, elem_max)``: ``tensor.compute_scale`` with power-of-two
  scales and 2^k of MX's RCEIL exponent (``mx.mx_shared_exponent``), read from the bits of one division in a few
  ops on the scale grid.
* ``cast_elements``: ``scaled.cast_elements`` (``per_tensor.saturating_cast``, ``e2m1.round_e2m1``).
* ``quantize_fp32_scaled`` and ``encode_fp32_scaled``: ``blockwise.quantize_fp32_scaled`` and ``encode_fp32_scaled``.
* ``quantize_mx``, ``encode_mx`` and ``encode_mx_exponents``: ``mx.quantize_mx`` and ``mx.encode_mx``.

``keep_fp32``: the quantizer also keeps its float32 dequantization (``ScaledTensor.dequantized``) for an emulated
GEMM. The encoders' torch bodies (``encode_fp32_scaled``, ``encode_mx`` where the compiled pass does not run: E5M2 and
E2M1 elements, no kept copy, no numba) are these steps' kernels there, the only fast path (the cast without its
clamp where torch's saturates, the kept copy written into the scratch the cast read): kept, and tested against the
rules. Contiguous 2-D float32 CPU tensors take the compiled passes (``fp8_passes``: the block amax, the cast and the
kept copy in one pass) where ``jit.takes`` says so. Checked by ``tests/core/quant/kernels/test_quant_fused.py``,
``test_quant_fastpath.py`` and ``tests/core/quant/test_quant_layout.py`` (every recipe's quantizers both ways).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...formats import FORMATS
from ..rules import mx, scaled, tensor
from ..rules.scaled import CONTAINER, ScaledTensor, block_multiplier, block_view, check_edges, expand, resolve_block
from . import fp8_passes
from .e2m1 import round_e2m1
from .jit import takes
from .per_tensor import saturating_cast
from .upcast import fp8_blocks_to_float32


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``scaled.block_amax(x, block)`` bit for bit: the compiled pass (``fp8_passes``), or for 1x16 blocks of a contiguous
    CPU tensor torch's 1-D max pooling with kernel = stride = 16 (torch's CPU reduction over a 16-wide innermost
    dimension is slow; a max is exact in any order, NaN propagates in both): that pooling is the kernel of 1x16
    blocks wherever the compiled pass does not run (no numba, ``torch.compile`` tracing), kept. Every other call
    is the rule's own."""
    scaled.check_floating(x)
    if x.numel() > 0 and takes(x):
        return fp8_passes.block_amax(x, resolve_block(x.shape, block))
    if x.numel() > 0 and block == (1, 16) and x.device.type == "cpu":
        a = x.detach().float().abs()                                           # (M, K) fp32
        if a.is_contiguous():
            M, K = a.shape
            return torch.nn.functional.max_pool1d(a.reshape(M, 1, K), 16, 16).reshape(M, K // 16)
    return scaled.block_amax(x, block)                                         # the rule itself


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``tensor.compute_scale(amax, fp8_max, margin=0, power_2_scale=True)`` bit for bit: the compiled pass
    (``loops.pow2_scale_loop``, one call instead of the rule's seven small ops) for float32 CPU amaxes, else the
    rule itself.

    amax: float32 tensor (any shape, >= 0 or NaN). The loop reads the rule's cases from the bits of
    s = fp8_max / amax (the same division): a usable amax (finite, > 0) keeps s's exponent bits (2^floor(log2 s));
    s = inf (a tiny amax) becomes FP32 max in the rule, whose power of two is 2^127; s never falls below the
    smallest normal (fp8_max / FP32 max > 2^-126); amax 0, inf or NaN gives 1.0.
    """
    if takes(amax, torch.float32, None):
        return fp8_passes.pow2_scale(amax, fp8_max)                            # the same bits, one compiled pass
    return tensor.compute_scale(amax, fp8_max, 0, None, True)                  # the rule itself


def rceil_scale_inv(amax: torch.Tensor, elem: str) -> torch.Tensor:
    """2^k as float32 for k = ``mx.mx_shared_exponent(amax, elem, "rceil")`` (the MX RCEIL rule), bit for bit: the
    compiled pass (``loops.rceil_scale_inv_loop``, without the int64 exponent) for float32 CPU amaxes, else the
    rule itself. The loop reads it from the bits of d = amax / elem_max (the same division): 2^ceil(log2 d) is
    (bits + 0x7FFFFF) & 0x7F800000 for a positive d (a nonzero mantissa carries into the exponent; a subnormal
    d above 2^-127 carries into 2^-126), capped at 2^127 (d = inf, or a carry past it); d <= 2^-127, zero or
    negative zero gives 2^-127 as the rule's k = -127.
    NaN amax is the caller's (the rule leaves it to quantize_mx too)."""
    if takes(amax, torch.float32, None):
        return fp8_passes.rceil_scale_inv(amax, mx.mx_element_format(elem).max)   # the same bits, one pass
    return torch.exp2(mx.mx_shared_exponent(amax, elem, "rceil").double()).float()   # the rule itself


def keep(data: torch.Tensor, scale_inv: torch.Tensor, block, elem: str, tensor_scale_inv, orig_dtype,
         y: torch.Tensor, keep_fp32: bool, amax: Optional[torch.Tensor] = None) -> ScaledTensor:
    """The ScaledTensor of a quantizer; with keep_fp32 also its float32 dequantization, written into the
    quantizer's scratch ``y`` (the scaled copy the cast read, no longer needed). ``amax``: the block amaxes, for
    quantizers whose data holds a NaN code only where a block holds a NaN (FP32-scaled FP8, MX)."""
    st = ScaledTensor(data, scale_inv, block, elem, tensor_scale_inv, orig_dtype)
    if keep_fp32 and data.dim() == 2 and data.is_contiguous() and y.is_contiguous():
        nan_free = amax is not None and not bool(torch.isnan(amax).any())
        st.dequantized = fp8_blocks_to_float32(data, st.block_scale_inv(), st.block, y, nan_free)
    return st


def fuses(x: torch.Tensor) -> bool:
    """Whether a quantizer takes the compiled pass (``fp8_passes``) for x (per call, about the input): ``takes(x)`` and
    contiguous (the layer's operands; its copy keeps x's layout, as ``keep``'s does)."""
    return takes(x) and x.is_contiguous()


def kept(st: ScaledTensor, dequantized: torch.Tensor) -> ScaledTensor:
    """st holding its float32 dequantization (from ``fp8_passes.quantize_fp8`` / ``quantize_e2m1``)."""
    st.dequantized = dequantized
    return st


def cast_elements(y: torch.Tensor, elem: str, rounding: str = "nearest",
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``scaled.cast_elements`` bit for bit. ``y`` is a scratch tensor of the caller's: the FP8 formats may clamp
    it in place (``saturating_cast``); E2M1 takes ``round_e2m1``'s few int32/FP32 passes."""
    if elem in tensor.FP8_DTYPES and rounding == "nearest":
        return saturating_cast(y, tensor.FP8_DTYPES[elem], FORMATS[elem].max)
    if elem == "e2m1" and rounding in ("nearest", "stochastic"):
        return round_e2m1(y.contiguous(), rounding, generator).to(CONTAINER[elem])
    return scaled.cast_elements(y, elem, rounding, generator)


def quantize_fp32_scaled(x: torch.Tensor, block, fp8_format="e4m3", *, margin: int = 0, power_2_scale: bool = False,
                         amax_epsilon: float = 0.0, keep_fp32: bool = False) -> ScaledTensor:
    """``blockwise.quantize_fp32_scaled`` bit for bit; ``keep_fp32``: also keep the float32 dequantization
    (``ScaledTensor.dequantized``), for an emulated GEMM. Power-of-two scales come from ``pow2_scale``."""
    name = tensor.fp8_format_name(fp8_format)
    b = resolve_block(x.shape, block)
    amax = tensor.apply_amax_epsilon(block_amax(x, b), amax_epsilon)       # (M/r, K/c) fp32
    top = FORMATS[name].max
    if power_2_scale and margin == 0:
        scale = pow2_scale(amax, top)                         # compute_scale's bits in fewer ops
    else:
        scale = tensor.compute_scale(amax, top, margin, None, power_2_scale)
    return encode_fp32_scaled(x, b, name, scale, keep_fp32, amax)


def encode_fp32_scaled(x: torch.Tensor, b: tuple[int, int], name: str, scale: torch.Tensor, keep_fp32: bool = False,
                       amax: Optional[torch.Tensor] = None) -> ScaledTensor:
    """``blockwise.encode_fp32_scaled`` bit for bit (``amax``: the block amaxes the scales came from, if they did:
    then no NaN code needs searching for)."""
    if keep_fp32 and name == "e4m3" and fuses(x):
        # the rule's cast and keep's FP32 copy, in one compiled pass (the same bits: tests/core/quant/kernels/test_quant_fused.py)
        scale_inv = scale.reciprocal()
        data, dq = fp8_passes.quantize_fp8(x, b, scale, False, scale_inv)
        return kept(ScaledTensor(data, scale_inv, b, name, None, x.dtype), dq)
    y = block_view(x.float(), b) * expand(scale, b)           # (M/r, r, K/c, c) fp32, one rounding
    data = cast_elements(y, name).reshape(x.shape)
    return keep(data, scale.reciprocal(), b, name, None, x.dtype, y, keep_fp32, amax)


def quantize_mx(x: torch.Tensor, block=(1, 32), elem: str = "e4m3", rule: str = "floor",
                keep_fp32: bool = False, edges: str = "course") -> ScaledTensor:
    """``mx.quantize_mx`` bit for bit; the RCEIL scale from ``rceil_scale_inv`` (2^k without the int64 k)."""
    mx.mx_element_format(elem)                                # refuses an unknown element format
    check_edges(edges)
    b = resolve_block(x.shape, mx.check_mx_block(block))
    amax = block_amax(x, b)                                    # (M/r, K/c) fp32
    if rule == "rceil":
        return encode_mx(x, b, elem, amax, rceil_scale_inv(amax, elem), keep_fp32, rule, edges)
    k = mx.mx_shared_exponent(amax, elem, rule)      # held until the cast is done, as the rule holds it
    return encode_mx(x, b, elem, amax, torch.exp2(k.double()).float(), keep_fp32, rule, edges)


def encode_mx(x: torch.Tensor, b: tuple[int, int], elem: str, amax: torch.Tensor, scale_inv: torch.Tensor,
              keep_fp32: bool = False, rule: str = "floor", edges: str = "course") -> ScaledTensor:
    """``mx.encode_mx`` bit for bit, from the scales 2^k (float32) instead of k (the divisor: ``mx.mx_divisor``'s,
    2^k itself unless ``edges="torchao"``)."""
    mx.check_mx_block(b)
    scale_inv = torch.where(torch.isnan(amax), float("nan"), scale_inv)
    divisor = mx.mx_divisor(scale_inv, rule, edges)
    if keep_fp32 and elem == "e4m3" and fuses(x):
        # the cast and keep's FP32 copy, in one compiled pass (the same bits: tests/core/quant/kernels/test_quant_fused.py)
        e8m0 = scale_inv.to(torch.float8_e8m0fnu)
        data, dq = fp8_passes.quantize_fp8(x, b, divisor, True, block_multiplier(e8m0))
        return kept(ScaledTensor(data, e8m0, b, elem, None, x.dtype), dq)
    y = block_view(x.float(), b) / expand(divisor, b)
    data = cast_elements(y, elem).reshape(x.shape)
    return keep(data, scale_inv.to(torch.float8_e8m0fnu), b, elem, None, x.dtype, y, keep_fp32, amax)


def encode_mx_exponents(x: torch.Tensor, block: tuple[int, int], elem: str, amax: torch.Tensor, k: torch.Tensor,
                        rule: str = "floor", edges: str = "course", keep_fp32: bool = False) -> ScaledTensor:
    """``mx.encode_mx(x, block, elem, amax, k, rule, edges)`` bit for bit, from the same shared exponents k (a
    learner's ``mx_shared_exponent``): ``encode_mx`` with 2^k, exact in float32 (2^-127 is a subnormal)."""
    return encode_mx(x, block, elem, amax, torch.exp2(k.double()).float(), keep_fp32, rule, edges)

