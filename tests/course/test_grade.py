"""``mpcourse grade``: a learner's notebook is graded fresh, whatever its stored outputs say.

A correct notebook saved with stale outputs, out-of-order execution counts and a never-run check
cell passes; a wrong one fails with the grader's one-line verdict (the traceback only with
``--verbose``); the file itself is never modified; it works on a copy outside the repository.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
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


@pytest.mark.slow
def test_a_cell_that_never_ends_is_one_fail_line_and_the_summary_prints(tmp_path):
    """A learner's function that loops forever, graded with --timeout as a person runs it: each cell that called it
    is one FAIL line naming the cell and the timeout (interrupted, the next cells still run), the summary prints,
    exit code 1, and no traceback (nbclient's CellTimeoutError, the kernel's ZMQError) reaches the learner."""
    path = tmp_path / "99_double.ipynb"
    nbformat.write(learner_notebook("    while True:\n        pass"), path)
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "grade", "--timeout", "3", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    said = "timed out: still running after 3 s (--timeout 3), interrupted (a loop that never ends?)"
    assert lines[1:] == [f"  FAIL  [your code, cell 3] Part 1: doubling: {said}",
                         f"  FAIL  [check, cell 4] Part 1: doubling: {said}",
                         f"  FAIL  [check, cell 6] part-2 (Part 2): {said}",
                         "  0/2 checks passed  (--verbose shows the tracebacks)"], proc.stdout
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_kernel_that_dies_is_named_and_the_summary_prints(tmp_path, capsys):
    """The learner's code ends the kernel (os._exit): the cell is named, the checks after it are "not run"."""
    path = tmp_path / "99_double.ipynb"
    nb = learner_notebook("    import os\n    os._exit(1)")
    nbformat.write(nb, path)
    assert main([str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  FAIL  [your code, cell 3] Part 1: doubling: the kernel died while this cell ran")
    assert lines[2:] == ["  FAIL  [check, cell 4] Part 1: doubling: not run: the kernel died in cell 3",
                         "  FAIL  [check, cell 6] part-2 (Part 2): not run: the kernel died in cell 3",
                         "  0/2 checks passed  (--verbose shows the tracebacks)"]


@pytest.mark.slow
def test_grade_and_compare_with_number_a_cell_the_same(tmp_path, capsys):
    """One numbering (``learner.cell_number``: the position from the top, every cell counted, from 1): a cell that
    does not parse is the same "cell N" in ``mpcourse grade`` and in ``mpcourse compare --with``."""
    from mpcourse.cli import main as cli
    from mpcourse.experiment.learner import cell_number

    path = tmp_path / "04_mine.ipynb"
    nb = learner_notebook("    return 2 * x")
    nb.cells.insert(2, V4.new_code_cell("def update_scale(x:\n    pass"))          # the 3rd cell: cell 3
    nbformat.write(nb, path)
    assert cell_number(2) == 3
    assert cli(["compare", "--recipes", "fp16-dynamic", "--with", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path.name} cell 3: syntax error on line 1" in err, err
    report = grade(path)
    broken = [c for c in report.cells if c.verdict.startswith("SyntaxError")]
    assert [c.index for c in broken] == [3]
    assert "[your code, cell 3]" in format_report(report)
