"""Mutation testing of the exercises' graders, through the notebooks' own check cells.

A grader is proven by the mistakes it catches. For each exercise function, ``tests/course/mutants/mNN.py`` keeps a list
of learner-plausible wrong versions (edge values, dtypes, operation order, a Python float for a tensor, ...), each
a complete ``def`` with the exercise's signature. :func:`run_mutant` runs the *solution* notebook's code cells in
order in one namespace, as a kernel would, with the function's definition replaced by the mutant right after the
cell that defines it, and reports whether a check cell after that point rejected it (raised). Cells tagged
``train-yours`` (they train a GPT; graded elsewhere) and cells with IPython syntax are skipped.

``tests/course/test_mutation.py`` requires each lesson's check cells to reject at least 98% of its mutants.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
_DEF = re.compile(r"^def\s+(\w+)", re.M)


def _exec(source: str, ns: dict, filename: str) -> None:
    """exec with a source file linecache can find (the graders read a function's source with inspect)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)


def code_cells(notebook: str):
    """(index, source, tags) of the solution notebook's runnable code cells."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    for i, cell in enumerate(nb.cells):
        tags = cell.metadata.get("tags", [])
        if cell.cell_type != "code" or "train-yours" in tags:
            continue
        if any(line.lstrip().startswith(("%", "!")) for line in cell.source.splitlines()):
            continue
        yield i, cell.source, tags


def run_mutant(notebook: str, name: str, mutant: str | None) -> str | None:
    """Run ``solutions/<notebook>`` with ``name`` replaced by ``mutant`` (None: the solution itself).

    Returns None when every check cell passed, else the first rejecting check cell's one-line message.
    Raises a RuntimeError when a cell that is not a check cell fails *before* the mutant is in place (the
    harness's fault, not the grader's)."""
    ns: dict = {"__name__": "__main__"}
    placed = mutant is None
    for i, source, tags in code_cells(notebook):
        is_check = "check" in tags
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                _exec(source, ns, f"<{notebook}-cell-{i}>")
                if not placed and name in _DEF.findall(source):
                    _exec(mutant, ns, f"<{notebook}-mutant-{name}>")
                    placed = True
        except Exception as e:                            # noqa: BLE001 - any failure of a check cell rejects
            if placed and is_check:
                return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if not placed:
                raise RuntimeError(f"{notebook} cell {i} failed before the mutant was placed: {e!r}") from e
            # a lesson cell after the mutant failed: the learner sees an error there too; keep going
    if not placed:
        raise RuntimeError(f"{notebook} defines no function {name!r}")
    return None
