"""``mpcourse compare --autoswitch STAT=THRESHOLD`` (and ``--inspect`` over every format): the flag is checked
before training (one line, exit code 2), names its own output folder, reaches the training of every row, and the
switches land in results.json's history, the inspector's JSON and the console."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpcourse.cli import main


def _fake_run(seen):
    def fake(recipes, corpus, cfg, out, **kw):
        seen.update(out=out, **kw)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"results": [{}], "config": {}}))
    return fake


@pytest.mark.parametrize("flags, said", [
    (["--autoswitch", "underflow"], "argument --autoswitch: must be STATISTIC=THRESHOLD"),
    (["--autoswitch", "overflow=0.1"], "STATISTIC one of underflow, saturation, rel_error, mse"),
    (["--autoswitch", "underflow=0.05", "--nproc", "2", "--parallel", "ddp"], "--autoswitch trains in one process"),
    (["--autoswitch", "underflow=0.05", "--with", "solutions/07_fp8_formats_and_scaling.ipynb"], "--autoswitch with --with"),
])
def test_a_bad_autoswitch_is_refused_before_training(flags, said, tmp_path, capsys):
    try:
        code = main(["compare", "--recipes", "fp8-current", "--steps", "2", "--out", str(tmp_path), *flags])
    except SystemExit as e:                      # a flag's type refuses it in the parser
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


def test_autoswitch_names_its_folder_and_reaches_the_job(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", _fake_run(seen))
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--recipes", "fp8-current", "--autoswitch", "underflow=0.05"]) == 0
    assert seen["out"] == Path("mpcourse-out-runs/recipes=fp8-current+autoswitch=underflow=0.05")
    assert seen["measurement"].autoswitch == "underflow=0.05"


@pytest.mark.slow
def test_compare_logs_the_switches_and_inspects_every_format(tmp_path, capsys):
    """Two steps of fp8-current with a threshold its E5M2 gradients pass (relative error about 5%): every block
    layer switches after step 0, as the console, results.json's history and inspect-fp8-current.json say."""
    code = main(["compare", "--recipes", "fp8-current", "--steps", "2", "--batch-size", "2", "--jobs", "1",
                 "--inspect", "1", "--autoswitch", "rel_error=0.03", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    [row] = json.loads((tmp_path / "results.json").read_text())["results"]
    events = [e for h in row["history"] for e in h.get("autoswitch", [])]
    assert len(events) == 20 and {e["step"] for e in events} == {0}           # 5 blocks x 4 linears, after step 0
    assert all(e["statistic"] == "rel_error" and e["value"] > 0.03 for e in events)
    assert out.count("autoswitch: step 0: blocks.") == 20
    log = json.loads((tmp_path / "inspect-fp8-current.json").read_text())
    assert log["autoswitch"] == events
    step0 = [r for r in log["records"] if r["step"] == 0 and r["role"] == "activation" and r["layer"] != "head"]
    step1 = [r for r in log["records"] if r["step"] == 1 and r["role"] == "activation" and r["layer"] != "head"]
    assert all("run" in r["recipes"] and "nvfp4" in r["recipes"] for r in step0)
    assert all("run" not in r["recipes"] for r in step1)                        # switched: nothing quantizes them
    for name in ("inspect-fp8-current.png", "inspect-fp8-current-recipes.png", "inspect-fp8-current-hist.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
