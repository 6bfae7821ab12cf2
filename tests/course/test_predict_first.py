"""Every predict-first answer is hidden until the learner runs or opens it, and nbval still grades it.

A lesson's ``**Predict first:**`` prompt is followed by the code cell that answers it; that cell's stored output
is collapsed (``mpcourse.course.predict_first``: ``jupyter.outputs_hidden`` and ``collapsed``, the keys
JupyterLab reads), and only those cells are. Re-executing a notebook (``course.exercises.execute``) keeps it so,
and nbval compares a collapsed output like any other (checked on a notebook with a wrong stored answer). The
website's side (a ``<details>`` element) is in ``test_site.py``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mpcourse.course.exercises import _normalise
from mpcourse.course.predict_first import PROMPT, answer_cells, hide_answers, is_hidden

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("[0-9]*.ipynb"))


def _prompts(nb) -> int:
    return sum(c.cell_type == "markdown" and PROMPT in c.source for c in nb.cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_predict_first_answer_is_hidden_and_nothing_else(path):
    nb = nbformat.read(path, as_version=4)
    answers = answer_cells(nb)
    assert len(answers) == _prompts(nb)
    for i in answers:
        cell = nb.cells[i]
        assert cell.cell_type == "code", f"{path.name}: cell {i} answers a predict-first prompt: make it a code cell"
        assert cell.outputs, f"{path.name}: cell {i} answers a prompt but stores no output"
        assert cell.metadata.get("jupyter", {}).get("outputs_hidden") is True and cell.metadata.get("collapsed") is True, \
            f"{path.name}: cell {i}'s answer is visible (python -m mpcourse.course execute {path.relative_to(ROOT)})"
    others = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and is_hidden(c) and i not in answers]
    assert others == [], f"{path.name}: cells {others} are collapsed but answer no prompt"


def test_the_later_lessons_ask_for_predictions():
    """The check above is not empty: lessons 09-13 each hold prompts (the brief: before each measured table)."""
    for path in sorted((ROOT / "notebooks").glob("09_*.ipynb")) + sorted((ROOT / "notebooks").glob("1[0-3]_*.ipynb")):
        assert _prompts(nbformat.read(path, as_version=4)) >= 5, path.name


def _lesson(stored: str, collapsed_elsewhere: bool = False) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    other = nbformat.v4.new_code_cell("print('context')", execution_count=1, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="context\n")])
    if collapsed_elsewhere:                          # a learner collapsed it in JupyterLab: view state only
        other.metadata.update({"collapsed": True, "jupyter": {"outputs_hidden": True}})
    nb.cells = [nbformat.v4.new_markdown_cell("# 99 — t"), other,
                nbformat.v4.new_markdown_cell(f"{PROMPT} what does 6 x 7 print?"),
                nbformat.v4.new_code_cell("print(6 * 7)", execution_count=2, outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text=stored)])]
    return nb


def test_storing_a_notebook_hides_its_answers_and_only_them():
    nb = _lesson("42\n", collapsed_elsewhere=True)
    _normalise(nb)                                   # what execute() applies before it writes the notebook
    assert is_hidden(nb.cells[3]) and nb.cells[3].metadata == {"jupyter": {"outputs_hidden": True}, "collapsed": True}
    assert not is_hidden(nb.cells[1]) and "jupyter" not in nb.cells[1].metadata
    assert hide_answers(nb) == 1                     # idempotent
    nbformat.validate(nb)


@pytest.mark.slow
def test_nbval_compares_a_hidden_answer(tmp_path):
    """A collapsed output is still graded: nbval passes the right stored answer and fails a wrong one."""
    rcs = {}
    for stored in ("42\n", "41\n"):
        nb = _lesson(stored)
        hide_answers(nb)
        path = tmp_path / f"answer_{stored.strip()}.ipynb"
        nbformat.write(nb, path)
        (tmp_path / "pytest.ini").write_text("[pytest]\n")       # none of the repository's options
        rcs[stored] = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                                      "--nbval", "--nbval-current-env", str(path)], cwd=tmp_path,
                                     capture_output=True, text=True, timeout=300)
    assert rcs["42\n"].returncode == 0, rcs["42\n"].stdout[-2000:]
    assert rcs["41\n"].returncode == 1 and "41" in rcs["41\n"].stdout, rcs["41\n"].stdout[-2000:]


def test_storing_a_notebook_merges_the_chunks_of_a_stream():
    """How a busy kernel happened to flush its prints is not stored: consecutive stdout chunks become one output,
    the same text (re-executing under load gives the same file)."""
    nb = nbformat.v4.new_notebook()
    out = lambda name, text: nbformat.v4.new_output("stream", name=name, text=text)
    nb.cells = [nbformat.v4.new_code_cell("...", execution_count=1, outputs=[
        out("stdout", "a\n"), out("stdout", "b"), out("stdout", "\n"), out("stderr", "w\n"), out("stdout", "c\n")])]
    _normalise(nb)
    assert [(o.name, o.text) for o in nb.cells[0].outputs] == [("stdout", "a\nb\n"), ("stderr", "w\n"), ("stdout", "c\n")]
