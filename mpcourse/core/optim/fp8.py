"""FP8 optimizer state: a moment stored as blockwise-scaled ``float8_e4m3fn`` codes, as torchao's ``AdamWFp8``.

torchao 0.18, ``torchao/optim/subclass_fp8.py`` (``quantize_fp8``, ``OptimStateFp8.dequantize``) and
``torchao/optim/adam.py`` (``AdamWFp8``, ``_AdamBase._new_buffer``) define the storage this module states as a
rule:

* the moment (any shape, ``numel`` a multiple of ``block_size``; default 256) is read flat in blocks of
  ``block_size`` consecutive elements;
* each block has one FP32 scale ``amax(|block|) / 448`` (448 = E4M3's largest finite value; an all-zero block's
  amax is clipped to 1e-12 first), so the block's largest magnitude lands on 448;
* the codes are ``block / scale`` cast to E4M3 (round to nearest even; torch's cast);
* dequantize: ``codes.float() * scale``.

torchao stores both AdamW moments with this rule, the second moment as it is (not its square root), so E4M3's
sign bit is spent on a value that is never negative. The course's default stores ``sqrt(v)`` with the same rule and
gives a positive value that would round to 0 E4M3's smallest positive code instead (``nonzero_fp8_codes``); why, in
``mpcourse.core.optim.blockwise``. Tensors with fewer than 4096 elements or a ``numel`` that is not a multiple of
the block size are not quantized at all (torchao follows bitsandbytes there). 1 byte per element plus 4 bytes per
block: 1 + 4/256 = 1.016 bytes, whichever rule.
"""
from __future__ import annotations

import torch

from ..formats import get_format

E4M3 = get_format("e4m3")
BLOCK_SIZE = 256
AMAX_FLOOR = 1e-12        # an all-zero block gets this amax (no division by zero)
SMALLEST_CODE = E4M3.min_subnormal  # E4M3's smallest positive value, 2**-9 (subnormal, bits 0x01)


def fp8_state_scale(amax: torch.Tensor) -> torch.Tensor:
    """The blocks' amax (B,) fp32 -> their scales (B,) fp32: ``amax`` clipped to 1e-12, over 448."""
    return amax.clamp_min(AMAX_FLOOR) / E4M3.max


def quantize_fp8_state(x: torch.Tensor, block_size: int = BLOCK_SIZE,
                       scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, fp32, numel % block_size == 0) -> (codes float8_e4m3fn shaped like x,
    scale fp32 (numel // block_size,)). The block's amax maps to 448. ``scale``: the blocks' scales when part of
    a block lies elsewhere (a sharded moment, ``mpcourse.core.optim.shards``); None: from ``x``'s own blocks."""
    blocks = x.reshape(-1, block_size)                                        # (B, block)
    if scale is None:
        scale = fp8_state_scale(blocks.abs().amax(-1))                         # (B,)
    codes = (blocks / scale[:, None]).to(E4M3.torch_dtype)                     # (B, block) e4m3, nearest even
    return codes.reshape(x.shape), scale


def dequantize_fp8_state(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes e4m3 any shape, scale fp32 (B,)) -> fp32 shaped like codes: ``codes * scale`` per block."""
    blocks = codes.float().reshape(scale.numel(), -1)                          # (B, block)
    return (blocks * scale[:, None]).reshape(codes.shape)


def nonzero_fp8_codes(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``codes`` (float8_e4m3fn) of ``x`` (same shape) with every positive ``x`` that rounded to 0 given E4M3's
    smallest positive code (2**-9) instead: a stored moment is 0 only where its value is 0 (or negative)."""
    tiny = torch.tensor(SMALLEST_CODE, dtype=codes.dtype, device=codes.device)
    return torch.where((x > 0) & (codes.float() == 0), tiny, codes)
