"""Argument and checkpoint validation shared by the scalers' constructors, setters and `load_state_dict`.

One rule set for every way a value can enter a scaler, so a checkpoint cannot smuggle in what the constructor
refuses (a scale of 0 makes every gradient 0 and 1/S inf; NaN poisons every step; a growth factor <= 1 never
recovers from a backoff). Each function raises ValueError (TypeError for a wrong type) naming the fix.
"""
from __future__ import annotations

import math
import numbers

from .check import FP32_MAX, FP32_TINY


def scale(value, what="loss scale") -> float:
    """A scale S: a real number in [2**-126, FP32 max] (below 2**-126, 1/S overflows FP32; above, S is inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not (math.isfinite(v) and FP32_TINY <= v <= FP32_MAX):
        raise ValueError(f"{what} must be a finite number in [2**-126, FP32 max {FP32_MAX:g}], got {value}; "
                         "powers of two (e.g. 2.0**16) make scaling and unscaling exact.")
    return v


def factor(value, name: str, low: float, high: float) -> float:
    """growth_factor in (1, inf) or backoff_factor in (0, 1): a finite real strictly inside (low, high)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not (math.isfinite(v) and low < v < high):
        raise ValueError(f"{name} must lie strictly between {low} and {high}, got {value} "
                         "(torch.amp.GradScaler defaults: growth_factor=2.0, backoff_factor=0.5)")
    return v


def integer(value, name: str, low: int, high: float = math.inf) -> int:
    """An integer (not a bool, not 2.5) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and float(value).is_integer():
            value = int(value)  # 2000.0 from a JSON checkpoint is 2000
        else:
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return int(value)


def boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def keys(state_dict, required: set, optional: set, who: str) -> None:
    """The checkpoint is a dict holding every required key and nothing unknown."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{who}.load_state_dict takes a dict from {who}.state_dict(), got {type(state_dict).__name__}")
    missing, unknown = required - state_dict.keys(), state_dict.keys() - required - optional
    if missing or unknown:
        raise ValueError(f"not a {who} state_dict: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                         f"pass what {who}.state_dict() (or torch.amp.GradScaler.state_dict()) returned")
