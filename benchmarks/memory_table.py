"""Memory of one training step of the compare model (defaults) for every recipe, counted from live tensors
(``mpcourse.experiment.memory.measure_step``): bytes per parameter by kind, activations, FP8 weight copies, peak.

    python benchmarks/memory_table.py [--batch-size 16]
"""
import argparse

import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.data import load_corpus
from mpcourse.experiment.memory import measure_step
from mpcourse.experiment.model import GPT, GPTConfig
from mpcourse.experiment.recipes import RECIPES, OptimConfig


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16)
    a = p.parse_args()
    corpus = load_corpus(None)
    cfg = GPTConfig(vocab_size=corpus.vocab_size)
    x, y = corpus.batch("train", a.batch_size, cfg.block_size, torch.Generator().manual_seed(0))
    print(f"{'recipe':<26} {'B/param w+g+m+o+x':<22} {'state MB':>8} {'act MB':>7} {'fp8 copies MB':>13} {'peak MB':>8}")
    for name, cls in RECIPES.items():
        torch.manual_seed(0)
        r = cls(GPT(cfg), OptimConfig())
        with tensor_cores():
            _, _, m = measure_step(r, x, y)
        b = m.bytes_per_param()
        parts = "+".join(f"{b[k]:.3g}" for k in ("weights", "grads", "master", "optimizer", "extra"))
        print(f"{name:<26} {parts + '=' + format(sum(b.values()), '.3g'):<22} {m.state / 2**20:8.2f} "
              f"{m.activations / 2**20:7.2f} {m.fp8_cache / 2**20:13.2f} {m.peak / 2**20:8.2f}", flush=True)
    print(f"model: {m.n_params:,} parameters, batch {a.batch_size} x {cfg.block_size} tokens")


if __name__ == "__main__":
    main()
