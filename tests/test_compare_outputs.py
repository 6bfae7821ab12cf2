"""What ``mpcourse compare`` writes: strict JSON, the environment, the spike flag, a readable plot.

Built from hand-made ``RunResult`` histories (a spike, a divergence), so each case is known.
"""
from __future__ import annotations

import json
import math

import pytest

from mpcourse.experiment.compare import (SPIKE_RATIO, family, format_table, loss_peak, plot_curves,
                                         results_payload, strict_json)
from mpcourse.experiment.data import load_corpus
from mpcourse.experiment.train import RunResult, TrainConfig


def reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def run(name, losses, diverged_at=None):
    hist = [{"step": i, "loss": l, "skipped": False, "loss_scale": None} for i, l in enumerate(losses)]
    if diverged_at is None:
        hist[-1]["val_loss"] = losses[-1] * 0.9
    final = losses[-1] if diverged_at is None else math.nan
    return RunResult(name, "", final, final * 0.9 if diverged_at is None else math.nan, 0, None, 1000.0,
                     {"weights": 4, "grads": 4, "master": 0, "optimizer": 8}, 1024, len(losses), diverged_at, hist)


SMOOTH = [4.6 - 0.04 * i for i in range(50)]                       # 4.6 -> 2.64, steady
SPIKY = SMOOTH[:30] + [5.4] + SMOOTH[31:]                            # one spike at step 30


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def test_peak_flags_a_spike_and_not_a_smooth_run():
    assert loss_peak(run("a", SMOOTH), 20) == (pytest.approx(SMOOTH[20]), 20, False)
    peak, step, spiked = loss_peak(run("b", SPIKY), 20)
    assert (peak, step, spiked) == (5.4, 30, True)
    # just under / over the threshold relative to the best loss before it
    best = min(SMOOTH[:30])
    assert not loss_peak(run("c", SMOOTH[:30] + [best * SPIKE_RATIO * 0.999] + SMOOTH[31:]), 20)[2]
    assert loss_peak(run("d", SMOOTH[:30] + [best * SPIKE_RATIO * 1.001] + SMOOTH[31:]), 20)[2]
    # the untrained first steps (high loss) are warm-up, not spikes
    assert loss_peak(run("e", SMOOTH), 0)[0] == SMOOTH[0]


def test_table_shows_the_spike():
    text = format_table([run("fp32", SMOOTH), run("fp8-delayed", SPIKY)], warmup_steps=20)
    rows = {line.split()[0]: line for line in text.splitlines()[2:4]}
    assert "5.40!" in rows["fp8-delayed"] and "!" not in rows["fp32"]
    assert "peak" in text.splitlines()[0]


def test_results_json_is_strict_and_says_why(corpus, tmp_path):
    cfg = TrainConfig(steps=50)
    results = [run("fp32", SMOOTH), run("fp16-pure", [4.6, math.nan], diverged_at=1), run("fp8-delayed", SPIKY)]
    text = json.dumps(results_payload(results, corpus, cfg), allow_nan=False)   # raises on NaN
    data = json.loads(text, parse_constant=reject)
    pure = data["results"][1]
    assert pure["final_val_loss"] is None and pure["nonfinite"]["final_val_loss"] == "nan"
    assert "step 1" in pure["null_reason"]
    assert pure["history"][1]["loss"] is None and pure["history"][1]["nonfinite"] == {"loss": "nan"}
    assert data["results"][2]["loss_spiked"] is True and data["results"][0]["loss_spiked"] is False
    env = data["environment"]
    import torch
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert set(env["emulation"]) == {"bfloat16", "float16"}
    assert all(isinstance(v["emulated"], bool) for v in env["emulation"].values())


def test_strict_json_names_each_kind():
    assert strict_json({"a": math.inf, "b": -math.inf, "c": [1.0, math.nan], "d": 2.0}) == \
        {"a": None, "b": None, "c": [1.0, None], "d": 2.0, "nonfinite": {"a": "inf", "b": "-inf"}}


def test_families_and_plot(tmp_path):
    assert [family(n) for n in ("fp32", "torch-amp-fp16", "fp16-static", "bf16-pure-sr", "fp8-delayed")] == \
        ["fp32", "torch.amp", "fp16", "bf16", "fp8"]
    results = [run("fp32", SMOOTH), run("torch-amp-fp16", SMOOTH), run("fp16-pure", [4.6, math.nan], 1),
               run("fp16-master", SMOOTH), run("bf16-pure", SMOOTH), run("fp8-delayed", SPIKY)]
    path = tmp_path / "loss_curves.png"
    plot_curves(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_curves([run("fp32", SMOOTH)], tmp_path / "one.png")          # fp32 alone still plots
