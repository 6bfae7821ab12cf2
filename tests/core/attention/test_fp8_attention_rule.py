"""The FP8 attention rule (mpcourse.core.attention.fp8_attention), forward and backward, against three oracles:

* bit for bit, an independent reference written here in the same order of operations (cuDNN frontend's
  ``fp8_ref.py`` order: online softmax over key blocks, P cast per block, O divided by l after P @ V; backward from
  P = exp(S - lse)), its casts done by ml_dtypes (OCP FP8, round to nearest even) and its scales by numpy;
* within a bound derived from the formats' half-ulps, a float64 reference computed from the same FP8 inputs;
* ``torch.nn.functional.scaled_dot_product_attention`` and its gradients when nothing is quantized.
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.attention.fp8_attention import (BACKWARD_ROLES, FORWARD_ROLES, ROLES, RoleCast,
                                                   attention_backward, attention_forward, values)

ML = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
FORMATS = {"HYBRID": ("e4m3", "e5m2"), "E4M3": ("e4m3", "e4m3")}
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}         # half an ulp, relative, for normal values
ABS = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}       # half the smallest subnormal, in scaled units
B, H, T = 2, 2, 40                                    # T: two full blocks of 16 and a partial one


# ------------------------------------------------------------------------------------------- the reference
def ref_cast(x, fmt, scale=None):
    """(float32 codes, float32 descale) of ``x`` under per-tensor scaling: numpy scale, ml_dtypes cast."""
    dtype, top = ML[fmt]
    a = np.asarray(x.detach().float().numpy(), dtype=np.float32)
    amax = np.float32(np.abs(a).max()) if a.size else np.float32(0)
    if scale is None:
        scale = np.float32(top) / amax if (amax > 0 and np.isfinite(amax)) else np.float32(1.0)
    scale = np.float32(scale)
    y = np.clip(a * scale, -top, top).astype(dtype).astype(np.float32)
    return torch.from_numpy(y), torch.tensor(np.float32(1.0) / scale)


def ref_forward(q, k, v, fmts, scales, attn_scale, kv_block, cast_o=True, in_turn=False):
    """Returns (O8 codes, O descale, lse, operands); ``cast_o=False``: O in FP32 (descale 1); ``in_turn``: each
    product's descales applied one after the other, as cuDNN's fp8_ref.py does, instead of their product."""
    f32 = torch.tensor(np.float32(attn_scale))
    (qc, dq), (kc, dk), (vc, dv) = (ref_cast(t, fmts[0], scales.get(r)) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    s = torch.matmul(qc, kc.transpose(-2, -1)) * (dq * dk) * f32
    s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, torch.tensor(float("-inf")))
    if kv_block is None:
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        l = e.sum(-1, keepdim=True)
        pc, ds_ = ref_cast(e / l, fmts[0], scales.get("s"))
        o = torch.matmul(pc, vc) * (ds_ * dv)
    else:
        m = torch.full((B, H, T, 1), float("-inf"))
        l, o = torch.zeros(B, H, T, 1), torch.zeros(B, H, T, vc.shape[-1])
        for start in range(0, T, kv_block):
            blk = s[..., start:start + kv_block]
            m_new = torch.maximum(m, blk.amax(-1, keepdim=True))
            c = torch.exp(m - m_new)               # m = -inf only before the first block, where o = l = 0
            o, l = o * c, l * c
            p = torch.exp(blk - m_new)
            l = l + p.sum(-1, keepdim=True)
            pc, ds_ = ref_cast(p, fmts[0], scales["s"])
            pv = torch.matmul(pc, vc[..., start:start + kv_block, :])
            o = o + (pv * dv * ds_ if in_turn else pv * (ds_ * dv))
            m = m_new
        o = o / l
    if not cast_o:
        return o, torch.tensor(1.0), m + torch.log(l), None
    oc, do_ = ref_cast(o, fmts[0], scales.get("o"))
    return oc, do_, m + torch.log(l), ((qc, dq), (kc, dk), (vc, dv))


def ref_backward(grad, q, k, v, fmts, scales, attn_scale, kv_block):
    oc, do_, lse, ((qc, dq), (kc, dk), (vc, dv)) = ref_forward(q, k, v, fmts, scales, attn_scale, kv_block)
    f32 = torch.tensor(np.float32(attn_scale))
    gc, dg = ref_cast(grad, fmts[1], scales.get("do"))
    s = torch.matmul(qc, kc.transpose(-2, -1)) * (dq * dk) * f32
    p = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), torch.exp(s - lse), torch.tensor(0.0))
    pc, ds_ = ref_cast(p, fmts[0], scales["s"] if "s" in scales else None)
    d_v = torch.matmul(pc.transpose(-2, -1), gc) * (ds_ * dg)
    d_p = torch.matmul(gc, vc.transpose(-2, -1)) * (dg * dv)
    row = (oc * gc).sum(-1, keepdim=True) * (do_ * dg)
    d_s = p * (d_p - row) * f32
    sc, dds = ref_cast(d_s, fmts[1], scales.get("dp"))
    d_q = torch.matmul(sc, kc) * (dds * dk)
    d_k = torch.matmul(sc.transpose(-2, -1), qc) * (dds * dq)
    out = []
    for g, r in ((d_q, "dq"), (d_k, "dk"), (d_v, "dv")):
        c, d = ref_cast(g, fmts[1], scales.get(r))
        out.append(c * d)
    return out


# ------------------------------------------------------------------------------------------- helpers
def inputs(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g) * s for s in (1.5, 1.0, 2.0))
    return q, k, v, torch.randn(B, H, T, d, generator=g) * 1e-3


def scales_for(scaling, q, k, v):
    """Delayed scaling: scales from an amax 30% above this step's (an earlier step's); current: None except P and
    dS, which a blocked kernel must know beforehand (what TE's CurrentScaling gives them: delayed)."""
    out = {"s": np.float32(448.0 / 1.0), "dp": np.float32(57344.0 / 3e-3)}
    if scaling == "delayed":
        for r, t in (("q", q), ("k", k), ("v", v), ("o", v)):
            out[r] = np.float32(448.0) / np.float32(1.3 * float(t.abs().max()))
        out.update(do=np.float32(900.0), dq=np.float32(3e4), dk=np.float32(2e4), dv=np.float32(5e4))
    return out


def casts_for(fmts, scales, roles=ROLES):
    return {r: RoleCast(fmts[0] if r in FORWARD_ROLES else fmts[1],
                        None if r not in scales else torch.tensor(scales[r], dtype=torch.float32)) for r in roles}


def bits(t):
    return t.contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("kv_block", [16, None])
@pytest.mark.parametrize("d", [24, 48])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_bit_for_bit_against_the_reference(fmt, scaling, d, kv_block):
    q, k, v, grad = inputs(d)
    fmts, attn_scale = FORMATS[fmt], 1.0 / math.sqrt(d)
    scales = scales_for(scaling, q, k, v)
    if kv_block is None and scaling == "current":
        scales.pop("s")                                   # whole rows: P's scale from P itself
    casts = casts_for(fmts, scales)
    fwd = attention_forward(q, k, v, casts, attn_scale=attn_scale, kv_block=kv_block)
    oc, do_, lse, _ = ref_forward(q, k, v, fmts, scales, attn_scale, kv_block)
    o_codes, o_descale = values(fwd.o8)
    assert torch.equal(bits(o_codes), bits(oc)) and torch.equal(bits(o_descale), bits(do_))
    assert torch.equal(bits(fwd.lse), bits(lse))
    assert torch.equal(bits(fwd.out), bits(oc * do_))
    got = attention_backward(grad, fwd, casts, attn_scale=attn_scale)
    want = ref_backward(grad, q, k, v, fmts, scales, attn_scale, kv_block)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want):
        assert torch.equal(bits(a), bits(b)), name
    assert all(float(x) > 0 for x in got[3].values())
    # the amaxes recorded are those of the tensors cast: Q, K, V as given, P <= 1 (exactly 1 in blocks)
    assert float(fwd.amax["q"]) == float(q.abs().max()) and float(fwd.amax["v"]) == float(v.abs().max())
    assert float(fwd.amax["s"]) == 1.0 if kv_block else 0 < float(fwd.amax["s"]) <= 1.0
    assert float(got[3]["do"]) == float(grad.abs().max())


