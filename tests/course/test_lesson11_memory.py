"""Lesson 11's memory table (``notebooks/data/11/memory.json``) is what the library measures now: re-measuring a
few rows with the command's own function gives every stored byte count, the peak included (the table the lesson
showed before came from an older run whose peaks the layers no longer reach: nvfp4 40.02 MB, now 31.44)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "benchmarks" / "memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp8-current", "nvfp4"])
def test_stored_memory_rows_are_measured_now(name):
    stored = json.loads((ROOT / "notebooks" / "data" / "11" / "memory.json").read_text())
    assert stored["command"] == "python benchmarks/memory_table.py --batch-size 8 --json notebooks/data/11/memory.json"
    corpus = load_corpus(None)
    cfg = GPTConfig(vocab_size=corpus.vocab_size)
    assert (stored["block_size"], stored["n_layer"], stored["n_embd"]) == (cfg.block_size, cfg.n_layer, cfg.n_embd)
    x, y = corpus.batch("train", stored["batch_size"], cfg.block_size, torch.Generator().manual_seed(0))
    assert _benchmark().measure(name, cfg, x, y).to_dict() == stored["rows"][name]


def test_the_lesson_shows_the_stored_rows_of_section_1s_recipes():
    """Every recipe of the lesson's 3-seed compare run has a row (the lesson's table reads them by name)."""
    stored = json.loads((ROOT / "notebooks" / "data" / "11" / "memory.json").read_text())
    compare = json.loads((ROOT / "notebooks" / "data" / "11" / "compare.json").read_text())
    assert {r["recipe"] for r in compare["results"]} <= set(stored["rows"])
    assert stored["batch_size"] == compare["config"]["batch_size"]
