"""``mpcourse grade``: a learner's notebook is graded fresh, whatever its stored outputs say.

A correct notebook saved with stale outputs, out-of-order execution counts and a never-run check
cell passes; a wrong one fails with the grader's one-line verdict (the traceback only with
``--verbose``); the file itself is never modified; it works on a copy outside the repository.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from mpcourse.course.grade import format_report, grade, main

ROOT = Path(__file__).resolve().parents[2]
V4 = nbformat.v4


def learner_notebook(body: str) -> nbformat.NotebookNode:
    nb = V4.new_notebook()
    nb.cells = [
        V4.new_markdown_cell("# Exercise 99\n\n## Part 1: doubling"),
        V4.new_code_cell(f"def double(x):\n{body}\n"),
        V4.new_code_cell("print(double(21))"),
        V4.new_code_cell(
            "class GradingError(AssertionError): pass\n"
            "for x in (0, 1, -3, 21):\n"
            "    if double(x) != 2 * x:\n"
            "        raise GradingError(f'FAIL double: double({x}) gave {double(x)}, expected {2 * x}.\\n'\n"
            "                           'hint: multiply, do not add')\n"
            "print('PASS double: 4 cases')", metadata={"tags": ["check"]}),
        V4.new_markdown_cell("## Part 2"),
        V4.new_code_cell("assert double(2) == 4\nprint('PASS part 2')", metadata={"tags": ["check", "part-2"]}),
    ]
    return nb


def save_stale(nb, path):
    """As JupyterLab saves a notebook run out of order: old outputs, a stale error, counts 7, 3, ..."""
    demo, check1, check2 = nb.cells[2], nb.cells[3], nb.cells[5]
    demo.outputs = [V4.new_output("stream", name="stdout", text="43\n")]           # from an older, wrong version
    demo.execution_count = 7
    check1.outputs = [V4.new_output("error", ename="GradingError", evalue="FAIL double: stale", traceback=[])]
    check1.execution_count = 3
    check2.outputs, check2.execution_count = [], None                            # never run
    nbformat.write(nb, path)


@pytest.mark.slow
def test_correct_notebook_with_stale_outputs_passes_and_is_not_modified(tmp_path):
    path = tmp_path / "99_double.ipynb"                                          # outside the repository
    save_stale(learner_notebook("    return 2 * x"), path)
    before = path.read_bytes()
    report = grade(path)
    assert report.passed, format_report(report, verbose=True)
    assert [c.name for c in report.checks] == ["Part 1: doubling", "part-2 (Part 2)"]
    assert report.checks[0].verdict == "PASS double: 4 cases"
    assert path.read_bytes() == before


@pytest.mark.slow
def test_wrong_notebook_gives_the_one_line_verdict(tmp_path, capsys):
    path = tmp_path / "99_double.ipynb"
    nbformat.write(learner_notebook("    return x + 2"), path)
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == ("  FAIL  [check, cell 4] Part 1: doubling: GradingError: FAIL double: double(0) gave 2, "
                        "expected 0.")
    assert "Traceback" not in out and "hint" not in out and "--verbose" in out
    assert main([str(path), "--verbose"]) == 1
    assert "GradingError" in capsys.readouterr().out.split("cell 4", 1)[1]      # traceback shown


@pytest.mark.slow
def test_a_stub_is_reported_where_it_raised(tmp_path):
    path = tmp_path / "99_double.ipynb"
    nbformat.write(learner_notebook("    raise NotImplementedError('exercise: replace this line')"), path)
    report = grade(path)
    assert not report.passed
    first = report.cells[0]
    assert not first.is_check and first.index == 3 and first.verdict.startswith("NotImplementedError")


def test_missing_notebook_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_solution_saved_with_stale_outputs_passes_outside_the_repo(tmp_path):
    """The course's own exercise 04, completed (its solution), saved with stale and missing outputs."""
    src = ROOT / "solutions" / "04_dynamic_loss_scaling.ipynb"
    path = tmp_path / "04_copy.ipynb"
    nb = nbformat.read(src, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        if "check" in c.metadata.get("tags", []):
            c.outputs = []                                                      # check never re-run
        else:
            c.outputs = [V4.new_output("stream", name="stdout", text="stale output\n")]
    nbformat.write(nb, path)
    report = grade(path)
    assert report.passed and report.checks, format_report(report, verbose=True)
    assert all(c.verdict.startswith("PASS") for c in report.checks)
    shutil.rmtree(tmp_path)
