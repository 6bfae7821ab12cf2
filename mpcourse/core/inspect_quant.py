"""What a recipe's quantizer does to one tensor: underflow, saturation, block dynamic range, MSE and relative error,
for every recipe the library knows (the "what-if" statistics of Transformer Engine's debug API), computed with the
engine's own quantizers so that the numbers are the ones training would see.

``quantized_stats(x, q)`` reads one tensor ``x`` (M, K) and its quantization ``q`` (a ``Float8Tensor`` from a
per-tensor quantizer, or a ``ScaledTensor`` from a block quantizer). Fractions are of the nonzero finite elements
of x (the inspector's convention, ``mpcourse.core.inspect``), 0.0 when there are none::

    underflow       x != 0 and its quantized element is 0: the value is lost (TE ``underflows%``: "non-zero
                    elements of tensor clipped to 0 after quantization", LogFp8TensorStats / LogNvfp4TensorStats,
                    counted there as count_nonzero(x) - count_nonzero(data)). Under a block format this is the
                    block's rule, not the tensor's: a small value next to a large one in its own block of 16, 32
                    or 128 elements flushes, the same value in a block of small ones does not.
    saturation      |x| lies past the overflow point of its block, |x| > (max + ulp/2) * m_b (>= where the tie
                    rounds up), with max the element format's largest value, ulp its spacing at the top, m_b the
                    block's decode multiplier (scale_inv; NVFP4: the E4M3 block scale times the FP32 tensor
                    scale): the saturating cast clipped it to +-max, where a non-saturating (OCP) cast would give
                    inf or NaN. TE's ``overflows%`` (LogFp8TensorStats, delayed scaling only) counts
                    |x| > fp8_max * scale_inv, which also takes the band (max, max + ulp/2], values that round to
                    max anyway; the course leaves that band out so that the amax element of a current-scaled
                    tensor, whose scale_inv is 1/scale rounded, is never counted for an ulp.
    block_dynamic_range   the largest log2(block amax) - log2(smallest nonzero |x| of the block) over the blocks
                    that hold a nonzero (TE ``max_blockwise_dynamic_range``), in binades; the whole tensor is one
                    block under per-tensor scaling
    mse             mean((x - dequantized)^2) over the finite elements (TE ``mse``)
    rel_error       ||x - dequantized|| / ||x|| over the finite elements (0 for an all-zero x)
    scale_inv_min, scale_inv_max   the smallest and largest finite block decode multiplier m_b (TE
                    ``scale_inv_min/max``; a block holding a NaN has a NaN scale under MX, left out)
    nonfinite_out   finite elements of x that dequantize to inf or NaN (NVFP4 turns a tensor holding an inf into NaNs)

``WHAT_IFS`` names the recipes (the rows of ``mpcourse compare`` that quantize: their fields and defaults): each
role's quantizer is ``engine.quantizer(recipe, role)``, the one training builds, and the copy measured is the one
the role's first GEMM reads (TE's rowwise copy): x and W along K for the forward GEMM, dy along N for the input
gradient (``axis=1``). The inspector's roles map to the quantizers' (``QUANTIZER_ROLE``): activation -> "input",
weight -> "weight", output_grad -> "grad_output"; a weight gradient is no GEMM operand and gets none.
``run_quantizer(module, role)`` is the layer's own quantizer where it has one (``Float8Linear.quantizers``): its
statistics are the run's own (TE's unprefixed stats), delayed scaling's scale included.

NVFP4 rounds gradients stochastically from torch's global generator; ``WhatIfQuantizers.stats`` quantizes inside
``torch.random.fork_rng``, so inspecting never moves a run's random stream (a run with the inspector trains bit for
bit as without it), and each recipe draws the numbers the layer's own cast draws next: recorded just before a
layer's backward, the NVFP4 what-if of an NVFP4 layer's output gradient is the copy training makes, bit for bit.

Sources: NVIDIA/TransformerEngine ``transformer_engine/debug/features/log_fp8_tensor_stats.py``,
``log_nvfp4_tensor_stats.py`` and ``utils/stats_computation.py`` (the statistics and their definitions);
``debug/features/autoswitch_gemm.py`` (underflow and MSE of the quantized tensor as the switch's metrics).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .formats import FORMATS
from .quant.block_recipes import (BlockRecipe, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                                  NVFP4BlockScaling, block_for)
from .quant.engine import quantizer as build_quantizer
from .quant.layers.fp8_weights import Float8WeightLinear
from .quant.recipe import CurrentScaling, Format, Recipe
from .quant.rules.scaled import ScaledTensor, block_view, expand, resolve_block
from .quant.rules.tensor import Float8Tensor


class WhatIf(NamedTuple):
    """A recipe the inspector quantizes each tensor with, whatever the run uses, and which roles it applies to."""
    recipe: Recipe
    roles: tuple[str, ...]
    description: str


ALL_ROLES = ("input", "weight", "grad_output")
#: every recipe the library quantizes GEMM operands with, as ``mpcourse compare``'s rows configure it
WHAT_IFS: dict[str, WhatIf] = {
    "fp8-current": WhatIf(CurrentScaling(fp8_format=Format.HYBRID), ALL_ROLES,
                          "per-tensor current scaling, E4M3 forward, E5M2 gradients (TE Float8CurrentScaling)"),
    "fp8-rowwise": WhatIf(Float8RowwiseScaling(), ALL_ROLES, "E4M3, a power-of-two scale per row (torchao rowwise)"),
    "fp8-block": WhatIf(Float8BlockScaling(), ALL_ROLES,
                        "E4M3, 1x128 tiles (x, dy) and 128x128 blocks (W), power-of-two scales (TE Float8BlockScaling)"),
    "mxfp8": WhatIf(MXFP8BlockScaling(), ALL_ROLES, "E4M3 in blocks of 32 sharing an E8M0 scale, RCEIL (TE MXFP8)"),
    "mxfp8-floor": WhatIf(MXFP8BlockScaling(scale_rule="floor"), ALL_ROLES,
                          "MXFP8 with the OCP spec's floor scale rule (a block max up to 2x E4M3's max saturates)"),
    "mxfp8-e5m2": WhatIf(MXFP8BlockScaling(fp8_format=Format.HYBRID), ("grad_output",),
                         "MXFP8 HYBRID: E5M2 gradients in blocks of 32 (on x and W it is mxfp8)"),
    "nvfp4": WhatIf(NVFP4BlockScaling(), ALL_ROLES, "E2M1, E4M3 scale per 16 (16x16 for W) and an FP32 tensor "
                    "scale, gradients rounded stochastically (TE NVFP4BlockScaling)"),
}
#: the inspector's role names -> the quantizers' (``mpcourse.core.quant.ROLES``); other tensors (e.g. attention's Q,
#: K, V, P: "input"; dO, dP: "grad_output") name theirs to ``Inspector.observe(..., as_role=...)``
QUANTIZER_ROLE = {"activation": "input", "weight": "weight", "output_grad": "grad_output"}
STATISTICS = ("underflow", "saturation", "block_dynamic_range", "mse", "rel_error", "scale_inv_min",
              "scale_inv_max", "nonfinite_out")


def overflow_point(fmt: str) -> tuple[float, bool]:
    """(the midpoint between ``fmt``'s max and the next step above it, whether that tie rounds up): round to
    nearest even sends a value past it to inf/NaN in a non-saturating cast. E4M3 (464, False), E5M2 (61440, True),
    E2M1 (7, True)."""
    f = FORMATS[fmt]
    step = 2.0 ** (math.floor(math.log2(f.max)) - f.mantissa_bits)     # the spacing of the top binade
    return f.max + step / 2, int(f.max / step) % 2 == 1


def zero_codes(data: torch.Tensor) -> torch.Tensor:
    """Which elements of a float8 container (E4M3, E5M2, or E2M1 held in E4M3) are +0 or -0: all bits but the
    sign clear (TE's ``count_nonzero_fp8`` reads the same bytes). Read from the bytes, not upcast: faster, exact."""
    return (data.view(torch.uint8) & 0x7F) == 0


def _decoded(q) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], str]:
    """(multiplier per block (M/r, K/c) fp32, dequantized (M, K) fp32, block, element format) of a quantized
    tensor."""
    if isinstance(q, Float8Tensor):
        m = q.scale_inv.float().reshape(1, 1)                            # (1, 1): the whole tensor is one block
        return m, q.dequantize(torch.float32), tuple(q.shape), q.fp8_format
    if isinstance(q, ScaledTensor):
        return q.block_scale_inv(), q.dequantize_fp32(), q.block, q.elem_format
    raise TypeError(f"quantized_stats takes a Float8Tensor or a ScaledTensor, got {type(q).__name__}")


