"""What a token's row becomes on the wire between ranks in expert parallelism: the dispatch and the combine as rules.

Under expert parallelism each rank holds E / world experts; the rows a rank's tokens route to another rank's experts
travel there (the *dispatch*, an all-to-all), and the experts' outputs travel back (the *combine*). A row is one
(token, expert) assignment: a token routed to k experts is sent once per expert (torchtitan's layout; DeepSeek-V3
sends a token once per node and copies it there, which saves bytes this rule does not count). Each trip has a *wire
format* (``WIRES``)::

    wire   what travels, per row of C values                                 bytes per row
    fp8    E4M3 codes of the row in 1x128 tiles + one FP32 scale_inv per tile    C + 4 * C / 128   (C / 128 = 1 if C
           (power-of-two scales, the quantization of DeepSeek-V3's                                  is no multiple)
           FP8 Fprop operand), sent as uint8 bytes: the codes' bits,
           then the scales' bits
    bf16   the row rounded to BF16 (round to nearest even)                      2 * C
    fp32   the row as it is (exact)                                              4 * C

A *dispatch mode* (``DISPATCH_MODES``) names the wire of each direction. The direction, not the pass, decides:
a trip towards the experts (the forward dispatch, and in the backward the gradient of the experts' output, the
"backward dispatch") takes ``to_experts``; a trip back to the tokens' rank (the forward combine, and in the
backward the gradient of the dispatched rows, the "backward combine") takes ``from_experts``::

    mode   to_experts   from_experts
    fp8    fp8          bf16            DeepSeek-V3 (arXiv 2412.19437, 3.3.3): activations quantized to FP8 before the
                                        dispatch, and the activation gradient before the MoE down-projection too;
                                        forward and backward combine kept BF16
    bf16   bf16         bf16            the BF16 dispatch the FP8 one is measured against
    fp32   fp32         fp32            exact: expert parallelism changes no bit of what crosses

On arrival a row is decoded to the sender's dtype (``decode``): the FP8 codes times their tile's scale_inv, computed
in FP32 (exact: an E4M3 value times a power of two) and cast to that dtype. So the receiving experts see exactly
``round_trip(rows, wire)`` and their own format quantizes those values as it does in one process. For the FP8
experts of ``fp8-rowwise`` and ``fp8-block`` (power-of-two scales, E4M3) that re-quantization gives back the
dispatch's E4M3 values: a row's amax after the trip may round down to the next power of two, and then the codes come
back doubled with half the scale, the same values (the tests check the values).

One process runs the same rule with ``to_experts`` / ``from_experts`` (``RoundTrip``): the rows cross no wire but
take the same encode and decode at the same points, forward and backward, so an expert-parallel run can be compared
with one process bit for bit where the arithmetic allows (``core.experts.expert_parallel``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.rules.blockwise import quantize_fp32_scaled
from ..quant.rules.scaled import ScaledTensor

WIRES = ("fp8", "bf16", "fp32")
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: DeepSeek-V3's activation tile along the hidden dimension (1x128)
TILE = 128


@dataclass(frozen=True)
class DispatchMode:
    """The wire of each direction (see the module docstring): ``to_experts`` (forward dispatch, backward dispatch of
    the output gradient) and ``from_experts`` (forward combine, backward combine of the input gradient)."""

    name: str
    to_experts: str
    from_experts: str


DISPATCH_MODES = {m.name: m for m in (DispatchMode("fp8", "fp8", "bf16"), DispatchMode("bf16", "bf16", "bf16"),
                                      DispatchMode("fp32", "fp32", "fp32"))}


def dispatch_mode(mode) -> DispatchMode:
    """``DISPATCH_MODES[mode]`` for a name (a ``DispatchMode`` is returned as it is); ValueError naming the rest."""
    if isinstance(mode, DispatchMode):
        return mode
    if mode not in DISPATCH_MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}: use one of {', '.join(DISPATCH_MODES)}")
    return DISPATCH_MODES[mode]


def tile_width(dim: int) -> int:
    """Columns per FP8 scale of a row of ``dim`` values: 128 (DeepSeek-V3's 1x128 tile) when it divides ``dim``,
    else the whole row (one scale per token)."""
    return TILE if dim % TILE == 0 else dim


def bytes_per_row(dim: int, wire: str) -> int:
    """Bytes one row of ``dim`` values takes on ``wire`` (codes and scales; the module docstring's table)."""
    if wire == "fp8":
        return dim + 4 * (dim // tile_width(dim))
    return dim * WIRE_DTYPES[wire].itemsize


def encode(rows: torch.Tensor, wire: str) -> torch.Tensor:
    """rows (A, C) float -> what travels: (A, ``bytes_per_row``) uint8 for fp8 (the E4M3 codes' bits, then the FP32
    scale_inv bits of each tile), (A, C) bfloat16 / float32 otherwise."""
    if wire == "fp8":
        q = quantize_fp32_scaled(rows, (1, tile_width(rows.shape[1])), "e4m3", power_2_scale=True)
        return torch.cat([q.data.view(torch.uint8), q.scale_inv.contiguous().view(torch.uint8)], dim=1)
    return rows.to(WIRE_DTYPES[wire]).contiguous()


def decode(sent: torch.Tensor, wire: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``encode`` sent, (A, *) -> (A, ``dim``) ``dtype``: the FP8 codes times their tile's scale_inv in FP32,
    then cast (exact for FP32 and BF16); the BF16 / FP32 rows cast."""
    if wire == "fp8":
        codes = sent[:, :dim].contiguous().view(torch.float8_e4m3fn)                      # (A, C)
        scale_inv = sent[:, dim:].contiguous().view(torch.float32)                        # (A, C / tile)
        return ScaledTensor(codes, scale_inv, (1, tile_width(dim)), "e4m3", None, dtype).dequantize()
    return sent.to(dtype)


def round_trip(rows: torch.Tensor, wire: str) -> torch.Tensor:
    """rows (A, C) as the receiving rank sees them after ``wire``: ``decode(encode(rows))`` in rows' dtype."""
    return decode(encode(rows, wire), wire, rows.shape[1], rows.dtype)


class RoundTrip(torch.autograd.Function):
    """One process's stand-in for a trip over the wire: forward ``round_trip(rows, wire)``, backward
    ``round_trip(grad, back)`` (the gradient travels the other way, on the other direction's wire)."""

    @staticmethod
    def forward(ctx, rows, wire: str, back: str):
        ctx.back = back
        return round_trip(rows, wire)

    @staticmethod
    def backward(ctx, grad):
        return round_trip(grad.contiguous(), ctx.back), None, None


def to_experts(rows: torch.Tensor, mode) -> torch.Tensor:
    """rows (A, C) as the experts' rank receives them under dispatch ``mode`` (gradient: the backward combine)."""
    mode = dispatch_mode(mode)
    return RoundTrip.apply(rows, mode.to_experts, mode.from_experts)


def from_experts(rows: torch.Tensor, mode) -> torch.Tensor:
    """Expert outputs (A, C) as the tokens' rank receives them (gradient: the backward dispatch)."""
    mode = dispatch_mode(mode)
    return RoundTrip.apply(rows, mode.from_experts, mode.to_experts)
