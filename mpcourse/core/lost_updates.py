"""Updates that FP16 weights cannot hold: the rule, and the fraction of a real step's updates it loses.

An update ``dw`` added to an FP16 weight ``w`` is lost when ``w + dw`` rounds back to ``w`` (round to nearest,
ties to even): ``|dw|`` below half of w's spacing (IEEE 754-2019, section 4.3.1), which is why Micikevicius
et al., "Mixed Precision Training" (ICLR 2018, section 3.1) keep an FP32 master copy. ``is_update_lost`` has
the signature of lesson 01's exercise; ``lost_update_fraction`` measures, for one optimizer step of an
FP32-master run, the fraction of FP16 weight elements whose update (master after minus master before, in
FP16) would have been lost had it been added straight to the FP16 weights. The ``fp16-master`` recipe
reports it per step (history key ``lost_updates``) only when given the rule (``overrides``), so a default
run pays nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .learner_table import returned


def is_update_lost(w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """True where ``dw != 0`` and ``round_to_fp16(w + dw) == w``; w, dw: float16 tensors of one shape -> bool.

    The sum is exact in float64 (two 11-bit significands at most 40 binades apart fit in 53 bits), so the
    one rounding is the cast back to FP16, as in an FP16 add.
    """
    if w.dtype != torch.float16 or dw.dtype != torch.float16 or w.shape != dw.shape:
        raise ValueError(f"is_update_lost needs two float16 tensors of one shape, got {w.dtype} {tuple(w.shape)} "
                         f"and {dw.dtype} {tuple(dw.shape)}")
    exact = w.double() + dw.double()                       # exact
    return (dw != 0) & (exact.half() == w)                 # (shape of w) bool


@torch.no_grad()
def lost_update_fraction(weights: Sequence[torch.Tensor], master_before: Sequence[torch.Tensor],
                         master_after: Sequence[torch.Tensor],
                         rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    """The fraction of FP16 weight elements whose step's update would be lost added straight to the FP16 weights.

    Args:
        weights: the FP16 model weights before the step (aligned with the next two).
        master_before, master_after: their FP32 masters before and after the step; the update is
            ``(after - before)`` rounded to FP16.
        rule: ``fn(w, dw) -> bool tensor`` (lesson 01's ``is_update_lost``), checked by
            ``mpcourse.core.seams.returned_mask``; None: ``is_update_lost``.
    """
    rule = rule or is_update_lost
    lost = total = 0
    for w, before, after in zip(weights, master_before, master_after):
        dw = (after.float() - before.float()).half()       # (shape of w) fp16
        lost += int(returned("is_update_lost", w, rule(w, dw)).sum())
        total += w.numel()
    return lost / total if total else 0.0
