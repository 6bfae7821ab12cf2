"""An inspector that acts: a layer whose quantized tensors pass a threshold computes in high precision from then on
(Transformer Engine's debug feature ``AutoswitchGemm``, made permanent).

The rule (``SwitchRule``): after each inspected step, for every layer still quantized, read the statistics its own
quantizer produced on that step ("run" in the inspector's records, ``mpcourse.core.inspect_quant``: what the
layer's GEMMs were fed, delayed scales included) for its input, weight and output gradient; if any one passes a
threshold, ``statistic > threshold``, the layer is switched: ``Float8Linear.high_precision = True``, so all three of
its GEMMs compute in high precision for the rest of the run, exactly as a layer that ``module_filter_fn`` kept out
of conversion (its weight and bias, its optimizer state and its hooks are untouched; a ``Float8WeightLinear``
computes with its dequantized stored weight, TE's ``allow_fp8_model_params_dequantized_weight``). Each switch is an
event {step, layer, role, statistic, value, threshold}, printed once and kept in ``events``.

The rules are checked on every step, or every N-th (``every=N`` in the spec, TE's ``freq``: the watching costs a
second quantization of each tensor of the layers still quantized on the steps it runs).

FP8 attention (``FP8DotProductAttention``, ``mpcourse.core.attention``) is watched too: the rules read the "run"
statistics of every tensor it casts (Q, K, V, P, O, dO, P_bwd, dP, dQ, dK, dV; ``attention.inspected``), and one
passing switches, by the spec's ``attention=``: ``layer`` (the default) the whole attention to FP32
(``high_precision``: as TE's ``DotProductAttention`` with ``fp8_dpa`` off), ``tensor`` that tensor's role alone
(``high_precision_roles``; P and P_bwd are one role, one scale), ``off`` nothing (attention not watched). A
tensor's event also names its ``target``, "layer:P" (the layer's name, a colon, the tensor's forward name).

Statistics a rule may name (``SWITCH_STATISTICS``; definitions in ``inspect_quant``): ``underflow`` (the fraction
of the nonzero elements quantized to zero; TE's example threshold: 5%), ``saturation``, ``rel_error`` and ``mse``
(TE's second metric, the MSE of the quantized tensor). Several rules: any passing switches the layer (TE: "if any
monitored tensor breaches thresholds, the GEMM switches to high precision"). Off unless built: the default run never
inspects and never switches.

Differences from TE, on purpose: TE decides per GEMM (fprop, dgrad, wgrad) and only for the iteration it measured
(it measures again the next one); here a layer switches whole and for good, the decision taken after the step it
measured (the step itself ran quantized), so a run's precision changes at most once per layer and a log of events
says all of it. TE's underflow percentage divides by all elements, the course's fraction by the nonzero ones.

Sources: NVIDIA/TransformerEngine ``transformer_engine/debug/features/autoswitch_gemm.py`` (the thresholds
``underflow_threshold_pct`` = 5.0 and ``mse_threshold``, the per-tensor metrics, the OR over tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch.nn as nn

from .attention.inspected import ROLE_NAME, RULE_ROLE
from .attention.layer import attention_layers
from .inspect import Inspector

SWITCH_STATISTICS = ("underflow", "saturation", "rel_error", "mse")
SWITCH_ROLES = ("activation", "weight", "output_grad")
ATTENTION_SCOPES = ("layer", "tensor", "off")


@dataclass(frozen=True)
class SwitchRule:
    """Switch a layer when the run's ``statistic`` of one of its quantized tensors is above ``threshold``."""

    statistic: str
    threshold: float

    def __post_init__(self):
        if self.statistic not in SWITCH_STATISTICS:
            raise ValueError(f"an autoswitch statistic is one of {SWITCH_STATISTICS}, got {self.statistic!r}")
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"an autoswitch threshold is a finite number >= 0, got {self.threshold!r}")

    def passes(self, value: float) -> bool:
        return value > self.threshold

    def __str__(self) -> str:
        return f"{self.statistic}={self.threshold:g}"


