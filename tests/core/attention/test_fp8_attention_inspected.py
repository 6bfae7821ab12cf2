"""The inspector sees FP8 attention (mpcourse.core.attention.inspected): every tensor the layer casts is recorded
under its name, and its statistics equal a direct computation with the library's quantizers on the same tensors:
"run" equals ``quantized_stats`` of the very copies the rule's casts made in training (caught by a spy on the
rule's ``cast``), each what-if equals the engine's quantizer of that recipe applied to the same tensor. Inspecting
moves no bit of the run; a layer switched to high precision computes as a layer that never cast."""
import math

import pytest
import torch
import torch.nn as nn

import mpcourse.core.attention.fp8_attention as rule
from mpcourse.core.attention.fp8_attention import ROLES
from mpcourse.core.attention.inspected import ATTENTION_ROLES
from mpcourse.core.attention.layer import FP8DotProductAttention
from mpcourse.core.inspect import Inspector
from mpcourse.core.inspect_quant import WHAT_IFS, as_2d, quantize_as_training, quantized_stats
from mpcourse.core.quant import CurrentScaling, DelayedScaling, autocast
from mpcourse.core.quant.engine import quantizer
from mpcourse.core.quant.rules.tensor import Float8Tensor

B, H, T, D = 2, 2, 32, 32
FORWARD = ["Q", "K", "V", "P", "O"]
BACKWARD = ["dO", "P_bwd", "dP", "dQ", "dK", "dV"]
#: read with the contraction dimension of their first product last (V in P V, dO and P in dV = P^T dO): transposed
TRANSPOSED = ("V", "dO", "P_bwd")


def qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g) * s).requires_grad_() for s in (1.5, 1.0, 2.0)]


class Spy:
    """Wraps the rule's ``cast``: keeps (tensor, its FP8 copy) of every cast that quantizes, in call order."""

    def __init__(self, monkeypatch):
        self.calls, self.real = [], rule.cast
        monkeypatch.setattr(rule, "cast", self)

    def __call__(self, x, how):
        out = self.real(x, how)
        if how is not None:
            self.calls.append((x.detach().clone(), out[0]))
        return out


def joined(calls):
    """One (tensor, copy) of several casts with one scale (P's blocks of keys), side by side along the keys."""
    xs, qs = zip(*calls)
    assert all(torch.equal(q.scale_inv, qs[0].scale_inv) for q in qs)
    return torch.cat(xs, -1), Float8Tensor(torch.cat([q.data for q in qs], -1), qs[0].scale_inv)


def by_name(calls, n_blocks):
    """The spy's casts named as the rule makes them (module docstring of fp8_attention): forward Q, K, V, P's
    blocks, O; backward dO, P, dS, dQ, dK, dV."""
    fwd, bwd = calls[: 4 + n_blocks], calls[4 + n_blocks:]
    assert len(bwd) == 6
    named = dict(zip(["Q", "K", "V"], fwd[:3]))
    named["P"], named["O"] = joined(fwd[3:3 + n_blocks]), fwd[-1]
    named.update(zip(BACKWARD, bwd))
    return named


def direct_run_stats(x, q, name):
    """quantized_stats of the copy training made, laid out as the inspector reads the tensor."""
    if name in TRANSPOSED:
        x, q = x.transpose(-2, -1), Float8Tensor(q.data.transpose(-2, -1), q.scale_inv)
    return quantized_stats(as_2d(x), Float8Tensor(as_2d(q.data), q.scale_inv))


def direct_what_if(x, name, what_if):
    x2d = as_2d(x.transpose(-2, -1) if name in TRANSPOSED else x)
    role = "input" if name in FORWARD or name == "P_bwd" else "grad_output"
    return quantized_stats(x2d, quantize_as_training(quantizer(WHAT_IFS[what_if].recipe, role), x2d))


@pytest.mark.parametrize("recipe, kv_block", [(DelayedScaling(amax_history_len=4), 8),
                                              (DelayedScaling(amax_history_len=4), None), (CurrentScaling(), 8)])
