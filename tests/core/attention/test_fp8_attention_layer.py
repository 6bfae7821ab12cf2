"""FP8DotProductAttention (mpcourse.core.attention.layer): its scales follow the library's delayed-scaling rule
(``amax_and_scale_update``, TE's) on the FP8 region's schedule, current scaling keeps state only for P and dS
(as TE's DotProductAttention under Float8CurrentScaling), the layer computes what the rule computes bit for bit,
and its state round-trips through ``state_dict`` with bad checkpoints refused."""
import math

import pytest
import torch

from mpcourse.core.attention.fp8_attention import (BACKWARD_ROLES, FORWARD_ROLES, ROLES, RoleCast,
                                                   attention_backward, attention_forward)
from mpcourse.core.attention.layer import FP8DotProductAttention
from mpcourse.core.quant import CurrentScaling, DelayedScaling, Format, MXFP8BlockScaling, autocast
from mpcourse.core.quant.rules.delayed import amax_and_scale_update

B, H, T, D = 2, 2, 24, 24
DS = DelayedScaling(amax_history_len=4)


def qkv(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g) * s).to(dtype).requires_grad_() for s in (1.5, 1.0, 2.0)]


def grad_of(seed=7):
    return torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed)) * 1e-2


def snapshot(layer):
    return {r: (s.scale.clone(), s.amax_history.clone()) for r, s in layer.scaling_state.items()}


def rule_step(q, k, v, grad, casts, kv_block):
    fwd = attention_forward(q.detach(), k.detach(), v.detach(), casts, attn_scale=1 / math.sqrt(D), kv_block=kv_block)
    return fwd, attention_backward(grad, fwd, casts, attn_scale=1 / math.sqrt(D))


@pytest.mark.parametrize("kv_block", [8, None])
def test_delayed_scaling_follows_te_rule_and_equals_the_rule(kv_block):
    """Three training steps inside an FP8 region: each step's output and gradients equal the rule's with the
    scales the layer held, and every state equals TE's update (``amax_and_scale_update``) of the amaxes the rule
    reports; forward states change only when the region exits, backward states right after the backward."""
    layer = FP8DotProductAttention(DS, kv_block=kv_block)
    for step in range(3):
        q, k, v = qkv(step)
        grad = grad_of(step)
        before = snapshot(layer)
        casts = {r: RoleCast("e4m3" if r in FORWARD_ROLES else "e5m2", before[r][0]) for r in ROLES}
        fwd, (dq, dk, dv, amax_b) = rule_step(q, k, v, grad, casts, kv_block)
        with autocast(recipe=DS):
            out = layer(q, k, v)
            assert all(torch.equal(layer.scaling_state[r].scale, before[r][0]) for r in FORWARD_ROLES)
        out.backward(grad)
        assert torch.equal(out, fwd.out)
        assert all(torch.equal(a, b) for a, b in zip((q.grad, k.grad, v.grad), (dq, dk, dv)))
        amax = {**fwd.amax, **amax_b}
        for r in ROLES:
            hist = before[r][1].clone()
            hist[0] = amax[r]
            want_h, want_s = amax_and_scale_update(hist, before[r][0], 448.0 if r in FORWARD_ROLES else 57344.0)
            assert torch.equal(layer.scaling_state[r].amax_history, want_h), (step, r)
            assert torch.equal(layer.scaling_state[r].scale, want_s), (step, r)
    assert float(layer.scaling_state["s"].scale) == 448.0   # amax of P is 1: in blocks by construction, in whole
    #                                                         rows from the first query, which sees one key


def test_current_scaling_keeps_state_for_p_and_ds_only():
    """TE under Float8CurrentScaling: Q, K, V, O, dO, dQKV current; S and dP delayed with a history of 1,
    "most_recent". The layer equals the rule with those two scales given and the others computed now."""
    cs = CurrentScaling()
    layer = FP8DotProductAttention(cs, kv_block=8)
    assert set(layer.scaling_state) == {"s", "dp"}
    assert all(s.amax_history.shape == (1,) for s in layer.scaling_state.values())
    for step in range(2):
        q, k, v = qkv(step)
        before = snapshot(layer)
        casts = {r: RoleCast("e4m3" if r in FORWARD_ROLES else "e5m2", before[r][0] if r in before else None)
                 for r in ROLES}
        fwd, (dq, dk, dv, amax_b) = rule_step(q, k, v, grad_of(step), casts, 8)
        out = layer(q, k, v)
        out.backward(grad_of(step))
        assert torch.equal(out, fwd.out) and torch.equal(q.grad, dq) and torch.equal(v.grad, dv)
        assert float(layer.scaling_state["s"].scale) == 448.0
        assert torch.equal(layer.scaling_state["dp"].scale, torch.tensor(57344.0) / amax_b["dp"])


