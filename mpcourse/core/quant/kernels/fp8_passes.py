"""The compiled FP8 passes for CPU tensors (``loops``' FP8 loops, given tensors' memory), each equal bit for bit to a rule.

* ``block_amax(x, block)``: ``scaled.block_amax`` (and ``tensor.compute_amax`` as one block).
* ``quantize_fp8(x, block, mult, divide, dequant, fp8_format)``: the saturating cast of ``tensor.to_float8``,
  ``blockwise.encode_fp32_scaled`` (x * scale) and ``mx.encode_mx`` (x / 2^k), with ``dequant`` also
  ``ScaledTensor.dequantize``'s float32 copy, in one pass.
* ``dequantize_fp8(data, block, mult)``: ``ScaledTensor.dequantize`` to float32 and ``tensor.fp8_to_float32``.
* ``pow2_scale``, ``rceil_scale_inv``: ``tensor.compute_scale(..., power_2_scale=True)`` and 2^k of
  ``mx.mx_shared_exponent(..., "rceil")`` on the grid of blocks.

Called by the kernels (``per_tensor``, ``blocks``, ``upcast``) where ``jit.takes`` says a tensor fits; the inputs
are 2-D (or flat) float32 / float8 CPU tensors. ``tests/core/quant/kernels/test_quant_fused.py`` checks each
against its rule.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...formats import FORMATS
from .jit import AVAILABLE, FP8_NAMES, check_grid, np_view

if AVAILABLE:
    from . import loops


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``scaled.block_amax(x, block)``: (M/r, K/c) float32 max |x| per resolved block, NaN propagating.
    x: (M, K) float32 on the CPU (``jit.takes``)."""
    x = x.detach().contiguous()
    r, c = block
    check_grid(x, block)
    out = torch.empty(x.shape[0] // r, x.shape[1] // c, dtype=torch.int32)
    loops.amax_bits(np_view(x.view(torch.int32)), r, c, np_view(out))
    return out.view(torch.float32)



def quantize_fp8(x: torch.Tensor, block: tuple[int, int], mult: torch.Tensor, divide: bool = False,
                 dequant: Optional[torch.Tensor] = None, fp8_format: str = "e4m3"):
    """(data (M, K) float8, its float32 dequantization or None): ``fp8(saturate(x * mult))`` per block, rounded to
    nearest even (``divide``: x / mult, MX's rule), and with ``dequant`` the copy float32(data) * dequant.
    x: (M, K) float32 on the CPU (``jit.takes``); mult, dequant: (M/r, K/c) float32 (the blocks' scales and
    dequantization multipliers); fp8_format "e4m3" or "e5m2"."""
    x = x.detach().contiguous()
    M, K = x.shape
    r, c = block
    keep = dequant is not None
    check_grid(x, block, mult, *([dequant] if keep else []))
    codes = torch.empty(M, K, dtype=torch.uint8)
    out = torch.empty(M if keep else 1, K, dtype=torch.float32)
    mult = mult.float().contiguous()                # locals: np_view's views need their tensors alive
    dequant = dequant.float().contiguous() if keep else mult
    loops.QUANTIZE[fp8_format, bool(divide), keep](np_view(x), r, c, np_view(mult), np_view(dequant), np_view(codes), np_view(out))
    return codes.view(FORMATS[fp8_format].torch_dtype), (out if keep else None)


def dequantize_fp8(data: torch.Tensor, block: tuple[int, int], mult: torch.Tensor) -> torch.Tensor:
    """``float32(data) * mult`` per block, (M, K) float32: ``ScaledTensor.dequantize``'s rule (and the FP8 upcast
    times a per-tensor scale, ``upcast.fp8_to_float32``) for contiguous 2-D float8_e4m3fn (E4M3, or E2M1 values
    in that container) or float8_e5m2 ``data`` on the CPU and (M/r, K/c) float32 ``mult``."""
    data, mult = data.contiguous(), mult.float().contiguous()             # locals, alive for np_view's views
    M, K = data.shape
    check_grid(data, block, mult)
    out = torch.empty(M, K, dtype=torch.float32)
    loops.DEQUANTIZE[FP8_NAMES[data.dtype]](np_view(data.view(torch.uint8)), block[0], block[1], np_view(mult), np_view(out))
    return out


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``blocks.pow2_scale(amax, fp8_max)`` for float32 CPU ``amax`` (any shape), one compiled pass."""
    a = amax.contiguous()
    out = torch.empty_like(a)
    loops.pow2_scale_loop(np_view(a.view(-1)), np.float32(fp8_max), np_view(out.view(-1)))
    return out


def rceil_scale_inv(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """``blocks.rceil_scale_inv(amax, elem_max)`` for float32 CPU ``amax`` (any shape), one compiled pass."""
    a = amax.contiguous()
    out = torch.empty_like(a)
    loops.rceil_scale_inv_loop(np_view(a.view(-1)), np.float32(elem_max), np_view(out.view(-1)))
    return out
