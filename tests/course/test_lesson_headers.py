"""Every lesson opens with its time, what it needs and what the learner can do after it, and the README's
lesson table says the same (one row per lesson, same time, same prerequisites, the link to the notebook)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.ipynb"))
LABELS = ("**Time:**", "**Needs:**", "**After it you can:**")


def header(path: Path) -> str:
    """The markdown cell right after the title cell."""
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# {path.name[:2]} "), \
        f"{path.name}: the first cell is the title, '# {path.name[:2]} ...'"
    return nb.cells[1].source if nb.cells[1].cell_type == "markdown" else ""


def lesson_numbers(text: str) -> set[str]:
    """'lessons 00 and 03' / '00, 03' / '00-08' -> {'00', '03'} / {'00', ..., '08'}."""
    out = set()
    for a, b in re.findall(r"\b(\d\d)(?:-(\d\d))?\b", text):
        out |= {f"{i:02d}" for i in range(int(a), int(b or a) + 1)}
    return out


def readme_rows() -> dict[str, tuple[str, str, str]]:
    """lesson number -> (link target, time, needs) from the README's lesson table."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| (\d\d) \| \[[^]]+\]\(([^)]+)\)[^|]*\((\d[^)]*)\) \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_the_course_has_its_lessons_from_00_in_order():
    assert len(LESSONS) >= 15 and [p.name[:2] for p in LESSONS] == [f"{i:02d}" for i in range(len(LESSONS))]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_opens_with_time_needs_and_outcomes(path):
    text = header(path)
    assert all(label in text for label in LABELS), f"{path.name}: cell 2 must hold {', '.join(LABELS)}"
    assert [text.index(label) for label in LABELS] == sorted(text.index(label) for label in LABELS)
    after = text.split("**After it you can:**", 1)[1].strip()
    assert len(after) > 40, f"{path.name}: say what the learner can do after the lesson"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_readme_row_matches_the_lesson(path):
    rows = readme_rows()
    number = path.name[:2]
    assert number in rows, f"README's lesson table has no row {number}"
    link, time, needs = rows[number]
    assert link == f"notebooks/{path.name}"
    text = header(path)
    lesson_time = re.search(r"\*\*Time:\*\* about ([^ ]+ (?:h|min))", text).group(1)
    assert time == lesson_time, f"{path.name}: README says {time}, the lesson {lesson_time}"
    lesson_needs = text.split("**Needs:**", 1)[1].split("**After", 1)[0]
    assert lesson_numbers(needs) == lesson_numbers(lesson_needs), f"{path.name}: README needs {needs!r}"


def test_the_number_parser_reads_ranges_and_lists():
    assert lesson_numbers("lessons 00 and 03") == {"00", "03"}
    assert lesson_numbers("00-02, 07") == {"00", "01", "02", "07"}
    assert lesson_numbers("Python, PyTorch tensors") == set()