def block_dynamic_range(a: torch.Tensor, block: tuple[int, int]) -> float:
    """max over blocks holding a nonzero of log2(block amax) - log2(block min nonzero), binades; a: |x| (M, K)
    fp32 with no inf or NaN."""
    v = block_view(a, block)                                               # (M/r, r, K/c, c)
    top = v.amax(dim=(1, 3))
    low = v.masked_fill(v == 0, math.inf).amin(dim=(1, 3))
    held = top > 0
    if not bool(held.any()):
        return 0.0
    return float((torch.log2(top[held]) - torch.log2(low[held])).max())


def _count(mask: torch.Tensor) -> int:
    return int(torch.count_nonzero(mask))            # a bool tensor's sum() is far slower on a CPU


class Operand:
    """What the statistics of one tensor x (M, K) share across recipes, computed once: x in FP32, |x| with
    inf/NaN read as 0 (``finite``: their mask, None when there are none), the nonzero mask and count, ||x||, and
    the block dynamic range per block shape (``dynamic_range``, cached)."""

    def __init__(self, x: torch.Tensor):
        self.xf = x.detach().float()
        a = self.xf.abs()                                                  # (M, K) fp32
        self.finite = None if bool(torch.isfinite(a.amax())) else torch.isfinite(a)
        self.a = a if self.finite is None else torch.where(self.finite, a, 0.0)
        self.nz = self.a > 0
        self.n_nonzero = _count(self.nz)
        self.n = max(self.n_nonzero, 1)
        self.norm = float(self.a.norm())
        self.n_finite = a.numel() if self.finite is None else _count(self.finite)
        self._ranges: dict[tuple[int, int], float] = {}

    def dynamic_range(self, block: tuple[int, int]) -> float:
        if block not in self._ranges:
            self._ranges[block] = block_dynamic_range(self.a, block)
        return self._ranges[block]


