"""Tensor-core emulation against PyTorch's native low-precision CPU kernels, measured in one run.

Prints, for BF16 and FP16: a 512x512x512 matmul and one training step (forward + backward +
AdamW) of the compare model in pure low precision, each as native time / emulated time, with the
FP32 time for scale. Ratios are what to read (this machine is shared and noisy); the absolute
milliseconds are for context only.

    python benchmarks/bench_emulation.py
"""
from __future__ import annotations

import time

import torch

from mpcourse.core import emulation
from mpcourse.experiment.data import load_corpus
from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.model import GPT, GPTConfig


def best_of(fn, repeats: int, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_case(dtype, emulate, n=512):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)

    def run():
        with tensor_cores(emulate):
            a @ b
    return run


def train_step_case(dtype, emulate, corpus):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4)
    x, y = corpus.batch("train", 16, 64, torch.Generator().manual_seed(0))

    def run():
        with tensor_cores(emulate):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return run


def main():
    torch.manual_seed(0)
    corpus = load_corpus()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {emulation.status()}")
    print(f"{'case':<34}{'fp32 ms':>9}{'native ms':>11}{'emulated ms':>13}{'native/emulated':>17}")
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        for label, make, reps in (("matmul 512x512x512", lambda d, e: matmul_case(d, e), 5),
                                  ("train step (compare model)", lambda d, e: train_step_case(d, e, corpus), 2)):
            fp32 = best_of(make(torch.float32, False), reps)
            native = best_of(make(dtype, False), reps)
            emulated = best_of(make(dtype, True), reps)
            print(f"{name + ' ' + label:<34}{fp32 * 1e3:>9.1f}{native * 1e3:>11.1f}{emulated * 1e3:>13.1f}"
                  f"{native / emulated:>16.1f}x")


if __name__ == "__main__":
    main()
