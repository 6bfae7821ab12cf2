"""The inspector that acts (mpcourse.core.autoswitch): a layer switches exactly when its own quantizer's statistic
passes the threshold (never at it, never when off), a switched layer computes as a layer kept out of conversion,
bit for bit, and the switch survives a checkpoint."""
import pytest
import torch
import torch.nn as nn

from mpcourse.core.autoswitch import Autoswitch, Spec, SwitchRule, describe, parse_rules, parse_spec
from mpcourse.core.quant import CurrentScaling, Format, autocast, convert_to_float8_training

RECIPE = CurrentScaling(fp8_format=Format.HYBRID)


def planted_input(frac_tiny: float = 0.1) -> torch.Tensor:
    """(40, 64) with ``frac_tiny`` of its elements 2^-30 and the rest 1: per-tensor E4M3 maps 1 to 448, and
    2^-30 * 448 = 2^-21.2 lies below half of E4M3's smallest subnormal (2^-10): exactly that fraction underflows."""
    x = torch.ones(40, 64)
    x.view(-1)[: round(frac_tiny * x.numel())] = 2.0 ** -30
    return x


def one_step(model, switch, x, step=0):
    switch.set_step(step)
    with autocast(enabled=True, recipe=RECIPE):
        y = model(x)
    y.sum().backward()
    return switch.after_step(step)


def model_of_two():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    return convert_to_float8_training(model, recipe=RECIPE)


@pytest.mark.parametrize("threshold, fires", [(0.1, False), (0.0999, True)])
def test_switch_fires_exactly_when_the_statistic_passes_the_threshold(threshold, fires):
    """Layer 0's input underflows in exactly 10% of its elements: a threshold of 0.1 is not passed (the rule is
    value > threshold), 0.0999 is; layer 1's input (layer 0's output, no tiny values) never switches."""
    model = model_of_two()
    said = []
    switch = Autoswitch(model, parse_rules(f"underflow={threshold}"), echo=said.append)
    events = one_step(model, switch, planted_input(0.1))
    if fires:
        assert events == [{"step": 0, "layer": "0", "role": "activation", "statistic": "underflow", "value": 0.1,
                           "threshold": threshold}]
        assert model[0].high_precision and not model[1].high_precision and switch.switched == ["0"]
        assert said == [describe(events[0])] and "step 0: 0 -> high precision" in said[0]
    else:
        assert events == [] and switch.switched == [] and said == []
    # a later step records the switched layer in high precision: no "run" statistics, no second event for it
    assert one_step(model, switch, planted_input(0.1), step=1) == events * 0
    switch.remove()


def test_never_switches_when_off():
    """No Autoswitch, no hooks: the same planted step leaves every layer quantized."""
    model = model_of_two()
    with autocast(enabled=True, recipe=RECIPE):
        model(planted_input(0.5)).sum().backward()
    assert not any(m.high_precision for m in model)
    assert not any(m._forward_pre_hooks or m._backward_pre_hooks for m in model)


def test_a_switched_layer_computes_as_a_layer_kept_high():
    """Output, input gradient and weight gradient equal an nn.Linear's with the same parameters, bit for bit,
    inside the FP8 region."""
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    layer = convert_to_float8_training(nn.Linear(64, 32), recipe=RECIPE)
    layer.load_state_dict(ref.state_dict())
    layer.high_precision = True
    x = torch.randn(8, 64)
    outs = []
    for m in (ref, layer):
        xi = x.clone().requires_grad_()
        with autocast(enabled=True, recipe=RECIPE):
            y = m(xi)
        y.pow(2).sum().backward()
        outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rules_parse_and_refuse():
    assert parse_rules("underflow=0.05,rel_error=0.3") == (SwitchRule("underflow", 0.05), SwitchRule("rel_error", 0.3))
    assert parse_spec("underflow=0.05, every=10") == Spec((SwitchRule("underflow", 0.05),), 10)
    for bad in ("underflow", "under=0.1", "underflow=-1", "underflow=x", "", "underflow=nan", "every=10",
                "underflow=0.1,every=0", "underflow=0.1,every=2.5"):
        with pytest.raises(ValueError, match="STATISTIC=THRESHOLD"):
            parse_rules(bad)
    with pytest.raises(TypeError, match="SwitchRule"):
        Autoswitch(nn.Linear(4, 4), ["underflow=0.05"])