def test_the_reference_can_fail():
    """The comparison sees the last bit: O before its cast equals the reference's, and differs from it (by FP32
    rounding only) when the reference applies the P @ V product's descales in turn, as cuDNN's fp8_ref.py does."""
    q, k, v, _ = inputs(24)
    scales = scales_for("delayed", q, k, v)
    casts = casts_for(FORMATS["HYBRID"], scales, roles=("q", "k", "v", "s"))
    fwd = attention_forward(q, k, v, casts, attn_scale=24 ** -0.5, kv_block=16)
    same = ref_forward(q, k, v, FORMATS["HYBRID"], scales, 24 ** -0.5, 16, cast_o=False)[0]
    in_turn = ref_forward(q, k, v, FORMATS["HYBRID"], scales, 24 ** -0.5, 16, cast_o=False, in_turn=True)[0]
    assert torch.equal(bits(fwd.out), bits(same))
    assert not torch.equal(fwd.out, in_turn)
    torch.testing.assert_close(fwd.out, in_turn, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- float64 bound
def f64(a):
    v, d = values(a)
    return v.double() if d is None else v.double() * d.double()


def f64_attention(q, k, v, grad, attn_scale, o_given=None):
    """Exact (float64) attention and its gradients from the given (dequantized) tensors, no cast in between;
    ``o_given``: the forward's O, which D = rowsum(O * dO) reads (an input of the backward, as dO is)."""
    s = (q @ k.transpose(-2, -1)) * attn_scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    if grad is None:
        return o, p
    o = o if o_given is None else o_given
    d_s = p * (grad @ v.transpose(-2, -1) - (o * grad).sum(-1, keepdim=True)) * attn_scale
    return d_s @ k, d_s.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad, p, d_s


@pytest.mark.parametrize("kv_block", [16, None])
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_within_the_format_bound_of_float64(fmt, kv_block):
    """Forward: O (not cast) from the same FP8 Q, K, V differs from float64 attention only by P's cast:
    |O - O64| <= sum_j (r P_ij + a / scale_s) |V_jd| (r, a: E4M3's relative and absolute half-ulp; a block's P is
    relative to a running max <= the row max and l >= 1, so the same bound holds per block). Backward: each
    gradient from the same FP8 Q, K, V, O, dO within the error its casts (P, dS, the output) can make."""
    fmts, attn_scale = FORMATS[fmt], 24 ** -0.5
    q, k, v, grad = inputs(24, seed=3)
    scales = {"s": np.float32(448.0), "dp": np.float32({"e5m2": 57344.0, "e4m3": 448.0}[fmts[1]] / 3e-3)}
    casts = casts_for(fmts, scales, roles=("q", "k", "v", "s", "do", "dp", "dq", "dk", "dv"))
    fwd = attention_forward(q, k, v, casts, attn_scale=attn_scale, kv_block=kv_block)
    q64, k64, v64 = f64(fwd.q8), f64(fwd.k8), f64(fwd.v8)
    o64, p64 = f64_attention(q64, k64, v64, None, attn_scale)
    r, a = REL[fmts[0]], ABS[fmts[0]] / 448.0
    bound = (r * p64 + a * p64.gt(0)) @ v64.abs()
    err = (fwd.out.double() - o64).abs()
    assert (err <= bound * (1 + 1e-4) + 1e-6).all() and err.max() > 0
    assert float((err / bound.clamp(min=1e-30)).max()) > 0.05          # the bound is not vacuous

    dq, dk, dv, amax = attention_backward(grad, fwd, casts, attn_scale=attn_scale)
    g64 = f64(attention_forward(grad, grad, grad, {"q": casts["do"]}, attn_scale=1.0).q8)   # dO8 as the rule casts it
    dq64, dk64, dv64, p64, ds64 = f64_attention(q64, k64, v64, g64, attn_scale, f64(fwd.o8))
    rb = REL[fmts[1]]
    ab_ds = ABS[fmts[1]] / float(scales["dp"])
    err_ds = rb * ds64.abs() + ab_ds * p64.gt(0) + 1e-6 * ds64.abs().max()
    err_p = r * p64 + a * p64.gt(0)
    for got, want, step in ((dq, dq64, err_ds @ k64.abs()), (dk, dk64, err_ds.transpose(-2, -1) @ q64.abs()),
                            (dv, dv64, err_p.transpose(-2, -1) @ g64.abs())):
        # the output's own cast (current scaling): relative rb, absolute below its smallest subnormal
        out_cast = rb * (want.abs() + step) + ABS[fmts[1]] * float(want.abs().max()) / ML[fmts[1]][1]
        assert ((got.double() - want).abs() <= step * (1 + 1e-4) + out_cast + 1e-7).all()


# ------------------------------------------------------------------------------------------- nothing quantized
@pytest.mark.parametrize("kv_block", [16, None])
@pytest.mark.parametrize("d", [24, 48])
def test_equal_to_torch_sdpa_when_nothing_is_quantized(d, kv_block):
    """No roles: FP32 attention. Against torch's SDPA (math backend on a CPU), forward and gradients, within
    FP32 rounding: atol 1e-5, rtol 1e-5 (the two sum in different orders; measured: at most 1e-6 on O, 5e-6 on
    the gradients)."""
    from mpcourse.core.attention.layer import FP8DotProductAttention

    q, k, v, _ = inputs(d, seed=1)
    grad = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(9))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = FP8DotProductAttention(roles=(), kv_block=kv_block)(*leaves)
    want = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.backward(grad)
    want.backward(grad)
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_not_causal_equals_torch_sdpa():
    q, k, v, _ = inputs(24, seed=2)
    fwd = attention_forward(q, k, v, {}, attn_scale=24 ** -0.5, causal=False, kv_block=16)
    torch.testing.assert_close(fwd.out, torch.nn.functional.scaled_dot_product_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- blocks vs rows
def test_blocks_versus_whole_rows():
    """Casting each block's unnormalized P (cuDNN) and casting the normalized softmax (whole rows) round different
    numbers: the outputs differ, both stay within the E4M3 bound of float64, and their errors are of one size."""
    q, k, v, _ = inputs(48, seed=4)
    casts = casts_for(FORMATS["HYBRID"], {"s": np.float32(448.0)}, roles=("q", "k", "v", "s"))
    outs = {kb: attention_forward(q, k, v, casts, attn_scale=48 ** -0.5, kv_block=kb) for kb in (16, 40, 128, None)}
    assert torch.equal(outs[40].out, outs[128].out)                 # one block holding every key: the same numbers
    assert not torch.equal(outs[16].out, outs[None].out) and not torch.equal(outs[128].out, outs[None].out)
    o64, _ = f64_attention(f64(outs[None].q8), f64(outs[None].k8), f64(outs[None].v8), None, 48 ** -0.5)
    rel = {kb: float((o.out.double() - o64).norm() / o64.norm()) for kb, o in outs.items()}
    assert all(1e-4 < e < 2 ** -4 for e in rel.values()), rel
    assert max(rel.values()) < 3 * min(rel.values()), rel


def test_refusals():
    q, k, v, _ = inputs(24)
    with pytest.raises(ValueError, match="needs its scale before the first block"):
        attention_forward(q, k, v, {"s": RoleCast("e4m3")}, attn_scale=0.2, kv_block=16)
    assert set(FORWARD_ROLES) | set(BACKWARD_ROLES) == set(ROLES) and len(ROLES) == 10


# ------------------------------------------------------------------------------------------- P's blocks alone
@pytest.mark.parametrize("kv_block", [1, 16, 40, 128])
@pytest.mark.parametrize("scale", [448.0, 16.0, 1.0, 1000.0])
def test_quantize_p_blocks_is_what_the_forward_casts(kv_block, scale):
    """``quantize_p_blocks`` (lesson 14's exercise) equals, bit for bit, the reference's per-block cast (ml_dtypes,
    running max through each block), with a first block masked whole in some rows and one row masked everywhere:
    no NaN, masked keys code 0; and the forward's O is the product of those very codes."""
    from mpcourse.core.attention.fp8_attention import causal_scores, p_blocks, quantize_p_blocks

    q, k, v, _ = inputs(24, seed=5)
    s = causal_scores(q, k, 24 ** -0.5, True)
    s[0, 0, 20:, :17] = float("-inf")                 # rows 20.. see no key in the first block(s)
    s[1, 1, 7, :] = float("-inf")                     # a row with no key at all
    got = quantize_p_blocks(s, torch.tensor(scale), kv_block)
    parts = []
    m = torch.full((B, H, T, 1), float("-inf"))
    for start in range(0, T, kv_block):
        blk = s[..., start:start + kv_block]
        m_new = torch.maximum(m, blk.amax(-1, keepdim=True))
        p = torch.where(m_new == float("-inf"), torch.zeros_like(blk), torch.exp(blk - m_new))
        parts.append(ref_cast(p, "e4m3", scale)[0])
        m = m_new
    want = torch.cat(parts, -1)
    assert got.data.dtype == torch.float8_e4m3fn and got.data.shape == s.shape
    assert torch.equal(bits(got.data.float()), bits(want))
    assert not got.data.float().isnan().any() and bool((got.data.float()[s == float("-inf")] == 0).all())
    assert len(list(p_blocks(s, kv_block))) == -(-T // kv_block)
    assert float(got.scale_inv) == float(np.float32(1.0) / np.float32(scale))
