"""Which CPU kind produced a run: the instruction set torch dispatched to, the CPU's relevant feature flags, and
whether the BF16/FP16 GEMMs ran on native units or through the tensor-core emulation.

Why it is recorded: the same recipe and seed give other bits on another kind of CPU. FP32 GEMMs on AVX2 and on
AVX-512 sum in another order (MKL and oneDNN pick their kernels by instruction set), and on a CPU with BF16/FP16
units (``avx512_bf16``, ``amx_bf16``, ``avx512_fp16``, ``amx_fp16``) the low-precision matmuls run natively instead
of emulated (``mpcourse.core.emulation``). So ``results.json`` says which, and a table's exact digits hold only
on the kind it names.

Sources: ``torch.backends.cpu.get_cpu_capability()`` (ATen's dispatch level: "DEFAULT", "AVX2", "AVX512", ...;
``ATEN_CPU_CAPABILITY`` lowers it); the Linux kernel's ``/proc/cpuinfo`` ``flags`` (x86) or ``Features`` (Arm)
line; the environment variables that force a lower path (``MKL_ENABLE_INSTRUCTIONS``, ``DNNL_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``: MKL, oneDNN and ATen documentation).
"""
from __future__ import annotations

import os
import platform

import torch

from mpcourse.core.emulation.policy import cpuinfo_flags  # noqa: F401  (one reader of /proc/cpuinfo's flags)

#: the /proc/cpuinfo flags that decide which GEMM kernels run (x86 vector and matrix units; Arm SIMD, BF16, SVE)
RELEVANT_FLAGS = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                  "amx_bf16", "amx_fp16", "amx_int8", "asimd", "asimdhp", "bf16", "i8mm", "sve", "sve2")
#: environment variables that force a lower instruction set (recorded when set)
FORCING_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MPCOURSE_EMULATE")


def cpu_model(text: str | None = None) -> str | None:
    """The ``model name`` line of ``/proc/cpuinfo`` (None where there is none)."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name":
            return value.strip()
    return None


def describe(text: str | None = None) -> dict:
    """This machine's CPU kind, as ``results.json`` records it::

        {"arch": "x86_64", "capability": "AVX512", "model": "...", "flags": ["avx2", "avx512_bf16", ...],
         "forced": {"ATEN_CPU_CAPABILITY": "avx2"}, "gemm": {"bfloat16": "native", "float16": "emulated"}}

    ``capability``: the level torch dispatches its own kernels to; ``flags``: those of ``RELEVANT_FLAGS`` the CPU
    has; ``forced``: the variables of ``FORCING_VARIABLES`` that are set; ``gemm``: how a training run's BF16 and
    FP16 GEMMs are computed (``tensor_cores`` auto mode: "emulated" where the emulation is on, else "native")."""
    from mpcourse.core import emulation

    flags = cpuinfo_flags(text)
    return {"arch": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
            "model": cpu_model(text), "flags": [f for f in RELEVANT_FLAGS if f in flags],
            "forced": {v: os.environ[v] for v in FORCING_VARIABLES if v in os.environ},
            "gemm": {str(dt).replace("torch.", ""): "emulated" if emulation.emulation_enabled(dt) else "native"
                     for dt in emulation.LOW_PRECISION}}


def summary(info: dict | None = None) -> str:
    """One line: ``AVX512 (avx512f, avx512_bf16, amx_bf16); bf16 GEMMs native, fp16 GEMMs native``."""
    info = info or describe()
    flags = [f for f in info["flags"] if f.startswith(("avx512", "amx", "avx2", "sve", "bf16"))]
    forced = f"; forced: {', '.join(f'{k}={v}' for k, v in info['forced'].items())}" if info["forced"] else ""
    gemm = ", ".join(f"{k.replace('bfloat16', 'bf16').replace('float16', 'fp16')} GEMMs {v}"
                     for k, v in info["gemm"].items())
    return f"{info['capability']} ({', '.join(flags) or 'no AVX2/AVX-512/AMX flags'}); {gemm}{forced}"
