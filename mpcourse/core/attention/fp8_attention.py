"""FP8 attention, the rule: causal scaled-dot-product attention, forward and backward, with each tensor in FP8
under its own per-tensor scale.

Sources: Transformer Engine ``DotProductAttention`` with ``fp8_dpa`` / ``fp8_mha`` (computed by cuDNN's fused FP8
attention; ``transformer_engine/pytorch/attention/dot_product_attention``: the meta slots QKV, S, O forward and dO,
dP, dQKV backward); cuDNN frontend's Python reference of its FP8 SDPA (``test/python/sdpa/fp8_ref.py``,
``compute_ref`` / ``compute_ref_backward``); FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), whose FP8
attention is forward only. Every product is computed as an FP8 tensor core computes it: the FP8 codes upcast
exactly, one FP32 GEMM (FP32 accumulation), then the product of the two operands' descales (``fp8_matmul``).

The tensors ("roles") and their formats (``Format.HYBRID``: E4M3 forward, E5M2 backward; ``Format.E4M3``: E4M3
everywhere). Shapes per (batch, head): Q, K (T, d), V (T, d_v), S and P (T, T)::

    role  tensor                     pass      TE slot  amax recorded
    q k v Q, K, V                    forward   QKV      of each
    s     P, the softmax output      both      S        max of the P the forward casts
    o     O, the output              forward   O        of O before its cast
    do    dO, the output gradient    backward  dO       of dO
    dp    dS = P * (dP - D) * scale  backward  dP       of dS
    dq dk dv  dQ, dK, dV             backward  dQKV     of each

Forward (``attention_forward``)::

    Q8, K8, V8 = cast(Q), cast(K), cast(V)
    S  = fp8_matmul(Q8, K8^T) * attn_scale                       FP32; -inf above the diagonal (causal)
    online softmax over blocks of ``kv_block`` keys (cuDNN's reference, FlashAttention):
        m' = max(m, rowmax(S_blk));  c = exp(m - m');  O = O * c;  l = l * c
        P_blk = exp(S_blk - m')                                  FP32, in [0, 1], not normalized
        l = l + rowsum(P_blk)                                    (from the FP32 P)
        O = O + fp8_matmul(cast(P_blk, scale_s), V8[blk])
    O = O / max(l, 1);  O8 = cast(O, scale_o);  lse = m + log(l) (kept for the backward)

Backward (``attention_backward``; P is recomputed from the forward's lse, as cuDNN's kernel and reference do)::

    dO8 = cast(dO);  S as in the forward;  P = exp(S - lse)      (normalized)
    dV = fp8_matmul(cast(P, scale_s)^T, dO8)                     the forward's scale_s
    dP = fp8_matmul(dO8, V8^T)
    D  = rowsum(float32(O8 codes) * float32(dO8 codes)) * (descale_o * descale_do)
    dS = P * (dP - D) * attn_scale;  dS8 = cast(dS, scale_dP)
    dQ = fp8_matmul(dS8, K8);  dK = fp8_matmul(dS8^T, Q8);  dQ8, dK8, dV8 = cast(dQ), cast(dK), cast(dV)

The blocks of keys are ``p_blocks`` (running max, rescale factor, P_blk per block); ``quantize_p_blocks`` is P's
cast alone, every block's codes side by side (lesson 14's exercise, graded against it).

Blocks of keys versus whole rows. ``kv_block=None`` computes the softmax over whole rows first and casts the
*normalized* P = softmax(S) (what TE's unfused FP8 emulation, ``UnfusedDotProductAttention`` with
``FP8EmulationFunc``, does). ``kv_block=128`` (the default, cuDNN's ``BLOCK``) casts each block's *unnormalized*
P_blk = exp(S_blk - m'), relative to the running maximum m' of the blocks seen so far, and divides by l only after
the P @ V product, in FP32. So different numbers are rounded to FP8: a whole row rounds exp(S - m) / l (m the row's
max), a block rounds exp(S - m') (m' <= m, the max so far) and scales by exp(m' - m) / l after the product; as 1 / l
is not a power of two, the roundings differ. P's amax is at most 1 either way, and exactly 1 in blocks (each row's
largest element is exp(0)), so delayed scaling settles at scale_s = fp8_max. Measured in
``tests/core/attention/test_fp8_attention_rule.py`` (``test_blocks_versus_whole_rows``: the outputs differ, their
errors against float64 are of one size) and, in training, by the ``fp8-attention`` ablation's ``p`` and ``p-rows``.

Scales. Each role's ``RoleCast`` gives its format and its scale: a given FP32 scale (delayed scaling, or a fixed
one), or None for current scaling from the tensor itself (``tensor.quantize_current``). P's cast in blocks needs its
scale before the first block is cast, so ``s`` takes a given scale there (TE uses delayed scaling for S and dP even
under ``Float8CurrentScaling``). A role left out of ``casts`` stays FP32: with no roles at all this is plain FP32
attention (compared with ``torch.nn.functional.scaled_dot_product_attention`` in the tests).

Policies where the sources differ: the descales of a product are multiplied together first and applied once to
the FP32 result (a GEMM's alpha); cuDNN's reference multiplies them in one after another. cuDNN's test reference
takes scale_dP from the amax of dP = dO V^T; here, as in TE's unfused emulation, the ``dp`` role's amax is that of
dS, the tensor its scale is applied to. Q, K, V (and dQ, dK, dV) each have their own scale, as in cuDNN's
reference; TE shares one QKV (and one dQKV) slot among them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch

from ..quant.rules.tensor import Float8Tensor, compute_amax, fp8_dtype, fp8_to_float32, quantize_current, to_float8

FORWARD_ROLES = ("q", "k", "v", "s", "o")
BACKWARD_ROLES = ("do", "dp", "dq", "dk", "dv")
ROLES = FORWARD_ROLES + BACKWARD_ROLES
KV_BLOCK = 128          # keys per block of the online softmax (cuDNN frontend's reference, ``BLOCK``)

Operand = Union[Float8Tensor, torch.Tensor]     # an FP8 tensor, or an FP32 tensor left unquantized


@dataclass(frozen=True)
class RoleCast:
    """How one role's tensor is cast: ``fmt`` ("e4m3" / "e5m2") and ``scale`` (a float32 () tensor; None: current
    scaling from the tensor's own amax, with ``power_2_scale`` and ``amax_epsilon`` as in ``CurrentScaling``).
    ``seen``: a list that ``cast`` appends each tensor it casts to, as it was before the cast (the numerics
    inspector reads the tensors from it, ``attention.inspected``); None, the default, keeps nothing."""
    fmt: str
    scale: Optional[torch.Tensor] = None
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    seen: Optional[list] = field(default=None, compare=False, repr=False)


Casts = Mapping[str, RoleCast]


def cast(x: torch.Tensor, how: Optional[RoleCast]) -> tuple[Operand, torch.Tensor]:
    """(``x`` cast as ``how`` says, amax of ``x`` as float32 ()): a ``Float8Tensor``, or ``x`` in FP32 if ``how`` is
    None (the role is not quantized)."""
    amax = compute_amax(x)
    if how is None:
        return x.detach().float(), amax
    if how.seen is not None:
        how.seen.append(x.detach())
    if how.scale is None:
        return quantize_current(x.detach(), how.fmt, 0, how.power_2_scale, how.amax_epsilon), amax
    return to_float8(x.detach(), how.fmt, how.scale), amax


def values(a: Operand) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(float32 values, descale or None): an FP8 operand's codes upcast exactly and its ``scale_inv``."""
    if isinstance(a, Float8Tensor):
        return fp8_to_float32(a.data), a.scale_inv
    return a, None


