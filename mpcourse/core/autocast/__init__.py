"""mpcourse.core.autocast: torch.autocast's op-level cast policy, readable and in Python (lesson 05).

Public API (semantics of ``torch.autocast``, ``torch.amp.custom_fwd``/``custom_bwd``, torch 2.13):

* ``autocast(device_type, dtype=None, enabled=True, cache_enabled=None)``: context manager and
  decorator (``mode.py``); ``course_additions=False`` applies torch's tables alone (below).
* ``custom_fwd(device_type=..., cast_inputs=None)`` / ``custom_bwd(device_type=...)`` for
  torch.autograd.Function (``custom.py``).
* Queries: ``is_autocast_enabled(device_type)``, ``get_autocast_dtype(device_type)``,
  ``is_autocast_cache_enabled()``, ``clear_autocast_cache()``, ``cache_size()`` (``state.py``);
  ``autocast_dtype_in_effect(device_type)``: the dtype of torch's or this autocast, whichever is on;
  ``any_autocast_enabled(device_type)``: whether either casts anything at all.
  ``torch.is_autocast_enabled`` stays False inside this package's autocast: ask here instead.
* ``no_autocast(device_type)``: neither autocast casts inside (``mode.py``).
* ``torch.utils.checkpoint`` inside a region recomputes under the region's state (``checkpoint.py``).
* The policy as data: ``policy.TABLES["cpu"|"cuda"][policy]``, ``policy_for(device_type, op)``,
  ``op_name(callable)`` (``policy.py``, transcribed from aten/src/ATen/autocast_mode.{h,cpp}), and where the
  course departs from them, ``policy.ADDITIONS`` (the grouped GEMM ``torch._grouped_mm`` in ``bmm``'s policy).
"""
from . import checkpoint as _checkpoint
from . import policy
from .custom import custom_bwd, custom_fwd
from .mode import AutocastMode, autocast, no_autocast, op_name
from .policy import (BANNED, FP32, FP32_APPEND_DTYPE, FP32_SET_OPT_DTYPE, LOWER_PRECISION_FP, PROMOTE,
                     TABLES, policy_for)
from .state import (any_autocast_enabled, autocast_dtype_in_effect, cache_size, clear_autocast_cache,
                    get_autocast_dtype, is_autocast_cache_enabled, is_autocast_enabled)

_checkpoint.install()      # torch.utils.checkpoint recomputes under this package's state (checkpoint.py)

__all__ = [
    "autocast", "custom_fwd", "custom_bwd", "AutocastMode", "op_name", "policy", "policy_for", "TABLES",
    "LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "FP32_APPEND_DTYPE", "PROMOTE", "BANNED",
    "is_autocast_enabled", "get_autocast_dtype", "is_autocast_cache_enabled", "clear_autocast_cache",
    "cache_size", "autocast_dtype_in_effect", "any_autocast_enabled", "no_autocast",
]
