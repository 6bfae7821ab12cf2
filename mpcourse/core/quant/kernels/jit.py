"""How a tensor reaches the compiled passes: numba imported once, ``COMPILED`` chosen once, ``takes`` asked per call.

``AVAILABLE``: numba (and llvmlite) import, and the library's switch is on (``mpcourse.core.kernels_switch.ENABLED``;
with ``MPCOURSE_FUSED=0`` numba is not even imported). ``COMPILED``: whether the kernels hand tensors to the compiled
passes (``loops``, through ``fp8_passes`` and ``nvfp4_passes``) at all, fixed at import. ``takes(x)``: the input's
half, asked per call. ``np_view`` and ``check_grid``: how a tensor's memory is handed to a loop and the shapes a loop
may index without bounds checks. No rule is computed here.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...kernels_switch import ENABLED

try:
    if not ENABLED:
        raise ImportError("turned off by MPCOURSE_FUSED=0")
    import llvmlite  # noqa: F401
    import numba
except ImportError:  # numba missing (or turned off): the kernels' torch bodies and the rules run
    numba = None

AVAILABLE = numba is not None     # the compiled loops exist; which calls take them is ``takes``' choice
#: whether the compiled passes run at all: chosen once, here, at import (the switch on and numba imported)
COMPILED: bool = ENABLED and AVAILABLE
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


def takes(x: torch.Tensor, dtype: torch.dtype = torch.float32, dims: Optional[int] = 2) -> bool:
    """Whether a compiled pass takes ``x`` in this call: ``COMPILED`` (the machine's half, fixed at import),
    then the input's half, asked per call: a non-empty CPU tensor of ``dtype`` with ``dims`` dimensions (None: any
    number), outside ``torch.compile``'s tracing (which cannot trace a compiled call: the torch body is traced)."""
    return (COMPILED and x.device.type == "cpu" and x.dtype == dtype and x.numel() > 0
            and (dims is None or x.dim() == dims) and not _is_compiling())


_TYPESTR = {torch.float32: "<f4", torch.int32: "<i4", torch.uint8: "|u1", torch.int64: "<i8"}


class _Memory:
    """A tensor's memory as NumPy's array interface describes it (address, shape, dtype): nothing else."""
    __slots__ = ("__array_interface__",)

    def __init__(self, t: torch.Tensor):
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": _TYPESTR[t.dtype], "version": 3}


_VIEWS: dict = {}      # (address, shape, dtype) -> the NumPy view of that memory


def np_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of contiguous CPU tensor t's memory, made from its address: ``t.numpy()`` would mark t's
    storage as not resizable, and FSDP2 frees a gathered parameter by resizing its storage to 0. t must stay
    alive while the view is used (the passes hold it).

    A view is nothing but (address, shape, dtype), owns nothing and refers to no tensor, so the one made for an
    address, shape and dtype serves any later tensor with the same three (the allocator hands the same blocks
    out step after step): looked up, a view costs about 0.5 us instead of 3 (the kernels take 10-20 per call).
    The table is emptied when it reaches 4096 entries."""
    assert t.is_contiguous() and t.is_cpu, "the compiled passes take contiguous CPU tensors"
    key = (t.data_ptr(), t.shape, t.dtype)
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) >= 4096:
            _VIEWS.clear()
        view = _VIEWS[key] = np.asarray(_Memory(t))
    return view



FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def check_grid(x: torch.Tensor, block: tuple[int, int], *grids: torch.Tensor) -> None:
    """ValueError unless ``block`` (r, c) divides x's (M, K) and every grid is (M/r, K/c): the kernels index
    without bounds checks, so a wrong shape (e.g. a learner's scale function returning a flat tensor) is refused
    here, as the rule's broadcast would refuse it."""
    (M, K), (r, c) = x.shape, block
    if r < 1 or c < 1 or M % r or K % c:
        raise ValueError(f"a {r}x{c} block does not divide shape {(M, K)}")
    for g in grids:
        if tuple(g.shape) != (M // r, K // c):
            raise ValueError(f"block scales of shape {tuple(g.shape)} for a {(M, K)} tensor in {r}x{c} blocks: "
                             f"expected {(M // r, K // c)}, one per block")