@torch.no_grad()
def quantized_stats(x: torch.Tensor, q, operand: Optional[Operand] = None) -> dict:
    """The statistics (module docstring) of ``x`` (M, K), any float dtype, against its quantization ``q``
    (``operand``: ``Operand(x)`` if already made, shared by the recipes of one tensor)."""
    m, deq, block, fmt = _decoded(q)
    o = operand if operand is not None else Operand(x)
    mid, tie_up = overflow_point(fmt)
    top = mid * expand(m, block)                                           # (M/r, 1, K/c, 1) the overflow point
    blocks = block_view(o.a, block)                                        # (M/r, r, K/c, c); a zero is never past
    past = _count((blocks >= top) if tie_up else (blocks > top))           # (m_b > 0: NVFP4's t = 0 has a = 0)
    err = o.xf - deq                                                       # (M, K) fp32
    sq = float(torch.linalg.vector_norm(err)) ** 2                          # the squared error, summed
    clean = o.finite is None and math.isfinite(sq)                          # no inf or NaN in x or its copy
    if clean:
        lost = _count(zero_codes(q.data)) - (o.a.numel() - o.n_nonzero)    # a zero of x is a zero of its copy
        bad = 0
    else:
        ok = torch.isfinite(o.xf) & torch.isfinite(deq)
        sq = float(torch.linalg.vector_norm(torch.where(ok, err, 0.0))) ** 2
        lost = _count(o.nz & zero_codes(q.data))
        bad = _count(torch.isfinite(o.xf) & ~torch.isfinite(deq))
    scales = m.reshape(-1)
    scales = scales[torch.isfinite(scales)] if not bool(torch.isfinite(scales).all()) else scales
    return {"elem_format": fmt, "block": list(block),
            "underflow": lost / o.n,
            "saturation": past / o.n,
            "block_dynamic_range": o.dynamic_range(tuple(block)),
            "mse": sq / max(o.n_finite, 1),
            "rel_error": math.sqrt(sq) / o.norm if o.norm > 0 else 0.0,
            "scale_inv_min": float(scales.min()) if scales.numel() else 0.0,
            "scale_inv_max": float(scales.max()) if scales.numel() else 0.0,
            "nonfinite_out": bad}


