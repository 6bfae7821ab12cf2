"""``custom_fwd`` / ``custom_bwd``: autocast for the forward and backward of a torch.autograd.Function.

Semantics of ``torch.amp.custom_fwd`` / ``torch.amp.custom_bwd`` (torch/amp/autocast_mode.py,
torch 2.13), over ``mpcourse.core.autocast``:

* ``custom_fwd`` records on ``ctx`` the autocast dtype of ``device_type`` and whether autocast was
  enabled when forward ran. With ``cast_inputs=dtype`` inside an enabled region, it casts the
  floating tensor inputs of that device type (not float64; also inside lists, tuples and dicts) to
  ``dtype`` and runs forward with autocast *disabled*; backward then also runs with it disabled.
  Outside an enabled region ``cast_inputs`` has no effect.
* ``custom_bwd`` runs backward inside ``autocast(device_type, dtype=<recorded>, enabled=<recorded>)``,
  so backward's ops are cast as forward's were (BF16 matmuls in forward -> BF16 matmuls in backward).

Across the two autocasts:

* These decorators work inside ``torch.autocast`` as ``torch.amp``'s do: forward records which
  autocast was on (torch's or this package's) and its dtype, ``cast_inputs`` casts under either (then
  forward runs with both disabled), and backward re-enters the same kind of region.
* ``torch.amp.custom_fwd``/``custom_bwd`` inside this package's autocast cannot: they ask
  ``torch.is_autocast_enabled``, which is False here (see ``state.autocast_dtype_in_effect``). So
  ``cast_inputs`` is ignored, forward's ops are still cast by this autocast (its mode is active), and
  backward runs with no autocast, so a backward that multiplies forward's BF16 output gradient with
  the FP32 saved inputs fails with a dtype mismatch. ``tests/core/autocast/test_autocast_trust.py`` pins this; use
  these decorators with this package's autocast.

Why: the backward of a custom Function runs when ``loss.backward()`` is called, usually after the
autocast region has exited; without ``custom_bwd`` its matmuls would run in FP32 while forward's ran
in BF16. Example::

    class MyMM(torch.autograd.Function):
        @staticmethod
        @custom_fwd(device_type="cpu")
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)                                  # bf16 inside autocast("cpu")
        @staticmethod
        @custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)           # bf16 too
"""
from __future__ import annotations

import functools

import torch

from .mode import autocast, no_autocast
from .state import _check_device_type, get_autocast_dtype, is_autocast_enabled

_DTYPE_ATTR = "_mpcourse_autocast_dtype"
_ENABLED_ATTR = "_mpcourse_fwd_used_autocast"
_KIND_ATTR = "_mpcourse_autocast_kind"       # "torch" or "mpcourse": whose region forward ran in


def _cast_inputs(value, device_type: str, dtype: torch.dtype):
    """Cast eligible tensors (floating, of ``device_type``, not float64) found in ``value``."""
    if isinstance(value, torch.Tensor):
        eligible = (value.is_floating_point() and value.device.type == device_type
                    and value.dtype is not torch.float64)
        return value.to(dtype) if eligible else value
    if isinstance(value, dict):
        return {k: _cast_inputs(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_cast_inputs(v, device_type, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuple
    return value


def _device_arg(fn, device_type, name):
    if isinstance(fn, str):                    # custom_fwd("cpu") written positionally
        fn, device_type = None, fn
    if not isinstance(device_type, str):
        raise ValueError(f"{name} needs device_type='cpu' or 'cuda' (a str), got {device_type!r}; "
                         f"write @{name}(device_type='cpu')")
    _check_device_type(device_type)
    return fn, device_type


def custom_fwd(fwd=None, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None):
    """Decorate the ``forward`` staticmethod of a torch.autograd.Function (below ``@staticmethod``).

    Args:
        fwd: the forward function (given when used without parentheses after binding device_type).
        device_type: ``"cpu"`` or ``"cuda"``; also accepted as the first positional argument.
        cast_inputs: None (forward's ops follow the current autocast state), or a dtype: inside an
            enabled region, cast floating inputs to it and run forward with autocast disabled.

    Raises:
        ValueError: a missing or unknown ``device_type``.
    """
    fwd, device_type = _device_arg(fwd, device_type, "custom_fwd")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        on_torch = torch.is_autocast_enabled(device_type)
        setattr(ctx, _KIND_ATTR, "torch" if on_torch else "mpcourse")
        setattr(ctx, _DTYPE_ATTR, torch.get_autocast_dtype(device_type) if on_torch
                else get_autocast_dtype(device_type))
        enabled = on_torch or is_autocast_enabled(device_type)
        if cast_inputs is None or not enabled:
            setattr(ctx, _ENABLED_ATTR, enabled if cast_inputs is None else False)
            return fwd(ctx, *args, **kwargs)
        setattr(ctx, _ENABLED_ATTR, False)
        with no_autocast(device_type):
            return fwd(ctx, *_cast_inputs(args, device_type, cast_inputs),
                       **_cast_inputs(kwargs, device_type, cast_inputs))

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type: str | None = None):
    """Decorate the ``backward`` staticmethod: run it with the autocast state forward recorded.

    Args:
        bwd: the backward function.
        device_type: ``"cpu"`` or ``"cuda"``, the same as forward's ``custom_fwd``.

    Raises:
        ValueError: a missing or unknown ``device_type``.
        RuntimeError: forward was not decorated with ``custom_fwd`` (nothing was recorded).
    """
    bwd, device_type = _device_arg(bwd, device_type, "custom_bwd")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *args, **kwargs):
        if not hasattr(ctx, _ENABLED_ATTR):
            raise RuntimeError("custom_bwd found no autocast state on ctx: decorate the Function's "
                               f"forward with @custom_fwd(device_type={device_type!r}) as well")
        dtype, enabled = getattr(ctx, _DTYPE_ATTR), getattr(ctx, _ENABLED_ATTR)
        if not enabled:
            region = no_autocast(device_type)
        elif getattr(ctx, _KIND_ATTR) == "torch":
            region = torch.autocast(device_type, dtype=dtype)
        else:
            region = autocast(device_type, dtype=dtype)
        with region:
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd
