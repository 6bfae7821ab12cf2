"""The table of the exercises' functions (``mpcourse.core.learner_table``) against the notebooks it describes, and
its three doors: ``learner_functions`` (the one filter), ``check_overrides`` (the one check where a recipe is
built), ``returned`` (the run-time check of what a function returned, ``mpcourse.core.seams``)."""
import ast
import inspect
import re
from pathlib import Path

import nbformat
import pytest
import torch

from mpcourse.core import seams
from mpcourse.core.learner_table import (EXERCISE_FUNCTIONS, CheckedFunctions, OverrideRefused, check_overrides,
                                         check_signature, exercise_names, learner_functions, returned)
from mpcourse.core.quant.recipe import recipe_classes
from mpcourse.core.seams import SeamError

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "### BEGIN SOLUTION"


def _code(cell) -> str:
    return "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _defs(path: Path, only_solutions: bool) -> dict[str, ast.AST]:
    """Top-level ``def`` / ``class`` statements of a notebook: those holding a ``### BEGIN SOLUTION`` block (the
    exercise's functions, in a solution notebook), or all of them."""
    out = {}
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = _code(cell)
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                body = lines[node.lineno - 1:node.end_lineno]
                if not only_solutions or any(BEGIN in line for line in body):
                    out[node.name] = node
    return out


def _signature(node) -> str:
    """A ``def``'s or ``class``'s first line as the table writes it (type hints and defaults included)."""
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def _normal(signature: str) -> str:
    """The table's signature through the same parser (spacing around ``=`` and quotes as ``ast.unparse`` writes)."""
    if signature.startswith("class "):
        return signature
    return _signature(ast.parse(f"def {signature}:\n    pass").body[0])


SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def _exercise_functions() -> dict[str, tuple[str, str]]:
    """name -> (lesson, signature) of every function a solution notebook defines as an exercise function."""
    out = {}
    for path in SOLUTIONS:
        for name, node in _defs(path, only_solutions=True).items():
            assert name not in out, f"{name} is an exercise function of two lessons ({out[name][0]}, {path.stem[:2]})"
            out[name] = (path.stem[:2], _signature(node))
    return out


def test_the_table_is_every_exercise_function_of_the_solutions_and_nothing_else():
    found = _exercise_functions()
    assert len(found) >= 25                                         # the parse found the exercises: it can fail
    assert sorted(EXERCISE_FUNCTIONS) == sorted(found), (
        f"missing from the table: {sorted(set(found) - set(EXERCISE_FUNCTIONS))}; "
        f"not an exercise function: {sorted(set(EXERCISE_FUNCTIONS) - set(found))}")
    for name, (lesson, signature) in found.items():
        entry = EXERCISE_FUNCTIONS[name]
        assert (entry.name, entry.lesson) == (name, lesson), name
        assert _normal(entry.signature) == signature, f"{name}: the table: {entry.signature}, the exercise: {signature}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_each_generated_exercise_states_the_tables_signatures(path):
    defined = _defs(ROOT / "exercises" / path.name, only_solutions=False)
    for name, entry in EXERCISE_FUNCTIONS.items():
        if entry.lesson == path.stem[:2]:
            assert name in defined, f"exercises/{path.name} does not define {name}"
            assert _signature(defined[name]) == _normal(entry.signature), name


def test_each_function_the_library_calls_has_a_check_on_what_it_returns():
    for cls in recipe_classes():
        for name in cls.TAKES:
            assert EXERCISE_FUNCTIONS[name].returned is not None, name
    for entry in EXERCISE_FUNCTIONS.values():
        check = entry.returned
        if check is not None:                                   # a seams check, taking the function's name first
            assert check.__module__ == "mpcourse.core.seams" and check.__name__.startswith("returned_"), entry.name
            assert list(inspect.signature(check).parameters)[0] == "name"


def test_seams_and_graders_have_one_name_per_idea():
    """The library's run-time checks are ``returned_*``; the course's graders are ``check_<exercise function>``:
    no seams function bears a grader's name or a ``check_`` prefix."""
    import mpcourse.course.grading as grading
    from importlib import import_module
    from pkgutil import iter_modules

    graders = {n for m in iter_modules(grading.__path__) for n in dir(import_module(f"{grading.__name__}.{m.name}"))
               if n.startswith(("check_", "grade_"))}
    assert {"check_cast_args", "check_delayed_update", "check_nvfp4_scales", "check_compute_scale"} <= graders
    own = {n for n, v in vars(seams).items() if inspect.isfunction(v) and v.__module__ == seams.__name__}
    assert not own & graders and not [n for n in own if n.startswith("check_")]
    assert {n for n in own if not n.startswith("_")} == {n for n in own if n.startswith("returned_")}


