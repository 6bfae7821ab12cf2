"""Test helpers shared by the tests of the learner's functions: the solutions' FP8 functions (lessons 07-09), and a
count of the one check (``mpcourse.core.learner_table.check_overrides``) wherever a module imported it."""
import sys
from pathlib import Path

from mpcourse.core import learner_table
from mpcourse.experiment.learner import load_functions

ROOT = Path(__file__).resolve().parents[1]
FP8_LESSONS = ("07_fp8_formats_and_scaling", "08_delayed_scaling", "09_finer_grained_scaling")


def fp8_solution_functions() -> dict:
    """{name: function} of every exercise function the solutions of lessons 07, 08 and 09 define."""
    out = {}
    for nb in FP8_LESSONS:
        out.update(load_functions(ROOT / "solutions" / f"{nb}.ipynb"))
    return out


def count_check_overrides(monkeypatch) -> tuple[list, set]:
    """Replace ``check_overrides`` in every ``mpcourse`` module that imported it by a counting wrapper: returns
    (the ``who`` of every call, in order, as a list that grows; the names of the modules patched)."""
    real, calls, patched = learner_table.check_overrides, [], set()

    def counting(overrides, accepts, who, **kw):
        calls.append(who)
        return real(overrides, accepts, who, **kw)

    for name, module in list(sys.modules.items()):
        if name.startswith("mpcourse") and getattr(module, "check_overrides", None) is real:
            monkeypatch.setattr(module, "check_overrides", counting)
            patched.add(name)
    return calls, patched