def quantize_as_training(quantizer, x2d: torch.Tensor):
    """``x2d`` (M, K) quantized by ``quantizer`` as the role's first GEMM reads it: a per-tensor quantizer's cast
    (nothing recorded: a delayed-scaling state is read, never changed), a block quantizer's copy along K (axis 1)."""
    if getattr(quantizer, "per_tensor", False):
        return quantizer(x2d, False)
    return quantizer(x2d, 1)


def applicable(recipe: Recipe, role: str, shape) -> Optional[str]:
    """Why ``recipe`` cannot quantize a ``role`` tensor of ``shape`` (M, K) as training would, or None."""
    if not isinstance(recipe, BlockRecipe):
        return None
    try:
        resolve_block(tuple(shape), block_for(recipe, role, 1))
    except ValueError as e:
        return str(e).split(":")[0]
    return None


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K), contiguous, as a linear layer flattens its input (a 1-D tensor is one row)."""
    return t.detach().reshape(-1, t.shape[-1]).contiguous() if t.dim() else t.detach().reshape(1, 1)


class WhatIfQuantizers:
    """The engine's quantizer of each (what-if, role), built once and reused (they keep no state)."""

    def __init__(self, names=tuple(WHAT_IFS)):
        unknown = [n for n in names if n not in WHAT_IFS]
        if unknown:
            raise ValueError(f"unknown what-if recipe(s) {unknown}: choose from {list(WHAT_IFS)}")
        self.names = tuple(names)
        self._built: dict[tuple[str, str], object] = {}

    def get(self, name: str, role: str):
        key = (name, role)
        if key not in self._built:
            self._built[key] = build_quantizer(WHAT_IFS[name].recipe, role)
        return self._built[key]

    @torch.no_grad()
    def stats(self, t: torch.Tensor, role: str, own=None) -> tuple[dict, dict]:
        """({name: quantized_stats}, {name: why not}) of tensor ``t`` in quantizer role ``role`` under every
        what-if that applies to the role, plus "run" (``own``, the layer's own quantizer) when given. Each
        quantization draws its random numbers (NVFP4's stochastic rounding) from its own fork of the caller's
        stream (``fork_rng``): the stream does not move, and a recipe draws what the layer would draw next."""
        x = as_2d(t)
        out, skipped = {}, {}
        if x.numel() == 0:
            return out, skipped
        todo = [("run", own)] if own is not None else []
        for name in self.names:
            w = WHAT_IFS[name]
            if role not in w.roles:
                continue
            why = applicable(w.recipe, role, x.shape)
            if why is not None:
                skipped[name] = why
            else:
                todo.append((name, self.get(name, role)))
        devices = [x.device] if x.device.type == "cuda" else []
        operand = Operand(x)
        for name, q in todo:
            with torch.random.fork_rng(devices=devices):     # each draws what the layer's own cast would draw
                out[name] = quantized_stats(x, quantize_as_training(q, x), operand)
        return out, skipped


def run_quantizer(module, role: str):
    """The module's own quantizer of quantizer role ``role`` (``Float8Linear.quantizers``), or None: a layer that
    computes in high precision (an ``nn.Linear``, a ``Float8Linear`` switched high), or one whose weight is stored in FP8 (``Float8WeightLinear``: the stored copy is
    not re-quantized from a high-precision weight, so there is no cast to measure)."""
    if getattr(module, "high_precision", False) or (isinstance(module, Float8WeightLinear) and role == "weight"):
        return None
    qs = getattr(module, "quantizers", None)
    return qs.get(role) if isinstance(qs, dict) else None
