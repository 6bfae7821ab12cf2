"""Activation checkpointing under ``mpcourse.core.autocast``: the recompute replays the region's state.

``torch.utils.checkpoint.checkpoint`` (torch 2.13, ``torch/utils/checkpoint.py``) saves *torch's*
autocast state when a segment runs forward (``_get_autocast_kwargs``) and re-enters it when the
segment is recomputed during backward. It cannot see this package's state, so without help a segment
run forward in BF16 under ``autocast("cpu")`` would be recomputed in FP32 after the region exited:
the reentrant variant silently (other gradients), the non-reentrant one with a metadata error.

What this module does: when this package's autocast has a region open at the ``checkpoint`` call,
the function handed to the recompute is wrapped so that it re-enters the state of that moment
(enabled flag and dtype per device type, ``cache_enabled``, the learner's functions,
``course_additions``), exactly as torch does for its own state. The recompute then makes the same
casts and the gradients are bit-identical to the run without checkpointing. Both code paths are
covered, whatever name the caller imported:

* reentrant (``use_reentrant=True``): ``checkpoint`` calls the module global ``CheckpointFunction``;
  it is replaced by a subclass whose ``forward`` stores the wrapped function as ``ctx.run_function``.
* non-reentrant: ``checkpoint`` calls the module global ``_checkpoint_without_reentrant_generator``,
  whose ``fn`` argument is only used to recompute; it is replaced by a wrapper passing the wrapped fn.

This touches two private names of ``torch.utils.checkpoint``; ``install`` checks they exist and
``tests/core/autocast/test_autocast_trust.py`` checks the gradients, so a torch release that moves them fails there.
Outside this package's regions nothing changes (the original function is passed through).
"""
from __future__ import annotations

import contextlib
import functools

import torch.utils.checkpoint as _tc

from .mode import autocast
from .state import STATE

_DEVICE_TYPES = ("cpu", "cuda")


def _replaying(fn):
    """``fn`` wrapped to run under this thread's current autocast state, or ``fn`` outside any region."""
    if STATE.nesting == 0:
        return fn
    saved = [(dev, STATE.enabled[dev], STATE.dtype[dev]) for dev in _DEVICE_TYPES]
    cache_enabled, given = STATE.cache_enabled, {"cast_args": STATE.cast_args, "cached_cast": STATE.cached_cast,
                                                 "course_additions": STATE.course_additions}

    @functools.wraps(fn)
    def replay(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dev, enabled, dtype in saved:
                stack.enter_context(autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled, **given))
            return fn(*args, **kwargs)
    return replay


def install() -> None:
    """Make ``torch.utils.checkpoint`` replay this package's autocast state (idempotent)."""
    if getattr(_tc, "_mpcourse_autocast_installed", False):
        return
    if not (hasattr(_tc, "CheckpointFunction") and hasattr(_tc, "_checkpoint_without_reentrant_generator")):
        raise ImportError("torch.utils.checkpoint no longer has CheckpointFunction and "
                          "_checkpoint_without_reentrant_generator: mpcourse.core.autocast cannot make "
                          "checkpointing replay its state on this torch; pin the torch the course pins")
    base = _tc.CheckpointFunction

    class CheckpointFunction(base):          # reentrant path
        @staticmethod
        def forward(ctx, run_function, preserve_rng_state, *args):
            return base.forward(ctx, _replaying(run_function), preserve_rng_state, *args)

    generator = _tc._checkpoint_without_reentrant_generator

    @functools.wraps(generator)
    def without_reentrant(fn, *args, **kwargs):   # non-reentrant path: fn is used only to recompute
        return generator(_replaying(fn), *args, **kwargs)

    _tc.CheckpointFunction = CheckpointFunction
    _tc._checkpoint_without_reentrant_generator = without_reentrant
    _tc._mpcourse_autocast_installed = True
