"""The FP8 upcasts and the per-tensor FP8 GEMM on a CPU, each equal bit for bit to the rule it names.

* ``fp8_to_float32(data, scale=None)``: ``tensor.fp8_to_float32``, the upcast of a float8 tensor (E4M3 / E5M2
  containers, so E2M1 data too). torch's CPU cast from float8 converts element by element (about as slow as a
  128-wide FP32 GEMM over the same tensor); reading each code as the top bits of an FP16 number and upcasting that
  (one vectorized pass) is the same cast, about 3x faster than the gather from a 256-entry table it replaced
  (1024 x 512 E4M3, 1 thread). With a per-tensor ``scale`` the dequantization multiply is folded in: each element
  is the one FP32 product it was before.
* ``fp8_blocks_to_float32(data, block_mult, block, out)``: ``ScaledTensor.dequantize``'s rule to float32 for
  block-scaled data (the same upcast, 2^8 folded into each block's multiplier), written into a buffer the
  quantizer no longer needs; the block quantizers call it when asked to keep the FP32 copy an emulated GEMM
  reads (``keep_fp32``), so the layer's CPU path upcasts each operand once, at quantization.
* ``dequantize(st, dtype)``: ``ScaledTensor.dequantize``, the block-scaled GEMM's emulation.
* ``cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)``: ``tensor.scaled_mm``, what ``torch._scaled_mm`` computes on
  a CPU (upcast both operands, multiply by their scales, make them row-major, one FP32 GEMM, one rounding to
  ``out_dtype``; measured on torch 2.13), with the fast upcast.

Contiguous 2-D E4M3 / E5M2 CPU data takes the compiled pass (``fp8_passes.dequantize_fp8``) where ``jit.takes``
says so; otherwise the FP16-bit reading here runs (tested against the rules in
``tests/core/quant/kernels/test_quant_fastpath.py``). Measured with ``benchmarks/bench_block_recipes.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..rules import scaled, tensor
from ..rules.scaled import ScaledTensor, block_view, expand
from . import fp8_passes
from .jit import takes


def fp8_to_float32(data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tensor.fp8_to_float32(data, scale)``, bit for bit: ``data.float()`` (times ``scale``, a one-element float32
    tensor, if given), same shape and strides for a contiguous tensor or the transpose of one; other layouts come
    back contiguous. Non-CPU tensors take the rule itself (``tensor.fp8_to_float32``). On a CPU the compiled pass
    (``fp8_passes.dequantize_fp8``) runs where ``jit.takes`` says so; elsewhere (no numba, ``torch.compile``
    tracing) the FP16-bit reading below is this step's kernel: the only fast path there, kept (torch's own upcast,
    the rule's, converts element by element).

    Each code is read as the top bits of an FP16 number, whose upcast to FP32 is one vectorized pass (F16C):
      E5M2 (s eeeee mm) is FP16's top byte, inf and NaN included: FP16 bits = code << 8.
      E4M3 (s eeee mmm): FP16 bits s 0eeee mmm 0000000 (the code shifted left by 7, bit 14 cleared) hold 2^-8
        times the E4M3 value, normals and subnormals alike (both formats' bias differs by 8, and an E4M3
        subnormal lands on an FP16 subnormal); times 2^8 (exact) gives the value. E4M3 has no inf; its NaN codes
        (S.1111.111) would read as +-1.875, so they are set to NaN where present.
    With ``scale`` the product float32(code) * scale is rounded once, as in the rule: the 2^8 is folded into the
    scale (exact, unless 2^8 * scale overflows, when the two are applied one after the other).
    """
    if data.device.type != "cpu":
        return tensor.fp8_to_float32(data, scale)                          # the rule itself
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        return fp8_to_float32(data.t(), scale).t()
    data = data.contiguous()
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"fp8_to_float32 takes float8_e4m3fn or float8_e5m2 data, got {data.dtype}")
    if takes(data, data.dtype, None) and data.dim() >= 1:    # the same products in one compiled pass
        d2 = data.reshape(-1, data.shape[-1])                                     # (M, K) codes
        m = torch.ones(1, 1) if scale is None else scale.reshape(1, 1).float()
        return fp8_passes.dequantize_fp8(d2, tuple(d2.shape), m).reshape(data.shape)
    out = torch.empty(data.shape, dtype=torch.float32, device=data.device)
    return _upcast_into(data, out, None if scale is None else scale.reshape(()).float())


