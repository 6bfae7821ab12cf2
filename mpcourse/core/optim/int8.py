"""8-bit optimizer state: blockwise dynamic quantization (Dettmers et al. 2021), as torchao's ``AdamW8bit``.

Dettmers, Lewis, Shleifer, Zettlemoyer 2021, "8-bit Optimizers via Block-wise Quantization"
(arXiv 2110.02861): section 2.1 (block-wise quantization: each block of 2048 in the paper, 256 in torchao,
is normalized by its absolute maximum) and section 2.2 (dynamic quantization: a non-linear map of 256
values that spends its codes on small magnitudes). torchao 0.18's ``torchao/optim/subclass_8bit.py``
(``OptimState8bit``, block size 256) and ``torchao/optim/quant_utils.py`` (``create_dynamic_map``,
``scale_tensor``, ``quantize_8bit_with_qmap``, ``dequant_with_qmap``; the map follows bitsandbytes'
``create_dynamic_map``, originally Dettmers 2015, arXiv 1511.04561) define the exact rule stated here:

* the map (``dynamic_map``): for decades k = 0..6 (magnitudes 10^(k-6) * [0.1, 1]), split [0.1, 1] into
  2^k equal bins (signed map, also their negatives) or 2^(k+1) bins (unsigned map) and keep each bin's
  midpoint times 10^(k-6); add 0 and 1; sort. 254 + 2 = 256 values either way: the unsigned map (second moment)
  puts the sign bit to use as one more fraction bit. Edges, midpoints and the decade's factor are all FP32
  arithmetic, as in torchao, so the map is torchao's bit for bit.
* quantize: each block of ``block_size`` elements is divided by its absmax (clipped to 1e-12) and each value
  takes the code of the nearest map value (a value exactly half way goes to the larger one);
* dequantize: ``map[code] * absmax``.

1 byte per element plus 4 bytes per block: 1.016 bytes at block 256. The first moment uses the signed map,
the second moment the unsigned one (torchao stores ``v``; the course's default stores ``sqrt(v)`` and gives a
positive value that would take the code of 0 the code of the smallest positive map value instead,
``nonzero_int8_codes``; why, in ``mpcourse.core.optim.blockwise``).
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 256
DECADES = 7               # magnitudes 1e-6 .. 1 (bitsandbytes' max_exponent_bits)
ABSMAX_FLOOR = 1e-12


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values (fp32, sorted, in [-1, 1] or [0, 1]) the codes 0..255 stand for."""
    values = [torch.zeros(()), torch.ones(())]
    for k in range(DECADES):
        n_bins = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1, n_bins + 1)                             # fp32, as torchao
        mids = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (k - (DECADES - 1))   # all in fp32
        values += [mids, -mids] if signed else [mids]
    return torch.sort(torch.cat([v.reshape(-1) for v in values])).values   # (256,) fp32


def int8_state_absmax(amax: torch.Tensor) -> torch.Tensor:
    """The blocks' amax (B,) fp32 -> the absmax each block is divided by (B,) fp32: clipped to 1e-12."""
    return amax.clamp_min(ABSMAX_FLOOR)


def quantize_int8_state(x: torch.Tensor, qmap: torch.Tensor, block_size: int = BLOCK_SIZE,
                        absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, fp32, numel % block_size == 0), ``qmap`` (256,) -> (codes uint8 shaped like x,
    absmax fp32 (numel // block_size,)). Nearest map value, ties to the larger. ``absmax``: the blocks' when part
    of a block lies elsewhere (a sharded moment, ``mpcourse.core.optim.shards``); None: from ``x``'s own blocks."""
    blocks = x.reshape(-1, block_size)                                         # (B, block)
    if absmax is None:
        absmax = int8_state_absmax(blocks.abs().amax(-1))                      # (B,)
    y = blocks / absmax[:, None]                                               # in [-1, 1]
    lo = (torch.searchsorted(qmap, y, right=True) - 1).clamp(0, qmap.numel() - 1)   # largest map value <= y
    hi = (lo + 1).clamp(max=qmap.numel() - 1)
    up = (y - qmap[lo]) >= (qmap[hi] - qmap[lo]) * 0.5
    return torch.where(up, hi, lo).to(torch.uint8).reshape(x.shape), absmax


def dequantize_int8_state(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """(codes uint8 any shape, absmax fp32 (B,), qmap (256,)) -> fp32 shaped like codes."""
    blocks = qmap[codes.long()].reshape(absmax.numel(), -1)                    # (B, block)
    return (blocks * absmax[:, None]).reshape(codes.shape)


def nonzero_int8_codes(codes: torch.Tensor, x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """``codes`` (uint8) of ``x`` (same shape) in ``qmap`` with every positive ``x`` that took the code of 0 given
    the code of the smallest positive map value instead (the next code up: the map is sorted)."""
    zero = int(torch.nonzero(qmap == 0).item())                               # 0 unsigned, 127 signed
    return torch.where((x > 0) & (codes == zero), torch.full_like(codes, zero + 1), codes)
