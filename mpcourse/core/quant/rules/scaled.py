"""A scaled tensor of any granularity: low-precision data plus one scale per block, and its quantizers.

One container for every scaling the field uses (2-D tensors (M, K); a block of ``(rows, cols)`` elements
shares one scale, ``-1`` meaning the whole dimension):

    granularity             block        data       scales                        source
    tensorwise              (-1, -1)     E4M3/E5M2  () FP32                       TE DelayedScaling / current
    rowwise / colwise       (1, -1)      E4M3/E5M2  (M, 1) / (1, K) FP32, pow2    torchao ``rowwise``
    1x128 tiles             (1, 128)     E4M3       (M, K/128) FP32, pow2         DeepSeek-V3 3.3.1, TE Float8BlockScaling
    128x128 blocks          (128, 128)   E4M3       (M/128, K/128) FP32, pow2     same (weights)
    MX                      (1, 32)      E4M3 ...   (M, K/32) E8M0                OCP MX v1.0 section 6.3
    NVFP4                   (1, 16)      E2M1       (M, K/16) E4M3 + () FP32      NVIDIA NVFP4 (arXiv 2509.25149)

``scale_inv`` is always the *dequantization* multiplier, stored in its own format: float32 for FP8 scaling,
``torch.float8_e8m0fnu`` for MX, ``torch.float8_e4m3fn`` for NVFP4 (times ``tensor_scale_inv``, FP32)::

    dequantize = float32(data) * float32(scale_inv)[block]  (* tensor_scale_inv for NVFP4)

FP4 and FP6 values are held one per byte in a ``torch.float8_e4m3fn`` container: every E2M1, E2M3 and E3M2
value is exactly an E4M3 value (packing two FP4 values per byte is a storage detail this course leaves out;
``bits_per_element`` counts the real width). Padding rule: none. A dimension that a block does not divide
raises ValueError naming the block; the course's GPT has widths and token counts that are multiples of 128.

The rules here (``block_amax``, ``cast_elements``, ``ScaledTensor.dequantize``) are plain torch; their kernels are
``kernels.blocks.block_amax``, ``blocks.cast_elements`` and ``kernels.upcast.dequantize`` (numba's passes in ``kernels.fp8_passes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...formats import FORMATS, round_to
from .tensor import FP8_DTYPES

ELEMENT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
#: what the MX and NVFP4 rules do at their edges (a tiny, subnormal or zero amax): "course", the default, decodes
#: every block within its element format's error wherever the scales can represent it (``mx.quantize_mx``,
#: ``nvfp4.quantize_nvfp4`` say how); "torchao" is what torchao 0.18 computes there, bit for bit, kept reachable
#: for the oracle tests against it
EDGES = ("course", "torchao")
CONTAINER = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e3m2": torch.float8_e4m3fn,
              "e2m3": torch.float8_e4m3fn, "e2m1": torch.float8_e4m3fn}
SCALE_BITS = {"fp32": 32, "e8m0": 8, "e4m3": 8}


def resolve_block(shape, block) -> tuple[int, int]:
    """The block (rows, cols) for a 2-D ``shape``, -1 replaced by the dimension; ValueError if it does not divide.

    An empty dimension (size 0) is divided by any block; a -1 block along it resolves to 0 and still counts as
    one block (``grid``), so an empty tensor gets the scales the per-tensor path gives it: one per whole-dimension
    block (scale 1.0 from amax 0), none along an empty dimension cut into fixed-size blocks. A resolved block
    resolves to itself (a 0 along an empty dimension is that whole dimension)."""
    if len(shape) != 2:
        raise ValueError(f"block scaling takes 2-D (M, K) tensors, got shape {tuple(shape)}: reshape to (-1, K) first")
    if not isinstance(block, (tuple, list)) or len(block) != 2 or any(
            not isinstance(n, int) or isinstance(n, bool) or (n < 1 and n != -1 and (n, d) != (0, 0))
            for n, d in zip(block, shape)):
        got = tuple(block) if isinstance(block, (tuple, list)) else repr(block)
        raise ValueError(f"a block is (rows, cols) of positive ints or -1 (the whole dimension), got {got}")
    rows, cols = (shape[0] if block[0] == -1 else block[0]), (shape[1] if block[1] == -1 else block[1])
    if shape[0] % max(rows, 1) or shape[1] % max(cols, 1):
        raise ValueError(f"a {block[0]}x{block[1]} block does not divide shape {tuple(shape)}: pad the dimension "
                         f"to a multiple of the block (no padding is done here) or use a coarser granularity "
                         "(rowwise and tensorwise take any shape)")
    return rows, cols


def check_edges(edges: str) -> None:
    """ValueError unless ``edges`` names one of ``EDGES``."""
    if edges not in EDGES:
        raise ValueError(f"edges must be one of {EDGES} (the course's rule, or torchao's numbers), got {edges!r}")


def grid(shape, block: tuple[int, int]) -> tuple[int, int]:
    """(M/r, K/c): the number of blocks along each dimension of a resolved ``block`` (a 0-row block: one)."""
    return tuple(n // b if b else 1 for n, b in zip(shape, block))


def block_view(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(M, K) -> (M/r, r, K/c, c) view (x must be contiguous or a transpose of a contiguous tensor)."""
    (gm, gk), (r, c) = grid(x.shape, block), block
    return x.reshape(gm, r, gk, c)