def test_statistics_equal_a_direct_computation_on_the_tensors_training_cast(recipe, kv_block, monkeypatch):
    """Two steps (delayed scales have a history on the second); on the second, every attention tensor's "run"
    statistics equal those of the spy's copy, and its fp8-current and mxfp8 what-ifs the engine's quantizers'."""
    layer = FP8DotProductAttention(recipe, kv_block=kv_block)
    ins = Inspector(nn.ModuleDict({"attn": layer}), every=1)
    for step in range(2):
        ins.set_step(step)
        if step == 1:
            spy = Spy(monkeypatch)
        q, k, v = qkv(step)
        with autocast(recipe=recipe):
            out = layer(q, k, v)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)) * 1e-2)
    recs = {r["role"]: r for r in ins.records if r["step"] == 1}
    assert list(recs) == list(ATTENTION_ROLES) and all(r["layer"] == "attn" for r in recs.values())
    named = by_name(spy.calls, 1 if kv_block is None else math.ceil(T / kv_block))
    assert torch.equal(named["Q"][0], q.detach()) and float(named["P"][0].amax()) == 1.0
    for name, (x, copy) in named.items():
        rec = recs[name]
        assert rec["recipes"]["run"] == direct_run_stats(x, copy, name), name
        for what_if in ("fp8-current", "mxfp8"):
            assert rec["recipes"][what_if] == direct_what_if(x, name, what_if), (name, what_if)
        assert rec["amax"] == float(x.abs().max()) and rec["numel"] == x.numel()
    assert recs["dO"]["recipes"]["run"]["elem_format"] == "e5m2" == recs["dP"]["recipes"]["run"]["elem_format"]
    assert recs["P"]["recipes"]["run"]["elem_format"] == "e4m3" == recs["P_bwd"]["recipes"]["run"]["elem_format"]
    ins.remove()
    assert layer.observer is None


def _train(inspect: bool, layer_kw=None, steps=3):
    recipe = DelayedScaling(amax_history_len=4)
    layer = FP8DotProductAttention(recipe, kv_block=8, **(layer_kw or {}))
    ins = Inspector(nn.ModuleDict({"attn": layer}), every=1) if inspect else None
    outs = []
    for step in range(steps):
        q, k, v = qkv(step)
        with autocast(recipe=recipe):
            out = layer(q, k, v)
        out.pow(2).sum().backward()
        outs += [out.detach(), q.grad, k.grad, v.grad]
    return outs, layer, ins


def test_inspecting_moves_no_bit_and_records_only_cast_roles():
    plain, layer, _ = _train(False)
    seen, layer2, ins = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, seen))
    assert all(torch.equal(layer.scaling_state[r].scale, layer2.scaling_state[r].scale) for r in ROLES)
    _, _, ins = _train(True, {"roles": ("q", "k", "dp")}, steps=1)
    assert [r["role"] for r in ins.records] == ["Q", "K", "dP"]


def test_no_records_outside_grad_mode_or_off_steps():
    recipe = DelayedScaling()
    layer = FP8DotProductAttention(recipe, kv_block=8)
    ins = Inspector(nn.ModuleDict({"attn": layer}), every=2)
    q, k, v = qkv(0)
    with torch.no_grad(), autocast(recipe=recipe):
        layer(q, k, v)
    ins.set_step(1)
    with autocast(recipe=recipe):
        layer(q, k, v).sum().backward()
    assert ins.records == []
    assert Inspector(nn.ModuleDict({"attn": layer}), attention=False).attention == {}


def test_switched_attention_computes_as_a_layer_that_never_cast():
    """``high_precision``: FP32 attention, bit for bit the layer with no roles; ``high_precision_roles``: the layer
    built without those roles (P here), bit for bit, both over two steps of training."""
    whole, _, _ = _train(False, steps=2)
    hp, layer, _ = [], None, None

    def run(kw, switch):
        recipe = DelayedScaling(amax_history_len=4)
        m = FP8DotProductAttention(recipe, kv_block=8, **kw)
        switch(m)
        outs = []
        for step in range(2):
            q, k, v = qkv(step)
            with autocast(recipe=recipe):
                out = m(q, k, v)
            out.pow(2).sum().backward()
            outs += [out.detach(), q.grad, k.grad, v.grad]
        return outs

    switched = run({}, lambda m: setattr(m, "high_precision", True))
    assert all(torch.equal(a, b) for a, b in zip(switched, run({"roles": ()}, lambda m: None)))
    no_p = run({}, lambda m: m.high_precision_roles.add("s"))
    assert all(torch.equal(a, b) for a, b in zip(no_p, run({"roles": tuple(r for r in ROLES if r != "s")},
                                                           lambda m: None)))
    assert not torch.equal(no_p[0], whole[0]) and not torch.equal(switched[0], no_p[0])
