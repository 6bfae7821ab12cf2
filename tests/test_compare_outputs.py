"""What ``mpcourse compare`` writes: strict JSON, the environment, the spike flag, a readable plot.

Built from hand-made ``RunResult`` histories (a spike, a divergence), so each case is known.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mpcourse.experiment.compare import (family, format_seed_table, format_table, peak_after, plot_curves,
                                         results_payload, spike_reports, strict_json)
from mpcourse.experiment.data import load_corpus
from mpcourse.experiment.train import RunResult, TrainConfig


def reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def run(name, losses, diverged_at=None):
    hist = [{"step": i, "loss": l, "skipped": False, "loss_scale": None} for i, l in enumerate(losses)]
    if diverged_at is None:
        hist[-1]["val_loss"] = losses[-1] * 0.9
    final = losses[-1] if diverged_at is None else math.nan
    fields = {f.name for f in dataclasses.fields(RunResult)}
    values = dict(recipe=name, description="", final_train_loss=final,
                  final_val_loss=final * 0.9 if diverged_at is None else math.nan, skipped_steps=0,
                  final_loss_scale=None, tokens_per_s=1000.0,
                  bytes_per_param={"weights": 4, "grads": 4, "master": 0, "optimizer": 8},
                  activation_bytes=1024, memory={}, flops_per_token=1.0, steps_run=len(losses),
                  diverged_at=diverged_at, history=hist)
    return RunResult(**{k: v for k, v in values.items() if k in fields})


SMOOTH = [4.6 - 0.04 * i for i in range(50)]                       # 4.6 -> 2.64, steady
SPIKY = SMOOTH[:30] + [5.4] + SMOOTH[31:]                            # one spike at step 30


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def test_peak_after_warm_up():
    assert peak_after(run("a", SMOOTH), 20) == (pytest.approx(SMOOTH[20]), 20)
    assert peak_after(run("b", SPIKY), 20) == (5.4, 30)
    assert peak_after(run("e", SMOOTH), 0) == (SMOOTH[0], 0)       # the untrained first steps are warm-up
    assert peak_after(run("f", [4.6, math.nan], diverged_at=1), 5) == (None, None)


def test_spikes_are_judged_per_seed_against_that_seeds_runs():
    """Three runs of seed 0 make a consensus; seed 1's two runs are judged on their own."""
    runs = [run("fp32", SMOOTH), run("fp16-master", SMOOTH), run("fp8-delayed", SPIKY),
            run("fp32", SMOOTH), run("fp8-delayed", SPIKY)]
    reports = spike_reports(runs, [0, 0, 0, 1, 1])
    assert [r.against for r in reports] == ["consensus"] * 3 + ["itself"] * 2
    assert [r.spike_steps for r in reports] == [[], [], [30], [], [30]]


def test_table_shows_the_spike():
    text = format_table([run("fp32", SMOOTH), run("fp8-delayed", SPIKY)])
    rows = {line.split()[0]: line for line in text.splitlines()[2:4]}
    assert "x1.49@30" in rows["fp8-delayed"] and "@" not in rows["fp32"]
    assert "spike" in text.splitlines()[0]
    seeds = format_seed_table({0: [run("fp32", SMOOTH), run("fp8-delayed", SPIKY)],
                               1: [run("fp32", SMOOTH), run("fp8-delayed", SMOOTH)]})
    rows = {line.split()[0]: line for line in seeds.splitlines()[2:4]}
    assert "x1.49@30/-" in rows["fp8-delayed"] and "-/-" in rows["fp32"]


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
    assert data["results"][2]["spikes"]["spike_steps"] == [30] and data["results"][2]["peak_loss"] == 5.4
    assert data["results"][1]["spikes"]["jump"] is None                 # diverged at step 1: nothing to judge
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
