"""Thread-local autocast state and the weight-cast cache.

Mirrors the state ``aten/src/ATen/autocast_mode.cpp`` keeps for ``torch.autocast`` (torch 2.13):

* per device type: enabled or not, and the lower-precision dtype (default ``torch.bfloat16`` on CPU,
  ``torch.float16`` on CUDA: the ``autocast_dtype`` array there);
* ``cache_enabled`` (default True) and a nesting counter of autocast regions;
* the weight-cast cache (``cached_cast`` there): only casts of FP32 leaf tensors that require grad
  and are not views, to the device type's lower-precision dtype, are cached. The cache is emptied
  when the outermost region exits.

Three choices, documented:

* All of it is thread-local here. In torch the enabled flags, dtypes, ``cache_enabled`` and nesting
  are thread-local but the cache map itself is process-global behind a mutex (so one thread's
  outermost exit empties every thread's cache). A per-thread cache never shares a cast across
  threads and is never emptied by another thread.
* The cache is keyed by the tensor *and* the target dtype. torch keys it by the tensor alone
  (``TensorImpl*``), so a region nested in another with a different dtype (``autocast("cpu")`` around
  ``autocast("cpu", dtype=torch.float16)``) gets the weight cast cached by the other region, in the
  other dtype: in torch 2.13, ``mm(x, w)`` after an inner fp16 region returns float16 inside a bf16
  region. Here each region gets casts in its own dtype.
* A cached cast is reused only while its source is unchanged: the cache stores the weight's version
  counter (``t._version``, bumped by every in-place write to ``t`` or a view of it:
  ``optimizer.step()``, ``w.add_`` or ``w.copy_`` under ``no_grad``) and recasts when it moved.
  torch 2.13 keys by the tensor alone and serves the old cast for the rest of the region after an
  in-place update (the failure NVIDIA/apex#132 describes for apex's cache). A write through
  ``w.data`` is not seen: ``.data`` is a tensor with its own version counter (that is its documented
  difference from ``w.detach()``), so write under ``torch.no_grad()`` instead, or call
  ``clear_autocast_cache()``.
* A cacheable cast is made with grad mode on and is not cached under ``torch.inference_mode``, as in
  torch since pytorch/pytorch#165068 (fixing #158232, #112583, #65766): a forward under ``no_grad``
  inside a region then a forward with grad must not reuse a cast that has no autograd history.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..learner_table import returned

DEFAULT_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}


class _State(threading.local):
    """One per thread: created with the defaults on first use in that thread."""

    def __init__(self):
        self.enabled = {"cpu": False, "cuda": False}
        self.dtype = dict(DEFAULT_DTYPE)
        self.cache_enabled = True
        self.nesting = 0
        self.cache: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}  # (id(leaf), dtype) -> (ref, version, cast)
        self.mode = None            # the TorchFunctionMode pushed by the outermost region
        self.cast_args = None       # a cast_args given to autocast (lesson 05), or None: the library's
        self.cached_cast = None     # a cached_cast given to autocast (lesson 05), or None: the library's cache
        self.given_cache: dict = {}  # the dict handed to that cached_cast, emptied at the outermost exit
        self.course_additions = True  # apply policy.ADDITIONS (False: torch's tables alone)


STATE = _State()


def _check_device_type(device_type: str) -> None:
    if device_type not in DEFAULT_DTYPE:
        raise ValueError(f"mpcourse.core.autocast supports device_type 'cpu' or 'cuda', got {device_type!r}")


def is_autocast_enabled(device_type: str) -> bool:
    """Whether an enabled mpcourse autocast region for ``device_type`` is active in this thread.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``. Raises ValueError otherwise.
    """
    _check_device_type(device_type)
    return STATE.enabled[device_type]


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The lower-precision dtype of ``device_type`` in this thread (default: CPU bf16, CUDA fp16).

    Like ``torch.get_autocast_dtype``: inside a region, that region's dtype; outside, the default.
    """
    _check_device_type(device_type)
    return STATE.dtype[device_type]


def autocast_dtype_in_effect(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype of whichever autocast is enabled for ``device_type``, else None.

    Either ``torch.autocast`` or this package's ``autocast``: code that must behave the same under
    both (``mpcourse.core.quant.QuantizedLinear``'s output dtype) asks here. ``torch.is_autocast_enabled``
    cannot answer for this package: its flag switches on torch's own casting, so it stays False inside
    ``mpcourse.core.autocast.autocast`` (a test pins this).
    """
    _check_device_type(device_type)
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return STATE.dtype[device_type] if STATE.enabled[device_type] else None


def any_autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast(device_type)`` or an enabled region of this package's autocast (for any device)
    is on in this thread. Where neither is, no op is cast: code that only computes (``QuantizedLinear``'s
    quantizers and GEMMs) can then skip ``no_autocast``, whose disabled region would still send each of its ops
    through the package's Python mode. ValueError for a device type other than "cpu" or "cuda"."""
    _check_device_type(device_type)
    return torch.is_autocast_enabled(device_type) or any(STATE.enabled.values())


def is_autocast_cache_enabled() -> bool:
    """Whether casts of weights are cached in the current region (default True)."""
    return STATE.cache_enabled


def clear_autocast_cache() -> None:
    """Drop every cached weight cast of this thread (done automatically at the outermost exit)."""
    STATE.cache.clear()
    STATE.given_cache.clear()


def cache_size() -> int:
    """Number of cached weight casts held by this thread (for tests and lesson 05)."""
    return len(STATE.cache)


def _cacheable(t: torch.Tensor, to_type: torch.dtype, device_type: str) -> bool:
    """``can_try_cache`` of ``cached_cast``: an FP32 leaf parameter cast to the lower dtype."""
    return (STATE.cache_enabled and t.requires_grad and t.dtype is torch.float32
            and to_type is STATE.dtype[device_type] and t.is_leaf and not t._is_view()
            and not torch.is_inference_mode_enabled())


def cached_cast(t: torch.Tensor, to_type: torch.dtype, device_type: str) -> torch.Tensor:
    """``t.to(to_type)``, reusing this region's earlier cast of the same weight when allowed.

    ``t`` must already be eligible (floating, of ``device_type``, not float64) and not of ``to_type``.
    A cached cast is served only if ``t`` is the same object and its version counter is the one
    recorded at the cast (no in-place write since); otherwise ``t`` is cast again and the entry replaced.
    The cast is recorded by autograd (``ToCopyBackward0``), so the gradient flows back to ``t`` in
    FP32, as with ``torch.autocast``.
    """
    if STATE.cached_cast is not None:    # a cache given to autocast (lesson 05's signature), checked
        if not STATE.cache_enabled:
            return t.to(to_type)
        return returned("cached_cast", t, STATE.cached_cast(STATE.given_cache, t, to_type), to_type)
    if not _cacheable(t, to_type, device_type):
        return t.to(to_type)
    key = (id(t), to_type)
    hit = STATE.cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    version = t._version                 # read before the cast: the cast itself does not write t
    with torch.enable_grad():            # keep autograd history even under no_grad (pytorch#165068)
        cast = t.to(to_type)
    STATE.cache[key] = (weakref.ref(t), version, cast)
    return cast
