"""What the numerics inspector sees of FP8 attention: every tensor the layer casts, as it was before the cast, under
its Transformer Engine name, with the cast that made it as the "run" quantizer.

The rule (``fp8_attention``) casts each tensor of a quantized role through ``cast``; a ``RoleCast`` whose ``seen`` is
a list gets each tensor appended (``watched``), and ``report`` hands them to an observer (the inspector's
``Inspector.observe``, ``mpcourse.core.inspect``) after the pass, before any scale moves::

    name    tensor                                           pass      cast as   read as (contraction dim last)
    Q K     Q, K                                             forward   input     (..., T, d)   S = Q K^T
    V       V                                                forward   input     V^T (..., d_v, T)   O = P V
    P       P as the forward casts it: in blocks of keys,   forward   input     (..., Tq, Tk)   P V
            exp(S - running max), the blocks side by side
    O       O before its cast                                forward   input     (..., T, d_v)
    dO      dO                                               backward  grad      dO^T (..., d_v, Tq)   dV = P^T dO
    P_bwd   P = exp(S - lse), cast again for dV = P^T dO     backward  input     P^T (..., Tk, Tq)
    dP      dS = P * (dP - D) * scale (TE's dP slot)         backward  grad      (..., Tq, Tk)   dQ = dS K
    dQ dK dV  dQ, dK, dV before their casts                  backward  grad      (..., T, d)

"cast as" is the quantizer role the inspector's what-ifs use (``inspect_quant``): "input" for the E4M3 tensors of
``Format.HYBRID``, "grad_output" for the E5M2 ones; "read as" the layout whose last dimension blocks run along (each
tensor with the contraction dimension of its first product last, as a linear layer's operands are read). The "run"
statistics re-cast the tensor with the role's own cast (``RoleQuantizer``: its format and this step's scale), so
they are the numbers of the copy training made, bit for bit (a per-tensor cast does not depend on the layout).
Roles left in FP32 are not cast and not reported. P in blocks of keys: each block is cast with one scale, so the
statistics of the blocks side by side are those of the blocks' casts together.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import torch

from .fp8_attention import FORWARD_ROLES, RoleCast, cast

#: the inspector's name of each rule role, forward pass and backward pass ("s" is P in both)
FORWARD_NAMES = {"q": "Q", "k": "K", "v": "V", "s": "P", "o": "O"}
BACKWARD_NAMES = {"do": "dO", "s": "P_bwd", "dp": "dP", "dq": "dQ", "dk": "dK", "dv": "dV"}
ATTENTION_ROLES = ("Q", "K", "V", "P", "O", "dO", "P_bwd", "dP", "dQ", "dK", "dV")
#: the rule role of each name (what a switch of one tensor turns to high precision), and each role's name in a switch
RULE_ROLE = {**{n: r for r, n in FORWARD_NAMES.items()}, **{n: r for r, n in BACKWARD_NAMES.items()}}
ROLE_NAME = {**BACKWARD_NAMES, **FORWARD_NAMES}
TRANSPOSED = ("V", "dO", "P_bwd")          # read with their last two dimensions swapped (table above)

Observer = Callable[..., object]    # observer(name, tensor, as_role=..., own=...), e.g. Inspector.observe's partial


class RoleQuantizer:
    """A role's cast as the inspector's "run" quantizer: per tensor, ``cast(x, how)`` with a copy of the scale."""

    per_tensor = True

    def __init__(self, how: RoleCast):
        self.how = replace(how, scale=None if how.scale is None else how.scale.detach().clone(), seen=None)

    def __call__(self, x: torch.Tensor, record: bool = False):
        return cast(x, self.how)[0]


def watched(casts: Mapping[str, RoleCast]) -> dict:
    """``casts`` with an empty ``seen`` list in each: the rule's casts append their tensors to it."""
    return {r: replace(how, seen=[]) for r, how in casts.items()}


def seen_tensor(how: RoleCast) -> torch.Tensor:
    """The tensor a role cast: the one cast, or P's blocks of keys side by side (..., Tq, Tk)."""
    return how.seen[0] if len(how.seen) == 1 else torch.cat(how.seen, dim=-1)


def report(observer: Observer, casts: Mapping[str, RoleCast], backward: bool) -> None:
    """Hand each tensor ``casts`` saw (``watched``) to ``observer`` under its name (the table above), in the order
    of ``ATTENTION_ROLES``; roles that cast nothing are left out."""
    names = BACKWARD_NAMES if backward else FORWARD_NAMES
    for role, name in names.items():
        how = casts.get(role)
        if how is None or not how.seen:
            continue
        t = seen_tensor(how)
        t = t.transpose(-2, -1) if name in TRANSPOSED else t
        as_role = "input" if role in FORWARD_ROLES else "grad_output"
        observer(name, t, as_role=as_role, own=RoleQuantizer(how))
