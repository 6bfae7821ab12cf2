"""NVFP4's kernels: the quantizer, its scale levels and its random Hadamard transform, each equal bit for bit to a rule.

* ``quantize_nvfp4`` and ``encode_nvfp4``: ``nvfp4.quantize_nvfp4`` and ``nvfp4.encode_nvfp4`` (the block amaxes from
  ``blocks.block_amax``, the E2M1 rounding from ``e2m1.round_e2m1`` or the compiled pass, whose stochastic draws are
  made inside the loop from the generator's state).
* ``nvfp4_block_scales``: ``nvfp4.two_level_scales``' two levels from the block amaxes, with ``nvfp4_multipliers``
  (``nvfp4.encode_multipliers``) in one compiled pass (``nvfp4_passes``).
* ``rht(x, seed)``: ``hadamard.rht``, one batched matmul with a cached matrix.

Contiguous 2-D float32 CPU tensors take the compiled passes where ``jit.takes`` says so. Checked by
``tests/core/quant/kernels/test_quant_fused.py``, ``test_quant_fastpath.py`` and ``tests/core/quant/test_quant_tiny_amax.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..rules import hadamard, nvfp4
from ..rules.scaled import ScaledTensor, block_view, check_edges, expand, resolve_block
from . import nvfp4_passes
from .blocks import block_amax, cast_elements, fuses, keep, kept
from .jit import takes
from .upcast import fp8_to_float32


def quantize_nvfp4(x: torch.Tensor, block=(1, 16), *, tensor_amax: Optional[torch.Tensor] = None,
                   rounding: str = "nearest", generator: Optional[torch.Generator] = None,
                   keep_fp32: bool = False, edges: str = "course") -> ScaledTensor:
    """``nvfp4.quantize_nvfp4`` bit for bit (the block amaxes from ``block_amax``, both scale levels and the
    encoding multipliers from ``nvfp4_block_scales``)."""
    check_edges(edges)
    b = resolve_block(x.shape, nvfp4.check_nvfp4_block(block))
    amax_b = block_amax(x, b)                                # (M/r, K/c) fp32
    if takes(amax_b, torch.float32, None):
        t, s, recip, mult = nvfp4_block_scales(amax_b, tensor_amax, edges)     # one compiled pass
    else:                                                    # the rule itself, then its multipliers
        t, s = nvfp4.two_level_scales(x, b, tensor_amax, edges)
        recip, mult = nvfp4_multipliers(t, s, edges)
    return _encode_nvfp4(x, b, t, s, recip, mult, _preshift(t, edges), rounding, generator, keep_fp32)


def nvfp4_block_scales(amax_b: torch.Tensor, tensor_amax=None, edges: str = "course"):
    """(t, s, recip, mult) bit for bit, in one compiled pass over non-empty float32 CPU block amaxes
    (``nvfp4_passes.nvfp4_scale_pass``): ``nvfp4.two_level_scales``' two levels (t () float32 from ``given_tensor_amax`` and
    ``nvfp4_tensor_scale_inv``; s (M/r, K/c) float8_e4m3fn, 0 where the course flushes a block) and
    ``nvfp4_multipliers`` of them (``encode_nvfp4``'s). Where the pass does not run ``quantize_nvfp4`` calls the
    rule itself."""
    given = None if tensor_amax is None else nvfp4.given_tensor_amax(tensor_amax, amax_b)
    return nvfp4_passes.nvfp4_scale_pass(amax_b, given, edges == "course")


def nvfp4_multipliers(t: torch.Tensor, s: torch.Tensor, edges: str = "course") -> tuple[torch.Tensor, torch.Tensor]:
    """(recip, mult), (M/r, K/c) float32 each, bit for bit: ``nvfp4.encode_multipliers``' encode multiplier
    ((1 / t') / pre) / float32(s) (t' = t, or 1 where t is not > 0; 0 where s is 0) and ``block_multiplier(s, t)`` =
    float32(s) * t, with the block scales upcast once by ``fp8_to_float32`` (torch's E4M3 upcast is element by
    element). ``_preshift`` is the pre the encode multiplies x by first."""
    safe_t = torch.where(t > 0, t, torch.ones_like(t))
    sf = fp8_to_float32(s)
    recip = ((1.0 / safe_t) / _preshift(t, edges)) / sf
    return torch.where(sf == 0, 0.0, recip), sf * t


def _preshift(t: torch.Tensor, edges: str) -> torch.Tensor:
    """``nvfp4.encode_multipliers``' pre: () float32, ``NVFP4_ENCODE_PRESHIFT`` for a tiny tensor, else 1."""
    shift = nvfp4.tiny_tensor(t) if edges == "course" else torch.zeros((), dtype=torch.bool, device=t.device)
    return torch.where(shift, nvfp4.NVFP4_ENCODE_PRESHIFT, 1.0).to(torch.float32)


def _preshifted(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """float32 x * pre (exact, a power of two); x itself where pre is 1 on the CPU (the same bits, no pass)."""
    x32 = x.float()
    if pre.device.type == "cpu" and float(pre) == 1.0:
        return x32
    return x32 * pre


def encode_nvfp4(x: torch.Tensor, b: tuple[int, int], t: torch.Tensor, s: torch.Tensor, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None, keep_fp32: bool = False,
                 edges: str = "course") -> ScaledTensor:
    """``nvfp4.encode_nvfp4`` bit for bit: the compiled pass (``fp8_passes``) from the rule's own random draws, or ``round_e2m1``."""
    nvfp4.check_nvfp4_block(b)
    check_edges(edges)
    return _encode_nvfp4(x, b, t, s, *nvfp4_multipliers(t, s, edges), _preshift(t, edges), rounding, generator,
                         keep_fp32)


def _encode_nvfp4(x: torch.Tensor, b: tuple[int, int], t: torch.Tensor, s: torch.Tensor, recip: torch.Tensor,
                  mult: torch.Tensor, pre: torch.Tensor, rounding: str, generator: Optional[torch.Generator],
                  keep_fp32: bool):
    """``encode_nvfp4`` with its multipliers computed (``nvfp4_multipliers``): x * pre (``_preshift``) times recip
    is the encoded value, mult the kept copy's multiplier."""
    orig_dtype, fuse = x.dtype, keep_fp32 and rounding in ("nearest", "stochastic") and fuses(x)
    x = _preshifted(x, pre)                                   # (M, K) fp32
    if fuse:
        if rounding == "nearest":
            data, dq = nvfp4_passes.quantize_e2m1(x, b, recip, mult, None)
        else:     # the rule's draws (torch.randint(0, 2**62)), drawn inside the kernel from the generator's state
            data, dq = nvfp4_passes.quantize_e2m1_drawing(x, b, recip, mult, generator)
        return kept(ScaledTensor(data, s, b, "e2m1", t, orig_dtype), dq)
    y = block_view(x, b) * expand(recip, b)
    data = cast_elements(y, "e2m1", rounding, generator).reshape(x.shape)
    return keep(data, s, b, "e2m1", t, orig_dtype, y, keep_fp32)


_RHT_MATRICES: dict = {}


def rht(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``hadamard.rht(x, seed)`` bit for bit: the rule's batched GEMM, H @ each (16, K) group, with the matrix built
    once per (seed, device) instead of at every call."""
    hadamard.check_rht_shape(x)
    key = (seed, str(x.device))
    if key not in _RHT_MATRICES:
        _RHT_MATRICES[key] = hadamard.random_hadamard(16, seed).to(x.device)
    M, K = x.shape
    return torch.matmul(_RHT_MATRICES[key], x.float().reshape(M // 16, 16, K)).reshape(M, K)

