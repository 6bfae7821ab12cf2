"""How a test run is laid out, for every path pytest collects (tests/, notebooks/, solutions/, exercises/).

The fast lane: each notebook graded by nbval starts a fresh kernel and replays the whole lesson, so its
cells are marked ``slow``; ``pytest -m "not slow"`` skips them and the tests marked slow by hand (see
``[tool.pytest.ini_options]`` in pyproject.toml), and keeps every rule's oracle test.

Parallel workers (pytest-xdist, ``pytest -n auto``): the work is spread by file (``--dist loadfile``, chosen
here when ``-n`` is given without ``--dist``), each file run whole, in order, by one worker: a notebook's cells
share one kernel and run in order, and a test module's module-scoped fixtures and module-level caches (the
library's training runs the tests compare against) are made once per run, not once per worker. Files start
longest first (``COSTLY``, measured; the rest in collection order), so that the last ones to finish are short
and both workers stay busy to the end.
"""
from __future__ import annotations

import pytest

# Groups measured to take longest, longest first (a prefix of a test's node id: a module, a folder of
# notebooks, one test); measured with one worker per core on a 2-core CPU (see README, For contributors).
COSTLY = [
    "tests/experiment/parallel/test_checkpoint_distributed.py",       # spawned gloo ranks: one job for every resume case
    "tests/experiment/parallel/test_distributed.py",                  # spawned gloo ranks: one job for every DDP/FSDP case
    "tests/course/test_train_yours.py",                  # the library's runs, made once, against every learner
    "tests/experiment/test_compare_jobs.py",                 # worker processes
    "solutions/",                                 # a kernel each, training the last cell's rows
    "notebooks/",                                 # a kernel each
    "tests/course/test_course.py",                       # a kernel for every shipped exercise
]


@pytest.hookimpl(tryfirst=True)                        # before xdist's own, which would set ``load``
def pytest_cmdline_main(config):
    """``-n N`` without ``--dist``: by file, as described above (xdist's default, ``load``, would split a notebook)."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False          # keep the order chosen below, not largest file first


def _is_notebook_cell(item) -> bool:
    return item.nodeid.split("::", 1)[0].endswith(".ipynb")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_notebook_cell(item):
            item.add_marker(pytest.mark.slow)

    def rank(item):
        for i, prefix in enumerate(COSTLY):
            if item.nodeid.startswith(prefix):
                return i
        return len(COSTLY)
    items.sort(key=rank)                                  # stable: each file keeps its own order
