"""Memory of one training step of the compare model (defaults) for every recipe, counted from live tensors
(``mpcourse.experiment.measure.memory.measure_step``): bytes per parameter by kind, activations, FP8 weight copies, peak.

    python benchmarks/memory_table.py [--batch-size 16]
    python benchmarks/memory_table.py --tiny      # the 1-block GPT of tests/experiment/measure/test_memory.py (4 x 16 tokens), in bytes
    python benchmarks/memory_table.py --batch-size 8 --recipes A,B --json FILE   # also writes the bytes as JSON

Lesson 11's memory table is ``notebooks/data/11/memory.json``, written by the last form with the recipes of its
stored compare run (batch 8 x 64 tokens, as ``mpcourse compare --quick``).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.measure.memory import measure_step
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import RECIPES, OptimConfig


def measure(name: str, cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor):
    """``measure_step`` of one first step of recipe ``name`` on a GPT of ``cfg`` seeded 0 (a ``StepMemory``)."""
    torch.manual_seed(0)
    r = RECIPES[name](GPT(cfg), OptimConfig())
    with tensor_cores():
        _, _, m = measure_step(r, x, y)
    return m


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="1 block, n_embd 32, 2 heads, 16 tokens, batch 4 (the tests' model)")
    p.add_argument("--recipes", default=None, help="comma-separated recipe names (default: all)")
    p.add_argument("--json", type=Path, default=None, help="also write the bytes of every recipe to this JSON file")
    a = p.parse_args()
    corpus = load_corpus(None)
    if a.tiny:
        cfg = GPTConfig(vocab_size=corpus.vocab_size, n_layer=1, n_embd=32, n_head=2, block_size=16)
        a.batch_size = 4
    else:
        cfg = GPTConfig(vocab_size=corpus.vocab_size)
    x, y = corpus.batch("train", a.batch_size, cfg.block_size, torch.Generator().manual_seed(0))
    unit, u = (1, "B") if a.tiny else (2**20, "MB")
    fmt = (lambda v: f"{v:,.0f}") if a.tiny else (lambda v: f"{v / unit:.2f}")
    print(f"{'recipe':<26} {'B/param w+g+m+o+x':<22} {'state ' + u:>10} {'act ' + u:>9} {'fp8 copies ' + u:>14} {'peak ' + u:>9}")
    names = a.recipes.split(",") if a.recipes else list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    rows = {}
    for name in names:
        m = measure(name, cfg, x, y)
        b = m.bytes_per_param()
        parts = "+".join(f"{b[k]:.3g}" for k in ("weights", "grads", "master", "optimizer", "extra"))
        print(f"{name:<26} {parts + '=' + format(sum(b.values()), '.3g'):<22} {fmt(m.state):>10} "
              f"{fmt(m.activations):>9} {fmt(m.fp8_cache):>14} {fmt(m.peak):>9}", flush=True)
        rows[name] = m.to_dict()
    print(f"model: {m.n_params:,} parameters, batch {a.batch_size} x {cfg.block_size} tokens")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "batch_size": a.batch_size,
                                      "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
                                      "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
