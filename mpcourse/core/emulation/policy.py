"""Tensor-core emulation, when it is on: ``set_emulation``, ``MPCOURSE_EMULATE``, or auto from the CPU's flags.

``set_emulation(True/False)`` (Python) wins; otherwise the environment variable ``MPCOURSE_EMULATE=1`` (on) or
``0`` (off); otherwise *auto*: on for a dtype when the CPU lacks native units for it (BF16: ``avx512_bf16`` or
``amx_bf16``; FP16: ``avx512_fp16`` or ``amx_fp16``, read from ``/proc/cpuinfo``; off-Linux, assumed absent). Units
the process is told not to use count as absent: ``DNNL_MAX_CPU_ISA`` capped below AVX-512 (oneDNN's documented
switch, which the low-precision matmuls go through) or ``ATEN_CPU_CAPABILITY`` set to ``avx2``/``default``, so
that forcing the AVX2 path on an AVX-512 machine computes what an AVX2 machine computes.
Configuration only: the rule (what an emulated GEMM computes) is in ``emulation/rule.py``, its kernel in
``emulation/kernel.py``, the choice between them in ``emulation/__init__.py`` (``tensor_cores``).
"""
from __future__ import annotations

import functools
import os

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Native low-precision GEMM units, by /proc/cpuinfo flag (x86).
_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}

_override: bool | None = None  # set_emulation(); None means: environment variable, then auto


def cpuinfo_flags(text: str | None = None) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo`` (``text``: its contents, for tests);
    empty where there is no such file (not Linux)."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    return cpuinfo_flags()


#: oneDNN ISA caps (``DNNL_MAX_CPU_ISA``) and ATen dispatch levels (``ATEN_CPU_CAPABILITY``) below AVX-512
_BELOW_AVX512_ISA = ("SSE41", "AVX", "AVX2", "AVX2_VNNI")
_BELOW_AVX512_ATEN = ("default", "avx2")


def forced_below_avx512() -> bool:
    """Whether the environment caps this process below AVX-512 (the AVX2 path forced): then no BF16/FP16 units."""
    isa = os.environ.get("DNNL_MAX_CPU_ISA", "").strip().upper()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return isa in _BELOW_AVX512_ISA or aten in _BELOW_AVX512_ATEN


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has native GEMM units for ``dtype`` (bf16 or fp16) that this process may use.

    Read from the x86 flags in ``/proc/cpuinfo``; ``False`` where they cannot be read, and where the environment
    forces a path below AVX-512 (``forced_below_avx512``).
    """
    if forced_below_avx512():
        return False
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
