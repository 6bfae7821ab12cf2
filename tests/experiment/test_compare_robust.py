"""``mpcourse compare`` gives the same answer wherever a row trains, and never fails silently.

- A recipe's row for a seed is the same bits in this process or in a worker, alone or beside other recipes, and
  the learner's ``[yours]`` row (trained in this process after the workers) equals the library's for the same
  functions: every run trains on ``TRAINING_THREADS`` intra-op threads (``mpcourse.experiment.training.threads``). The
  oracle is the run itself under another placement: equality, bit for bit.
- ``--with`` prints one verdict line per recipe after the table (not between progress bars).
- A run that fails, or is interrupted (Ctrl-C, in this process or in the workers), keeps every finished row in
  ``results.json``, names the others (``failed``) and the CLI exits 1 (130); a run in which nothing finished writes
  nothing; ``--seeds`` writes the table's mean and std (``seed_summary``, checked against ``statistics``);
  ``results.json`` records the CPU's kind (checked against torch's own query and a synthetic ``/proc/cpuinfo``).
- The default run writes ``mpcourse-out/``, ``--quick`` alone ``mpcourse-out-quick/``, any other run a folder of
  its own named after its flags (so a side run never replaces the main results); a run says where at its start and
  end, and says that it overwrote an earlier ``results.json`` only after it did.
- The notebooks' "train with your code" cells assert a verdict instead of storing machine-dependent losses.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import nbformat
import pytest
import torch

from mpcourse.experiment.measure import machine
from mpcourse.cli import main
from mpcourse.experiment.cli.out_folder import QUICK_OUT
from mpcourse.experiment.compare.run import CompareFailed, Execution, run_compare
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.learner import load_functions
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.training.threads import TRAINING_THREADS, training_threads
from mpcourse.experiment.training.train import RunResult, TrainConfig
from mpcourse.course.yours import Comparison

ROOT = Path(__file__).resolve().parents[2]
SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
CFG = TrainConfig(steps=3, batch_size=4, eval_interval=3, eval_batches=1, model=SMALL)
QUIET = Execution(progress=False, echo=lambda *_: None)          # no bars, no table


def _into(lines: list[str]) -> Execution:
    """A job run in this process, its table and the lines under it appended to ``lines``."""
    return Execution(progress=False, echo=lines.append)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _rows(path: Path) -> dict[tuple[str, int], dict]:
    payload = json.loads((path / "results.json").read_text())
    return {(r["recipe"], r["seed"]): r for r in payload["results"]}


def test_training_threads_sets_one_thread_and_restores_the_callers_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with training_threads() as n:
            assert n == TRAINING_THREADS == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), training_threads():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_rows_bits_do_not_depend_on_jobs_company_or_process(corpus, tmp_path):
    """fp16-dynamic alone in this process (jobs=1) on a 2-thread torch, then beside fp32 in two workers, then as the
    learner's row (the solution's update_scale) trained in this process after the workers: one history."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)                       # what a laptop's torch has: several threads
    try:
        alone = run_compare(["fp16-dynamic"], corpus, CFG, tmp_path / "alone", execution=QUIET)
        lines: list[str] = []
        mine = load_functions(ROOT / "solutions" / "04_dynamic_loss_scaling.ipynb")
        pooled = run_compare(["fp32", "fp16-dynamic"], corpus, CFG, tmp_path / "pooled", learner=mine,
                             execution=Execution(jobs=2, progress=False, echo=lines.append))
    finally:
        torch.set_num_threads(before)
    by = {r.recipe: r for r in pooled}
    a, b, y = alone[0], by["fp16-dynamic"], by["fp16-dynamic [yours]"]
    assert a.history == b.history and (a.final_train_loss, a.final_val_loss) == (b.final_train_loss, b.final_val_loss)
    assert y.history == b.history and y.final_val_loss == b.final_val_loss
    assert json.loads((tmp_path / "pooled" / "results.json").read_text())["threads"] == TRAINING_THREADS
    # one verdict per recipe, after the table: identical for fp16-dynamic, "cannot use" for fp32
    verdicts = [ln for ln in lines if ln.startswith(("fp32", "fp16-dynamic [yours]:"))]
    assert len(verdicts) == 2 and verdicts[0].startswith("fp32: cannot use any of ") and \
        verdicts[0].endswith("(it accepts: none)"), lines
    assert verdicts[1] == ("fp16-dynamic [yours]: identical to the library's bit for bit "
                           "(3 training losses, loss scales, final losses)"), lines
    table = next(i for i, ln in enumerate(lines) if ln.startswith("recipe"))
    assert all(lines.index(v) > table for v in verdicts)


