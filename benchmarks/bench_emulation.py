"""Tensor-core emulation against PyTorch's native low-precision CPU kernels, measured in one run.

Prints, for BF16 and FP16: a 512x512x512 matmul and one training step of the compare model in pure
low precision (``Trainer.train_step`` of the ``bf16-pure`` / ``fp16-pure`` recipe; ``fp32`` for scale), each as
native time / emulated time, with the FP32 time for scale. The training step is emulated the way the training
loop does it (``tensor_cores(fast=True)``: kernels on the matmul ops only); the last column times the same
step through the ``TensorCoreEmulation`` dispatch mode (every op in Python) over the fast path. Ratios are what
to read (this machine is shared and noisy); the absolute milliseconds are for context only.

    python benchmarks/bench_emulation.py

Measured on this course's 2-core AVX2 CPU (no AVX-512, no BF16 or FP16 units: every BF16/FP16 matmul is
emulated by default), torch 2.13, 1 thread, while other work kept the load at 17-21 (best of 2-5, so read the
ratios only; the FP16 matmul's emulated time under its FP32 time is that noise)::

    case                                fp32 ms  native ms  emulated ms  native/emulated  mode/fast
    bfloat16 matmul 512x512x512            20.6     1852.6         52.0            35.6x
    bfloat16 train step (compare model)   2033.6    17133.2       2011.4             8.5x      1.26x
    float16 matmul 512x512x512             25.6     1925.4         14.1           136.7x
    float16 train step (compare model)   2018.5    19608.5       2132.9             9.2x      1.07x
"""
from __future__ import annotations

import time

import torch

from mpcourse.core import emulation
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.training.train import TrainConfig, Trainer

PURE_RECIPE = {torch.float32: "fp32", torch.bfloat16: "bf16-pure", torch.float16: "fp16-pure"}


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


def train_step_case(dtype, emulate, corpus, fast=True):
    trainer = Trainer(PURE_RECIPE[dtype], corpus, TrainConfig(steps=10**6, batch_size=16))  # evaluates never
    trainer.fast_emulation = fast                        # False: the dispatch mode instead of the matmul kernels

    def run():
        emulation.set_emulation(emulate)                 # forced on/off for this case; the step enters it
        try:
            trainer.train_step()
        finally:
            emulation.set_emulation(None)
    return run


def main():
    torch.manual_seed(0)
    corpus = load_corpus()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {emulation.status()}")
    print(f"{'case':<34}{'fp32 ms':>9}{'native ms':>11}{'emulated ms':>13}{'native/emulated':>17}{'mode/fast':>11}")
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        for label, make, reps in (("matmul 512x512x512", lambda d, e, f: matmul_case(d, e), 5),
                                  ("train step (compare model)", lambda d, e, f: train_step_case(d, e, corpus, f), 2)):
            fp32 = best_of(make(torch.float32, False, True), reps)
            native = best_of(make(dtype, False, True), reps)
            emulated = best_of(make(dtype, True, True), reps)
            mode = "" if label.startswith("matmul") else \
                f"{best_of(make(dtype, True, False), reps) / emulated:>10.2f}x"
            print(f"{name + ' ' + label:<34}{fp32 * 1e3:>9.1f}{native * 1e3:>11.1f}{emulated * 1e3:>13.1f}"
                  f"{native / emulated:>16.1f}x{mode}")


if __name__ == "__main__":
    main()