class Spec(NamedTuple):
    """What ``--autoswitch`` says: the rules, every how many steps they are checked, what an FP8 attention's
    tensor passing switches (``ATTENTION_SCOPES``)."""
    rules: tuple[SwitchRule, ...]
    every: int = 1
    attention: str = "layer"


SPEC_FORM = (f"STATISTIC=THRESHOLD[,...][,every=N][,attention=layer|tensor|off], STATISTIC one of "
             f"{', '.join(SWITCH_STATISTICS)}, THRESHOLD a number >= 0 and N a whole number >= 1 (e.g. "
             "underflow=0.05 or underflow=0.05,every=10)")


def _option(name: str, value: str, got: dict) -> None:
    """Read one ``every=N`` or ``attention=SCOPE`` into ``got`` (ValueError if it is not one)."""
    if name == "every":
        got["every"] = int(value)
        if got["every"] < 1:
            raise ValueError
    elif value not in ATTENTION_SCOPES:
        raise ValueError
    else:
        got["attention"] = value


def parse_spec(spec: str) -> Spec:
    """The rules and options of ``"underflow=0.05"``, ``"underflow=0.05,rel_error=0.3"``,
    ``"underflow=0.05,every=10"`` or ``"underflow=0.05,attention=tensor"`` (the CLI's ``--autoswitch``; every: 1,
    attention: layer, unless given); ValueError naming the form otherwise."""
    rules, got = [], {}
    for part in (p.strip() for p in str(spec).split(",")):
        name, _, value = (t.strip() for t in part.partition("="))
        try:
            if name in ("every", "attention"):
                _option(name, value, got)
            else:
                rules.append(SwitchRule(name, float(value)))
        except ValueError:
            raise ValueError(f"--autoswitch takes {SPEC_FORM}, got {spec!r}") from None
    if not rules:
        raise ValueError(f"--autoswitch needs at least one rule: {SPEC_FORM}, got {spec!r}")
    return Spec(tuple(rules), **got)


def parse_rules(spec: str) -> tuple[SwitchRule, ...]:
    """``parse_spec(spec).rules``."""
    return parse_spec(spec).rules


