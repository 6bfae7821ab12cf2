"""Speed, explained: model FLOPs per token, achieved FLOP/s and the fraction of the machine's peak.

Model FLOPs (the "MFU" convention of PaLM, Chowdhery et al. 2022, appendix B, and nanoGPT's
``estimate_mfu``): a multiply-add is 2 FLOPs; a training step costs 3x the forward (the backward
computes two GEMMs per forward GEMM: input gradient and weight gradient). Per token, forward::

    linear layers   2 * (weights of every GEMM)     qkv 3C^2, proj C^2, fc 4C^2, mlp proj 4C^2 per block,
                                                    the head V*C (embedding lookups cost no FLOPs)
    attention       2 * 2 * T * C per block         q @ k^T and att @ v over the full T x T square
                                                    (the model computes the masked half too)

Biases, LayerNorm, softmax and GELU are left out (they are O(C) per token, memory-bound).

Peaks, one per GEMM dtype, and each row measured against the peak of the dtype its GEMMs run in
(``peak_key``; the recipe declares it as ``gemm_dtype``). On a GPU: the chip's dense tensor-core peak
(``GPU_PEAKS``; H100/H200 SXM 989 TFLOP/s BF16, 1979 FP8; NVIDIA H100 datasheet): FP8 rows against the FP8
peak, every other row against the BF16 one (PaLM's MFU convention: the chip's training peak; an FP32 row cannot
reach it). On a CPU there is no datasheet number worth trusting, so ``measure_gemm_peak`` times the machine's
own GEMM in that dtype: FP32, and BF16 or FP16 where the CPU has native units for it (where it has not, those
GEMMs are emulated as FP32 GEMMs plus one rounding, ``mpcourse.core.emulation``, and an FP8/MX/NVFP4 GEMM on a
CPU is an FP32 GEMM of the upcast codes, ``mpcourse.core.quant.kernels.upcast.cpu_scaled_mm``: those rows are measured
against the FP32 peak).

A timing is only ever too slow (another process took the core, a frequency step), never too fast, so the peak
is the best of several timings (``GEMM_REPEATS``, after a warm-up): one GEMM timed once varied 2.2x across five
start-ups of ``mpcourse compare`` on a shared 2-core CPU. Even so a row can beat a peak measured while the
machine was busy; ``percent_of_peak`` then clamps it at 100 and says so (``mpcourse compare`` first measures
that dtype's peak again, and keeps the better of the two).
"""
from __future__ import annotations

import time

import torch

# dense (no sparsity) tensor-core peaks in FLOP/s: (bf16/fp16, fp8); NVIDIA datasheets
GPU_PEAKS = {"H100": (989e12, 1979e12), "H200": (989e12, 1979e12), "B200": (2250e12, 4500e12),
             "A100": (312e12, None)}


def flops_per_token(n_layer: int, n_embd: int, block_size: int, vocab_size: int, *, training: bool = True,
                    mlp: int | None = None) -> float:
    """Model FLOPs per token of the course's GPT (forward x3 when ``training``). ``mlp``: the GEMM weights one
    token meets in a block's MLP (default the dense MLP's 8 C^2; a mixture of experts passes its own,
    ``gpt.model.mlp_weights_per_token``)."""
    C, T = n_embd, block_size
    mlp = 8 * C * C if mlp is None else mlp
    linear = n_layer * (4 * C * C + mlp) + vocab_size * C            # GEMM weights per token: attention's 4 C^2
    fwd = 2 * linear + n_layer * 4 * T * C
    return 3 * fwd if training else fwd


#: the GEMM dtypes a row's peak is keyed by (``TrainingRecipe.gemm_dtype``); "fp8" stands for every quantized
#: recipe (FP8, MXFP8, NVFP4 operands)
GEMM_DTYPES = ("fp32", "bf16", "fp16", "fp8")
#: timed GEMMs per peak measurement (the best counts), after one warm-up
GEMM_REPEATS = 10


def _torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def measure_gemm_peak(dtype: str = "fp32", n: int = 1024, repeats: int = GEMM_REPEATS, threads: int | None = None,
                      clock=time.perf_counter) -> float:
    """FLOP/s of this CPU's best ``(n x n) @ (n x n)`` GEMM in ``dtype`` ("fp32", "bf16", "fp16") on ``threads``
    threads (default: torch's current count): 2 n^3 over the shortest of ``repeats`` timed runs, after a warm-up.
    ``clock``: the timer (seconds), replaceable for a test."""
    if threads is not None:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
    try:
        dt = _torch_dtype(dtype)
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            a @ b
            best = min(best, clock() - t0)
    finally:
        if threads is not None:
            torch.set_num_threads(old)
    return 2 * n ** 3 / best


