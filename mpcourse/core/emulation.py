"""Tensor-core emulation: how matmuls on BF16/FP16 CPU tensors are computed.

A GPU tensor core multiplies low-precision operands exactly, accumulates in FP32 and rounds the
result once to the output dtype (NVIDIA, "Mixed Precision Training" guide; Micikevicius et al. 2018,
section 3.3: "FP16 products accumulated into FP32"). Many CPUs have no BF16/FP16 units: on them
PyTorch's native low-precision matmul kernels are 10-100x slower than FP32 (measured in
``benchmarks/bench_emulation.py``). Here those ops are computed the way a tensor core computes
them instead:

    out = round_to_dtype( float32(a) @ float32(b) )      # exact upcast, FP32 accumulation, one rounding

Every BF16/FP16 value is exactly representable in FP32, so the upcast loses nothing; the FP32
GEMM runs on the fast FP32 kernel; the single rounding at the end is the only low-precision step.
The result can differ from PyTorch's native CPU kernel by at most one unit in the last place of the
output (different accumulation order inside the FP32 sum), and is the same on every machine.

The switch is a ``TorchDispatchMode`` (``torch.utils._python_dispatch``). It sits *below*
autograd and autocast in PyTorch's dispatcher, so it sees the matmuls of the forward pass, of the
backward pass and of ``torch.autocast`` regions alike, after any cast autocast made.

When is it on?  ``set_emulation(True/False)`` (Python) wins; otherwise the environment variable
``MPCOURSE_EMULATE=1`` (on) or ``0`` (off); otherwise *auto*: on for a dtype when the CPU lacks
native units for it (BF16: ``avx512_bf16`` or ``amx_bf16``; FP16: ``avx512_fp16`` or ``amx_fp16``,
read from ``/proc/cpuinfo``; off-Linux, assumed absent). The mode only acts inside
``tensor_cores()``, which the training loop, ``mpcourse compare`` and the benchmarks enter. The training loop
enters ``tensor_cores(fast=True)``: the same bits through kernels on the matmul ops alone, so that the other
ops never call into Python (see "the fast path" below).

Example::

    from mpcourse.core.emulation import tensor_cores
    with tensor_cores():                       # auto: emulate where the CPU is slow
        y = x.bfloat16() @ w.bfloat16()        # (M, N) bf16, computed as fp32 GEMM + one rounding
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Native low-precision GEMM units, by /proc/cpuinfo flag (x86).
_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}

_override: bool | None = None  # set_emulation(); None means: environment variable, then auto


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has native GEMM units for ``dtype`` (bf16 or fp16).

    Read from the x86 flags in ``/proc/cpuinfo``; ``False`` where they cannot be read.
    """
    return any(flag in _cpu_flags() for flag in _NATIVE_FLAGS.get(dtype, ()))


def set_emulation(enabled: bool | None) -> None:
    """Force tensor-core emulation on (``True``) or off (``False``), or back to auto (``None``).

    Takes precedence over ``MPCOURSE_EMULATE``. Notebooks call ``set_emulation(True)`` so that
    every machine computes the same bits.
    """
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_emulation takes True, False or None (auto), got {enabled!r}")
    _override = enabled


def emulation_enabled(dtype: torch.dtype) -> bool:
    """Whether matmuls on CPU tensors of ``dtype`` are emulated inside ``tensor_cores()``.

    Raises:
        ValueError: ``MPCOURSE_EMULATE`` is set to something other than ``0`` or ``1``.
    """
    if dtype not in LOW_PRECISION:
        return False
    if _override is not None:
        return _override
    env = os.environ.get("MPCOURSE_EMULATE", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"MPCOURSE_EMULATE must be 0 (off) or 1 (on), or unset for auto; got {env!r}")
    return not cpu_has_native(dtype)


# --- the emulated ops: exact upcast, FP32 accumulation, one rounding -----------------------------

def _f32(t):
    return t.float() if isinstance(t, torch.Tensor) else t


def _mm(a, b):                       # (M, K) @ (K, N)
    return torch.mm(a.float(), b.float()).to(a.dtype)


def _bmm(a, b):                      # (B, M, K) @ (B, K, N)
    return torch.bmm(a.float(), b.float()).to(a.dtype)