def _upcast_into(data: torch.Tensor, out: torch.Tensor, m: Optional[torch.Tensor], nan_free: bool = False):
    """out (contiguous float32 of data's shape) := float32(code) * m for contiguous float8 ``data`` (m broadcasts
    over out; None: 1), read through FP16 bits (see ``fp8_to_float32``), each element rounded once as in the rule.

    E4M3's FP16 reading is 2^-8 times the value: the 2^8 is folded into m, exact unless it overflows; where some
    |m| >= 2^119 (or is inf) the two are applied one after the other, as in the rule. E4M3's NaN codes would read
    as +-1.875 * 2^-8: they are set to NaN first, unless ``nan_free`` (the caller knows there is none)."""
    codes = data.view(torch.int8).to(torch.int16)                           # (...) int16, sign-extended: bit 15
    if data.dtype == torch.float8_e5m2:
        out.copy_(codes.bitwise_left_shift_(8).view(torch.float16))         # the value
        factor = 1.0
    else:
        out.copy_(codes.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16))   # value * 2^-8
        factor = 256.0
        b = data.view(torch.uint8)                                          # NaN codes: 0x7F and 0xFF
        if not nan_free and b.numel() and (int(b.max()) == 0xFF or int(data.view(torch.int8).max()) == 0x7F):
            out[(b & 0x7F) == 0x7F] = float("nan")
    if m is None:
        if factor != 1.0:
            out.mul_(factor)
    elif factor != 1.0 and bool((m.abs() >= 2.0 ** 119).any()):
        out.mul_(factor).mul_(m)
    else:
        out.mul_(m * factor if factor != 1.0 else m)
    return out


def fp8_blocks_to_float32(data: torch.Tensor, block_mult: torch.Tensor, block: tuple[int, int],
                          out: Optional[torch.Tensor] = None, nan_free: bool = False) -> torch.Tensor:
    """``ScaledTensor.dequantize(torch.float32)``'s rule, bit for bit, in fewer passes: float32(data) times the
    multiplier of each (r, c) block, for contiguous float8 ``data`` (M, K) and ``block_mult`` (M/r, K/c) float32.

    The codes are read through FP16 bits as in ``fp8_to_float32``, written into ``out`` (a contiguous float32
    (M, K) buffer the caller no longer needs, e.g. the quantizer's scaled copy, so nothing new is allocated),
    and the E4M3 path's 2^8 is folded into the block multipliers (``_upcast_into``: float32(code) * m is the one
    product it was). NaN codes are set to NaN first, as the rule does; ``nan_free=True`` (the caller knows there
    is none: every block amax was a number) skips that search. Returns out, shaped (M, K).
    """
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not data.is_contiguous() or data.dim() != 2:
        raise TypeError("fp8_blocks_to_float32 takes contiguous 2-D float8_e4m3fn or float8_e5m2 data, got "
                        f"{data.dtype} of shape {tuple(data.shape)}")
    M, K = data.shape
    r, c = block
    out = torch.empty(M, K, dtype=torch.float32, device=data.device) if out is None else out.view(M, K)
    m = block_mult.float()[:, None, :, None]                                # (M/r, 1, K/c, 1) fp32
    (gm, gk) = scaled.grid((M, K), block)
    blocks = (gm, r, gk, c)                                        # each block times its multiplier
    _upcast_into(data.view(blocks), out.view(blocks), m, nan_free)
    return out


def cpu_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``tensor.scaled_mm(a, b, scale_a, scale_b, out_dtype)`` bit for bit (what ``torch._scaled_mm`` computes on a
    CPU for per-tensor scales): ``(float32(a) * scale_a) @ (float32(b) * scale_b)`` in FP32, rounded once to
    ``out_dtype``, with the fast upcast. a: (M, K) float8, b: (K, N) float8 (any of the layouts ``_scaled_mm`` takes)."""
    # _scaled_mm makes both FP32 operands row-major before its GEMM (for small shapes the layout changes the
    # bits); so does this, on the 1-byte codes, before the upcast
    out = torch.mm(fp8_to_float32(a.contiguous(), scale_a), fp8_to_float32(b.contiguous(), scale_b))   # (M, N) fp32
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def dequantize(st: ScaledTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``ScaledTensor.dequantize(st, dtype)`` bit for bit: the compiled pass (``fp8_passes``) for contiguous E4M3 data to float32,
    else the fast upcast (``fp8_to_float32``) times each block's multiplier: this step's kernel there (E5M2 data,
    other dtypes, no numba), the only fast path, kept."""
    if (dtype or st.orig_dtype) == torch.float32 and takes(st.data, torch.float8_e4m3fn) \
            and st.data.is_contiguous():
        return fp8_passes.dequantize_fp8(st.data, st.block, st.block_scale_inv())
    x = block_view(fp8_to_float32(st.data), st.block) * expand(st.block_scale_inv(), st.block)  # fp32
    return x.reshape(st.shape).to(st.orig_dtype if dtype is None else dtype)