# -- learner_functions: the one filter --------------------------------------------------------------------------

def test_learner_functions_takes_the_tables_callables_that_are_the_learners():
    from mpcourse.core.scaling.update import update_scale as library_update_scale

    def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        return scale, growth_tracker

    def helper(x):
        return x

    def quantize(x, scale, fp8_max):
        return x

    namespace = {"helper": helper, "update_scale": update_scale, "quantize": quantize, "make_master": 3,
                 "round_to_bf16": library_update_scale, "torch": torch}
    assert list(learner_functions(namespace)) == ["update_scale", "quantize"]          # table order
    assert learner_functions(namespace, ("quantize", "update_scale")) == {"quantize": quantize,
                                                                          "update_scale": update_scale}
    assert learner_functions(namespace, ()) == {}
    with pytest.raises(ValueError, match="did you mean update_scale"):
        learner_functions(namespace, ("updat_scale",))


# -- check_overrides: the one check, where a recipe is built ----------------------------------------------------

def _update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    return scale, growth_tracker


ACCEPTS = ("unscale_grads_", "update_scale")


def _refusal(overrides, accepts=ACCEPTS, **kw) -> str:
    with pytest.raises(OverrideRefused) as e:
        check_overrides(overrides, accepts, "recipe 'x'", **kw)
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)
    return str(e.value)


def test_a_misspelled_name_is_refused_with_the_closest_one():
    words = _refusal({"updat_scale": _update_scale})
    assert words == ("updat_scale is not one of the exercises' functions (did you mean update_scale?); recipe 'x' "
                     "takes unscale_grads_, update_scale")


def test_a_name_the_recipe_does_not_take_is_refused_naming_who_does():
    words = _refusal({"quantize": lambda x, scale, fp8_max: x}, takers=lambda n: ["fp8-current", "fp8-delayed"])
    assert words == ("recipe 'x' cannot use quantize: it takes unscale_grads_, update_scale; quantize (lesson 07) "
                     "goes to fp8-current, fp8-delayed")
    assert _refusal({"update_scale": _update_scale}, accepts=()).endswith("it takes none")


@pytest.mark.parametrize("fn", [
    lambda scale, growth_tracker: (scale, 0),                                     # too few parameters
    lambda scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, extra: (scale, 0),
    lambda *, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval: (scale, 0),
])
def test_a_function_the_library_cannot_call_is_refused_with_the_signature(fn):
    words = _refusal({"update_scale": fn})
    assert words.startswith("your update_scale(")
    assert ("cannot be called as the library calls it, update_scale(scale, growth_tracker, found_inf, growth_factor, "
            "backoff_factor, growth_interval) (lesson 04's signature: ") in words


@pytest.mark.parametrize("fn", [
    _update_scale,
    lambda scale, growth_tracker, found_inf, *rest: (scale, 0),                  # the rest in *args
    lambda scale, tracker, inf, gf, bf, gi, verbose=False: (scale, 0),           # other names, an extra default
])
def test_a_function_callable_as_the_library_calls_it_passes(fn):
    assert check_overrides({"update_scale": fn}, ACCEPTS, "recipe 'x'") == {"update_scale": fn}
    check_signature("update_scale", fn)


def test_not_a_function_and_a_recipes_own_refusal_are_one_line():
    assert _refusal({"update_scale": 2.0}).startswith("update_scale must be a function (def update_scale(scale: float")
    words = _refusal({"update_scale": _update_scale}, refuse=lambda n: f"{n} needs the 'max' rule")
    assert words == "update_scale needs the 'max' rule"
    assert check_overrides(None, ACCEPTS, "recipe 'x'") == {}


def test_exercise_names_refuse_a_name_outside_the_table():
    assert exercise_names("quantize", "update") == ("quantize", "update")
    with pytest.raises(ValueError, match="quantise is not one of the exercises' functions .did you mean quantize"):
        exercise_names("quantize", "quantise")