def _addmm(bias, a, b, *, beta=1, alpha=1):          # beta*bias + alpha*(a @ b), rounded once
    return torch.addmm(_f32(bias), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    return torch.baddbmm(_f32(bias), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)


def _addbmm(bias, a, b, *, beta=1, alpha=1):
    return torch.addbmm(_f32(bias), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)


def _mv(a, v):
    return torch.mv(a.float(), v.float()).to(a.dtype)


def _addmv(bias, a, v, *, beta=1, alpha=1):
    return torch.addmv(_f32(bias), a.float(), v.float(), beta=beta, alpha=alpha).to(a.dtype)


def _dot(a, b):
    return torch.dot(a.float(), b.float()).to(a.dtype)


EMULATED_OPS = {
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _baddbmm,
    aten.addbmm.default: _addbmm,
    aten.mv.default: _mv,
    aten.addmv.default: _addmv,
    aten.dot.default: _dot,
}
"""ATen ops computed as tensor cores compute them. ``linear`` and ``matmul`` are composite:
PyTorch lowers them to ``mm``/``addmm``/``bmm`` before this mode sees them, forward and backward."""


def _wants_emulation(args) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return False
    dtypes = {t.dtype for t in tensors}
    # Operands of one low-precision dtype (a bias may be the same dtype); mixed dtypes are
    # an error for the native kernel too, so leave them to it.
    return len(dtypes) == 1 and emulation_enabled(tensors[0].dtype)


class TensorCoreEmulation(TorchDispatchMode):
    """Dispatch mode that computes BF16/FP16 CPU matmuls as FP32 GEMMs with one final rounding.

    Ops in ``EMULATED_OPS`` whose tensor arguments are all CPU tensors of one dtype for which
    ``emulation_enabled(dtype)`` holds are replaced; every other op runs unchanged. Output dtype,
    shape and device equal the native op's.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        global _emulated_calls
        kwargs = kwargs or {}
        impl = EMULATED_OPS.get(func)
        if impl is not None and _wants_emulation(args):
            _emulated_calls += 1
            return impl(*args, **kwargs)
        return func(*args, **kwargs)


_emulated_calls = 0


def emulated_calls() -> int:
    """How many matmuls ``TensorCoreEmulation`` has computed in this process so far (a counter: compare two
    readings to see whether a region ran any low-precision CPU matmul)."""
    return _emulated_calls


# --- the fast path: a kernel on the matmul ops only ---------------------------------------------
#
# ``TensorCoreEmulation`` above is the rule. As a dispatch mode it is called in Python for *every* op, about
# 2,600 per training step of the compare model, of which some 100 are matmuls: on a 2-core CPU that costs a fifth
# of an FP32 step. ``tensor_cores(fast=True)`` (the training loop's) instead registers a Python kernel for the
# ``EMULATED_OPS`` only, at PyTorch's ``ADInplaceOrView`` dispatch key (``torch.library.Library("aten", "IMPL")``,
# ``with_keyset=True``).
# That key sits below autograd and autocast and above the Python key of dispatch modes and tensor subclasses
# (c10/core/DispatchKey.h), so the kernel sees the matmuls a mode would see -- forward, backward, inside
# ``torch.autocast`` -- and every other op never leaves C++. The kernel applies the rule (``_wants_emulation``,
# then the same ``EMULATED_OPS`` function) or hands the call on unchanged (``OpOverload.redispatch`` with the
# keys after ``ADInplaceOrView``). The kernels are registered while at least one thread is inside
# ``tensor_cores(fast=True)`` and act only in such a thread; outside, nothing is registered.
#
# Two cases keep the mode's exact behaviour:
# * A dispatch mode pushed inside the region (the memory tracker of the first step, a test's spy) saw the
#   low-precision matmul itself, with the emulation below it, invisible: the kernel then puts a
#   ``TensorCoreEmulation`` at the bottom of the mode stack for that one call and hands the call on. (A mode
#   pushed *before* the region saw the emulation's FP32 ops under the mode; here it sees the matmul instead.)
# * Inference tensors inside ``torch.inference_mode()`` skip ``ADInplaceOrView`` altogether: a region entered
#   under inference mode pushes the mode instead. (Limit: inference tensors of an ``inference_mode`` opened
#   *inside* ``tensor_cores()`` run torch's native kernel.)
# ``tests/test_emulation_fast.py`` checks the kernel against the mode bit for bit.

_AFTER_KERNEL = torch._C._after_ADInplaceOrView_keyset   # the dispatch keys below ADInplaceOrView
_local = threading.local()                               # .depth: tensor_cores() regions open in this thread
_registry_lock = threading.Lock()
_registry = {"users": 0, "lib": None}                    # threads inside tensor_cores(); the registered kernels


def _depth() -> int:
    return getattr(_local, "depth", 0)


def _make_kernel(op, impl):
    def kernel(keyset, *args, **kwargs):
        global _emulated_calls
        if _depth() and not getattr(_local, "inserting", False) and _wants_emulation(args):
            if torch._C._len_torch_dispatch_stack():       # modes pushed in the region see the op first
                return _below_modes(op, keyset, args, kwargs)
            _emulated_calls += 1
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


@contextlib.contextmanager
def tensor_cores(enabled: bool | None = None, *, fast: bool = False):
    """Context in which low-precision CPU matmuls are emulated (see the module docstring).

    Args:
        enabled: ``None`` (default) follows ``set_emulation`` / ``MPCOURSE_EMULATE`` / auto;
            ``True`` or ``False`` forces it for this region only.
        fast: ``False`` (default) enters the ``TensorCoreEmulation`` mode; ``True`` computes the same bits through
            kernels on the matmul ops only (the fast path, above; the training loop's), and enters the mode
            under ``torch.inference_mode()``.
    """
    global _override
    saved = _override
    if enabled is not None:
        set_emulation(enabled)
    try:
        if not any(emulation_enabled(dt) for dt in LOW_PRECISION):
            yield
        elif not fast or torch.is_inference_mode_enabled():
            with TensorCoreEmulation():
                yield
        else:
            with _fast_region():
                yield
    finally:
        _override = saved


def status() -> str:
    """One line saying, per dtype, whether emulation is on and whether the CPU is native."""
    parts = []
    for dt in LOW_PRECISION:
        name = str(dt).replace("torch.", "")
        parts.append(f"{name}: {'emulated' if emulation_enabled(dt) else 'native'}"
                     f" (CPU {'has' if cpu_has_native(dt) else 'lacks'} {name} units)")
    return "; ".join(parts)
