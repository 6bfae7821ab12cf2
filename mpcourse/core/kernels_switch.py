"""Whether the library binds its kernels or only its rules: the ``MPCOURSE_FUSED`` switch, read once, here.

Each idea of the library is a rule, one plain function, and where speed pays a kernel beside it that gives the
same bits faster: ``quant.kernels`` (torch fast paths, numba passes) for the quantizers and the emulated GEMMs,
``scaling.fused`` (ATen's fused loss-scaling calls) for the loss scalers. Which of the two runs is chosen when a
quantizer or a scaler is built (``quant.engine``, ``scaling.base`` and ``scaling.dynamic``), from this module:

* ``ENABLED``: ``MPCOURSE_FUSED`` as it was when this module was first imported ("0": False, the rules
  everywhere; unset or anything else: True). No other module reads the environment variable, and it is read once:
  setting it later in the same process changes nothing (set it before Python starts, or use ``flags``).
  ``quant.kernels.jit`` does not even import numba when it is False.
* ``enabled(kernels=None)``: the choice for a binding made now: ``kernels`` where a caller gives it
  (``engine.quantizers(..., kernels=False)``), else the innermost ``flags`` block's, else ``ENABLED``.
* ``flags(enabled=...)``: a block in which bindings made without an explicit choice take ``enabled``, e.g. a
  test building a model both ways in one process (``torch.backends.cudnn.flags`` is PyTorch's switch of this
  shape). What was bound inside keeps its binding after the block ends. With ``ENABLED`` False, ``flags(True)``
  binds the kernels' torch bodies only (numba was never imported).

Both choices give the same bits (the kernels are tested against their rules); only the speed differs.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

#: the environment variable, and its value when this module was imported ("0": the rules everywhere)
ENV = "MPCOURSE_FUSED"
ENABLED: bool = os.environ.get(ENV, "1") != "0"

_forced: list[bool] = []          # the open ``flags`` blocks' choices, innermost last


def enabled(kernels: Optional[bool] = None) -> bool:
    """Whether a binding made now takes the kernels: ``kernels`` if given, else the innermost ``flags`` block's
    choice, else ``ENABLED`` (the environment at import)."""
    if kernels is not None:
        if not isinstance(kernels, bool):
            raise TypeError(f"kernels must be True, False or None (the switch), got {kernels!r}")
        return kernels
    return _forced[-1] if _forced else ENABLED


@contextlib.contextmanager
def flags(enabled: bool) -> Iterator[None]:
    """Within the block, bindings made without an explicit choice take kernels (True) or the rules (False)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"flags(enabled=...) takes True or False, got {enabled!r}")
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()
