"""Choosing a static loss scale: the largest power of two that keeps the largest gradient finite.

Rule (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2: "choose a constant scaling factor ...
as long as back-propagated gradients do not overflow"): given the largest |gradient| ``g`` recorded in FP32 and the
gradient format's largest finite value ``fmt_max``, the scale is ``S = 2**k`` for the largest integer k with
``S * g * 2**margin <= fmt_max``; ``margin`` extra powers of two leave headroom for gradients larger than the
recorded one. Powers of two keep scaling exact: ``(S * g) / S == g`` bit for bit while nothing overflows.
Lesson 03 builds the same function; the recipe ``fp16-static`` chooses its scale with it (or with a
learner's ``choose_loss_scale`` of the same signature).
"""
from __future__ import annotations

import math

from ..formats import get_format

FP16_MAX = get_format("fp16").max          # 65504.0


def choose_loss_scale(grad_abs_max: float, fmt_max: float = FP16_MAX, margin: int = 0) -> float:
    """The largest power of two ``S`` with ``S * grad_abs_max * 2**margin <= fmt_max``.

    Args:
        grad_abs_max: the largest |gradient| (a positive finite float).
        fmt_max: the gradient format's largest finite value (default FP16's 65504.0).
        margin: extra powers of two of headroom (an int >= 0).

    Returns:
        ``S = 2**k`` as a float (k may be negative).

    Raises:
        ValueError: ``grad_abs_max`` is 0, negative, inf or NaN; ``fmt_max`` not positive and finite; ``margin``
            not an int >= 0.
    """
    if not (isinstance(grad_abs_max, (int, float)) and math.isfinite(grad_abs_max) and grad_abs_max > 0):
        raise ValueError(f"grad_abs_max must be a positive finite number, got {grad_abs_max!r}: 0 leaves nothing "
                         "to scale for, inf/NaN means the recorded gradients overflowed already")
    if not (math.isfinite(fmt_max) and fmt_max > 0):
        raise ValueError(f"fmt_max must be a positive finite number, got {fmt_max!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    # frexp: grad_abs_max = f * 2**e, f in [0.5, 1); fmt_max / 2**margin likewise. ldexp scales exactly.
    limit = math.ldexp(fmt_max, -margin)
    k = math.frexp(limit)[1] - math.frexp(grad_abs_max)[1]      # within one of the answer
    while math.ldexp(grad_abs_max, k) > limit:
        k -= 1
    while math.ldexp(grad_abs_max, k + 1) <= limit:
        k += 1
    return math.ldexp(1.0, k)
