"""The kernel of tensor-core emulation: the rule of ``emulation/rule.py`` on the matmul ops alone, the same bits.

Equals ``rule.TensorCoreEmulation`` bit for bit (``tests/core/emulation/test_emulation_fast.py`` checks it op by op and on a
training step); ``tensor_cores(fast=True)`` (``emulation/__init__.py``, the training loop's) chooses it.

``rule.TensorCoreEmulation`` is the rule. As a dispatch mode it is called in Python for *every* op, about
2,600 per training step of the compare model, of which some 100 are matmuls: on a 2-core CPU that costs a fifth
of an FP32 step. ``tensor_cores(fast=True)`` (the training loop's) instead registers a Python kernel for the
``EMULATED_OPS`` only, at PyTorch's ``ADInplaceOrView`` dispatch key (``torch.library.Library("aten", "IMPL")``,
``with_keyset=True``).
That key sits below autograd and autocast and above the Python key of dispatch modes and tensor subclasses
(c10/core/DispatchKey.h), so the kernel sees the matmuls a mode would see -- forward, backward, inside
``torch.autocast`` -- and every other op never leaves C++. The kernel applies the rule (``_wants_emulation``,
then the same ``EMULATED_OPS`` function) or hands the call on unchanged (``OpOverload.redispatch`` with the
keys after ``ADInplaceOrView``). The kernels are registered while at least one thread is inside
``tensor_cores(fast=True)`` and act only in such a thread; outside, nothing is registered.

Two cases keep the mode's exact behaviour:
* A dispatch mode pushed inside the region (the memory tracker of the first step, a test's spy) saw the
  low-precision matmul itself, with the emulation below it, invisible: the kernel then puts a
  ``TensorCoreEmulation`` at the bottom of the mode stack for that one call and hands the call on. (A mode
  pushed *before* the region saw the emulation's FP32 ops under the mode; here it sees the matmul instead.)
* Inference tensors inside ``torch.inference_mode()`` skip ``ADInplaceOrView`` altogether: a region entered
  under inference mode pushes the mode instead. (Limit: inference tensors of an ``inference_mode`` opened
  *inside* ``tensor_cores()`` run torch's native kernel.)
``tests/core/emulation/test_emulation_fast.py`` checks the kernel against the mode bit for bit.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from . import rule
from .rule import EMULATED_OPS, TensorCoreEmulation, _wants_emulation

_AFTER_KERNEL = torch._C._after_ADInplaceOrView_keyset   # the dispatch keys below ADInplaceOrView
_local = threading.local()                               # .depth: tensor_cores() regions open in this thread
_registry_lock = threading.Lock()
_registry = {"users": 0, "lib": None}                    # threads inside tensor_cores(); the registered kernels


def _depth() -> int:
    return getattr(_local, "depth", 0)


def _make_kernel(op, impl):
    def kernel(keyset, *args, **kwargs):
        if _depth() and not getattr(_local, "inserting", False) and _wants_emulation(args):
            if torch._C._len_torch_dispatch_stack():       # modes pushed in the region see the op first
                return _below_modes(op, keyset, args, kwargs)
            rule._emulated_calls += 1
            return impl(*args, **kwargs)
        return op.redispatch(keyset & _AFTER_KERNEL, *args, **kwargs)
    return kernel


def _below_modes(op, keyset, args, kwargs):
    """Hand the call on with a ``TensorCoreEmulation`` at the bottom of the mode stack, as if it had been pushed
    when the region was entered, then restore the stack."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    modes = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]   # top first
    bottom = TensorCoreEmulation()
    _push_mode(bottom)
    for m in reversed(modes):
        _push_mode(m)
    _local.inserting = True
    try:
        return op.redispatch(keyset & _AFTER_KERNEL, *args, **kwargs)
    finally:
        _local.inserting = False
        for _ in modes:
            _pop_mode()
        _pop_mode()
        for m in reversed(modes):
            _push_mode(m)


def _register() -> None:
    with _registry_lock:
        if _registry["users"] == 0:
            lib = torch.library.Library("aten", "IMPL")
            for op, impl in EMULATED_OPS.items():
                name = op._schema.name.split("::", 1)[1]
                lib.impl(name if op._overloadname == "default" else f"{name}.{op._overloadname}",
                         _make_kernel(op, impl), "ADInplaceOrView", with_keyset=True)
            _registry["lib"] = lib
        _registry["users"] += 1


def _unregister() -> None:
    with _registry_lock:
        _registry["users"] -= 1
        if _registry["users"] == 0:
            _registry["lib"]._destroy()
            _registry["lib"] = None


@contextlib.contextmanager
def _fast_region():
    """The kernels of the fast path, active in this thread for the region."""
    outermost = _depth() == 0
    if outermost:
        _register()
    _local.depth = _depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if outermost:
            _unregister()
