"""The rule of tensor-core emulation: what an emulated low-precision GEMM computes, and the dispatch mode that
applies it.

A GPU tensor core multiplies low-precision operands exactly, accumulates in FP32 and rounds the result once to
the output dtype (NVIDIA, "Mixed Precision Training" guide; Micikevicius et al. 2018, section 3.3: "FP16 products
accumulated into FP32")::

    out = round_to_dtype( float32(a) @ float32(b) )      # exact upcast, FP32 accumulation, one rounding

``EMULATED_OPS`` maps each ATen matmul op to that rule (``_mm``, ``_addmm``, ...); ``TensorCoreEmulation`` is a
``TorchDispatchMode`` that applies it to CPU operands of one low-precision dtype for which the policy
(``emulation/policy.py``) says so, and runs every other op unchanged. Its kernel, which computes the same bits
without a dispatch mode (a Python kernel on the matmul ops alone), is ``emulation/kernel.py``; this module does
not import it.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .policy import emulation_enabled

aten = torch.ops.aten


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
