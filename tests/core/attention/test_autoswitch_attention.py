"""The switch moves FP8 attention to high precision (mpcourse.core.autoswitch, ``attention=layer|tensor|off``): the
whole attention, or one tensor's role, exactly when that tensor's own cast passes the threshold; the event says
when and why; the switched tensor is cast no more; the switch survives a checkpoint."""
import pytest
import torch
import torch.nn as nn

from mpcourse.core.attention.layer import FP8DotProductAttention
from mpcourse.core.autoswitch import Autoswitch, Spec, SwitchRule, describe, parse_rules, parse_spec
from mpcourse.core.quant import CurrentScaling, autocast

B, H, T, D = 2, 2, 16, 16
RECIPE = CurrentScaling()


def inputs(frac_tiny=0.5):
    """Q: ones with ``frac_tiny`` of its elements 2^-30 (current scaling maps 1 to 448 and 2^-30 * 448 below half
    of E4M3's smallest subnormal: exactly that fraction of Q underflows, nothing else of attention does); K, V and
    the output gradient random."""
    g = torch.Generator().manual_seed(0)
    q = torch.ones(B, H, T, D)
    q.view(-1)[: round(frac_tiny * q.numel())] = 2.0 ** -30
    return q, torch.randn(B, H, T, D, generator=g) * 0.5, torch.randn(B, H, T, D, generator=g), \
        torch.randn(B, H, T, D, generator=g)


def one_step(model, switch, step=0, frac_tiny=0.5):
    q, k, v, grad = inputs(frac_tiny)
    switch.set_step(step)
    with autocast(recipe=RECIPE):
        out = model["attn"](*(t.requires_grad_() for t in (q, k, v)))
    out.backward(grad)
    return switch.after_step(step)


def attention_model():
    return nn.ModuleDict({"attn": FP8DotProductAttention(RECIPE, kv_block=None)})


@pytest.mark.parametrize("threshold, fires", [(0.5, False), (0.4999, True)])
def test_the_whole_attention_switches_when_a_tensor_passes(threshold, fires):
    model, said = attention_model(), []
    switch = Autoswitch(model, parse_rules(f"underflow={threshold}"), echo=said.append)
    events = one_step(model, switch)
    if fires:
        assert events == [{"step": 0, "layer": "attn", "role": "Q", "statistic": "underflow", "value": 0.5,
                           "threshold": threshold}]
        assert model["attn"].high_precision and switch.switched == ["attn"]
        assert said == ["autoswitch: step 0: attn -> high precision (Q underflow 0.5 > 0.4999)"]
        assert one_step(model, switch, step=1) == [] and switch.inspector.records == []   # nothing cast any more
    else:
        assert events == [] and not model["attn"].high_precision and said == []
    switch.remove()
    assert model["attn"].observer is None


def test_one_tensor_switches_alone_and_is_cast_no_more():
    """``attention=tensor``: a rule on the relative error of the E5M2 tensors (about 5%) switches dO and dP (dS)
    alone, each logged with its target; the next step casts every other tensor and these two no more."""
    model = attention_model()
    switch = Autoswitch(model, parse_rules("rel_error=0.05"), echo=None, attention="tensor")
    events = one_step(model, switch)
    assert [(e["role"], e["target"]) for e in events] == [("dO", "attn:dO"), ("dP", "attn:dP")]
    assert all(e["value"] > 0.05 for e in events) and "attn:dO -> high precision (dO rel_error" in describe(events[0])
    assert model["attn"].high_precision_roles == {"do", "dp"} and not model["attn"].high_precision
    assert switch.switched == ["attn:dO", "attn:dP"]
    seen = []
    switch.inspector.observe = lambda layer, role, t, **kw: seen.append(role)
    one_step(model, switch, step=1)
    assert seen == ["Q", "K", "V", "P", "O", "P_bwd", "dQ", "dK", "dV"]


def test_p_in_the_backward_switches_p():
    model = attention_model()
    switch = Autoswitch(model, (SwitchRule("underflow", 0.0),), echo=None, attention="tensor")
    switch.decide([])       # nothing recorded, nothing switched
    [e] = switch.decide([{"step": 3, "layer": "attn", "role": "P_bwd", "recipes": {"run": {"underflow": 0.2}}}])
    assert e["target"] == "attn:P"
    switch.switch(e["target"])
    assert model["attn"].high_precision_roles == {"s"} and switch.switched == ["attn:P"]


def test_off_leaves_attention_alone_and_checkpoints_resume_the_switch():
    model = attention_model()
    assert one_step(model, Autoswitch(model, parse_rules("underflow=0.05"), echo=None, attention="off")) == []
    assert not model["attn"].high_precision and model["attn"].high_precision_roles == set()
    model = attention_model()
    switch = Autoswitch(model, parse_rules("rel_error=0.05,underflow=0.05"), echo=None, attention="tensor")
    one_step(model, switch)
    state = switch.state_dict()
    assert state["switched"] == ["attn:dO", "attn:dP", "attn:Q"]           # roles in name order: do, dp, q
    assert sorted(e["target"] for e in switch.events) == sorted(state["switched"])
    fresh = attention_model()
    again = Autoswitch(fresh, parse_rules("underflow=0.05"), echo=None, attention="tensor")
    again.load_state_dict(state)
    assert fresh["attn"].high_precision_roles == {"q", "do", "dp"} and again.events == switch.events
    with pytest.raises(ValueError, match="FP8 attention tensor"):
        again.switch("attn:S")
    whole = Autoswitch(attention_model(), parse_rules("underflow=0.05"), echo=None)
    whole.load_state_dict({"switched": ["attn"], "events": []})
    assert whole.attention["attn"].high_precision


def test_the_spec_names_the_attention_scope():
    assert parse_spec("underflow=0.05,attention=tensor") == Spec((SwitchRule("underflow", 0.05),), 1, "tensor")
    assert parse_spec("underflow=0.05, every=2").attention == "layer"
    for bad in ("underflow=0.05,attention=all", "attention=tensor"):
        with pytest.raises(ValueError, match="attention=layer|tensor|off"):
            parse_spec(bad)
    with pytest.raises(ValueError, match="attention must be one of"):
        Autoswitch(attention_model(), parse_rules("underflow=0.05"), attention="whole")