def switch_events(records: list[dict], rules, switched=(), target: Optional[Callable[[dict], Optional[str]]] = None
                  ) -> list[dict]:
    """The rule, one step of it: the events that ``rules`` (``SwitchRule`` objects, or (statistic, threshold) pairs)
    make of one step's inspector ``records`` (in recording order). A record counts where it has the statistics of
    the quantizer that cast it (``record["recipes"]["run"]``) and what it would switch, ``target(record)`` (default:
    its layer; None: nothing, the record is skipped), is not in ``switched``. Per target at most one event: its
    first record, in recording order, on which a rule passes (``value > threshold``; a NaN statistic passes none),
    with the first such rule in ``rules``' order. An event: {step, layer, role, statistic, value, threshold}, and
    ``target`` where that is not the record's layer."""
    rules = [r if isinstance(r, SwitchRule) else SwitchRule(*r) for r in rules]
    events, done = [], set(switched)
    for r in records:
        run, name = r["recipes"].get("run"), (r["layer"] if target is None else target(r))
        if run is None or name is None or name in done:
            continue
        for rule in rules:
            if rule.passes(run[rule.statistic]):
                e = {"step": r["step"], "layer": r["layer"], "role": r["role"], "statistic": rule.statistic,
                     "value": run[rule.statistic], "threshold": rule.threshold}
                events.append(e if name == r["layer"] else {**e, "target": name})
                done.add(name)
                break
    return events


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers a switch applies to: those with quantizers of their own (``Float8Linear`` and its subclasses)."""
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "quantizers", None), dict)}


def tensor_target(layer: str, name: str) -> str:
    """"layer:P": one tensor of an FP8 attention (``name`` one of ``ATTENTION_ROLES``; P_bwd is P's role)."""
    return f"{layer}:{ROLE_NAME[RULE_ROLE[name]]}"


class Autoswitch:
    """Watch ``model``'s quantized layers every ``every`` steps and switch those whose tensors pass a rule.

    Call ``set_step(step)`` before the step's forward and ``after_step(step)`` after its backward (the training
    loop does both); ``after_step`` returns the step's events. ``echo``: where each event's line goes (None: nowhere).
    ``attention``: what an FP8 attention's tensor passing switches (``ATTENTION_SCOPES``, module docstring).
    ``state_dict()`` / ``load_state_dict()``: the switched layers (and attention tensors) and the events.
    """

    def __init__(self, model: nn.Module, rules, every: int = 1, echo: Optional[Callable[[str], None]] = print,
                 attention: str = "layer"):
        self.rules = tuple(rules)
        if not self.rules or not all(isinstance(r, SwitchRule) for r in self.rules):
            raise TypeError(f"rules must be SwitchRule objects (parse_rules('underflow=0.05')), got {rules!r}")
        if attention not in ATTENTION_SCOPES:
            raise ValueError(f"attention must be one of {ATTENTION_SCOPES}, got {attention!r}")
        self.model, self.echo, self.scope = model, echo, attention
        self.layers = quantized_layers(model)
        self.attention = attention_layers(model) if attention != "off" else {}
        self.inspector = Inspector(model, every=every, formats=(), what_ifs=(), run=True, roles=SWITCH_ROLES,
                                   summary=False, attention=attention != "off")
        self.events: list[dict] = []

    @property
    def switched(self) -> list[str]:
        """The layers switched whole, then the attention tensors switched alone ("layer:P")."""
        whole = [n for n, m in {**self.layers, **self.attention}.items() if m.high_precision]
        return whole + [f"{n}:{ROLE_NAME[r]}" for n, m in self.attention.items() for r in sorted(m.high_precision_roles)]

    def set_step(self, step: int) -> None:
        self.inspector.set_step(step)

    def _target(self, r: dict) -> Optional[str]:
        """What a record's tensor passing would switch: its layer, or its attention tensor; None: nothing."""
        if r["layer"] in self.layers:
            return r["layer"]
        if r["layer"] in self.attention:
            return r["layer"] if self.scope == "layer" else tensor_target(r["layer"], r["role"])
        return None

    def decide(self, records: list[dict]) -> list[dict]:
        """The events the rules make of one step's ``records`` (``switch_events``: the first tensor and rule that
        passes, per layer or attention tensor, in recording order), switching nothing."""
        return switch_events(records, self.rules, self.switched, self._target)

    def after_step(self, step: int) -> list[dict]:
        """Read the step's records, switch the layers they condemn, log and return the events."""
        records = [r for r in self.inspector.records if r["step"] == step]
        self.inspector.records.clear()                                # only the last step's are ever needed
        events = self.decide(records)
        for e in events:
            self.switch(e.get("target", e["layer"]))
            self.events.append(e)
            if self.echo is not None:
                self.echo(describe(e))
        return events

    def switch(self, name: str) -> None:
        """Layer ``name`` computes in high precision from now on (``Float8Linear.high_precision``, or the whole FP8
        attention's), or, for "layer:P", that attention tensor is no longer cast (``high_precision_roles``)."""
        layer, _, tensor = name.partition(":")
        if tensor and layer in self.attention and tensor in RULE_ROLE:
            self.attention[layer].high_precision_roles.add(RULE_ROLE[tensor])
            return
        module = self.layers.get(name, self.attention.get(name))
        if module is None or tensor:
            raise ValueError(f"{name!r} is not a quantized layer (or FP8 attention tensor, 'layer:P') of this model; "
                             f"the layers are: {list(self.layers) + list(self.attention)}")
        module.high_precision = True
        self.inspector.stop(name)                                     # nothing of it is quantized any more

    def state_dict(self) -> dict:
        return {"switched": self.switched, "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict) -> None:
        """Switch the layers ``state`` names (a model freshly built, a checkpoint's state): the run goes on as
        it was. ValueError naming the layer where the model has no such quantized layer."""
        for name in state["switched"]:
            self.switch(name)
        self.events = [dict(e) for e in state["events"]]

    def remove(self) -> None:
        self.inspector.remove()


def describe(e: dict) -> str:
    """One line for an event: when, which layer, why."""
    return (f"autoswitch: step {e['step']}: {e.get('target', e['layer'])} -> high precision ({e['role']} {e['statistic']} "
            f"{e['value']:.4g} > {e['threshold']:g})")