def test_not_implemented_yet_comes_after_the_table_not_between_progress_bars(corpus, tmp_path):
    lines: list[str] = []
    stubs = load_functions(ROOT / "exercises" / "04_dynamic_loss_scaling.ipynb")
    run_compare(["fp16-dynamic"], corpus, CFG, tmp_path, learner=stubs, execution=_into(lines))
    table = next(i for i, ln in enumerate(lines) if ln.startswith("recipe"))
    said = [i for i, ln in enumerate(lines) if "not implemented yet" in ln]
    assert len(said) == 1 and said[0] > table, lines
    assert lines[said[0]].startswith("fp16-dynamic [yours]: your update_scale is not implemented yet")


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.slow
def test_a_failed_recipe_keeps_the_finished_rows_and_names_itself(corpus, tmp_path, jobs):
    # fp8-block's 1x128 tiles need token counts in multiples of 128: 4 x 16 = 64 tokens fail, fp32 finishes
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(SMALL, n_embd=128))
    with pytest.raises(CompareFailed) as err:
        run_compare(["fp32", "fp8-block"], corpus, cfg, tmp_path, execution=dataclasses.replace(QUIET, jobs=jobs))
    assert [r.recipe for r in err.value.results] == ["fp32"]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["recipe"] for r in payload["results"]] == ["fp32"]
    assert [(f["recipe"], f["seed"]) for f in payload["failed"]] == [("fp8-block", 0)]
    assert payload["failed"][0]["error"].startswith("ValueError: ") and "128" in payload["failed"][0]["error"]


