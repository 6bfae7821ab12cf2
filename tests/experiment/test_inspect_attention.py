"""``mpcourse compare --recipes fp8-attention --inspect N`` (``train_inspected``): FP8 attention's tensors are in the
inspector's JSON log, every block's, under every recipe, and in their own heat map and histogram."""
from __future__ import annotations

import json

import pytest

from mpcourse.core.attention.inspected import ATTENTION_ROLES
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.training.train import TrainConfig, train_inspected

TINY = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32)      # head dim 32: MX blocks fit


@pytest.mark.parametrize("recipe", ["fp8-attention", "fp8-attention-current"])
def test_the_log_and_the_plots_hold_every_attention_tensor(recipe, tmp_path):
    cfg = TrainConfig(steps=2, batch_size=2, eval_interval=10 ** 9, eval_batches=1, model=TINY)
    train_inspected(recipe, load_corpus(None), cfg, tmp_path, every=1, progress=False)
    log = json.loads((tmp_path / f"inspect-{recipe}.json").read_text())
    assert log["attention_roles"] == list(ATTENTION_ROLES)
    attn = [r for r in log["records"] if r["role"] in ATTENTION_ROLES]
    for step in (0, 1):
        for b in (0, 1):
            roles = [r["role"] for r in attn if r["step"] == step and r["layer"] == f"blocks.{b}.attn.core_attention"]
            assert roles == list(ATTENTION_ROLES), (step, b)
    assert all("run" in r["recipes"] and "fp8-current" in r["recipes"] and "mxfp8" in r["recipes"] for r in attn)
    assert {r["recipes"]["run"]["elem_format"] for r in attn if r["role"] in ("dO", "dP", "dQ")} == {"e5m2"}
    p = next(r for r in attn if r["role"] == "P")
    assert p["amax"] == 1.0 and p["recipes"]["run"]["scale_inv_max"] == pytest.approx(1 / 448 if recipe == "fp8-attention" and p["step"] else 1.0)
    for name in (f"inspect-{recipe}-attention.png", f"inspect-{recipe}-attention-hist.png", f"inspect-{recipe}.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_no_attention_picture_without_fp8_attention(tmp_path):
    cfg = TrainConfig(steps=1, batch_size=2, eval_interval=10 ** 9, eval_batches=1, model=TINY)
    train_inspected("fp8-current", load_corpus(None), cfg, tmp_path, every=1, progress=False)
    log = json.loads((tmp_path / "inspect-fp8-current.json").read_text())
    assert not any(r["role"] in ATTENTION_ROLES for r in log["records"])
    assert not (tmp_path / "inspect-fp8-current-attention.png").exists()
