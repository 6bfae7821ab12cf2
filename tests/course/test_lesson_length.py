"""Lessons stay lean: the later lessons (09-13), the densest, hold at most 2,500 words of prose each (markdown
cells; reference material belongs in docs/)."""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2500


@pytest.mark.parametrize("lesson", sorted(p.name for p in (ROOT / "notebooks").glob("1[0-3]_*.ipynb"))
                         + sorted(p.name for p in (ROOT / "notebooks").glob("09_*.ipynb")))
def test_prose_is_at_most_2500_words(lesson):
    nb = nbformat.read(ROOT / "notebooks" / lesson, as_version=4)
    words = sum(len(re.findall(r"\S+", c.source)) for c in nb.cells if c.cell_type == "markdown")
    assert words <= LIMIT, f"{lesson}: {words} words of prose (at most {LIMIT}); move reference material to docs/"