def check_floating(x: torch.Tensor) -> None:
    """TypeError for what a quantizer cannot take: an integer, boolean or FP8 tensor (the per-tensor path's rule)."""
    if not x.is_floating_point() or x.dtype in FP8_DTYPES.values():
        raise TypeError(f"quantize takes a float32/bfloat16/float16 tensor, got {x.dtype}: convert it with .float() "
                        "(an FP8 tensor: dequantize() it first)")


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| of each block: (M/r, K/c) float32 (NaN propagates; 0 for an empty block, as ``compute_amax``)."""
    check_floating(x)
    if x.numel() == 0:
        return torch.zeros(grid(x.shape, block), dtype=torch.float32, device=x.device)
    return block_view(x.detach().float().abs(), block).amax(dim=(1, 3))


def expand(s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(M/r, K/c) -> (M/r, 1, K/c, 1), to broadcast over ``block_view``."""
    return s[:, None, :, None]


def block_multiplier(scale_inv: torch.Tensor, tensor_scale_inv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(M/r, K/c) float32 dequantization multiplier of each block: float32(scale_inv) (times the FP32
    ``tensor_scale_inv``, NVFP4's second level)."""
    s = scale_inv.float()
    return s if tensor_scale_inv is None else s * tensor_scale_inv


@dataclass
class ScaledTensor:
    """Low-precision ``data`` (M, K) plus one scale per ``block`` (see the module docstring).

    Fields: data (M, K) float8 container; scale_inv (M/r, K/c) float32 / float8_e8m0fnu / float8_e4m3fn;
    block (r, c) resolved; elem_format ("e4m3", "e5m2", "e2m1", ...); tensor_scale_inv () float32 or None
    (NVFP4's second level); orig_dtype (the dtype before quantization); dequantized: None, or the float32
    ``dequantize()`` kept by a quantizer called with ``keep_fp32=True`` (the emulated GEMM's operand, computed
    once with the quantization: ``dequantize_fp32``). It is not an init field, so ``dataclasses.replace`` starts
    without it; a ScaledTensor's fields are not to be reassigned once it holds one (the copy would go stale).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    elem_format: str
    tensor_scale_inv: Optional[torch.Tensor] = None
    orig_dtype: torch.dtype = torch.float32
    dequantized: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def scale_format(self) -> str:
        return {torch.float32: "fp32", torch.float8_e8m0fnu: "e8m0", torch.float8_e4m3fn: "e4m3"}[self.scale_inv.dtype]

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, scales included (MXFP8: 8 + 8/32 = 8.25; NVFP4: 4 + 8/16 = 4.5, plus the
        tensor scale's 32 bits over the whole tensor)."""
        n = self.data.numel()
        bits = FORMATS[self.elem_format].bits * n + SCALE_BITS[self.scale_format] * self.scale_inv.numel()
        if self.tensor_scale_inv is not None:
            bits += 32
        return bits / n

    def block_scale_inv(self) -> torch.Tensor:
        """(M/r, K/c) float32 multiplier of each block (NVFP4: the E4M3 scale times the FP32 tensor scale)."""
        return block_multiplier(self.scale_inv, self.tensor_scale_inv)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """float32(data) times each block's multiplier, rounded to ``dtype`` (default: ``orig_dtype``)."""
        x = block_view(self.data.float(), self.block) * expand(self.block_scale_inv(), self.block)  # fp32
        return x.reshape(self.shape).to(self.orig_dtype if dtype is None else dtype)

    def dequantize_fp32(self) -> torch.Tensor:
        """``dequantize(torch.float32)``: the copy kept at quantization when there is one (the same bits, from a
        kernels of ``kernels/``), else computed now. Read it, do not write it: it may be that copy."""
        return self.dequantize(torch.float32) if self.dequantized is None else self.dequantized

    def t(self) -> "ScaledTensor":
        """The transpose (K, M): a view of the data, the block and the scale grid transposed."""
        out = ScaledTensor(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]), self.elem_format,
                           self.tensor_scale_inv, self.orig_dtype)
        out.dequantized = None if self.dequantized is None else self.dequantized.t()
        return out


def cast_elements(y: torch.Tensor, elem: str, rounding: str = "nearest",
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Saturating cast of fp32 ``y`` to ``elem``, returned in its float8 container (NaN stays NaN where it can)."""
    if elem in FP8_DTYPES and rounding == "nearest":
        top = FORMATS[elem].max
        return y.clamp(-top, top).to(FP8_DTYPES[elem])     # in range: the cast only rounds (to nearest even)
    return round_to(y, elem, rounding=rounding, saturate=True, generator=generator).to(CONTAINER[elem])