def test_no_grad_records_nothing_and_disabled_region_is_fp32():
    layer = FP8DotProductAttention(DS, kv_block=8)
    q, k, v = qkv()
    layer(q, k, v).sum().backward()
    before = snapshot(layer)
    with torch.no_grad():
        layer(q, k, v)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before.values(),
                                                                                    snapshot(layer).values()))
    with autocast(enabled=False):
        out = layer(q, k, v)
    assert torch.equal(out, FP8DotProductAttention(roles=(), kv_block=8)(q, k, v))
    assert not torch.equal(out, layer(q, k, v))


def test_forward_only_fp8_backward_is_fp32_attention():
    """fp8_dpa_bwd=False (TE NVTE_FP8_DPA_BWD=0; FlashAttention-3's FP8 is forward only): the forward is FP8, the
    gradients those of FP32 attention at the same inputs, bit for bit."""
    fwd_only = FP8DotProductAttention(DS, kv_block=8, fp8_dpa_bwd=False)
    fp32 = FP8DotProductAttention(roles=(), kv_block=8)
    a, b = qkv(), qkv()
    oa, ob = fwd_only(*a), fp32(*b)
    assert not torch.equal(oa, ob)
    oa.backward(grad_of())
    ob.backward(grad_of())
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b))
    assert all(float(fwd_only.scaling_state[r].scale) == 1.0 for r in BACKWARD_ROLES)   # no backward cast ran


def test_roles_subset_fixed_scale_and_dtypes():
    layer = FP8DotProductAttention(DS, roles=("s",), fixed_scales={"s": 16.0}, kv_block=8)
    assert layer.scaling_state == {}
    q, k, v = qkv()
    fwd = attention_forward(q.detach(), k.detach(), v.detach(), {"s": RoleCast("e4m3", torch.tensor(16.0))},
                            attn_scale=1 / math.sqrt(D), kv_block=8)
    assert torch.equal(layer(q, k, v), fwd.out)
    qb, kb, vb = qkv(dtype=torch.bfloat16)
    out = FP8DotProductAttention(DS)(qb, kb, vb)
    out.float().sum().backward()
    assert out.dtype == qb.grad.dtype == torch.bfloat16


def test_checkpoint_round_trip_and_refusals():
    layer = FP8DotProductAttention(DS, kv_block=8)
    for step in range(2):
        layer(*qkv(step)).backward(grad_of(step))
    sd = layer.state_dict()
    assert sd["_extra_state"].shape == (len(ROLES), 1 + DS.amax_history_len)
    fresh = FP8DotProductAttention(DS, kv_block=8)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(snapshot(layer).values(), snapshot(fresh).values()))
    a, b = qkv(5), qkv(5)
    assert torch.equal(layer(*a), fresh(*b))
    bad = {"_extra_state": sd["_extra_state"].clone()}
    bad["_extra_state"][3, 0] = 0.0                                     # the O scale
    before = snapshot(fresh)
    with pytest.raises(ValueError, match="finite and > 0"):
        fresh.load_state_dict(bad)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(before.values(), snapshot(fresh).values()))
    with pytest.raises(ValueError, match="shape"):
        FP8DotProductAttention(DelayedScaling(amax_history_len=8)).load_state_dict(sd)
    fresh.load_state_dict({}, strict=True)                              # a checkpoint from before: state starts fresh
    assert all(float(s.scale) == 1.0 for s in fresh.scaling_state.values())


def test_refusals():
    with pytest.raises(TypeError, match="DelayedScaling or CurrentScaling"):
        FP8DotProductAttention(MXFP8BlockScaling())
    with pytest.raises(ValueError, match="kv_block"):
        FP8DotProductAttention(kv_block=0)
    with pytest.raises(ValueError, match="role"):
        FP8DotProductAttention(roles=("p",))
    with pytest.raises(ValueError, match="fixed_scales"):
        FP8DotProductAttention(roles=("q",), fixed_scales={"s": 16.0})
    layer = FP8DotProductAttention(DS)
    with pytest.raises(ValueError, match="differs"):
        with autocast(recipe=DelayedScaling(fp8_format=Format.E4M3)):
            layer(*qkv())
    q, k, v = qkv()
    with pytest.raises(ValueError, match="same leading dims"):
        layer(q, k[:, :1], v)
