"""The grading mechanism: exercises generated from solutions (no drift), shipped exercises fail their
checks, solution markers are well formed."""
from pathlib import Path

import nbformat
import pytest

from mpcourse.course.exercises import (BEGIN, END, STUB, CourseError, check_drift, exercise_pairs, make_exercise,
                             strip_solutions)

ROOT = Path(__file__).resolve().parent.parent


def test_strip_keeps_signature_docstring_and_indentation():
    src = (f'def f(x):\n    """Doc: y = 2x."""\n    {BEGIN}\n    y = 2 * x\n    return y\n    {END}\n\n'
           f'print(1)\n')
    out = strip_solutions(src)
    assert 'def f(x):\n    """Doc: y = 2x."""\n    # YOUR CODE HERE\n    ' + STUB in out
    assert "2 * x" not in out and "print(1)" in out


def test_unbalanced_markers_are_refused():
    with pytest.raises(CourseError, match="unbalanced"):
        strip_solutions(f"{BEGIN}\nx = 1\n")


def test_exercises_are_in_sync_with_solutions():
    assert check_drift(ROOT) == [], "run: python -m mpcourse.course exercises"


def test_drift_is_detected(tmp_path):
    for sub in ("solutions", "exercises"):
        (tmp_path / sub).mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"def f():\n    {BEGIN}\n    return 1\n    {END}\n"),
                nbformat.v4.new_code_cell("check(f)", metadata={"tags": ["check"]})]
    nbformat.write(nb, tmp_path / "solutions" / "99_x.ipynb")
    assert check_drift(tmp_path) == ["exercises/99_x.ipynb is missing"]
    ex = make_exercise(nb)
    nbformat.write(ex, tmp_path / "exercises" / "99_x.ipynb")
    assert check_drift(tmp_path) == []
    ex.cells[0].source += "\n# edited by hand"
    nbformat.write(ex, tmp_path / "exercises" / "99_x.ipynb")
    assert len(check_drift(tmp_path)) == 1


def _pairs():
    return [pytest.param(s, e, id=s.stem) for s, e in exercise_pairs(ROOT)]


@pytest.mark.parametrize("solution,exercise", _pairs())
def test_every_exercise_has_checks_and_solution_blocks(solution, exercise):
    nb = nbformat.read(solution, as_version=4)
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    assert checks, "a solution needs check cells (tag: check)"
    assert any("mpcourse.course.grading" in c.source for c in checks), "check cells call graders from mpcourse.course.grading"
    assert all(c.outputs and "PASS" in "".join(o.get("text", "") for o in c.outputs) for c in checks), \
        "every check cell of a solution stores its PASS verdict"


@pytest.mark.parametrize("solution,exercise", _pairs())
def test_shipped_exercise_fails_every_check(solution, exercise):
    """Run the shipped exercise: every check cell must fail (the graders can fail)."""
    from nbclient import NotebookClient

    nb = nbformat.read(exercise, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(exercise.parent)}}).execute()
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    for cell in checks:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert errors, f"check cell passed on the unfinished exercise:\n{cell.source}"
        assert errors[0].ename == "GradingError", errors[0].ename
        passes = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "PASS" not in passes
