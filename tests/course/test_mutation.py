"""The check cells of lessons 09-14 reject at least 98% of learner-plausible wrong versions of every
exercise function (``tests/course/mutants/``; harness: ``tests/course/mutation.py``)."""
import contextlib
import importlib

import pytest

from mutation import run_mutant

LESSONS = {   # module in tests/course/mutants -> solution notebook
    "m09": "09_finer_grained_scaling.ipynb",
    "m10": "10_beyond_one_machine.ipynb",
    "m11": "11_memory_speed_ablations.ipynb",
    "m12": "12_capstone.ipynb",
    "m13": "13_experts.ipynb",
    "m14": "14_fp8_attention.ipynb",
}


def _cases():
    for mod, notebook in LESSONS.items():
        yield pytest.param(notebook, importlib.import_module(f"mutants.{mod}"), id=mod)


@pytest.mark.slow
@pytest.mark.parametrize("notebook,module", list(_cases()))
def test_check_cells_reject_the_mutants(notebook, module):
    mutants = module.MUTANTS
    # a module may grade every function its check cells will see in one batch first (lesson 10: spawned ranks)
    together = getattr(module, "graded_together", None)
    with together(notebook, mutants) if together else contextlib.nullcontext():
        assert run_mutant(notebook, "", None) is None, f"the solution {notebook} fails its own check cells"
        survivors, total = [], 0
        for name, versions in mutants.items():
            assert len(versions) >= 5, f"{name}: too few mutants to measure its grader"
            for label, source in versions:
                total += 1
                if run_mutant(notebook, name, source) is None:
                    survivors.append(f"{name}: {label}")
    rejected = 1 - len(survivors) / total
    assert rejected >= 0.98, f"{len(survivors)} of {total} mutants pass the check cells: {survivors}"
