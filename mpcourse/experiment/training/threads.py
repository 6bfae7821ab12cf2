"""The intra-op thread count a training run uses: one, always, so a run's bits do not depend on where it trains.

A CPU GEMM or reduction split over T threads adds its partial sums in an order that depends on T (MKL and
oneDNN block the K dimension per thread; torch's ``parallel_for`` splits reductions by thread), so the same
recipe and seed trained on 1 and on 2 threads differ in the last bits after a few steps, and a training run
amplifies the difference (measured: ``[yours]`` rows trained beside one-thread workers left the library's
rows at step 5). ``mpcourse compare`` therefore trains every run, the library's and the learner's, in a
worker process or in this one, alone or beside others, on ``TRAINING_THREADS`` intra-op threads:
``training_threads()`` sets it around each run and restores the caller's count after. Parallelism comes
from running several recipes at once (``--jobs``, ``mpcourse.experiment.compare.pool``), one thread each.

What still differs between machines is the kernels themselves (AVX2 against AVX-512 FP32 GEMMs sum in
another order; ``mpcourse.experiment.measure.machine`` records which a run used), not the thread count.
See torch's "CPU threading and TorchScript inference" note (``torch.set_num_threads``, intra-op pool).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: intra-op threads of every training run (``torch.set_num_threads``)
TRAINING_THREADS = 1


@contextmanager
def training_threads(n: int = TRAINING_THREADS) -> Iterator[int]:
    """Run the block on ``n`` intra-op threads (default ``TRAINING_THREADS``); the caller's count comes back after,
    also when the block raises. Yields ``n``."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
