"""Speed, explained: model FLOPs per token, achieved FLOP/s and the fraction of the machine's peak.

Model FLOPs (the "MFU" convention of PaLM, Chowdhery et al. 2022, appendix B, and nanoGPT's
``estimate_mfu``): a multiply-add is 2 FLOPs; a training step costs 3x the forward (the backward
computes two GEMMs per forward GEMM: input gradient and weight gradient). Per token, forward::

    linear layers   2 * (weights of every GEMM)     qkv 3C^2, proj C^2, fc 4C^2, mlp proj 4C^2 per block,
                                                    the head V*C (embedding lookups cost no FLOPs)
    attention       2 * 2 * T * C per block         q @ k^T and att @ v over the full T x T square
                                                    (the model computes the masked half too)

Biases, LayerNorm, softmax and GELU are left out (they are O(C) per token, memory-bound).

Peaks: on a GPU the chip's dense tensor-core peak (``GPU_PEAKS``; H100/H200 SXM 989 TFLOP/s BF16,
1979 FP8; NVIDIA H100 datasheet); on a CPU there is no datasheet number worth trusting, so
``measure_cpu_peak`` times the machine's own FP32 GEMM (the best a dense kernel reaches here).
"""
from __future__ import annotations

import time

import torch

# dense (no sparsity) tensor-core peaks in FLOP/s: (bf16/fp16, fp8); NVIDIA datasheets
GPU_PEAKS = {"H100": (989e12, 1979e12), "H200": (989e12, 1979e12), "B200": (2250e12, 4500e12),
             "A100": (312e12, None)}


def flops_per_token(n_layer: int, n_embd: int, block_size: int, vocab_size: int, *, training: bool = True) -> float:
    """Model FLOPs per token of the course's GPT (forward x3 when ``training``)."""
    C, T = n_embd, block_size
    linear = n_layer * 12 * C * C + vocab_size * C                   # GEMM weights per token
    fwd = 2 * linear + n_layer * 4 * T * C
    return 3 * fwd if training else fwd


def measure_cpu_peak(n: int = 1024, repeats: int = 5, threads: int | None = None) -> float:
    """FP32 FLOP/s of this CPU's best (n x n) @ (n x n) GEMM over ``repeats`` timed runs (after a warm-up)."""
    if threads is not None:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        if threads is not None:
            torch.set_num_threads(old)
    return 2 * n ** 3 / best


def gpu_peak(device_name: str, fp8: bool = False) -> float | None:
    """The dense peak of a GPU from its ``torch.cuda.get_device_name()`` (None if not in ``GPU_PEAKS``)."""
    for key, (bf16, f8) in GPU_PEAKS.items():
        if key in device_name:
            return f8 if fp8 else bf16
    return None


def fraction_of_peak(tokens_per_s: float, flops_token: float, peak_flops: float) -> float:
    """Achieved model FLOP/s (tokens/s x FLOPs/token) over the peak."""
    return tokens_per_s * flops_token / peak_flops
