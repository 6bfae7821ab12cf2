"""Ablation (lesson 14): which attention tensors survive FP8, one at a time, on the course's GPT.

The linear layers stay FP32 and only attention changes, so each run's gap to ``fp32`` is that of the attention
tensors it casts (``mpcourse.core.attention``; delayed scaling, HYBRID, amax history 16, as ``fp8-attention``):

    label        FP8 in attention                                  source of the question
    q,k          Q and K (the scores' inputs)                      each tensor alone (TE's meta slots)
    v            V
    p            P, the softmax output, in blocks of 128 keys      cuDNN's FP8 SDPA
    o            O, the output
    do           dO, the output gradient (E5M2)
    dp           dS = P * (dP - D) * scale (E5M2)
    dqkv         dQ, dK, dV (E5M2)
    forward      Q, K, V, P, O; FP32 backward                      FlashAttention-3 (FP8 forward only)
    all          every tensor                                      TE fp8_dpa
    p-rows       P alone, the softmax over whole rows cast          TE's unfused emulation
    p-fixed-16   P alone, a fixed scale of 16                       cuDNN's MXFP8 attention
    p-fixed-1    P alone, scale 1: P's own values cast              (what no scaling does)

Where P's scale comes from: in blocks, P = exp(S - m) <= 1 with 1 in every row, so its amax is exactly 1 and delayed
scaling settles at scale_s = 448 (E4M3's max) after the first step; a fixed 16 spends 4.8 binades less on the top
and casts what falls below 2^-9 / 16 to zero; scale 1 casts values below 2^-10 to zero. The record keeps each
run's final scale_s per layer (``p_scale``).

Per-op error: at the ``fp32`` run's last step, each of attention's six products is computed again from that
step's FP32 tensors with its two operands cast (current scaling, HYBRID) and compared with the FP32 product:
||fp8 - fp32|| / ||fp32|| (Frobenius) per product and layer (``op_errors``): S = Q K^T, O = P V (P with scale 448,
where delayed scaling settles, and with the fixed scales; with each, the fraction of P's nonzero elements cast to 0),
dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.

Measured (``notebooks/data/11/fp8-attention.json``; ``python -m mpcourse.experiment.ablations fp8-attention``, 80
steps, seeds 0 and 1, one thread): on this GPT no variant separates from the seed spread after 80 steps (every gap to
fp32 within -1.2% .. +0.5%, of both signs, while the two fp32 seeds differ by 3.8%); scale_s is 448 from the first
update on; with scale 448 up to 8% of P's nonzero elements are cast to 0 (the last layer's peaked rows), 16% with a
fixed 16 and 26% with scale 1, yet O = P V's error moves by less than 0.001 (the elements lost are the ones that weigh
least); the largest product errors are the backward's, dV = P^T dO and dK = dS^T Q (5-6%, E5M2 operands).
"""
from __future__ import annotations

import math

import torch

from mpcourse.core.attention.fp8_attention import (FORWARD_ROLES, KV_BLOCK, ROLES, RoleCast, cast, causal_scores,
                                                   exp_minus, fp8_matmul, softmax_pv_blocks, transposed)
from mpcourse.experiment.gpt.model import CausalSelfAttention
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.recipes.fp8 import FP8Delayed
from mpcourse.experiment.recipes.fp8_attention import WithFP8Attention
from .common import AblationConfig, over_seeds

VARIANTS = (   # (label, FP8DotProductAttention keywords)
    ("q,k", {"roles": ("q", "k")}), ("v", {"roles": ("v",)}), ("p", {"roles": ("s",)}), ("o", {"roles": ("o",)}),
    ("do", {"roles": ("do",)}), ("dp", {"roles": ("dp",)}), ("dqkv", {"roles": ("dq", "dk", "dv")}),
    ("forward", {"roles": FORWARD_ROLES, "fp8_dpa_bwd": False}), ("all", {"roles": ROLES}),
    ("p-rows", {"roles": ("s",), "kv_block": None}), ("p-fixed-16", {"roles": ("s",), "fixed_scales": {"s": 16.0}}),
    ("p-fixed-1", {"roles": ("s",), "fixed_scales": {"s": 1.0}}),
)
P_SCALES = {"delayed": None, "fixed-16": 16.0, "fixed-1": 1.0}


class _LinearsHigh(FP8Delayed):
    """``fp8-delayed``'s region and recipe with every linear layer left in FP32."""

    def prepare_model(self, model):
        return model


