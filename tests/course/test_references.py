"""Lessons, exercises and the README point only to what exists.

Reads every "lesson NN" / "lessons NN-MM" and every ``notebooks/``, ``exercises/`` or
``solutions/`` ``NN_...`` path in the notebooks (markdown and code) and the README, and checks that
the lesson or file is there. Reads the files present, so new lessons are covered as they land.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSON = re.compile(r"\b[Ll]essons?\s+(\d{2})(?:\s*(?:-|–|and|to)\s*(\d{2}))?\b")
PATH = re.compile(r"\b(notebooks|exercises|solutions)/(\d{2})_([A-Za-z0-9_]*)(\*)?(\.ipynb)?")


def sources():
    for folder in ("notebooks", "solutions", "exercises"):
        for nb_path in sorted((ROOT / folder).glob("*.ipynb")):
            nb = nbformat.read(nb_path, as_version=4)
            for i, cell in enumerate(nb.cells):
                yield f"{folder}/{nb_path.name} cell {i}", cell.source
    yield "README.md", (ROOT / "README.md").read_text(encoding="utf-8")


def lessons() -> set[str]:
    return {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}


def broken_references(texts=None) -> list[str]:
    """Every reference in ``texts`` ((where, text) pairs; default: all notebooks and the README)
    to a lesson or a file that does not exist."""
    have, bad = lessons(), []
    for where, text in (sources() if texts is None else texts):
        for m in LESSON.finditer(text):
            lo, hi = m.group(1), m.group(2) or m.group(1)
            for n in range(int(lo), int(hi) + 1):
                if f"{n:02d}" not in have:
                    bad.append(f"{where}: '{m.group(0)}' but there is no notebooks/{n:02d}_*.ipynb")
        for m in PATH.finditer(text):
            folder, num, stem, star, ext = m.groups()
            pattern = f"{num}_{stem}*" if (star or not ext) else f"{num}_{stem}.ipynb"
            if not list((ROOT / folder).glob(pattern + ("" if pattern.endswith(".ipynb") else ".ipynb"))):
                bad.append(f"{where}: '{m.group(0)}' does not exist")
    return bad


def test_every_lesson_and_exercise_reference_exists():
    bad = broken_references()
    assert not bad, "references to lessons or files that do not exist:\n" + "\n".join(bad)


def test_the_checker_finds_a_broken_reference():
    planted = ("See lesson 97, then open exercises/97_nothing.ipynb or exercises/98_*.ipynb; "
               "lessons 00-01 and exercises/00_number_formats.ipynb exist, as does exercises/04_*.ipynb.")
    bad = broken_references([("planted", planted)])
    assert len(bad) == 3 and all(any(k in b for k in ("lesson 97", "97_nothing", "98_")) for b in bad), bad
    assert broken_references([("range", "lessons 00-99")])                      # 99 is not there