# -- returned: the run-time check, through the table ------------------------------------------------------------

def test_returned_checks_with_the_tables_check_and_names_the_function():
    amax = torch.tensor(2.0)
    assert returned("compute_scale", amax, torch.tensor(224.0)) == 224.0
    with pytest.raises(SeamError, match=r"^compute_scale returned the scale inf: an FP8 scale must be finite"):
        returned("compute_scale", amax, torch.tensor(float("inf")))
    assert returned("update_scale", (2.0**15, torch.tensor(3))) == (2.0**15, 3)
    with pytest.raises(SeamError, match="update_scale returned growth_tracker -1, expected an int >= 0"):
        returned("update_scale", (2.0**15, -1))
    x = torch.tensor([1.0, 2.0**-20])
    with pytest.raises(SeamError, match="round_to_fp16 returned dtype torch.bfloat16"):
        returned("round_to_fp16", x, x.bfloat16(), torch.float16)
    with pytest.raises(ValueError, match="diagnose has no check on what it returns"):
        returned("diagnose", "healthy")


def test_the_in_place_checks_refuse_what_they_name():
    w, comp = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    returned("kahan_add_", w, comp, w, None)
    with pytest.raises(SeamError, match="kahan_add_ returned Tensor: it should update w and comp in place"):
        returned("kahan_add_", w, comp, w, comp)
    with pytest.raises(SeamError, match="kahan_add_ changed the dtype or shape"):
        returned("kahan_add_", w.float(), comp, w, None)
    p = torch.zeros(2, dtype=torch.float16)
    returned("master_step", [p], [(torch.float16, p.shape)], None)
    with pytest.raises(SeamError, match=re.escape("master_step turned model parameter 0 into torch.float32")):
        returned("master_step", [p.float()], [(torch.float16, p.shape)], None)


# -- CheckedFunctions: what check_overrides returns, the record that the functions were checked ---------------------

def test_what_passes_comes_back_read_only_and_recording_the_check():
    given = {"update_scale": _update_scale}
    checked = check_overrides(given, ACCEPTS, "recipe 'x'", checked_for="the recipe's configuration")
    assert isinstance(checked, CheckedFunctions) and checked == given and dict(checked) == given
    assert (checked.who, checked.checked_for) == ("recipe 'x'", "the recipe's configuration")
    given["unscale_grads_"] = lambda grads, scale: False          # the caller's dict changing later changes nothing
    assert list(checked) == ["update_scale"] and len(checked) == 1 and "unscale_grads_" not in checked
    with pytest.raises(TypeError):
        checked["unscale_grads_"] = lambda grads, scale: False   # no item assignment
    with pytest.raises(TypeError):
        del checked["update_scale"]
    with pytest.raises(AttributeError):
        checked.checked_for = None                              # nor attribute assignment: the record stays
    with pytest.raises(AttributeError):
        checked._functions = {"update_scale": len}
    with pytest.raises(AttributeError):
        checked.update({"unscale_grads_": len})                 # not a dict: no mutating methods
    assert checked["update_scale"] is _update_scale and checked.checked_for == "the recipe's configuration"


def test_only_the_check_makes_checked_functions():
    with pytest.raises(TypeError, match="made by mpcourse.core.learner_table.check_overrides"):
        CheckedFunctions({"update_scale": len}, "recipe 'x'")


def test_wrapped_and_copied_checked_functions_keep_the_record():
    import copy
    import functools

    def guard(name, fn):
        @functools.wraps(fn)
        def call(*args):
            return fn(*args)
        return call

    checked = check_overrides({"update_scale": _update_scale}, ACCEPTS, "recipe 'x'", checked_for=("r", 1))
    wrapped = checked.wrapped(guard)
    assert isinstance(wrapped, CheckedFunctions) and (wrapped.who, wrapped.checked_for) == ("recipe 'x'", ("r", 1))
    assert wrapped["update_scale"] is not _update_scale and wrapped["update_scale"].__wrapped__ is _update_scale
    assert checked["update_scale"] is _update_scale                 # the original is left as it was
    copied = copy.deepcopy(wrapped)
    assert isinstance(copied, CheckedFunctions) and copied == wrapped
    assert (copied.who, copied.checked_for) == ("recipe 'x'", ("r", 1))