def measure_cpu_peak(n: int = 1024, repeats: int = GEMM_REPEATS, threads: int | None = None) -> float:
    """FP32 FLOP/s of this CPU's best GEMM (``measure_gemm_peak("fp32", ...)``)."""
    return measure_gemm_peak("fp32", n, repeats, threads)


def peak_key(gemm_dtype: str, device: str, emulated: dict[str, bool]) -> str:
    """The peak a row whose GEMMs run in ``gemm_dtype`` is measured against (a key of ``cpu_peaks`` /
    ``gpu_peaks``). ``emulated["bf16"]`` / ``["fp16"]``: whether this machine computes that dtype's GEMMs through
    the tensor-core emulation (FP32 GEMMs; ``mpcourse.core.emulation.emulation_enabled``).

    GPU: "fp8" for quantized rows, "bf16" for every other. CPU: "fp32" for FP32 and quantized rows (an FP8 GEMM on
    a CPU is an FP32 GEMM) and for an emulated 16-bit dtype, the dtype itself where it runs natively."""
    if gemm_dtype not in GEMM_DTYPES:
        raise ValueError(f"gemm dtype must be one of {', '.join(GEMM_DTYPES)}, got {gemm_dtype!r}")
    if device == "cuda":
        return "fp8" if gemm_dtype == "fp8" else "bf16"
    if gemm_dtype in ("fp32", "fp8"):
        return "fp32"
    return "fp32" if emulated[gemm_dtype] else gemm_dtype


def cpu_peaks(emulated: dict[str, bool], threads: int | None = None, measure=measure_gemm_peak) -> dict[str, float]:
    """The CPU peaks a run needs: FP32, and each 16-bit dtype this CPU computes natively (``emulated`` False)."""
    return {key: measure(key, threads=threads) for key in ("fp32", "bf16", "fp16")
            if key == "fp32" or not emulated[key]}


def gpu_peaks(device_name: str) -> dict[str, float]:
    """The dense tensor-core peaks of a GPU, by key ("bf16", "fp8" where known); {} for a GPU not in the table."""
    bf16, fp8 = gpu_peak(device_name), gpu_peak(device_name, fp8=True)
    return {k: v for k, v in (("bf16", bf16), ("fp8", fp8)) if v is not None}


def row_peaks(names, peaks: dict[str, float], device: str, emulated: dict[str, bool]) -> dict[str, float | None]:
    """Each row's peak (``names``: the table's row names; a learner's ``"NAME [yours]"`` row counts as ``NAME``):
    ``peaks[peak_key(recipe.gemm_dtype, ...)]``, None where that peak is unknown."""
    from ..recipes import get_recipe

    out = {}
    for name in names:
        key = peak_key(get_recipe(name.removesuffix(" [yours]")).gemm_dtype, device, emulated)
        out[name] = peaks.get(key)
    return out


def emulated_dtypes() -> dict[str, bool]:
    """{"bf16": ..., "fp16": ...}: whether this process computes that dtype's GEMMs through the emulation."""
    from mpcourse.core import emulation

    return {"bf16": emulation.emulation_enabled(torch.bfloat16), "fp16": emulation.emulation_enabled(torch.float16)}


def percent_of_peak(tokens_per_s: float, flops_token: float, peak_flops: float) -> tuple[float, bool]:
    """Model FLOP/s as a percentage of the peak, clamped at 100: (percent, clamped). A row above its peak means
    the peak measured low (a busy machine), not a kernel faster than the machine's best."""
    pct = 100.0 * fraction_of_peak(tokens_per_s, flops_token, peak_flops)
    return (100.0, True) if pct > 100.0 else (pct, False)


def gpu_peak(device_name: str, fp8: bool = False) -> float | None:
    """The dense peak of a GPU from its ``torch.cuda.get_device_name()`` (None if not in ``GPU_PEAKS``)."""
    for key, (bf16, f8) in GPU_PEAKS.items():
        if key in device_name:
            return f8 if fp8 else bf16
    return None


def fraction_of_peak(tokens_per_s: float, flops_token: float, peak_flops: float) -> float:
    """Achieved model FLOP/s (tokens/s x FLOPs/token) over the peak."""
    return tokens_per_s * flops_token / peak_flops
