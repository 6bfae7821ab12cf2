"""The command line rejects every bad value with a message naming the flag and the valid range.

Exit code 2 and no traceback, as argparse does for its own errors. Most cases parse in-process
(fast); one subprocess run per kind of failure checks what a person actually sees.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from mpcourse.cli import build_parser, main
from mpcourse.experiment.cli import argtypes
from mpcourse.experiment.cli.presets import QUICK
from mpcourse.experiment.training.train import TrainConfig

# flag -> (bad values, what the message must say)
BAD = {
    "--steps": (["abc", "0", "-3", "1.5", "", "nan"], "positive integer"),
    "--batch-size": (["0", "x", "2.0", "-1"], "positive integer"),
    "--lr": (["nan", "inf", "-inf", "0", "-1e-3", "abc", "1e400"], "finite number > 0"),
    "--min-lr-ratio": (["2", "-0.1", "nan", "inf", "1.0001", "half"], "finite number in [0, 1]"),
    "--seed": (["-1", "1.5", "abc", str(2**32)], "integer from 0 to 4294967295"),
    "--nproc": (["0", "two", "-2"], "positive integer"),
    "--dist-timeout": (["0", "nan", "inf", "-5"], "finite number > 0"),
    "--recipes": (["nope", "fp32,nope", ",", ""], "unknown recipe"),
}


def _compare_flags():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["compare"]._actions


@pytest.mark.parametrize("flag,value,msg", [(f, v, m) for f, (vals, m) in BAD.items() for v in vals])
def test_bad_value_exits_2_naming_flag_and_range(flag, value, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and msg in err, err
    assert repr(value) in err or flag == "--recipes"           # the offending text is echoed


def test_every_typed_flag_uses_a_checking_type():
    """A flag typed as bare int/float would accept nan/inf/negatives or print an internal name."""
    typed = [a for a in _compare_flags() if a.type is not None]
    assert typed, "compare has no typed flags?"
    for a in typed:
        assert a.type not in (int, float), f"{a.option_strings}: use a type from mpcourse.experiment.cli.argtypes"
    covered = {a.option_strings[-1] for a in typed if a.type is not argparse.FileType and a.type.__module__ == argtypes.__name__}
    assert set(BAD) - {"--recipes"} <= covered


@pytest.mark.parametrize("parse,good,bad", [
    (argtypes.positive_int, ["1", " 7 ", "150"], ["0", "-1", "1e3", "0x10"]),
    (argtypes.nonneg_int, ["0", "5"], ["-1", "a"]),
    (argtypes.positive_float, ["1e-300", "3e-3", "5"], ["0", "-0.0", "nan", "inf"]),
    (argtypes.nonneg_float, ["0", "0.0", "2.5"], ["-1e-9", "nan", "-inf"]),
    (argtypes.ratio, ["0", "1", "0.1", "1.0"], ["1.0000001", "-0.5", "nan"]),
    (argtypes.seed, ["0", str(2**32 - 1)], ["-1", str(2**32)]),
    (argtypes.int_in(2, 4), ["2", "4"], ["1", "5"]),
    (argtypes.float_in(0.0, 1.0, lo_open=True), ["1", "0.5"], ["0", "1.5"]),
])
def test_argtypes_boundaries(parse, good, bad):
    for text in good:
        parse(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            parse(text)


def test_quick_preset_and_explicit_flags_win(monkeypatch, tmp_path):
    seen = {}

    def fake_run(recipes, corpus, cfg, out, **kw):
        seen.update(steps=cfg.steps, batch_size=cfg.batch_size, recipes=recipes)

    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", fake_run)
    assert main(["compare", "--quick", "--out", str(tmp_path)]) == 0
    assert (seen["steps"], seen["batch_size"]) == (QUICK["steps"], QUICK["batch_size"])
    assert main(["compare", "--quick", "--steps", "7", "--out", str(tmp_path)]) == 0
    assert (seen["steps"], seen["batch_size"]) == (7, QUICK["batch_size"])
    assert main(["compare", "--out", str(tmp_path)]) == 0
    assert (seen["steps"], seen["batch_size"]) == (TrainConfig.steps, TrainConfig.batch_size)


def test_out_that_is_a_file_fails_before_training(tmp_path, capsys, monkeypatch):
    """``--out`` at a file (or under one): one line naming the problem and the fix, exit 2, nothing trained."""
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare",
                        lambda *a, **k: pytest.fail("trained although --out is a file"))
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["compare", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mpcourse compare: error: --out {f} is a file; give a folder", err
    assert main(["compare", "--out", str(f / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mpcourse compare: error: --out {f / 'sub'}: {f} is a file; give a folder", err
    assert f.read_text() == "x"


def test_a_mistyped_command_lists_all_five_and_guesses(capsys):
    """``mpcourse comapre``: one line naming every sub-command (the experiment's and the course's), with the
    closest as a guess (difflib); exit 2, no usage block, no traceback."""
    from mpcourse.cli import main as mpcourse_main

    assert mpcourse_main(["comapre", "--steps", "3"]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mpcourse: error: unknown command 'comapre'"), err
    assert "did you mean compare?" in err and out.out == ""
    assert "compare, recipes, lab, grade, site" in err
    assert mpcourse_main(["xyzzy"]) == 2
    err = capsys.readouterr().err.strip()
    assert "did you mean" not in err and "compare, recipes, lab, grade, site" in err


@pytest.mark.parametrize("value,guess", [("fp8-curent", "fp8-current"), ("fp32,bf16-pur", "bf16-pure"),
                                         ("mxfp8-flor", "mxfp8-floor")])
def test_a_misspelled_recipe_gets_a_guess_on_one_line(value, guess, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--recipes", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err                          # no usage block above the error
    assert err.startswith("mpcourse compare: error: argument --recipes: unknown recipe")
    assert f"did you mean {guess}?" in err


@pytest.mark.parametrize("value", ["fp32,fp32", "fp32, bf16-pure ,fp32", "fp32,bf16-pure,bf16-pure,"])
def test_a_recipe_named_twice_is_refused_on_one_line(value, capsys):
    """``--recipes fp32,fp32`` used to train fp32 twice and write two identical rows (and a folder named apart
    from ``--recipes fp32``'s); like ``--seeds 1,1`` it is one line, exit 2, nothing run."""
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--recipes", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "named more than once" in err, err


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_out_is_refused_on_one_line(value, capsys):
    """``--out ""`` (an unset shell variable, quoted) was Path("."): the run wrote into the current folder."""
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--recipes", "fp32", "--steps", "1", "--out", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --out: is empty" in err, err


@pytest.mark.parametrize("name", ["results.json", "loss_curves.png"])
def test_out_holding_a_folder_where_a_file_goes_is_refused_before_training(tmp_path, name, capsys):
    """A folder named results.json (or loss_curves.png) in --out used to fail with a traceback after the training,
    losing every row; refused first, one line, exit 2, nothing changed."""
    (tmp_path / name).mkdir()
    assert main(["compare", "--recipes", "fp32", "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mpcourse compare: error: --out {tmp_path}: {tmp_path / name} is a folder, where the run "
                   "writes a file; pass another folder"), err
    assert [p.name for p in tmp_path.iterdir()] == [name] and not any((tmp_path / name).iterdir())


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--stpes", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unrecognized arguments: --stpes" in err and "did you mean --steps?" in err


@pytest.mark.parametrize("args,msg", [
    (["compare", "--steps", "abc"], "argument --steps: must be a positive integer"),
    (["compare", "--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["comapre"], "did you mean compare?"),
    (["compare", "--recipes", "fp8-curent"], "did you mean fp8-current?"),
    (["compare", "--out", "README.md"], "--out README.md is a file; give a folder"),
])
@pytest.mark.slow
def test_what_a_person_sees(args, msg):
    proc = subprocess.run([sys.executable, "-m", "mpcourse", *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and msg in proc.stderr
    assert "Traceback" not in proc.stderr and "_positive" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("content", [b"print('not a notebook')\n", b"{\"a\": 1}", b"\x89PNG\r\n\x1a\n\x00\x00"])
def test_a_file_that_is_not_a_notebook_is_one_line_exit_2(tmp_path, content, capsys):
    """``--with`` and ``mpcourse grade`` given a file that is not a Jupyter notebook: one line naming the fix,
    exit code 2, no traceback (nbformat's own errors used to escape as tracebacks)."""
    from mpcourse.course.grade import main as grade_main

    f = tmp_path / "mine.py"
    f.write_bytes(content)
    assert main(["compare", "--recipes", "fp32", "--with", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mpcourse compare: error: --with") and "not a Jupyter notebook" in err
    assert "exercises/04_dynamic_loss_scaling.ipynb" in err and len(err.splitlines()) == 1
    assert grade_main([str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mpcourse grade: error:") and "not a Jupyter notebook" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_grade_of_a_non_notebook_as_a_person_sees_it(tmp_path):
    f = tmp_path / "README.md"
    f.write_text("# not a notebook\n")
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "grade", str(f)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "not a Jupyter notebook" in proc.stderr and "Traceback" not in proc.stderr


def test_preset_large_on_the_cpu_warns_with_the_expected_time(monkeypatch, tmp_path, capsys):
    """The large preset is for a GPU: on the CPU the run goes on, with a warning giving a lower bound of its
    time from the model FLOPs (6 N per token, as speed.flops_per_token) at the measured peak."""
    from mpcourse.experiment.cli import compare as compare_cli, presets
    from mpcourse.experiment.measure.speed import flops_per_token

    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", lambda *a, **k: None)
    monkeypatch.setattr(compare_cli, "_peak_flops", lambda device, threads=None: 1e11)
    assert main(["compare", "--preset", "large", "--recipes", "fp32", "--steps", "10", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    p = presets.PRESETS["large"]
    from mpcourse.experiment.gpt.data import load_corpus
    flops = flops_per_token(p["n_layer"], p["n_embd"], p["block_size"], load_corpus().vocab_size) \
        * p["block_size"] * presets.PRESET_BATCH["large"]
    minutes = flops * 10 / 1e11 / 60
    assert "warning: --preset large on the CPU will take at least" in err and "--device cuda" in err
    assert f"{minutes:.0f} min" in err or f"{minutes / 60:.1f} h" in err
    assert main(["compare", "--recipes", "fp32", "--steps", "10", "--out", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err                    # the small preset says nothing


def _torchrun(nproc: int, *flags: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m mpcourse compare FLAGS`` on this machine (loopback, a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", "0", "-m", "mpcourse", "compare", "--recipes", "fp32", "--steps", "1",
           "--no-progress", "--out", str(tmp_path / "out"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_torchrun_is_checked_as_nproc_is(tmp_path):
    """Under torchrun the flags are checked against the processes it started, as against --nproc: the one line,
    printed once (by rank 0), each rank exits 2 before any process group or training, and torchrun's own failure
    report quotes that line (the ranks' torchelastic error files), not a traceback of the ranks'."""
    proc = _torchrun(3, "--parallel", "ddp", "--batch-size", "16", tmp_path=tmp_path)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpcourse compare: error:")]
    assert said == ["mpcourse compare: error: --batch-size 16 is not divisible by the 3 processes torchrun started "
                    "(WORLD_SIZE=3) (each rank trains on batch_size / nproc sequences; pick a multiple of 3)"], \
        proc.stderr
    assert "[rank" not in proc.stderr and "ValueError" not in proc.stderr, proc.stderr     # no rank's traceback
    assert "exitcode  : 2" in proc.stderr and f"traceback : {said[0]}" in proc.stderr
    assert proc.returncode != 0 and not (tmp_path / "out").exists() and proc.stdout == ""


def test_nproc_refusal_is_the_same_line(capsys):
    """The --nproc case the torchrun test mirrors: one line, exit 2."""
    assert main(["compare", "--nproc", "3", "--parallel", "ddp", "--batch-size", "16", "--recipes", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mpcourse compare: error: --batch-size 16 is not divisible by --nproc 3 (each rank trains on "
                   "batch_size / nproc sequences; pick a multiple of 3)")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_torchrun_rank_refuses_before_any_process_group(rank, monkeypatch, tmp_path, capsys):
    """A rank torchrun started (its environment, in this process): a batch its 3 ranks cannot split, a block-scaled
    recipe whose blocks a rank's tokens cannot fill, an --nproc that is not torchrun's: exit 2, the line on rank 0
    only, and the line in the rank's torchelastic error file, in the shape torchrun's agent reads back."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    for k, v in {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                 "TORCHELASTIC_ERROR_FILE": str(error_file)}.items():
        monkeypatch.setenv(k, v)
    out = ["--out", str(tmp_path / "out")]
    for flags, said in [(["--recipes", "fp32", "--parallel", "ddp", "--batch-size", "16"],
                         "is not divisible by the 3 processes torchrun started (WORLD_SIZE=3)"),
                        (["--recipes", "fp8-block", "--parallel", "ddp", "--batch-size", "3"],
                         "but fp8-block scales them in blocks of 128: use a --batch-size that is a multiple of 6"),
                        (["--recipes", "fp32", "--parallel", "ddp", "--batch-size", "15", "--nproc", "2"],
                         "--nproc 2 but torchrun started 3 processes (WORLD_SIZE=3)")]:
        error_file.unlink(missing_ok=True)
        assert main(["compare", *flags, *out]) == 2
        err = capsys.readouterr().err.strip()
        assert (said in err and len(err.splitlines()) == 1) if rank == 0 else err == ""
        failure = ProcessFailure(local_rank=rank, pid=1, exitcode=2, error_file=str(error_file))
        assert said in failure.message["message"] and said in failure.message["extraInfo"]["py_callstack"]
        assert not (tmp_path / "out").exists()


def test_a_failed_rank_says_where_the_finished_rows_are(monkeypatch, tmp_path, capsys):
    """``--nproc``: a rank failed after rows had finished (``RankFailed`` carries them, written by
    ``run_distributed_compare``): the error line, then where the rows are and which recipes did not finish; exit 1."""
    from mpcourse.experiment.parallel.distributed import RankFailed

    def fails(job, nproc):
        e = RankFailed(1, "RuntimeError: boom")
        e.results, e.failed = ["row"], [{"recipe": "bf16-pure", "seed": 0, "error": "rank 1 failed: boom"}]
        raise e
    monkeypatch.setattr("mpcourse.experiment.parallel.distributed.run_distributed_compare", fails)
    out = tmp_path / "out"
    assert main(["compare", "--recipes", "fp32,bf16-pure", "--nproc", "2", "--parallel", "ddp", "--batch-size", "4",
                 "--steps", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["mpcourse compare: error: rank 1 failed: RuntimeError: boom",
                   f"mpcourse compare: the 1 finished rows are in {out / 'results.json'} (its \"failed\" list names "
                   "bf16-pure)"]
