"""How a test run is laid out, for every path pytest collects (tests/, notebooks/, solutions/, exercises/).

The fast lane: each notebook graded by nbval starts a fresh kernel and replays the whole lesson, so its
cells are marked ``slow``; ``pytest -m "not slow"`` skips them and the tests marked slow by hand (see
``[tool.pytest.ini_options]`` in pyproject.toml), and keeps every rule's oracle test.

Parallel workers (pytest-xdist, ``pytest -n auto``): the work is spread in groups (``--dist loadgroup``,
chosen here when ``-n`` is given without ``--dist``), each group run whole, in order, by one worker:

- a notebook's cells, since they share one kernel and run in order;
- a test module, since its module-scoped fixtures and module-level caches (the library's training runs
  the tests compare against) are then made once per run, not once per worker;
- except the modules in ``SPREAD``, whose tests are independent and long: each test is a group of its own.

The groups start longest first (``COSTLY``, measured; the rest in collection order), so that the last
ones to finish are short and both workers stay busy to the end.
"""
from __future__ import annotations

import pytest

# Modules whose tests share nothing costly and each take long (a fresh kernel, spawned ranks): spread them.
SPREAD = {"tests/test_course.py"}

# Groups measured to take longest, longest first (a prefix of a test's node id: a module, a folder of
# notebooks, one test); measured with one worker per core on a 2-core CPU (see README, For contributors).
COSTLY = [
    "tests/test_checkpoint_distributed.py",       # spawned gloo ranks: one job for every resume case
    "tests/test_distributed.py",                  # spawned gloo ranks: one job for every DDP/FSDP case
    "tests/test_course.py::test_shipped_exercise_fails_every_check[11",   # a kernel that spawns ranks
    "tests/test_train_yours.py",                  # the library's runs, made once, against every learner
    "tests/test_compare_jobs.py",                 # worker processes
    "solutions/",                                 # a kernel each, training the last cell's rows
    "notebooks/",                                 # a kernel each
    "tests/test_course.py::test_shipped_exercise_fails_every_check",      # a kernel each
]


@pytest.hookimpl(tryfirst=True)                        # before xdist's own, which would set ``load``
def pytest_cmdline_main(config):
    """``-n N`` without ``--dist``: group as described above (xdist's default, ``load``, would split a notebook)."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False          # keep the order chosen below, not largest group first


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tell each worker the dist mode chosen above (a worker parses the command line again, without it)."""
    node.workerinput["mpcourse_dist"] = node.config.option.dist


def _group(item) -> str:
    path = item.nodeid.split("::", 1)[0]
    return item.nodeid if path in SPREAD else path


def _is_notebook_cell(item) -> bool:
    return item.nodeid.split("::", 1)[0].endswith(".ipynb")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    grouped = config.pluginmanager.hasplugin("xdist")    # the xdist_group marker exists only with xdist
    if getattr(config, "workerinput", {}).get("mpcourse_dist") == "loadgroup":
        config.option.loadgroup = True                    # read next by xdist's own hook, in this worker
    for item in items:
        if _is_notebook_cell(item):
            item.add_marker(pytest.mark.slow)
        if grouped:
            item.add_marker(pytest.mark.xdist_group(_group(item)))

    def rank(item):
        for i, prefix in enumerate(COSTLY):
            if item.nodeid.startswith(prefix):
                return i
        return len(COSTLY)
    items.sort(key=rank)                                  # stable: each group keeps its own order
