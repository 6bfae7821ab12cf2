"""The per-tensor FP8 kernels: the amax and the saturating downcast, each equal bit for bit to the rule it names.

* ``compute_amax(x)``: ``tensor.compute_amax``.
* ``to_float8(x, fp8_format, scale, saturate)``: ``tensor.to_float8`` (lesson 07's ``quantize`` inside it).
* ``saturating_cast(y, dtype, top)``: the quantizers' clamp-then-cast (``tensor.quantize``'s, ``scaled.cast_elements``'
  for FP8), without the clamp where torch's own cast saturates (``E4M3_CAST_SATURATES``: E4M3 in torch 2.13,
  checked at import on both sides of 448, inf and NaN).

Contiguous float32 CPU tensors take the compiled passes (``fp8_passes``) where ``jit.takes`` says so. Checked by
``tests/core/quant/kernels/test_quant_fused.py`` and ``test_quant_fastpath.py``.
"""
from __future__ import annotations

import torch

from ...formats import FORMATS
from ..rules import tensor
from . import fp8_passes
from .jit import takes


def saturating_cast(y: torch.Tensor, dtype: torch.dtype, top: float) -> torch.Tensor:
    """``y.clamp_(-top, top).to(dtype)``: the quantizers' saturating cast of their float32 scratch ``y`` (clamped in
    place), without the clamp where torch's own cast saturates by itself (E4M3 on a CPU, ``E4M3_CAST_SATURATES``),
    which changes no bit."""
    if dtype == torch.float8_e4m3fn and E4M3_CAST_SATURATES and y.device.type == "cpu":
        return y.to(dtype)
    return y.clamp_(-top, top).to(dtype)


def _cast_saturates(dtype: torch.dtype, top: float) -> bool:
    """Whether torch's CPU cast to ``dtype`` already saturates every finite and infinite value beyond +-top (torch
    2.13 does for E4M3; older releases gave NaN): then clamping first changes no bit. Checked on the values that
    matter: top and the next FP32 above it, a dense grid up to 2 * top (the next E4M3 value, 480, and the
    midpoint, 464, included), the FP32 extremes, inf and NaN, of both signs. The quantizers use it on CPU
    tensors only."""
    t = torch.tensor(top, dtype=torch.float32)
    v = torch.cat([torch.linspace(top, 2 * top, 4097), torch.nextafter(t, t + 1)[None], t[None] * (1 + 1 / 28),
                   torch.tensor([1e30, 3.4e38, float("inf"), float("nan")])])
    v = torch.cat([v, -v])
    return torch.equal(v.to(dtype).view(torch.uint8), v.clamp(-top, top).to(dtype).view(torch.uint8))


E4M3_CAST_SATURATES = _cast_saturates(torch.float8_e4m3fn, FORMATS["e4m3"].max)


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """``tensor.compute_amax(x)`` bit for bit: the compiled pass (``fp8_passes.block_amax`` over the whole tensor) for a
    contiguous float32 CPU tensor, else max |x| = max(-min x, max x) from one reading pass (``aminmax``) instead of
    abs (a written copy) then amax; the final abs turns the -0.0 of an all-zero tensor into the 0.0 that max |x|
    gives. Both are exact, NaN propagates. The ``aminmax`` body is this step's kernel wherever the compiled pass
    does not run (bfloat16 inputs, no numba): the only fast path there, kept."""
    if x.numel() == 0:
        return tensor.compute_amax(x)
    if takes(x, torch.float32, None) and x.dim() >= 1 and x.is_contiguous():
        x2 = x.detach().reshape(-1, x.shape[-1])                               # (M, K) view
        return fp8_passes.block_amax(x2, tuple(x2.shape)).reshape(())
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(lo.neg(), hi).abs().float()


def to_float8(x: torch.Tensor, fp8_format, scale, saturate: bool = True) -> "tensor.Float8Tensor":
    """``tensor.to_float8(x, fp8_format, scale, saturate)`` bit for bit (lesson 07's ``quantize`` inside it): the
    saturating cast of a contiguous float32 CPU tensor in the compiled pass (``fp8_passes``); every other call
    (another dtype or layout, no numba, the non-saturating conversion) is the rule's own."""
    if saturate and takes(x, torch.float32, None) and x.dim() >= 1 and x.is_contiguous():
        name, dtype, top, scale, source = tensor.cast_arguments(x, fp8_format, scale)
        x2 = x.detach().reshape(-1, x.shape[-1])                                # (M, K) fp32 view
        data, _ = fp8_passes.quantize_fp8(x2, tuple(x2.shape), scale.detach().reshape(1, 1), fp8_format=name)
        return tensor.Float8Tensor(data.reshape(x.shape), scale.reciprocal(), x.dtype, source)
    return tensor.to_float8(x, fp8_format, scale, saturate)                     # the rule itself

