"""Argument types for the ``mpcourse`` command line: each checks one kind of value and says the range.

An ``argparse`` ``type=`` callable that raises ``argparse.ArgumentTypeError`` gets its message
printed as ``mpcourse compare: error: argument --lr: <message>`` with exit code 2 and no traceback
(see the ``argparse`` documentation, "type"). A plain ``ValueError`` would instead print the
callable's ``__name__`` ("invalid _positive value"), so every helper here converts and checks
itself, and states the valid range in its message.

Use the ready-made ones (``positive_int``, ``nonneg_int``, ``positive_float``, ``nonneg_float``,
``ratio``, ``seed``) or build another with ``int_in(lo, hi)`` / ``float_in(lo, hi)``::

    p.add_argument("--steps", type=positive_int)
    p.add_argument("--nproc", type=int_in(1, 64))
    p.add_argument("--warmup-frac", type=float_in(0.0, 1.0))
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["int_in", "float_in", "positive_int", "nonneg_int", "positive_float", "nonneg_float",
           "ratio", "seed", "comma_list", "did_you_mean"]


def _int_range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"an integer from {lo} to {hi}"
    if lo == 1:
        return "a positive integer (>= 1)"
    return f"an integer >= {lo}" if lo is not None else (f"an integer <= {hi}" if hi is not None else "an integer")


def _float_range(lo, hi, lo_open) -> str:
    if lo is not None and hi is not None:
        return f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"a finite number {'>' if lo_open else '>='} {lo:g}"
    return f"a finite number <= {hi:g}" if hi is not None else "a finite number"


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type accepting a decimal integer in ``[lo, hi]`` (either bound may be None)."""
    want = _int_range(lo, hi)

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want        # what argparse would show if anything slipped through
    return parse


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type accepting a finite number in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``).

    ``nan``, ``inf`` and ``-inf`` (which ``float()`` accepts) are always rejected: no training
    hyper-parameter means anything at those values.
    """
    want = _float_range(lo, hi, lo_open)

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        bad = (not math.isfinite(value)
               or (lo is not None and (value <= lo if lo_open else value < lo))
               or (hi is not None and value > hi))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want
    return parse


positive_int = int_in(1)
nonneg_int = int_in(0)
positive_float = float_in(0.0, lo_open=True)
nonneg_float = float_in(0.0)
ratio = float_in(0.0, 1.0)
# torch.manual_seed takes up to 2**64 - 1, and the trainer offsets the seed for its eval batches;
# 32 bits is plenty for a course and keeps every seed valid for numpy and random too.
seed = int_in(0, 2**32 - 1)


def did_you_mean(name: str, choices) -> str | None:
    """The choice closest to a misspelled ``name`` (``difflib.get_close_matches``, its default cutoff 0.6), or None."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1)
    return close[0] if close else None


def comma_list(choices, *, what: str = "name") -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of names, each one of ``choices``; an unknown name that is close
    to one gets a "did you mean" (``did_you_mean``); a name given twice is refused (it would run twice)."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            named = ", ".join(f"{n} (did you mean {g}?)" if (g := did_you_mean(n, choices)) else n for n in unknown)
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {named or '(none given)'}; choose from: {', '.join(choices)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{what}(s) {', '.join(twice)} named more than once; name each once")
        return names

    parse.__name__ = f"comma-separated {what}s"
    return parse
