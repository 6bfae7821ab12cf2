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

Modules: ``policy`` (when it is on), ``rule`` (what an emulated GEMM computes: ``EMULATED_OPS`` and the
``TensorCoreEmulation`` dispatch mode), ``kernel`` (the same bits through kernels on the matmul ops alone,
equal bit for bit to the rule); this package's ``tensor_cores`` chooses between rule and kernel.

Example::

    from mpcourse.core.emulation import tensor_cores
    with tensor_cores():                       # auto: emulate where the CPU is slow
        y = x.bfloat16() @ w.bfloat16()        # (M, N) bf16, computed as fp32 GEMM + one rounding
"""
from __future__ import annotations

import contextlib

import torch

from . import kernel, policy, rule
from .kernel import _depth, _registry
from .policy import LOW_PRECISION, cpu_has_native, emulation_enabled, set_emulation
from .rule import EMULATED_OPS, TensorCoreEmulation, emulated_calls

__all__ = ["LOW_PRECISION", "EMULATED_OPS", "TensorCoreEmulation", "cpu_has_native", "emulated_calls",
           "emulation_enabled", "set_emulation", "status", "tensor_cores"]


@contextlib.contextmanager
def tensor_cores(enabled: bool | None = None, *, fast: bool = False):
    """Context in which low-precision CPU matmuls are emulated (see the module docstring).

    Args:
        enabled: ``None`` (default) follows ``set_emulation`` / ``MPCOURSE_EMULATE`` / auto;
            ``True`` or ``False`` forces it for this region only.
        fast: ``False`` (default) enters the rule, the ``TensorCoreEmulation`` mode; ``True`` computes the same
            bits through its kernel on the matmul ops only (``emulation/kernel.py``; the training loop's), and
            enters the mode under ``torch.inference_mode()``.
    """
    saved = policy._override
    if enabled is not None:
        set_emulation(enabled)
    try:
        if not any(emulation_enabled(dt) for dt in LOW_PRECISION):
            yield
        elif not fast or torch.is_inference_mode_enabled():
            with TensorCoreEmulation():
                yield
        else:
            with kernel._fast_region():
                yield
    finally:
        policy._override = saved


def status() -> str:
    """One line saying, per dtype, whether emulation is on and whether the CPU is native."""
    parts = []
    for dt in LOW_PRECISION:
        name = str(dt).replace("torch.", "")
        parts.append(f"{name}: {'emulated' if emulation_enabled(dt) else 'native'}"
                     f" (CPU {'has' if cpu_has_native(dt) else 'lacks'} {name} units)")
    return "; ".join(parts)
