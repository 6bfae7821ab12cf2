"""Graders: the checks that the unit tests and the notebooks' check cells share.

Every exercise notebook ends in *check cells* (cells tagged ``check``) that call a grader from this
package with the learner's function. A grader runs the function on a fixed, deterministic set of
cases, compares it with an independent oracle (torch's own casts, ``torch.amp.GradScaler``,
``torch.autocast``, ...), and then either

* prints one short verdict line, ``PASS <what>: <n> cases ...`` (the same on every machine, so
  nbval can compare it with the stored output), or
* raises ``GradingError`` whose message points at the *first* wrong case: the input, the expected
  and the obtained value, and a hint.

A function that still raises ``NotImplementedError`` (the shipped exercise stub) fails with a
``GradingError`` saying which function to fill in. The unit tests call the same graders on the
library's reference implementation (must pass) and on planted wrong implementations (must fail).

Per-lesson graders live in submodules: ``grading.formats`` (lesson 00), and so on.
"""
from __future__ import annotations

import torch


class GradingError(AssertionError):
    """A check failed: the message names the first wrong case and how to fix it."""


def call(name: str, fn, *args, **kwargs):
    """Call the learner's ``fn``; turn a stub's ``NotImplementedError`` into a helpful ``GradingError``."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise GradingError(f"FAIL {name}: `{getattr(fn, '__name__', fn)}` is not implemented yet "
                           f"({e or 'NotImplementedError'}). Fill in the cell marked YOUR CODE HERE, "
                           "run it, then run this check again.") from None


def verdict(name: str, detail: str) -> None:
    """Print the one-line PASS verdict (deterministic: no timings, no machine-dependent numbers)."""
    print(f"PASS {name}: {detail}")


def _hex32(v: float) -> str:
    return "0x%08X" % (torch.tensor([v], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bit patterns as float32, except that any NaN equals any NaN.

    Distinguishes +0 from -0. Returns a bool tensor of the broadcast shape.
    """
    a32, b32 = a.float(), b.float()
    return (a32.view(torch.int32) == b32.view(torch.int32)) | (a32.isnan() & b32.isnan())


def check_tensor_fn(name: str, fn, inputs: torch.Tensor, expected: torch.Tensor, *,
                    oracle: str, hint: str = "", describe=None) -> None:
    """Grade an elementwise float32 -> float32 function against oracle values, bit for bit.

    Args:
        name: what is being checked (appears in the verdict).
        fn: the learner's function, called once as ``fn(inputs)``.
        inputs: (N,) float32 cases.
        expected: (N,) float32 oracle values.
        oracle: who computed ``expected`` (appears in the verdict), e.g. "torch .to(torch.bfloat16)".
        hint: added to the failure message.
        describe: optional ``f(x) -> str`` describing an input (e.g. "a tie between 1.0 and 1.0078125").

    Raises:
        GradingError: wrong type, shape or dtype, or the first value that differs.
    """
    got = call(name, fn, inputs.clone())
    if not isinstance(got, torch.Tensor):
        raise GradingError(f"FAIL {name}: expected a torch.Tensor back, got {type(got).__name__}.")
    if got.shape != inputs.shape:
        raise GradingError(f"FAIL {name}: expected shape {tuple(inputs.shape)}, got {tuple(got.shape)}. "
                           "Work elementwise and keep the input's shape.")
    if got.dtype != torch.float32:
        raise GradingError(f"FAIL {name}: return float32 values (the rounded value, stored in FP32), "
                           f"got dtype {got.dtype}.")
    ok = same_bits(got, expected)
    if bool(ok.all()):
        verdict(name, f"{inputs.numel():,} cases agree bit for bit with {oracle}")
        return
    bad = (~ok).nonzero().flatten()
    # Show the simplest wrong case: the one whose magnitude is closest to 1 (specials last).
    mag = inputs[bad].abs().double().log2().abs().nan_to_num(nan=1e9, posinf=1e9)
    i = int(bad[int(mag.argmin())])
    x, e, g = float(inputs[i]), float(expected[i]), float(got[i])
    what = f" ({describe(x)})" if describe else ""
    raise GradingError(
        f"FAIL {name}: {len(bad):,} of {inputs.numel():,} cases differ from {oracle}.\n"
        f"  first wrong case: input {x!r} [{_hex32(x)}]{what}\n"
        f"  expected {e!r} [{_hex32(e)}], got {g!r} [{_hex32(g)}]"
        + (f"\n  hint: {hint}" if hint else ""))
