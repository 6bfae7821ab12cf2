"""Lesson 14's inspector that acts (``ablations.autoswitch``): lesson 09's outlier channels make fp8-current stop
learning; with ``--autoswitch underflow=0.05`` the four planted layers of a 2-block GPT switch to high precision
after step 0 and the run trains as FP32 does; and (``--setting diverge``) fp8-attention at lr 0.3 blows up
where FP32 recovers, and ``--autoswitch saturation=0.01`` rescues it."""
import json

import pytest

from mpcourse.experiment.ablations.autoswitch import main, planted_run
from mpcourse.experiment.ablations.common import AblationConfig
from mpcourse.experiment.gpt.model import GPTConfig

SMALL = GPTConfig(n_layer=2)
ACFG = AblationConfig(steps=60, batch_size=8, seeds=(0,), eval_batches=2)


@pytest.mark.slow
def test_the_switch_rescues_a_run_that_fails_in_fp8():
    """Measured (seed 0): FP32 2.62, fp8-current 3.24 (it stops learning near step 20), with the switch 2.63."""
    [fp32] = planted_run("fp32", None, ACFG, model_cfg=SMALL)
    [fails] = planted_run("fp8-current", None, ACFG, model_cfg=SMALL)
    [rescued] = planted_run("fp8-current", "underflow=0.05", ACFG, model_cfg=SMALL)
    assert fails["final_train_loss"] > fp32["final_train_loss"] + 0.3
    assert abs(rescued["final_train_loss"] - fp32["final_train_loss"]) < 0.1
    assert fails["autoswitch"] == [] and fp32["autoswitch"] == []
    # the four planted layers, on step 0, for the flushed 126 of 128 channels of their input (and the few elements
    # of the two outlier channels that are themselves 2^20 below the amax)
    assert [(e["step"], e["layer"], e["role"], e["statistic"], e["threshold"]) for e in rescued["autoswitch"]] == [
        (0, f"blocks.{b}.{n}", "activation", "underflow", 0.05) for b in (0, 1) for n in ("attn.qkv", "mlp.fc")]
    assert all(126 / 128 <= e["value"] < 127 / 128 for e in rescued["autoswitch"])


def test_main_writes_the_runs(tmp_path, monkeypatch):
    """The command line: one short run of each setting into OUT/autoswitch.json (strict JSON)."""
    import mpcourse.experiment.ablations.autoswitch as ab

    monkeypatch.setattr(ab, "run", lambda acfg: {"ablation": "autoswitch", "runs": [], "steps": acfg.steps})
    assert main(["--steps", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "autoswitch.json").read_text())
    assert data["steps"] == 2 and data["command"].endswith("--steps 2 --seeds 0")
    with pytest.raises(SystemExit):
        main(["--seeds", "a"])


STORED_DIVERGENCE = "notebooks/data/14/autoswitch-divergence.json"


def _verdict(run: dict) -> dict:
    """What the divergence setting claims of a run: whether it blew up (in the second half of the run, after the
    spikes that FP32 has too, the loss rises above twice the untrained model's) and whether it trained (its final
    loss is 0.5 below the untrained model's)."""
    losses = [h["loss"] for h in run["history"]]
    first, final = losses[0], run["final_train_loss"]
    return {"blew_up": max(losses[len(losses) // 2:]) > 2 * first, "trained": final < first - 0.5}


@pytest.mark.slow
def test_the_switch_rescues_a_run_that_diverges_in_fp8_attention():
    """The stored divergence run (seed 0) again, fresh: FP32 at lr 0.3 spikes and recovers, fp8-attention blows up
    (its loss ends above the untrained model's), with ``--autoswitch saturation=0.01`` it trains; the switch fires on
    the same steps, layers, tensors and statistic as stored, and the verdicts are the stored ones."""
    from pathlib import Path

    from mpcourse.experiment.ablations.autoswitch import DIVERGE_RUNS, diverging_run

    stored = json.loads((Path(__file__).parents[3] / STORED_DIVERGENCE).read_text())
    acfg = AblationConfig(steps=len(stored["runs"][0]["history"]), seeds=(0,))
    fresh = [r for recipe, rules in DIVERGE_RUNS for r in diverging_run(recipe, rules, acfg)]
    old = [r for r in stored["runs"] if r["seed"] == 0]
    fp32, fails, rescued = fresh
    assert _verdict(fp32) == {"blew_up": False, "trained": True}
    assert _verdict(fails) == {"blew_up": True, "trained": False}
    assert _verdict(rescued) == {"blew_up": False, "trained": True}
    assert [_verdict(r) for r in old] == [_verdict(r) for r in fresh]
    assert fails["autoswitch"] == [] and fp32["autoswitch"] == []
    key = lambda e: (e["step"], e.get("target", e["layer"]), e["role"], e["statistic"])   # noqa: E731
    assert [key(e) for e in rescued["autoswitch"]] == [key(e) for e in old[2]["autoswitch"]]
    assert rescued["autoswitch"][0]["step"] <= 2 and all(e["statistic"] == "saturation" for e in rescued["autoswitch"])
    assert any(e["layer"].endswith("core_attention") for e in rescued["autoswitch"])


def test_main_writes_the_divergence_setting(tmp_path, monkeypatch):
    """``--setting diverge`` writes OUT/autoswitch-divergence.json and says so in its command."""
    import mpcourse.experiment.ablations.autoswitch as ab

    monkeypatch.setattr(ab, "run_diverge", lambda acfg: {"ablation": "autoswitch", "runs": [], "steps": acfg.steps})
    assert main(["--setting", "diverge", "--steps", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "autoswitch-divergence.json").read_text())
    assert data["steps"] == 3 and data["command"].endswith("--setting diverge --steps 3 --seeds 0")
    assert not (tmp_path / "autoswitch.json").exists()
    with pytest.raises(SystemExit):
        main(["--setting", "nope"])