@pytest.mark.slow
def test_cli_exits_1_naming_the_failed_recipe_and_writes_the_rest(tmp_path, capsys, monkeypatch):
    from mpcourse.experiment.compare import run as compare_module
    real = compare_module.train

    def planted(name, *args, **kwargs):                     # a recipe that fails mid-run
        if name == "fp8-block":
            raise ValueError("planted failure in fp8-block")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(compare_module, "train", planted)
    code = main(["compare", "--recipes", "fp32,fp8-block", "--steps", "2", "--batch-size", "2", "--jobs", "1",
                 "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "fp8-block (seed 0) failed: ValueError: planted" in err and "Traceback" not in err
    assert [r["recipe"] for r in json.loads((tmp_path / "results.json").read_text())["results"]] == ["fp32"]


def test_cli_refuses_a_batch_the_blocks_cannot_take_before_training(tmp_path, capsys):
    code = main(["compare", "--recipes", "fp32,fp8-block", "--steps", "2", "--batch-size", "1", "--jobs", "1",
                 "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--batch-size 1" in err and "multiple of 2" in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


def test_seeds_write_the_tables_mean_and_std(corpus, tmp_path):
    lines: list[str] = []
    runs = run_compare(["fp32", "bf16-pure"], corpus, CFG, tmp_path, seeds=[0, 1], execution=_into(lines))
    summary = json.loads((tmp_path / "results.json").read_text())["seed_summary"]
    assert set(summary) == {"fp32", "bf16-pure"}
    for name in summary:
        vals = [r.final_val_loss for r in runs if r.recipe == name]
        assert summary[name]["seeds"] == [0, 1]
        assert summary[name]["val"]["mean"] == statistics.mean(vals)
        assert summary[name]["val"]["std"] == statistics.stdev(vals)
        ref = {s: r.final_val_loss for s, r in zip([0, 0, 1, 1], runs) if r.recipe == "fp32"}
        gaps = [100 * (v - ref[s]) / ref[s] for s, v in zip([0, 1], vals)]
        assert summary[name]["gap_percent"]["mean"] == pytest.approx(statistics.mean(gaps), abs=0, rel=1e-15)
        row = next(ln for ln in "\n".join(lines).splitlines() if ln.startswith(name + " "))
        assert f"{summary[name]['val']['mean']:.3f}+-{summary[name]['val']['std']:.3f}" in row


CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_results_json_records_the_cpu_kind(corpus, tmp_path):
    from mpcourse.core import emulation
    assert machine.cpuinfo_flags(CPUINFO) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    info = machine.describe(CPUINFO)
    assert info["flags"] == ["fma", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert info["model"] == "Some CPU" and machine.cpuinfo_flags("nothing here") == frozenset()
    run_compare(["fp32"], corpus, CFG, tmp_path, execution=QUIET)
    cpu = json.loads((tmp_path / "results.json").read_text())["environment"]["cpu"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["gemm"] == {"bfloat16": "emulated" if emulation.emulation_enabled(torch.bfloat16) else "native",
                           "float16": "emulated" if emulation.emulation_enabled(torch.float16) else "native"}
    assert set(cpu["flags"]) <= set(machine.RELEVANT_FLAGS)


def _fake_run(seen, write=True):
    """A stand-in for run_compare that records its folder and writes a one-row results.json there."""
    def fake(recipes, corpus, cfg, out, **kw):
        seen.update(out=out, recipes=recipes)
        if write:
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps({"results": [{}], "config": {"steps": cfg.steps,
                                                                                      "batch_size": cfg.batch_size}}))
    return fake


def test_quick_has_its_own_folder_and_an_overwrite_is_said(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", _fake_run(seen))
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--quick"]) == 0 and seen["out"] == QUICK_OUT
    assert "overwrote" not in capsys.readouterr().out
    assert main(["compare", "--jobs", "1"]) == 0 and seen["out"] == Path("mpcourse-out")
    (tmp_path / "mpcourse-out" / "results.json").write_text(json.dumps(
        {"results": [{}] * 3, "config": {"steps": 80, "batch_size": 16}}))
    assert main(["compare", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    said = [ln for ln in out if "overwrote" in ln]
    assert len(said) == 1 and "3 rows, 80 steps" in said[0] and out.index(said[0]) == len(out) - 1


# (flags, folder): a flag at its default value, --jobs, --no-progress and --dist-timeout change nothing; any other
# change is named in the folder, flag=value joined by +, in --help's order
FOLDERS = [
    ([], "mpcourse-out"),
    (["--jobs", "1", "--no-progress", "--dist-timeout", "9"], "mpcourse-out"),
    (["--steps", "80", "--batch-size", "16", "--seed", "0", "--seeds", "0", "--lr", "0.003", "--min-lr-ratio", "0.1",
      "--device", "cpu", "--preset", "small", "--nproc", "1"], "mpcourse-out"),
    (["--recipes", ",".join(__import__("mpcourse.experiment.recipes", fromlist=["x"]).default_recipes())],
     "mpcourse-out"),
    (["--quick"], "mpcourse-out-quick"),
    (["--quick", "--steps", "50", "--batch-size", "8"], "mpcourse-out-quick"),
    (["--recipes", "mxfp8-floor"], "mpcourse-out-runs/recipes=mxfp8-floor"),
    (["--recipes", "fp32,mxfp8-floor", "--steps", "8", "--batch-size", "2"],
     "mpcourse-out-runs/recipes=fp32,mxfp8-floor+steps=8+batch-size=2"),
    (["--quick", "--recipes", "fp32"], "mpcourse-out-runs/recipes=fp32+quick"),
    (["--quick", "--steps", "80"], "mpcourse-out-runs/quick+steps=80"),
    (["--seeds", "0,1,2"], "mpcourse-out-runs/seeds=0,1,2"),
    (["--seed", "3"], "mpcourse-out-runs/seed=3"),
    (["--lr", "3e-4", "--min-lr-ratio", "1"], "mpcourse-out-runs/lr=0.0003+min-lr-ratio=1"),
    (["--recipes", "mxfp8-floor", "--with", "solutions/09_finer_grained_scaling.ipynb"],
     "mpcourse-out-runs/recipes=mxfp8-floor+with=09_finer_grained_scaling"),
    (["--with", "a/04_x.ipynb", "--with", "b/06_y.ipynb"], "mpcourse-out-runs/with=04_x,06_y"),
    (["--inspect", "5", "--preset", "large", "--batch-size", "32"], "mpcourse-out-runs/preset=large+inspect=5"),
    (["--recipes", "mxfp8-floor", "--out", "mine"], "mine"),
]


@pytest.mark.parametrize("flags,folder", FOLDERS)
def test_a_run_other_than_the_default_never_writes_into_the_default_folder(flags, folder, monkeypatch, tmp_path,
                                                                            capsys):
    seen = {}
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", _fake_run(seen))
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    monkeypatch.setattr("mpcourse.experiment.cli.with_notebooks.load_functions", lambda nb: {})  # where it is called
    monkeypatch.chdir(tmp_path)
    assert main(["compare", *flags]) == 0
    assert seen["out"] == Path(folder)
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, ln in enumerate(out) if ln.startswith("results go to "))
    assert out[first].startswith(f"results go to {folder}/") and first < 6           # said at the start ...
    assert out[-1].startswith(f"wrote {folder}/results.json")                      # ... and at the end


def test_a_data_parallel_run_has_its_own_folder_too(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake(job, nproc):
        seen["out"] = job.out
        job.out.mkdir(parents=True)
        (job.out / "results.json").write_text("{}")
        return [{"recipe": "fp32"}]
    monkeypatch.setattr("mpcourse.experiment.parallel.distributed.run_distributed_compare", fake)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--recipes", "fp32", "--nproc", "2", "--parallel", "fsdp", "--reduce-dtype", "bf16",
                 "--steps", "2", "--batch-size", "4"]) == 0
    folder = "mpcourse-out-runs/recipes=fp32+steps=2+batch-size=4+nproc=2+parallel=fsdp+reduce-dtype=bf16"
    assert seen["out"] == Path(folder)
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith(f"results go to {folder}/") for ln in out[:4]) and out[-1].startswith(f"wrote {folder}/")


def test_a_long_run_name_is_shortened_the_same_way_every_time(monkeypatch, tmp_path):
    from mpcourse.experiment.recipes import RECIPES
    seen, names = {}, []
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", _fake_run(seen, write=False))
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["compare", "--recipes", ",".join(reversed(list(RECIPES)))]) == 0
        names.append(seen["out"])
    other = main(["compare", "--recipes", ",".join(list(RECIPES)[1:])]) == 0 and seen["out"]
    assert names[0] == names[1] != other
    assert names[0].parent == Path("mpcourse-out-runs") and len(names[0].name) <= 80
    assert names[0].name.startswith("recipes=" + list(RECIPES)[-1])


def _default_folder_with_a_full_run(root: Path) -> dict[str, bytes]:
    main_out = root / "mpcourse-out"
    main_out.mkdir()
    (main_out / "results.json").write_text(json.dumps({"results": [{}] * 19, "config": {"steps": 80,
                                                                                        "batch_size": 16}}))
    (main_out / "loss_curves.png").write_bytes(b"\x89PNG the main run's plot")
    return {p.name: p.read_bytes() for p in main_out.iterdir()}


def test_a_side_run_keeps_the_default_runs_results(monkeypatch, tmp_path, capsys):
    """The issue's case, trained for real on a tiny budget: the default folder holds a 19-row run; a run of one
    recipe writes its own folder, and says where at the start and at the end; the default folder is untouched.
    Run again, it overwrites its own folder and says so, once, after the run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    before = _default_folder_with_a_full_run(tmp_path)
    flags = ["compare", "--recipes", "fp32", "--steps", "2", "--batch-size", "2", "--jobs", "1", "--no-progress"]
    assert main(flags) == 0
    side = Path("mpcourse-out-runs/recipes=fp32+steps=2+batch-size=2")
    assert {p.name: p.read_bytes() for p in (tmp_path / "mpcourse-out").iterdir()} == before
    assert [r["recipe"] for r in _rows(tmp_path / side).values()] == ["fp32"]
    out = capsys.readouterr().out
    assert f"results go to {side}/" in out and f"wrote {side}/results.json" in out and "overwrote" not in out
    assert main(flags) == 0
    out = capsys.readouterr().out.splitlines()
    said = [ln for ln in out if "overwrote" in ln]
    assert len(said) == 1 and str(side) in said[0] and "1 rows, 2 steps x 2" in said[0]
    assert out.index(said[0]) > next(i for i, ln in enumerate(out) if ln.startswith("recipe "))


def test_a_run_that_writes_nothing_claims_nothing_and_deletes_nothing(monkeypatch, tmp_path, capsys):
    """Every run failing (nothing finished), or a --with notebook that does not load: the earlier results stay as
    they were, no "overwrote" note, and a side run leaves no empty folder behind."""
    from mpcourse.experiment.compare import run as compare_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    before = _default_folder_with_a_full_run(tmp_path)

    def planted(name, *args, **kwargs):
        raise ValueError(f"planted failure in {name}")
    monkeypatch.setattr(compare_module, "train", planted)
    assert main(["compare", "--jobs", "1", "--no-progress"]) == 1
    out = capsys.readouterr()
    assert {p.name: p.read_bytes() for p in (tmp_path / "mpcourse-out").iterdir()} == before
    assert "overwrote" not in out.out + out.err and "Traceback" not in out.err
    assert "no run finished: nothing written" in out.err and "mpcourse-out/results.json" not in out.out
    bad = tmp_path / "mine.ipynb"
    bad.write_text("not a notebook")
    assert main(["compare", "--recipes", "fp32", "--with", str(bad), "--jobs", "1", "--no-progress"]) == 2
    assert main(["compare", "--recipes", "fp32", "--steps", "2", "--jobs", "1", "--no-progress"]) == 1
    out = capsys.readouterr()
    assert "overwrote" not in out.out + out.err
    assert not (tmp_path / "mpcourse-out-runs").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "mpcourse-out").iterdir()} == before


def test_an_interrupted_run_keeps_the_finished_rows(corpus, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second of three recipes: results.json holds the first row and names the other two as
    interrupted; run_compare raises an interrupt that carries the finished rows; the CLI exits 130 with one line."""
    from mpcourse.experiment.compare import run as compare_module
    from mpcourse.experiment.compare.run import CompareInterrupted

    real = compare_module.train

    def planted(name, *args, **kwargs):
        if name == "bf16-pure":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)
    monkeypatch.setattr(compare_module, "train", planted)
    with pytest.raises(KeyboardInterrupt) as err:
        run_compare(["fp32", "bf16-pure", "fp16-master"], corpus, CFG, tmp_path / "a", execution=QUIET)
    assert isinstance(err.value, CompareInterrupted) and [r.recipe for r in err.value.results] == ["fp32"]
    payload = json.loads((tmp_path / "a" / "results.json").read_text())
    assert [r["recipe"] for r in payload["results"]] == ["fp32"] and payload["interrupted"] is True
    assert [(f["recipe"], f["error"]) for f in payload["failed"]] == \
        [("bf16-pure", "interrupted before it finished"), ("fp16-master", "interrupted before it finished")]
    code = main(["compare", "--recipes", "fp32,bf16-pure", "--steps", "2", "--batch-size", "2", "--jobs", "1",
                 "--out", str(tmp_path / "b"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 130 and len(err.splitlines()) == 1 and "interrupted" in err and "Traceback" not in err
    assert "the 1 finished rows are in" in err
    assert [r["recipe"] for r in json.loads((tmp_path / "b" / "results.json").read_text())["results"]] == ["fp32"]


def test_an_interrupted_yours_row_is_named_as_not_finished(corpus, tmp_path, monkeypatch):
    """Ctrl-C while the learner's row trains (after the library's fp16-dynamic row): ``failed`` names
    "fp16-dynamic [yours]" as not finished, and the recipe after it; the library's row is kept."""
    from mpcourse.experiment.compare import learner_rows
    from mpcourse.experiment.compare.run import CompareInterrupted

    real = learner_rows.train

    def planted(name, *args, label=None, **kwargs):
        if label == "fp16-dynamic [yours]":
            raise KeyboardInterrupt
        return real(name, *args, label=label, **kwargs)
    monkeypatch.setattr(learner_rows, "train", planted)
    mine = load_functions(ROOT / "solutions" / "04_dynamic_loss_scaling.ipynb")
    lines: list[str] = []
    with pytest.raises(CompareInterrupted):
        run_compare(["fp16-dynamic", "fp32"], corpus, CFG, tmp_path, learner=mine, execution=_into(lines))
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["recipe"] for r in payload["results"]] == ["fp16-dynamic"]
    assert [(f["recipe"], f["error"]) for f in payload["failed"]] == \
        [("fp16-dynamic [yours]", "interrupted before it finished"), ("fp32", "interrupted before it finished")]
    assert "NOT FINISHED fp16-dynamic [yours] (seed 0): interrupted before it finished" in lines


def test_an_interrupted_rerun_keeps_the_earlier_complete_results(corpus, tmp_path, monkeypatch):
    """A folder holding a complete run; the same job re-run and interrupted after its first row: the earlier
    results.json and plot stay byte for byte, the finished row goes to results.partial.json (and its plot beside),
    and the interrupt says where. Without an earlier run the rows go to results.json, as before."""
    from mpcourse.experiment.compare import run as compare_module
    from mpcourse.experiment.compare.run import CompareInterrupted

    names = ["fp32", "bf16-pure"]
    run_compare(names, corpus, CFG, tmp_path, execution=QUIET)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = compare_module.train

    def planted(name, *args, **kwargs):
        if name == "bf16-pure":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)
    monkeypatch.setattr(compare_module, "train", planted)
    with pytest.raises(CompareInterrupted) as err:
        run_compare(names, corpus, CFG, tmp_path, execution=QUIET)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
    assert err.value.path == tmp_path / "results.partial.json" and (tmp_path / "loss_curves.partial.png").is_file()
    partial = json.loads((tmp_path / "results.partial.json").read_text())
    assert [r["recipe"] for r in partial["results"]] == ["fp32"] and partial["interrupted"] is True
    with pytest.raises(CompareInterrupted) as err:
        run_compare(names, corpus, CFG, tmp_path / "fresh", execution=QUIET)
    assert err.value.path == tmp_path / "fresh" / "results.json"
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["loss_curves.png", "results.json"]


@pytest.mark.slow
def test_ctrl_c_on_a_rerun_of_a_real_process_keeps_the_earlier_run(tmp_path):
    """The learner's day, as it happens: a complete run in a folder, then the same command again, stopped with
    SIGINT (Ctrl-C) once its first row has finished: exit 130, one line naming results.partial.json and the kept
    results.json, which (with its plot) is byte for byte the complete run's."""
    import re
    import signal
    import subprocess
    import sys
    import threading

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mpcourse", "compare", "--recipes", "fp32,bf16-pure", "--batch-size", "2",
           "--jobs", "1", "--out", str(out)]
    first = subprocess.run([*cmd, "--steps", "2", "--no-progress"], capture_output=True, text=True, timeout=300,
                           cwd=ROOT)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # the re-run: the signal goes once bf16-pure has trained a step (fp32's row is done), seconds before its end
    proc = subprocess.Popen([*cmd, "--steps", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    seen, started = [], threading.Event()

    def read():                             # wait for bf16-pure's first step: fp32's row is done by then
        for chunk in iter(lambda: proc.stderr.read(1), ""):
            seen.append(chunk)
            if chunk in "\r\n" and re.search(r"bf16-pure: .*\| [1-9]\d*/60", "".join(seen[-300:])):
                started.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(240), "".join(seen)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)                  # stderr is the reader's; stdout holds a few lines
    finally:
        proc.kill()
    reader.join(10)
    err = "".join(seen)
    said = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("mpcourse compare:")]
    assert proc.returncode == 130 and len(said) == 1, err
    assert f"the 1 finished rows are in {out / 'results.partial.json'}" in said[0]
    assert f"{out / 'results.json'} keeps the earlier run (2 rows, 2 steps x 2)" in said[0]
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    partial = json.loads((out / "results.partial.json").read_text())
    assert [r["recipe"] for r in partial["results"]] == ["fp32"] and partial["config"]["steps"] == 60


@pytest.mark.slow
def test_an_interrupt_in_the_pool_keeps_the_rows_the_workers_finished(corpus, tmp_path, monkeypatch):
    """Ctrl-C while worker processes train (simulated: the parent's wait raises once a run has come back): every
    run that came back is a row of results.json, every other one is named as interrupted."""
    from mpcourse.experiment.compare import pool as pool_module
    from mpcourse.experiment.compare.run import CompareInterrupted

    real_wait, came_back = pool_module.wait, []

    def wait_then_interrupt(fs, **kw):
        if came_back:
            raise KeyboardInterrupt
        done, pending = real_wait(fs, **kw)
        came_back.extend(done)
        return done, pending
    monkeypatch.setattr(pool_module, "wait", wait_then_interrupt)
    names = ["fp32", "bf16-pure", "fp16-master"]
    with pytest.raises(CompareInterrupted) as err:
        run_compare(names, corpus, CFG, tmp_path, execution=dataclasses.replace(QUIET, jobs=2))
    payload = json.loads((tmp_path / "results.json").read_text())
    kept = [r["recipe"] for r in payload["results"]]
    assert len(kept) == len(came_back) >= 1 and kept == [r.recipe for r in err.value.results]
    assert sorted(kept + [f["recipe"] for f in payload["failed"]]) == sorted(names)
    assert all(f["error"] == "interrupted before it finished" for f in payload["failed"])


def _run(history, final=3.0) -> RunResult:
    return RunResult(recipe="r", description="", final_train_loss=final, final_val_loss=final, skipped_steps=0,
                     final_loss_scale=None, tokens_per_s=1.0, bytes_per_param={}, activation_bytes=0, memory={},
                     flops_per_token=0.0, steps_run=len(history), diverged_at=None, history=history)


def test_comparison_wrong_is_a_verdict():
    h = [{"step": 0, "loss": 4.0}, {"step": 1, "loss": 3.5}]
    lib = _run(h)
    assert not Comparison("r", ("f",), lib, _run(list(h))).wrong
    assert Comparison("r", ("f",), lib, _run([h[0], {"step": 1, "loss": 3.25}])).wrong
    assert Comparison("r", ("f",), lib, _run(list(h), final=2.0)).wrong
    assert not Comparison("r", ("f",), lib, None, "r [yours]: f is not implemented yet (it raises ...)").wrong
    assert not Comparison("r", (), lib, None, "r: this notebook defines none of the functions it can use (f)").wrong
    assert Comparison("r", ("f",), lib, None, "r [yours]: training with your f failed: TypeError: x").wrong


def test_solutions_train_yours_cells_assert_the_verdict_not_the_losses():
    """The printed losses depend on the CPU's kernels: the cell's output is not compared, its assert is."""
    cells = 0
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for c in nbformat.read(path, as_version=4).cells:
            if "train-yours" in c.metadata.get("tags", []) and "train_yours(" in c.source:
                cells += 1
                assert "nbval-ignore-output" in c.metadata["tags"], path.name
                assert "assert not any(c.wrong for c in _)" in c.source, path.name
    assert cells >= 10


def _check_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_readme_tables", ROOT / "benchmarks" / "check_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    import sys
    sys.modules.setdefault(spec.name, mod)        # its dataclass looks its module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_readme_table_check_finds_a_changed_number_and_ignores_timing(corpus, tmp_path, capsys):
    """A synthetic README holding the table a small run printed: the check agrees with that run's results.json,
    and names the recipe and column of a number changed in the README (a tok/s change is not a difference)."""
    check = _check_script()
    lines: list[str] = []
    run_compare(["fp32", "bf16-pure"], corpus, CFG, tmp_path / "run", execution=_into(lines))
    table = "\n".join(lines[0].splitlines()[:4])                   # header, dashes, two rows
    readme = tmp_path / "README.md"
    results = str(tmp_path / "run" / "results.json")

    def check_with(text):
        readme.write_text(f"# t\n\n```\n$ mpcourse compare --steps 3  # 1 s\n{text}\n```\n")
        return check.main(["--readme", str(readme), "--table", "mpcourse compare --steps 3", "--results", results])

    assert check_with(table) == 0
    head, rows = check.parse_table(table.splitlines())
    i_val, i_tok = head.index("val"), head.index("tok/s")
    val = rows["bf16-pure"][i_val]
    changed = [ln.replace(f" {val} ", f" {float(val) + 0.001:.3f} ") if ln.startswith("bf16-pure") else ln
               for ln in table.splitlines()]
    capsys.readouterr()
    assert check_with("\n".join(changed)) == 1
    assert f"bf16-pure val: README.md {float(val) + 0.001:.3f}, fresh {val}" in capsys.readouterr().out
    tok = rows["fp32"][i_tok]
    slower = [ln.replace(f" {tok} ", " " + "9" * len(tok) + " ", 1) if ln.startswith("fp32") else ln
              for ln in table.splitlines()]
    assert check_with("\n".join(slower)) == 0
    assert check.main(["--readme", str(readme), "--table", "no such command", "--results", results]) == 2


def test_readme_table_check_names_the_file_and_compares_peak_mb_on_the_tables_kernels(corpus, tmp_path, capsys):
    """A table in docs/results.md is named as that file (not "README"); peak MB, which counts the quantizers'
    temporaries, is compared only for a run on the tables' kernels (results.json's environment.kernels: a run
    without numba is not failed on it, and a note says so); every other column still is."""
    check = _check_script()
    lines: list[str] = []
    run_compare(["fp32", "nvfp4"], corpus, CFG, tmp_path / "run", execution=_into(lines))
    table = lines[0].splitlines()[:4]
    head, rows = check.parse_table(table)
    peak, act = rows["nvfp4"][head.index("peak MB")], rows["nvfp4"][head.index("act MB")]
    results = tmp_path / "run" / "results.json"
    payload = json.loads(results.read_text())
    assert payload["environment"]["kernels"] in ("numba", "torch", "rules")
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()

    dashes = table[1]
    starts = [i for i, ch in enumerate(dashes) if ch == "-" and (i == 0 or dashes[i - 1] == " ")] + [None]

    def plus(line: str, column: str) -> str:            # the row with that cell 0.06 higher, the layout kept
        a, b = starts[head.index(column)], starts[head.index(column) + 1]
        cell = line[a:b].rstrip()
        return line[:a] + f"{float(cell) + 0.06:.2f}".rjust(len(cell)) + line[a + len(cell):]

    def check_with(column: str, kernels: str):
        payload["environment"]["kernels"] = kernels
        results.write_text(json.dumps(payload))
        changed = [plus(ln, column) if ln.startswith("nvfp4") else ln for ln in table]
        docs.write_text("# t\n\n```\n$ mpcourse compare --steps 3  # 1 s\n" + "\n".join(changed) + "\n```\n")
        code = check.main(["--readme", str(docs), "--table", "mpcourse compare --steps 3", "--results", str(results),
                           "--columns", "memory"])
        return code, capsys.readouterr().out
    code, out = check_with("peak MB", "numba")
    assert code == 1 and f"{docs} line 4 `mpcourse compare --steps 3`: 1 cell(s) differ" in out
    assert f"nvfp4 peak MB: results.md {float(peak) + 0.06:.2f}, fresh {peak}" in out and "README" not in out
    code, out = check_with("peak MB", "torch")
    assert code == 0 and "note: peak MB not compared: this run's quantizers took the torch kernels" in out
    assert "rows agree in B/param w+g+m+o=total, act MB (" in out
    code, out = check_with("act MB", "torch")
    assert code == 1 and f"nvfp4 act MB: results.md {float(act) + 0.06:.2f}, fresh {act}" in out


def test_spread_refuses_a_run_of_other_settings_than_the_tables(corpus, capsys, tmp_path):
    """``--spread`` holds a run against a seeds table of 80 steps x 16: a --quick run (50 x 8) is refused on one
    line naming the fix, exit 2; a run of the table's settings is compared (here: it lacks the table's recipes)."""
    check = _check_script()
    from mpcourse.experiment.compare.outputs import results_payload
    rows = [dataclasses.replace(_run([{"step": 0, "loss": 4.0}]), recipe="fp32")]
    for steps, batch, code in [(50, 8, 2), (80, 16, 1)]:
        cfg = dataclasses.replace(CFG, steps=steps, batch_size=batch)
        path = tmp_path / f"{steps}.json"
        path.write_text(json.dumps(results_payload(rows, corpus, cfg)))
        assert check.main(["--spread", "--results", str(path)]) == code
        err = capsys.readouterr().err
        said = [ln for ln in err.splitlines() if ln.startswith("check_readme_tables: error:")]
        if code == 2:
            assert len(said) == 1 and "--spread: this run trained 50 steps x 8 sequences" in said[0]
            assert "80 x 16" in said[0] and "without --quick" in said[0]
        else:
            assert said == []


def test_spread_check_passes_inside_and_names_what_lies_outside():
    """``check_readme_tables --spread``: a one-seed value inside the seeds table's 95% prediction interval (plus half
    a printed unit) passes, one beyond fails naming recipe and column; a recipe that diverged on every seed must
    diverge in the fresh run too."""
    check = _check_script()
    seeds = check.Table("mpcourse compare --seeds 0,1,2", ["recipe", "val", "gap%"],
                        {"fp32": ["fp32", "2.398+-0.039", "+0.0+-0.0"],
                         "bf16-pure": ["bf16-pure", "2.396+-0.046", "-0.1+-0.3"],
                         "fp16-pure": ["fp16-pure", "nan@1 (3/3)", "nan"]}, 1)
    k = check.spread_k(3)                                          # 4.303 * sqrt(4/3) = 4.97
    head = ["recipe", "train", "val", "gap%"]
    fresh = {"fp32": ["fp32", "2.6", "2.437", "+0.0"], "bf16-pure": ["bf16-pure", "2.6", "2.470", "-0.6"],
             "fp16-pure": ["fp16-pure", "nan", "nan@1", "nan"]}
    assert check.outside_spread(seeds, head, fresh) == []
    pooled = ((0.039 ** 2 + 0.046 ** 2) / 2) ** 0.5                # val: the std pooled over the recipes that train
    assert check.pooled_val_std(seeds) == pytest.approx(pooled)
    fresh["fp32"][2] = f"{2.398 + k * pooled - 0.001:.3f}"        # inside with the pooled std, not with fp32's own
    assert check.outside_spread(seeds, head, fresh) == []
    fresh["fp32"][2] = f"{2.398 + k * pooled + 0.001:.3f}"        # just beyond the interval
    fresh["bf16-pure"][3] = f"{-0.1 + k * 0.3 + 0.1:+.1f}"
    fresh["fp16-pure"][2] = "2.500"
    assert check.outside_spread(seeds, head, fresh) == [
        f"fp32 val: {fresh['fp32'][2]} is outside 2.398 +- {k:.2f} x {pooled:.3g}",
        f"bf16-pure gap%: {fresh['bf16-pure'][3]} is outside -0.1 +- {k:.2f} x 0.3",
        "fp16-pure val: every seed diverged, the fresh run gives 2.500"]
    fresh["fp32"][2] = "nan@3"
    assert "fp32 val: nan@3 is outside" in check.outside_spread(seeds, head, fresh)[0]


def test_spread_is_the_prediction_interval_of_students_t():
    """k(n) = t(0.975, n-1) * sqrt(1 + 1/n), against scipy's t distribution (the oracle)."""
    stats = pytest.importorskip("scipy.stats")
    check = _check_script()
    for n in range(2, 12):
        assert check.spread_k(n) == pytest.approx(stats.t.ppf(0.975, n - 1) * (1 + 1 / n) ** 0.5, rel=2e-4)
    with pytest.raises(ValueError):
        check.spread_k(1)


def test_spread_table_is_the_one_of_the_runs_cpu_kind():
    """Every CPU kind a seeds table in docs/results.md was measured on is found for a run of that kind; a kind
    with no table of its own falls back to the table with the same BF16 kind and says it is not exact."""
    check = _check_script()
    tables = check.readme_tables((ROOT / "docs" / "results.md").read_text())
    seeds = [t for t in tables if check._is_seeds_table(t)]
    assert len(seeds) >= 2 and all(t.kind for t in seeds)
    for t in seeds:
        command, exact = check.spread_table(tables, t.kind)
        assert exact and [u for u in seeds if u.command == command][0].kind == t.kind
        assert len(t.rows) == 19 and "+-" in t.rows["fp32"][2]
    kinds = [t.kind for t in seeds]
    for bf16 in ("native", "emulated"):
        for fp16 in ("native", "emulated"):
            command, exact = check.spread_table(tables, {"bfloat16": bf16, "float16": fp16})
            assert command is not None
            assert exact == ({"bfloat16": bf16, "float16": fp16} in kinds)


def test_a_stored_results_json_gives_each_rows_percent_of_peak(corpus):
    """``check_readme_tables`` rebuilds a table from results.json: each row against the peak recorded for it
    (``row_peak_flops``), clamped as the run printed it. Hand-made rows: 100 tok/s x 10 FLOPs = 1000 FLOP/s."""
    check = _check_script()
    rows = [_run([{"step": 0, "loss": 4.0}]) for _ in range(2)]
    rows = [dataclasses.replace(r, recipe=n, tokens_per_s=100.0, flops_per_token=10.0)
            for r, n in zip(rows, ("fp32", "bf16-pure"))]
    from mpcourse.experiment.compare.outputs import results_payload
    payload = results_payload(rows, corpus, CFG, extra={"peak_flops": {"fp32": 4000.0, "bf16": 800.0},
                                                        "row_peak_flops": {"fp32": 4000.0, "bf16-pure": 800.0}})
    head, table = check.fresh_table(json.loads(json.dumps(payload)))
    i = head.index("%peak")
    assert (table["fp32"][i], table["bf16-pure"][i]) == ("25.0", "100.0*")
    payload.pop("row_peak_flops")
    payload["peak_flops"] = 2000.0                                   # a file from before: one peak for every row
    head, table = check.fresh_table(json.loads(json.dumps(payload)))
    assert (table["fp32"][i], table["bf16-pure"][i]) == ("50.0", "50.0")
