"""When does FP8 pay? A break-even model for one linear layer's training step (forward + backward).

For y = x @ W^T with x (M, K), W (N, K) and output gradient g (M, N), a training step runs three GEMMs
(forward, input gradient, weight gradient): 6 M K N FLOPs. In BF16 that is all. With FP8 tensorwise
scaling (torchao ``Float8Linear``, TE current scaling) the GEMMs run at the FP8 rate, but each of the
three tensors x, W, g must first be scaled and cast, and those passes are memory-bound:

    amax pass      read the BF16 tensor (2 B/element)                       one kernel
    cast pass      read it again (2 B), write FP8 row-major and, for the     one kernel
                   backward GEMMs, FP8 column-major (1 + 1 B)                (a fused, compiled cast)

Time of a kernel: FLOPs / (peak x achievable fraction) for a GEMM, bytes / (bandwidth x achievable
fraction) for a memory-bound pass, and never less than ``min_kernel_s`` (the time of a kernel that does
almost nothing: launch and tail). The model has no free parameter: every input is a datasheet peak or a
published achievable fraction (``H100_TORCHAO``, from torchao's ``torchao/testing/training/roofline_utils.py``:
989 / 1979 TFLOP/s dense, 2.4 TB/s for the H100 variant torchao measured on, 78% of peak for large
GEMMs, 92% of bandwidth for pointwise kernels, 2 us for a one-element kernel). It is not fitted to the
torchao speedups it is tested against (tests/core/test_breakeven.py): 0.80x at M,K,N = 1024,2048,1024 and
1.39x at 4096,8192,16384 (torchao ``torchao/float8/README.md``, tensorwise, H100), nor to torchao's
auto-filter, which keeps layers out of FP8 when K <= 4096 and N <= 1024.

It is a roofline estimate, not a bound in either direction. It leaves out GEMM efficiency changing with the
shape (in both formats, and not in step), the BF16 casts autocast does anyway, and un-fused casts (without
``torch.compile`` each pass is separate eager kernels, which is why eager FP8 is often slower than BF16 at every
size). Against torchao's two H100 measurements it is 13% low and 11% high; against the FP32/BF16 sweep of lesson 11
(``benchmarks/breakeven_sweep.py`` on a CPU with BF16 units, the model given constants measured in the same run)
13 of 20 shapes lie above it and 6 below, from 0.33 to 8.2 times its value, because the measured GEMM rates vary
over tenfold with the shape while the model takes one rate per format.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Chip:
    """Peaks and achievable fractions of one accelerator (all in SI units: FLOP/s, bytes/s, seconds)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    mem_bw: float
    gemm_fraction: float
    mem_fraction: float
    min_kernel_s: float


# torchao's roofline constants for the H100 it benchmarks on (roofline_utils.py): dense peaks from NVIDIA's
# datasheet, 2.4 TB/s (Meta's H100 variant), 78% of peak for large GEMMs, 92% of bandwidth, 2 us per kernel.
H100_TORCHAO = Chip("H100 (torchao's)", 989e12, 1979e12, 2.4e12, 0.78, 0.92, 2e-6)
# H200 SXM: same tensor cores, 4.8 TB/s HBM3e (NVIDIA datasheet); the same published fractions.
H200 = replace(H100_TORCHAO, name="H200", mem_bw=4.8e12)
# B200: 2250 / 4500 TFLOP/s dense, 8 TB/s (NVIDIA datasheet); the same fractions (not yet measured).
B200 = replace(H100_TORCHAO, name="B200", bf16_flops=2.25e15, fp8_flops=4.5e15, mem_bw=8e12)

BF16_BYTES, FP8_BYTES = 2, 1


def _gemm_s(flops: float, peak: float, chip: Chip) -> float:
    return max(flops / (peak * chip.gemm_fraction), chip.min_kernel_s)


def _mem_s(nbytes: float, chip: Chip) -> float:
    return max(nbytes / (chip.mem_bw * chip.mem_fraction), chip.min_kernel_s)


def linear_times(M: int, K: int, N: int, chip: Chip = H100_TORCHAO, *, high_bytes: int = BF16_BYTES,
                 low_bytes: int = FP8_BYTES, amax: bool = True, layouts: int = 2) -> dict[str, float]:
    """Seconds of one linear layer's forward + backward: {"bf16", "fp8", "fp8_gemm", "fp8_cast"}.

    The defaults are BF16 against FP8 with tensorwise scaling. The same rule holds for any pair of formats:
    ``chip.bf16_flops`` is then the higher format's peak and ``chip.fp8_flops`` the lower one's, each input
    element is ``high_bytes`` before the cast and ``low_bytes`` after, ``amax`` says whether a scale is
    computed first, and ``layouts`` how many copies the cast writes (e.g. FP32 -> BF16 on a CPU: 4, 2,
    no amax, one layout)."""
    for name, v in (("M", M), ("K", K), ("N", N)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    gemm = 2.0 * M * K * N                                             # FLOPs of one of the three GEMMs
    bf16 = 3 * _gemm_s(gemm, chip.bf16_flops, chip)
    fp8_gemm = 3 * _gemm_s(gemm, chip.fp8_flops, chip)
    cast = 0.0
    for numel in (M * K, N * K, M * N):                                # x, W, g
        if amax:
            cast += _mem_s(numel * high_bytes, chip)                   # amax: read the high-precision tensor
        cast += _mem_s(numel * (high_bytes + layouts * low_bytes), chip)   # cast: read it, write the layouts
    return {"bf16": bf16, "fp8": fp8_gemm + cast, "fp8_gemm": fp8_gemm, "fp8_cast": cast}


def fp8_speedup(M: int, K: int, N: int, chip: Chip = H100_TORCHAO) -> float:
    """Predicted BF16 time / FP8 time of one linear layer's training step (> 1: FP8 is faster)."""
    t = linear_times(M, K, N, chip)
    return t["bf16"] / t["fp8"]


def gpt_linear_shapes(n_embd: int) -> list[tuple[int, int]]:
    """(K, N) of the four linear layers of a GPT block: qkv, attention proj, MLP fc, MLP proj."""
    C = n_embd
    return [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]


def model_speedup(n_embd: int, tokens: int, seq_len: int = 2048, chip: Chip = H100_TORCHAO) -> float:
    """Predicted end-to-end step speedup of FP8 linear layers for one GPT block of width ``n_embd`` on a
    batch of ``tokens`` tokens (per GPU): the linears as in ``linear_times``, attention's two matmuls
    (4 x tokens x seq_len x C FLOPs forward, x3 for training) at BF16 either way. Elementwise work (the same in
    both) is left out, which overstates the gain; the shape-dependent GEMM efficiency ``linear_times`` leaves
    out can move it either way (module docstring)."""
    bf16 = fp8 = 0.0
    for K, N in gpt_linear_shapes(n_embd):
        t = linear_times(tokens, K, N, chip)
        bf16, fp8 = bf16 + t["bf16"], fp8 + t["fp8"]
    attn = 3 * _gemm_s(4.0 * tokens * seq_len * n_embd, chip.bf16_flops, chip)
    return (bf16 + attn) / (fp8 + attn)


def break_even_width(tokens: int, chip: Chip = H100_TORCHAO, widths=tuple(2 ** i for i in range(7, 16))) -> int | None:
    """The smallest width in ``widths`` at which ``model_speedup`` exceeds 1 (None if none does)."""
    return next((w for w in widths if model_speedup(w, tokens, chip=chip) > 1.0), None)