def test_any_rule_switches_and_the_first_one_passing_is_logged():
    model = model_of_two()
    switch = Autoswitch(model, parse_rules("rel_error=10,underflow=0.05"), echo=None)
    events = one_step(model, switch, planted_input(0.1))
    assert [(e["layer"], e["statistic"]) for e in events] == [("0", "underflow")]
    switch.remove()


def test_trainer_logs_switches_in_history_and_resumes_them(tmp_path):
    """``Trainer(..., autoswitch=...)``: the events go into the step's history record; a checkpoint keeps the
    switched layers (resumed bit for bit), and refuses to resume them without --autoswitch."""
    from mpcourse.core.checkpoint import CheckpointError
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.training.train import TrainConfig, Trainer

    corpus = load_corpus(None)
    cfg = TrainConfig(steps=4, batch_size=2, eval_interval=10 ** 9,
                      model=GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    full = Trainer("fp8-current", corpus, cfg, autoswitch="rel_error=0.03").run()
    switched = [e for h in full.history for e in h.get("autoswitch", [])]
    assert switched and full.autoswitch.events == switched                   # E5M2 gradients: rel. error ~ 5%
    half = Trainer("fp8-current", corpus, cfg, autoswitch="rel_error=0.03").run(steps=2)
    path = tmp_path / "ck.pt"
    half.save(path)
    resumed = Trainer("fp8-current", corpus, cfg, autoswitch="rel_error=0.03").load(path).run()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert resumed.autoswitch.switched == full.autoswitch.switched
    if half.autoswitch.switched:
        with pytest.raises(CheckpointError, match="--autoswitch"):
            Trainer("fp8-current", corpus, cfg).load(path)


def test_every_n_checks_only_those_steps():
    """``every=2``: the rules read steps 0, 2, ...; a planted step 1 goes unseen, step 2 switches."""
    model = model_of_two()
    switch = Autoswitch(model, parse_rules("underflow=0.05"), every=2, echo=None)
    assert one_step(model, switch, torch.ones(40, 64), step=0) == []
    assert one_step(model, switch, planted_input(0.1), step=1) == []
    assert [e["step"] for e in one_step(model, switch, planted_input(0.1), step=2)] == [2]
    switch.remove()


def test_switch_events_the_rule_on_planted_records():
    """``switch_events`` (lesson 14's exercise): strict ``>``, a NaN never passes, one event per layer (its first
    passing record in recording order, the first passing rule in the rules' order), switched layers and records
    without the run's statistics skipped, a ``target`` that filters layers or names a tensor."""
    from mpcourse.core.autoswitch import switch_events

    def rec(layer, role, **run):
        return {"step": 3, "layer": layer, "role": role, "recipes": {"run": run} if run else {"fp8-block": {}}}

    records = [rec("a", "activation", underflow=0.05, rel_error=0.5), rec("a", "weight", underflow=0.2),
               rec("b", "activation", underflow=float("nan"), rel_error=0.01), rec("c", "activation"),
               rec("b", "output_grad", underflow=0.06, rel_error=0.9), rec("d", "activation", underflow=0.9)]
    rules = [("underflow", 0.05), ("rel_error", 0.3)]
    ev = switch_events(records, rules, switched={"d"})
    assert [(e["layer"], e["role"], e["statistic"], e["value"]) for e in ev] == [
        ("a", "activation", "rel_error", 0.5), ("b", "output_grad", "underflow", 0.06)]
    assert ev[0] == {"step": 3, "layer": "a", "role": "activation", "statistic": "rel_error", "value": 0.5,
                     "threshold": 0.3}
    only_ad = switch_events(records, [SwitchRule("underflow", 0.05)],
                            target=lambda r: r["layer"] if r["layer"] in "ad" else None)
    assert [e["layer"] for e in only_ad] == ["a", "d"] and "target" not in only_ad[0]
    per_role = switch_events(records, rules, target=lambda r: f"{r['layer']}:{r['role']}")
    assert [e["target"] for e in per_role] == ["a:activation", "a:weight", "b:output_grad", "d:activation"]
    assert switch_events(records, [("underflow", 1.0)]) == []
