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


# The long lane (``pytest -m long``; the README's test command is ``pytest -n auto -m "not long"``, CI runs both):
# tests that spawn gloo ranks, run whole CLI processes or training runs, reproduce a stored run, prove a grader by
# mutation or drive the website in a browser. A prefix of a test's node id: a folder, a module, one test.
LONG = [
    "tests/experiment/parallel/",                                  # spawned gloo ranks: DDP, FSDP2, DCP, experts
    "tests/core/quant/test_fp8_ranks_agree.py",                    # spawned gloo ranks
    "tests/core/quant/test_fp8_distributed.py",                    # spawned gloo ranks
    "tests/core/quant/layers/test_fp8_all_gather.py",              # spawned gloo ranks
    "tests/core/scaling/test_scaling_distributed.py",              # spawned gloo ranks
    "tests/course/grading/test_grading_distributed.py",            # spawned gloo ranks
    "tests/course/test_distributed_demos.py",                      # spawned gloo ranks
    "tests/core/quant/test_fp8_edges.py::test_amax_all_reduce_refuses_ranks_that_ran_different_layers",  # ranks
    "tests/course/test_mutation.py",                               # every mutant through its notebook's check cells
    "tests/course/test_site.py",                                   # the website in a browser
    "tests/test_gpu_suite.py",                                     # the GPU suite's dry run, every section
    "tests/experiment/test_compare_robust.py::test_a_rows_bits_do_not_depend_on_jobs_company_or_process",
    "tests/experiment/test_compare_robust.py::test_a_failed_recipe_keeps_the_finished_rows_and_names_itself",
    "tests/experiment/test_compare_robust.py::test_cli_exits_1_naming_the_failed_recipe_and_writes_the_rest",
    "tests/experiment/test_compare_robust.py::test_ctrl_c_on_a_rerun_of_a_real_process_keeps_the_earlier_run",
    "tests/experiment/test_compare_robust.py::test_an_interrupt_in_the_pool_keeps_the_rows_the_workers_finished",
    "tests/experiment/test_progress.py::test_pool_bar_counts_a_diverged_runs_remaining_steps_as_done",
    "tests/experiment/test_cli.py::test_torchrun_is_checked_as_nproc_is",           # a real torchrun, 3 processes
    "tests/experiment/ablations/test_ablation_autoswitch.py",      # training runs, with and without the switch
    "tests/experiment/test_compare_autoswitch.py",                 # a CLI run with the inspector and the switch
    "tests/course/test_stored_runs.py",                            # stored runs reproduced by their commands
    "tests/course/test_diagnose_yours.py::test_the_fresh_runs_show_the_cause_they_were_built_for",
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
        if item.nodeid.startswith(tuple(LONG)):
            item.add_marker(pytest.mark.long)
            item.add_marker(pytest.mark.slow)

    def rank(item):
        for i, prefix in enumerate(COSTLY):
            if item.nodeid.startswith(prefix):
                return i
        return len(COSTLY)
    items.sort(key=rank)                                  # stable: each file keeps its own order


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under ``-m "not long"`` (the README's test command), say what was left out and how to run it (xdist's summary
    line does not count deselected tests)."""
    if "not long" in (config.option.markexpr or ""):
        terminalreporter.write_line("the long lane (conftest.LONG: spawned gloo ranks, whole CLI processes, stored runs, "
                                    "mutation proofs, the website in a browser) was left out: pytest -n auto -m long "
                                    "runs it")