def dequantized(a: Operand) -> torch.Tensor:
    """float32 value of an operand: ``float32(code) * scale_inv``, or the FP32 tensor itself."""
    v, d = values(a)
    return v if d is None else v * d


def transposed(a: Operand) -> Operand:
    """The operand with its last two dimensions swapped (a view)."""
    if isinstance(a, Float8Tensor):
        return Float8Tensor(a.data.transpose(-2, -1), a.scale_inv, a.orig_dtype)
    return a.transpose(-2, -1)


def keys(a: Operand, start: int, end: int) -> Operand:
    """Rows ``start:end`` (keys) of a (..., T, d) operand."""
    if isinstance(a, Float8Tensor):
        return Float8Tensor(a.data[..., start:end, :], a.scale_inv, a.orig_dtype)
    return a[..., start:end, :]


def descale_product(da: Optional[torch.Tensor], db: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """da * db in FP32 (one rounding), the one present, or None."""
    if da is None or db is None:
        return db if da is None else da
    return da * db


def fp8_matmul(a: Operand, b: Operand) -> torch.Tensor:
    """a @ b (batched, (..., M, K) @ (..., K, N) -> (..., M, N) float32) as an FP8 tensor core computes it: the codes
    upcast exactly, one FP32 GEMM (FP32 accumulation), then times descale_a * descale_b (one FP32 product). An
    unquantized operand enters as its FP32 values with no descale."""
    (av, ad), (bv, bd) = values(a), values(b)
    out = torch.matmul(av, bv)                              # (..., M, N) fp32
    d = descale_product(ad, bd)
    return out if d is None else out * d


def causal_scores(q8: Operand, k8: Operand, attn_scale: float, causal: bool) -> torch.Tensor:
    """S = fp8_matmul(Q8, K8^T) * attn_scale, (..., Tq, Tk) float32; -inf above the diagonal when ``causal``."""
    s = fp8_matmul(q8, transposed(k8)) * attn_scale         # (..., Tq, Tk) fp32
    if causal:
        tq, tk = s.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def exp_minus(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """exp(s - m), 0 where m is -inf (a row with no key yet: -inf - -inf is no number)."""
    return torch.where(m == float("-inf"), torch.zeros_like(s), torch.exp(s - m))


def softmax_pv_rows(s: torch.Tensor, v8: Operand, how_s: Optional[RoleCast]):
    """Whole rows: P = softmax(S) in FP32 (normalized), cast, then P8 @ V8. Returns (O, lse, amax_s)."""
    m = s.amax(-1, keepdim=True)                             # (..., Tq, 1)
    e = exp_minus(s, m)
    l = e.sum(-1, keepdim=True)
    p = e / l.clamp(min=1.0)                                 # l >= 1 in any row with a key; 0 in one without
    p8, amax_s = cast(p, how_s)
    return fp8_matmul(p8, v8), m + torch.log(l), amax_s


def p_blocks(s: torch.Tensor, kv_block: int):
    """The online softmax's blocks of keys: yields (start, end, m, c, p) per block of ``kv_block`` keys of S
    (..., Tq, Tk) float32, in order; the last block may be shorter. m (..., Tq, 1): the running max of the keys seen so
    far (-inf in a row with no key yet); c = exp(m_before - m), the factor that rescales what the earlier blocks
    summed; p (..., Tq, end - start) = exp(S_blk - m), FP32 in [0, 1], unnormalized, 0 where S is -inf and in a row
    with no key yet (never NaN). The P that ``softmax_pv_blocks`` casts, block by block."""
    m = torch.full((*s.shape[:-1], 1), float("-inf"), device=s.device)     # running max (..., Tq, 1)
    for start in range(0, s.shape[-1], kv_block):
        end = min(start + kv_block, s.shape[-1])
        s_blk = s[..., start:end]
        m_new = torch.maximum(m, s_blk.amax(-1, keepdim=True))
        yield start, end, m_new, exp_minus(m, m_new), exp_minus(s_blk, m_new)
        m = m_new


def quantize_p_blocks(s: torch.Tensor, scale: torch.Tensor, kv_block: int = KV_BLOCK, fmt: str = "e4m3"):
    """P as the blocked forward casts it, every block of keys side by side: (..., Tq, Tk) FP8 codes (``fmt``, E4M3 by
    default) with descale 1 / ``scale``, a ``Float8Tensor``. Block b holds ``fp8(saturate(exp(S_b - m_b) * scale))``,
    m_b the running max through block b (``p_blocks``); one scale for all blocks (lesson 14's exercise)."""
    how = RoleCast(fmt, scale)
    codes = [cast(p, how)[0].data for _, _, _, _, p in p_blocks(s, kv_block)]
    data = torch.cat(codes, -1) if codes else torch.empty(s.shape, dtype=fp8_dtype(fmt), device=s.device)
    return Float8Tensor(data, torch.as_tensor(scale, dtype=torch.float32).reciprocal(), s.dtype)


def softmax_pv_blocks(s: torch.Tensor, v8: Operand, how_s: Optional[RoleCast], kv_block: int):
    """Online softmax over blocks of ``kv_block`` keys (``p_blocks``), each block's unnormalized P cast with one
    scale (cuDNN's reference). Returns (O, lse, amax_s): O (..., Tq, d_v), lse (..., Tq, 1), amax_s the largest P
    cast."""
    if how_s is not None and how_s.scale is None:
        raise ValueError("P cast in blocks needs its scale before the first block: give the 's' role a scale (TE "
                         "uses delayed scaling for S even under Float8CurrentScaling), or use kv_block=None")
    d_v = values(v8)[0].shape[-1]
    m = torch.full((*s.shape[:-1], 1), float("-inf"), device=s.device)     # running max (..., Tq, 1)
    l = torch.zeros_like(m)                                                  # running sum
    o = torch.zeros((*s.shape[:-1], d_v), device=s.device)                 # (..., Tq, d_v) fp32
    amax_s = torch.zeros((), device=s.device)
    for start, end, m, c, p in p_blocks(s, kv_block):   # c = exp(m_before - m): 0 before any key (O, l are 0 there)
        o, l = o * c, l * c
        l = l + p.sum(-1, keepdim=True)                                      # p: (..., Tq, blk) fp32, <= 1
        p8, a = cast(p, how_s)
        amax_s = torch.maximum(amax_s, a)
        o = o + fp8_matmul(p8, keys(v8, start, end))
    return o / l.clamp(min=1.0), m + torch.log(l), amax_s


@dataclass
class ForwardResult:
    """What the forward computed and keeps for the backward: the operands as cast (``q8``, ``k8``, ``v8``, ``o8``),
    ``lse`` (..., Tq, 1) float32, and each role's ``amax`` (float32 ())."""
    q8: Operand
    k8: Operand
    v8: Operand
    o8: Operand
    lse: torch.Tensor
    amax: dict

    @property
    def out(self) -> torch.Tensor:
        """O as the next layer reads it: the dequantized FP8 O (or the FP32 O)."""
        return dequantized(self.o8)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, casts: Casts, *, attn_scale: float,
                      causal: bool = True, kv_block: Optional[int] = KV_BLOCK) -> ForwardResult:
    """The forward (module docstring). q, k: (..., T, d); v: (..., T, d_v); ``casts``: {role: RoleCast} of the
    quantized roles (``FORWARD_ROLES``); ``kv_block``: keys per block (None: whole rows)."""
    amax = {}
    q8, amax["q"] = cast(q, casts.get("q"))
    k8, amax["k"] = cast(k, casts.get("k"))
    v8, amax["v"] = cast(v, casts.get("v"))
    s = causal_scores(q8, k8, attn_scale, causal)                            # (..., Tq, Tk) fp32
    if kv_block is None:
        o, lse, amax["s"] = softmax_pv_rows(s, v8, casts.get("s"))
    else:
        o, lse, amax["s"] = softmax_pv_blocks(s, v8, casts.get("s"), kv_block)
    o8, amax["o"] = cast(o, casts.get("o"))
    return ForwardResult(q8, k8, v8, o8, lse, amax)


def row_dot(o8: Operand, do8: Operand) -> torch.Tensor:
    """D = rowsum(O * dO), (..., Tq, 1) float32: the FP32 values summed, then times descale_o * descale_do."""
    (ov, od), (gv, gd) = values(o8), values(do8)
    d = (ov * gv).sum(-1, keepdim=True)
    s = descale_product(od, gd)
    return d if s is None else d * s


def attention_backward(do: torch.Tensor, fwd: ForwardResult, casts: Casts, *, attn_scale: float,
                       causal: bool = True):
    """The backward (module docstring): (dq, dk, dv, amax) with dq, dk, dv float32 (dequantized where cast) and
    amax {role: float32 ()} of the backward roles. ``casts`` holds the backward roles and ``s`` (P in the dV
    product, with the forward's scale)."""
    amax = {}
    do8, amax["do"] = cast(do, casts.get("do"))
    s = causal_scores(fwd.q8, fwd.k8, attn_scale, causal)                   # the forward's S, recomputed
    p = exp_minus(s, fwd.lse)                                                 # (..., Tq, Tk) normalized
    p8, _ = cast(p, casts.get("s"))
    dv = fp8_matmul(transposed(p8), do8)                                      # (..., Tk, d_v)
    dp = fp8_matmul(do8, transposed(fwd.v8))                                  # (..., Tq, Tk)
    ds = p * (dp - row_dot(fwd.o8, do8)) * attn_scale
    ds8, amax["dp"] = cast(ds, casts.get("dp"))
    dq = fp8_matmul(ds8, fwd.k8)                                              # (..., Tq, d)
    dk = fp8_matmul(transposed(ds8), fwd.q8)                                  # (..., Tk, d)
    grads = []
    for role, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        g8, amax[role] = cast(g, casts.get(role))
        grads.append(dequantized(g8))
    return (*grads, amax)
