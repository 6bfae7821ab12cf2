"""The path a learner's function takes into a training step is short and runs one way.

* Nothing hands the learner's functions on: no function in the package takes a ``functions`` or ``overrides``
  argument only to pass it to another call (read from the source). They ride in the recipe instead: the training
  recipe class (``TrainingRecipe.with_functions``) and the quantization recipe (``Recipe.functions``).
* The walk from ``train_yours`` (the last cell of every exercise) to the quantizer that takes lesson 09's
  ``nvfp4_scales`` crosses at most 8 of the package's files, and never climbs back up: read down the call stack
  at the moment the quantizer takes the function, no file's folder imports the folder of a file above it.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import mpcourse
from test_layout import _folder, _folder_graph, _reachable

PKG = Path(mpcourse.__file__).resolve().parent
NAMES = {"functions", "overrides"}
#: calls that take the learner's functions in (check, filter or hold them): not a hand-on
CONSUMERS = {"check_overrides", "check_functions", "checked_overrides", "learner_functions", "with_functions",
             "wrapped", "_checked", "CheckedFunctions", "dict", "MappingProxyType", "replace"}


def _hand_ons(source: str, where: str) -> list[str]:
    """Each function in ``source`` with a ``functions``/``overrides`` parameter whose every use is as an argument
    of a call that is not one of ``CONSUMERS``: it only hands the learner's functions on."""
    out = []
    tree = ast.parse(source)
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} & NAMES
        for name in sorted(params):
            uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]

            def handed_on(use) -> bool:
                call = parents.get(use)
                call = parents.get(call) if isinstance(call, ast.keyword) else call
                if not isinstance(call, ast.Call) or use is call.func:
                    return False
                f = call.func
                return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) not in CONSUMERS

            if uses and all(handed_on(u) for u in uses):
                out.append(f"{where}:{fn.lineno} {fn.name}({name})")
    return out


def test_no_function_hands_the_learners_functions_on():
    found = [h for p in sorted(PKG.rglob("*.py")) for h in _hand_ons(p.read_text(), str(p.relative_to(PKG.parent)))]
    assert found == [], "functions that only pass the learner's functions along:\n" + "\n".join(found)


def test_the_hand_on_check_finds_one():
    source = ("def train(name, overrides=None):\n    return Trainer(name, overrides)\n"
              "def build(cls, functions):\n    return cls(functions=functions)\n"
              "def check(functions):\n    return check_overrides(functions, (), 'x')\n"
              "def use(functions):\n    return functions['f'](1)\n")
    assert _hand_ons(source, "m") == ["m:1 train(overrides)", "m:3 build(functions)"]


def _module_of(path: str) -> str | None:
    p = Path(path).resolve()
    if PKG not in p.parents:
        return None
    parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture(scope="module")
def walk():
    """The package files on the call stack, from ``train_yours`` down to the quantizer, when the quantizer takes
    the solution's ``nvfp4_scales`` (the training stops there: nothing is trained)."""
    from learner_fixtures import fp8_solution_functions
    from mpcourse.core.quant import engine
    from mpcourse.course.yours import train_yours

    solution = fp8_solution_functions()["nvfp4_scales"]
    seen: list[list[str]] = []

    class Taken(Exception):
        pass

    real = engine.NVFP4Quantizer.__init__

    def spy(self, recipe, *args, **kwargs):
        real(self, recipe, *args, **kwargs)
        if inspect.unwrap(recipe.functions.get("nvfp4_scales", lambda: None)) is solution:
            frames = [f.filename for f in inspect.stack()[1:]]          # innermost first
            files = [f for f in reversed(frames) if _module_of(f)]        # outermost first
            start = next(i for i, f in enumerate(files) if f.endswith("course/yours.py"))
            seen.append(list(dict.fromkeys(files[start:])))               # each file once, in order
            raise Taken

    engine.NVFP4Quantizer.__init__ = spy
    try:
        out = train_yours({"nvfp4_scales": solution}, ["nvfp4"], echo=None, library_runs={"nvfp4": None})
    finally:
        engine.NVFP4Quantizer.__init__ = real
    assert seen and out[0].yours is None                                  # stopped at the quantizer
    return seen[0]


def test_the_walk_from_train_yours_to_the_quantizer_crosses_at_most_8_files(walk):
    assert walk[0].endswith("course/yours.py") and walk[-1].endswith("core/quant/engine.py"), walk
    assert len(walk) <= 8, "\n".join(walk)
    print("the walk:", " -> ".join(str(Path(f).relative_to(PKG.parent)) for f in walk))


def test_the_walk_never_climbs_back_up(walk):
    graph = _folder_graph()
    folders = [_folder(_module_of(f)) for f in walk]
    up = [f"{folders[j]} (below) imports {folders[i]} (above)" for i in range(len(folders))
          for j in range(i + 1, len(folders))
          if folders[j] != folders[i] and folders[i] in _reachable(graph, folders[j])]
    assert not up, " -> ".join(folders) + "\n" + "\n".join(up)
