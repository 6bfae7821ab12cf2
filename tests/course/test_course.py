"""The grading mechanism: exercises generated from solutions (no drift), shipped exercises fail their
checks, solution markers are well formed."""
from pathlib import Path

import nbformat
import pytest

import subprocess
import warnings

from mpcourse.course.exercises import (BEGIN, END, STUB, CourseError, check_drift, exercise_pairs, locally_edited,
                                       make_exercise, strip_solutions, write_exercises)

ROOT = Path(__file__).resolve().parents[2]


def test_strip_keeps_signature_docstring_and_indentation():
    src = (f'def f(x):\n    """Doc: y = 2x."""\n    {BEGIN}\n    y = 2 * x\n    return y\n    {END}\n\n'
           f'print(1)\n')
    out = strip_solutions(src)
    assert 'def f(x):\n    """Doc: y = 2x."""\n    # YOUR CODE HERE\n    ' + STUB in out
    assert "2 * x" not in out and "print(1)" in out


def test_unbalanced_markers_are_refused():
    with pytest.raises(CourseError, match="unbalanced"):
        strip_solutions(f"{BEGIN}\nx = 1\n")


def _edited_exercises():
    return {ex.relative_to(ROOT).as_posix() for _, ex in exercise_pairs(ROOT) if locally_edited(ex, ROOT)}


def test_exercises_are_in_sync_with_solutions():
    """Committed exercises match their solutions. An exercise with uncommitted edits (a learner's
    work) is left out with a warning: it is meant to differ, and nothing here touches it."""
    edited = _edited_exercises()
    if edited:
        warnings.warn(f"not checked (uncommitted edits, kept as they are): {', '.join(sorted(edited))}")
    problems = [p for p in check_drift(ROOT) if p.split(" ", 1)[0] not in edited]
    assert problems == [], ("exercises/ drifted from solutions/. Contributors: python -m mpcourse.course "
                            "exercises (it never overwrites an exercise with uncommitted edits)")


def _git_course(tmp_path):
    """A tiny course in a git repository: one solution, its generated exercise, committed."""
    for sub in ("solutions", "exercises"):
        (tmp_path / sub).mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"def f():\n    {BEGIN}\n    return 1\n    {END}\n"),
                nbformat.v4.new_code_cell("check(f)", metadata={"tags": ["check"]})]
    nbformat.write(nb, tmp_path / "solutions" / "99_x.ipynb")
    assert len(write_exercises(tmp_path, echo=lambda *_: None)[0]) == 1
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "course")
    return nb


def _change_solution(tmp_path, nb):
    nb.cells[1].source = "check(f)  # a better check"
    nbformat.write(nb, tmp_path / "solutions" / "99_x.ipynb")


def test_regenerating_never_overwrites_a_learners_edits(tmp_path):
    nb = _git_course(tmp_path)
    ex = tmp_path / "exercises" / "99_x.ipynb"
    work = nbformat.read(ex, as_version=4)
    work.cells[0].source = "def f():\n    return 1   # my answer"
    nbformat.write(work, ex)
    mine = ex.read_bytes()
    _change_solution(tmp_path, nb)                       # the exercise is now out of date too
    said = []
    written, kept = write_exercises(tmp_path, echo=said.append)
    assert (written, kept) == ([], [ex]) and ex.read_bytes() == mine
    assert "not overwritten" in said[0] and "--force" in said[0]
    written, kept = write_exercises(tmp_path, force=True, echo=said.append)
    assert written == [ex] and "my answer" not in ex.read_text()


def test_regenerating_replaces_a_committed_exercise(tmp_path):
    nb = _git_course(tmp_path)
    _change_solution(tmp_path, nb)
    written, kept = write_exercises(tmp_path, echo=lambda *_: None)
    assert written == [tmp_path / "exercises" / "99_x.ipynb"] and kept == []
    assert "a better check" in written[0].read_text()


def test_without_git_a_differing_exercise_is_kept(tmp_path):
    nb = _git_course(tmp_path)
    subprocess.run(["rm", "-rf", str(tmp_path / ".git")], check=True)
    assert locally_edited(tmp_path / "exercises" / "99_x.ipynb", tmp_path) is None
    _change_solution(tmp_path, nb)
    before = (tmp_path / "exercises" / "99_x.ipynb").read_bytes()
    assert write_exercises(tmp_path, echo=lambda *_: None)[1] and \
        (tmp_path / "exercises" / "99_x.ipynb").read_bytes() == before


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


@pytest.mark.slow
@pytest.mark.parametrize("solution,exercise", _pairs())
def test_shipped_exercise_fails_every_check(solution, exercise):
    """Run the shipped exercise: every check cell must fail (the graders can fail).

    The last cell (tagged ``train-yours``) is left out: it grades nothing, and what it prints for the shipped
    stubs is tested in tests/course/test_train_yours.py, against library runs made once for the whole module."""
    from mpcourse.course.grade import execute_fresh

    if locally_edited(exercise, ROOT):
        pytest.skip(f"{exercise.name} has uncommitted edits (your work?): this test is about the shipped version")
    nb = nbformat.read(exercise, as_version=4)
    nb.cells = [c for c in nb.cells if "train-yours" not in c.metadata.get("tags", [])]
    nb, _ = execute_fresh(nb, exercise.parent, timeout=300)
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    for cell in checks:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert errors, f"check cell passed on the unfinished exercise:\n{cell.source}"
        assert errors[0].ename == "GradingError", errors[0].ename
        passes = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert "PASS" not in passes
