"""The runs lessons load instead of training (``mpcourse.course.stored_runs``): each stored file is strict JSON
with the settings and command of its ``RUNS`` entry, and re-running that command on a short setting gives the
stored run's first steps (the warm-up's learning rate does not depend on the run's length)."""
import json

import pytest

from mpcourse.course.stored_runs import RUNS, default_path, main


def _stored(name):
    return json.loads(default_path(name).read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {name}"))


@pytest.mark.parametrize("name", list(RUNS))
def test_stored_file_has_its_runs_settings_and_command(name):
    spec, d = RUNS[name], _stored(name)
    assert d["stored_run"] == name and d["lesson"] == spec.lesson
    assert d["command"] == f"python -m mpcourse.course.stored_runs {name}"      # the full run, not a short one
    c = d["config"]
    assert (c["steps"], c["batch_size"], c["lr"]) == (spec.steps, spec.batch_size, spec.lr)
    assert {k: c[k] for k in spec.model} == spec.model
    assert (d["eval_interval"], d["eval_batches"], d["threads"]) == (spec.eval_interval, spec.eval_batches, spec.threads)
    assert d["environment"]["emulation"]["bfloat16"]["emulated"] is True
    assert [r["recipe"] for r in d["results"]] == list(spec.recipes)
    for r in d["results"]:
        assert r["diverged_at"] is None and r["steps_run"] == spec.steps == len(r["history"])
        assert [h["step"] for h in r["history"]] == list(range(spec.steps))
        evals = [h["step"] + 1 for h in r["history"] if "val_loss" in h]
        assert evals == list(range(spec.eval_interval, spec.steps + 1, spec.eval_interval))


def test_the_command_on_a_short_setting_gives_the_stored_first_steps(tmp_path):
    name, steps, recipes = "bf16-recipes", 3, ["fp32", "bf16-pure"]
    assert main([name, "--steps", str(steps), "--recipes", ",".join(recipes), "--out", str(tmp_path)]) == 0
    short = json.loads((tmp_path / f"{name}.json").read_text())
    stored = _stored(name)
    assert short["command"] == f"python -m mpcourse.course.stored_runs {name} --steps 3 --recipes fp32,bf16-pure"
    assert set(short) == set(stored) and set(short["results"][0]) == set(stored["results"][0])
    by = {r["recipe"]: r for r in stored["results"]}
    for r in short["results"]:
        here = [h["loss"] for h in r["history"]]
        there = [h["loss"] for h in by[r["recipe"]]["history"][:steps]]
        assert len(here) == steps and here == pytest.approx(there, abs=1e-5), r["recipe"]
    # the two recipes really differ by step 3, so the check tells them apart
    assert abs(short["results"][0]["history"][2]["loss"] - short["results"][1]["history"][2]["loss"]) > 1e-4


def test_bad_arguments_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        main(["bf16-recipes", "--recipes", "fp8-current"])
    assert "stores the recipes fp32, bf16-autocast" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bf16-recipes", "--steps", "0"])
    assert "--steps must be a positive integer" in capsys.readouterr().err
