"""Where the course lives: the folder holding ``notebooks/``, ``exercises/`` and ``solutions/``.

Shared by ``mpcourse lab`` (:mod:`mpcourse.course.learner`) and ``mpcourse site`` (:mod:`mpcourse.course.site`).
"""
from __future__ import annotations

from pathlib import Path

from .exercises import ROOT


def course_root(start: Path | None = None) -> Path:
    """The folder holding ``notebooks/`` and ``exercises/``: the current folder or one above it,
    else the source checkout this package was installed from."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "notebooks").is_dir() and (d / "exercises").is_dir():
            return d
    if (ROOT / "notebooks").is_dir():
        return ROOT
    raise SystemExit("mpcourse lab: error: no course folder (one with notebooks/ and exercises/) here or above; "
                     "run it from your clone of the repository")
