"""A learner's functions, loaded from an exercise notebook, to train the course's GPT with them.

``load_functions(path)`` reads a notebook (``exercises/NN_*.ipynb`` or ``solutions/NN_*.ipynb``) and runs
only what *defines* things: top-level ``import`` statements, ``def`` and ``class`` statements and
assignments to UPPER_CASE names (``A, B = 1, 2`` too), from every code cell except the check cells (tagged ``check``) and the
cell that trains with the learner's code (tagged ``train-yours``). Nothing else runs: no training, no
plots, no prints. The result maps function names to functions (helpers included).

It reads notebooks and sources only (no recipe, no training), so every folder of ``mpcourse.experiment`` can take
a learner's functions from it; ``mpcourse compare --with``'s check of them against the recipes asked for is
``mpcourse.experiment.cli.with_notebooks.exercise_functions``.
"""
from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

SKIP_TAGS = ("check", "train-yours")   # cells never run when loading


def cell_number(index: int) -> int:
    """The number a message gives the cell at ``index`` (0-based) in ``nb.cells``: its position from the top,
    every cell counted (markdown too), the first cell 1, which is what a learner counts scrolling the notebook in
    JupyterLab. Not the ``[n]`` JupyterLab prints beside a code cell (its execution count: it changes with every
    run, and is empty in a fresh copy), nor nbval's ``Cell N`` (code cells only, from 0). ``mpcourse grade`` and
    ``compare --with`` both number cells with this function."""
    return index + 1


class LearnerLoadError(ValueError):
    """A notebook whose definitions cannot be loaded (missing file, syntax error, failing import)."""


def _keep(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]   # A, B = 1, 2 too
        return all(isinstance(t, ast.Name) and t.id.isupper() for t in names)
    return False


def read_notebook(path: str | Path):
    """The notebook at ``path`` (nbformat v4), or ``LearnerLoadError`` with one line naming the fix when the
    file is missing or is not a Jupyter notebook (a .py file, a README, a notebook's folder, binary data)."""
    import nbformat

    path = Path(path)
    example = "give the path of an exercise notebook, e.g. exercises/04_dynamic_loss_scaling.ipynb"
    if not path.is_file():
        raise LearnerLoadError(f"{path}: no such notebook ({example})")
    try:
        nb = nbformat.read(path, as_version=4)
        if not isinstance(getattr(nb, "cells", None), list):
            raise ValueError("no list of cells")
    except Exception as e:                                       # nbformat raises many kinds for a non-notebook
        why = str(e).strip().splitlines()[0][:80] if str(e).strip() else type(e).__name__
        raise LearnerLoadError(f"{path}: not a Jupyter notebook ({why}); {example}") from None
    return nb


def load_functions(path: str | Path) -> dict[str, Callable]:
    """The functions (and classes) a notebook defines at top level, by name; see the module docstring.

    Raises ``LearnerLoadError`` naming the notebook and the cell when the file is missing or not a
    notebook, a cell does not parse, or running the definitions fails (e.g. an import of a module that is not installed).
    """
    nb = read_notebook(path)
    path = Path(path)
    body: list[ast.stmt] = []
    sources: dict[str, str] = {}           # def name -> its source text (for processes spawned by train_yours)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or any(t in cell.metadata.get("tags", []) for t in SKIP_TAGS):
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        where = f"{path.name} cell {cell_number(i)}"
        try:
            tree = ast.parse(source, filename=where)
        except SyntaxError as e:
            raise LearnerLoadError(f"{where}: syntax error on line {e.lineno}: {e.msg}") from None
        body.extend(ast.increment_lineno(n, 0) for n in tree.body if _keep(n))
        sources.update({n.name: ast.get_source_segment(source, n) for n in tree.body if isinstance(n, ast.FunctionDef)})
    namespace: dict = {"__name__": f"learner:{path.stem}"}
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    except Exception as e:
        raise LearnerLoadError(f"{path.name}: defining its functions failed: {type(e).__name__}: {e}") from None
    functions = {name: obj for name, obj in namespace.items()
                 if callable(obj) and getattr(obj, "__module__", None) == namespace["__name__"] and not name.startswith("_")}
    for name, fn in functions.items():
        if name in sources and hasattr(fn, "__code__"):
            fn.__learner_source__ = sources[name]   # inspect.getsource cannot read it back from the notebook file
    return functions


def functions_from_sources(sources: dict[str, str]) -> dict[str, Callable]:
    """The functions defined by ``sources`` (name -> the source of its ``def``, e.g. from ``inspect.getsource``),
    each run in one namespace that has ``torch`` and ``dist`` (``torch.distributed``) imported: how a learner's
    function reaches processes spawned for ``compare --nproc`` (a notebook's functions cannot be pickled). A source
    whose ``def`` has another name gives that function. Raises ``LearnerLoadError`` naming the function whose
    source fails to run or defines no function."""
    import torch
    import torch.distributed as dist

    namespace: dict = {"__name__": "learner:sources", "torch": torch, "dist": dist}
    out = {}
    for name, source in sources.items():
        try:
            tree = ast.parse(source, f"<your {name}>")
            defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
            exec(compile(tree, f"<your {name}>", "exec"), namespace)
        except Exception as e:
            raise LearnerLoadError(f"your {name}: defining it failed: {type(e).__name__}: {e}") from None
        if not defs:
            raise LearnerLoadError(f"the source given for {name} defines no function")
        out[name] = namespace[name if name in defs else defs[-1]]   # a function given under another name too
    return out