def attention_only(label: str, options: dict) -> type:
    """A recipe with FP32 linears and ``FP8DotProductAttention(**options)`` in every block."""
    return type(f"FP8Attention_{label}", (WithFP8Attention, _LinearsHigh),
                {"name": f"fp8-attention-only-{label}", "attention_options": dict(options)})


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def op_errors(q, k, v, do, attn_scale: float) -> dict:
    """{product: relative error} of attention's six products with both operands cast (current scaling, HYBRID; P
    with the scales of ``P_SCALES``), from FP32 q, k, v (B, H, T, d) and dO; P and dS from FP32 attention. Also
    "P zero (P tag)": the fraction of P's nonzero elements each scale casts to 0."""
    e4, e5 = RoleCast("e4m3"), RoleCast("e5m2")
    s = causal_scores(q, k, attn_scale, True)
    p = torch.softmax(s, -1)                                                  # (B, H, T, T) fp32
    o = p @ v
    ds = p * (do @ v.transpose(-2, -1) - (o * do).sum(-1, keepdim=True)) * attn_scale
    c = {name: cast(t, how)[0] for name, t, how in (("q", q, e4), ("k", k, e4), ("v", v, e4), ("do", do, e5),
                                                     ("ds", ds, e5))}
    out = {"S=QK^T": relative_error(fp8_matmul(c["q"], transposed(c["k"])), q @ k.transpose(-2, -1))}
    p_block = exp_minus(s, s.amax(-1, keepdim=True))       # P as one block of keys casts it (T <= KV_BLOCK here)
    for tag, scale in P_SCALES.items():                    # "delayed": P's amax is 1, so the scale is 448
        how = RoleCast("e4m3", torch.tensor(448.0 if scale is None else scale))
        out[f"O=PV (P {tag})"] = relative_error(softmax_pv_blocks(s, c["v"], how, KV_BLOCK)[0], o)
        zero = (cast(p_block, how)[0].data.float() == 0) & (p_block > 0)
        out[f"P zero (P {tag})"] = float(zero.sum() / (p_block > 0).sum())
    p8 = cast(p, e4)[0]
    out["dV=P^TdO"] = relative_error(fp8_matmul(transposed(p8), c["do"]), p.transpose(-2, -1) @ do)
    out["dP=dOV^T"] = relative_error(fp8_matmul(c["do"], transposed(c["v"])), do @ v.transpose(-2, -1))
    out["dQ=dSK"] = relative_error(fp8_matmul(c["ds"], c["k"]), ds @ k)
    out["dK=dS^TQ"] = relative_error(fp8_matmul(transposed(c["ds"]), c["q"]), ds.transpose(-2, -1) @ q)
    return out


class OpErrorProbe:
    """``run_one``'s probe for the ``fp32`` run (its numbers untouched: hooks only read): keeps each attention's input
    x (forward hook) and the gradient of its output before ``proj`` (dO, backward hook on ``proj``), and after the
    last step's backward recomputes that step's q, k, v from x and computes ``op_errors`` per layer."""

    def __init__(self, steps: int):
        self.steps, self.calls, self.errors, self.seen = steps, 0, {}, {}

    def _hook(self, name: str, m: CausalSelfAttention) -> None:
        keep = lambda key, t: self.seen.setdefault(name, {}).__setitem__(key, t.detach())       # noqa: E731
        m.register_forward_hook(lambda mod, args, out: keep("x", args[0]))
        m.proj.register_full_backward_hook(
            lambda mod, gin, gout: keep("dy", gin[0]))

    def __call__(self, recipe) -> dict:
        attentions = {n: m for n, m in recipe.model.named_modules() if isinstance(m, CausalSelfAttention)}
        if self.calls == 0:
            for n, m in attentions.items():
                self._hook(n, m)
        self.calls += 1
        if self.calls == self.steps and self.seen:
            for n, m in attentions.items():
                self.errors[n] = {k: round(e, 6) for k, e in self.layer_errors(m, **self.seen[n]).items()}
        return {}

    @staticmethod
    @torch.no_grad()
    def layer_errors(m: CausalSelfAttention, x: torch.Tensor, dy: torch.Tensor) -> dict:
        B, T, C = x.shape
        hs = C // m.n_head
        heads = lambda t: t.reshape(B, T, m.n_head, hs).transpose(1, 2)          # noqa: E731  (B, H, T, hs)
        q, k, v = (heads(t) for t in m.qkv(x).split(C, dim=2))
        return op_errors(q, k, v, heads(dy), 1.0 / math.sqrt(hs))


class PScaleProbe:
    """After each step, the scale_s of every attention layer that keeps one (``p_scale``, rounded)."""

    def __call__(self, recipe) -> dict:
        scales = [round(float(m.scaling_state["s"].scale), 4) for m in recipe.attention_layers().values()
                  if "s" in m.scaling_state]
        return {"p_scale": scales} if scales else {}


def run(acfg: AblationConfig) -> dict:
    runs, errors = [], {}
    fp32 = get_recipe("fp32")
    for seed in acfg.seeds:
        probe = OpErrorProbe(acfg.steps)
        one = type(acfg)(steps=acfg.steps, batch_size=acfg.batch_size, seeds=(seed,), eval_batches=acfg.eval_batches)
        [r] = over_seeds("fp32", lambda model, optim: fp32(model, optim), one, probe=probe)
        runs.append({**r, "roles": None})
        errors[str(seed)] = probe.errors
    for label, options in VARIANTS:
        cls = attention_only(label, options)
        for r in over_seeds(label, lambda model, optim, cls=cls: cls(model, optim), acfg, probe=PScaleProbe()):
            runs.append({**r, "roles": list(options["roles"]),
                         "options": {k: v for k, v in options.items() if k != "roles"}})
    return {"ablation": "fp8-attention", "linears": "fp32", "attention_recipe": "DelayedScaling(HYBRID, history 16)",
            "op_errors": errors, "runs": runs}
