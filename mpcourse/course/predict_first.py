"""Predict-first answers stay out of sight until the learner runs or opens them.

The later lessons ask the learner to predict before each measured table: a markdown cell holding
``**Predict first:**`` and, right under it, the code cell whose stored output is the answer. That output is
kept (nbval compares it, ``tests/course/test_predict_first.py`` checks that a wrong one fails) but *hidden*:

* in the notebook, through the cell metadata JupyterLab reads and writes for a collapsed output (nbformat 4:
  ``"jupyter": {"outputs_hidden": true}``, and the older ``"collapsed": true`` that JupyterLab 4 takes as the
  source of truth for a code cell and keeps in step with the first). The output shows as a thin bar: a click
  opens it; running the cell shows the learner's own output.
* on the website (``mpcourse.course.site``), behind a ``<details>`` element: a click opens it.

``course.exercises.execute`` applies ``hide_answers`` every time it stores a notebook, so re-executing a lesson
keeps its answers hidden.
"""
from __future__ import annotations

PROMPT = "**Predict first:**"


def answer_cells(nb) -> list[int]:
    """Indices of the cells that answer a predict-first prompt: the cell right after each markdown cell that
    holds ``PROMPT`` (a code cell in a well-formed lesson; the check is the test's)."""
    cells = nb["cells"]
    return [i + 1 for i, c in enumerate(cells[:-1])
            if c["cell_type"] == "markdown" and PROMPT in "".join(c["source"])]


def is_hidden(cell) -> bool:
    """Whether a code cell's outputs are collapsed (either metadata key, as JupyterLab reads them)."""
    meta = cell.get("metadata", {})
    return bool(meta.get("collapsed")) or bool(meta.get("jupyter", {}).get("outputs_hidden"))


def hide_answers(nb) -> int:
    """Collapse the outputs of every predict-first answer cell of ``nb`` (in place); returns how many."""
    n = 0
    for i in answer_cells(nb):
        cell = nb["cells"][i]
        if cell["cell_type"] != "code":
            continue
        cell["metadata"].setdefault("jupyter", {})["outputs_hidden"] = True
        cell["metadata"]["collapsed"] = True
        n += 1
    return n
