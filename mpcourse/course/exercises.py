"""Course tooling: exercises generated from solutions, notebooks executed with stored outputs.

One source, two notebooks. Each lesson's exercise is written once, as ``solutions/NN_name.ipynb``,
with the parts the learner writes between nbgrader-style markers::

    def round_to_bf16(x):
        \"\"\"docstring and formula stay in the exercise\"\"\"
        ### BEGIN SOLUTION
        ...the reference code...
        ### END SOLUTION

``exercises/NN_name.ipynb`` is *generated* from it: each marked block becomes
``raise NotImplementedError(...)`` under a ``# YOUR CODE HERE`` line, at the same indentation, and
everything else (markdown, docstrings, and the stored outputs of the lesson's own cells) is kept. No
answer is given away: a cell that runs the learner's code stores **no output** in the exercise (no
``PASS`` verdict, no value the learner's function should return). "Runs the learner's code" is
transitive: a cell that names a function or class the learner writes, or a name assigned by such a
cell (``q = block_quantize(x)`` in one cell, ``print(q)`` in the next). A shipped exercise fails its
checks. Cells tagged ``check`` call graders from ``mpcourse.course.grading``.

Prints are allowed where the learner works: in the exercise, every cell that holds learner code (a
marked block), every check cell, and every cell that calls a function or class the learner writes is
tagged ``nbval-ignore-output``, and so is the last cell, tagged ``train-yours``, which trains the course's GPT
with the learner's functions beside the library's (``mpcourse.course.yours.train_yours``: a correct but
differently written function may train a different row). Those cells are graded by what they raise (a check cell raises
``GradingError`` on a wrong implementation, a stub raises ``NotImplementedError``), not by their text,
so a debugging ``print`` cannot fail them. The solutions keep strict output checks.

Commands (contributors)::

    python -m mpcourse.course execute notebooks/00_number_formats.ipynb solutions/00_number_formats.ipynb
    python -m mpcourse.course exercises          # regenerate every exercises/*.ipynb from solutions/
    python -m mpcourse.course check              # fail if exercises/ drifted from solutions/
    python -m mpcourse.course from-script lesson.py notebooks/NN_name.ipynb   # jupytext percent -> executed notebook

``tests/course/test_course.py`` runs ``check`` in CI, so the two cannot drift.
"""
from __future__ import annotations

import argparse
import copy
import keyword
import re
import sys
from pathlib import Path

import nbformat

from .predict_first import hide_answers

ROOT = Path(__file__).resolve().parents[2]   # the repository root (mpcourse/course/exercises.py)
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
_BLOCK = re.compile(r"^([ \t]*)" + re.escape(BEGIN) + r"[ \t]*\n.*?^[ \t]*" + re.escape(END) + r"[ \t]*$\n?",
                    re.MULTILINE | re.DOTALL)


class CourseError(ValueError):
    """A malformed solution notebook (unbalanced markers) or a drifted exercise."""


def strip_solutions(source: str) -> str:
    """Replace every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block by a stub at its indentation.

    Raises:
        CourseError: a BEGIN without its END (or the reverse).
    """
    out = _BLOCK.sub(lambda m: f"{m.group(1)}# YOUR CODE HERE\n{m.group(1)}{STUB}\n", source)
    if BEGIN in out or END in out:
        raise CourseError("unbalanced solution markers: every '### BEGIN SOLUTION' needs a "
                          "matching '### END SOLUTION' in the same cell")
    return out.rstrip("\n") if not source.endswith("\n") else out


IGNORE_OUTPUT = "nbval-ignore-output"
TRAIN_YOURS = "train-yours"      # the last cell: trains the GPT with the learner's functions (course.yours)
_DEFINED = re.compile(r"^(?:def|class)\s+(\w+)", re.M)     # the names a solution cell defines
# names a cell binds at its top level: `a = ...`, `a, b = ...`, `a += ...`, `for a, b in ...`, `with ... as a`,
# `def a` / `class a`, `import a` / `from m import a` (a statement at the start of a line, any indentation)
_BOUND = re.compile(r"^[ \t]*(?:for\s+([\w\s,()]+?)\s+in\b|([\w\s,()]+?)\s*(?:[-+*/%@&|^]|//|\*\*)?=(?!=)"
                    r"|(?:def|class)\s+(\w+)|with\b.*\bas\s+(\w+))", re.M)


def _bound_names(source: str) -> set[str]:
    """Names a cell assigns (a conservative reading: enough to follow a learner's value from cell to cell)."""
    names = set()
    for m in _BOUND.finditer(source):
        names.update(n for n in re.findall(r"\w+", next(g for g in m.groups() if g))
                     if not n.isdigit() and not keyword.iskeyword(n))
    return names


def _uses(names: set[str]):
    return re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b") if names else None


def runs_learner_code(cells) -> list[bool]:
    """Per cell: whether it runs the learner's code (a marked block, a check cell, the train-yours cell,
    or a cell that names a learner's function or a value one of those cells computed; see the module
    docstring). The exercise stores no output for these."""
    learner = {m for c in cells if c.cell_type == "code" and BEGIN in c.source for m in _DEFINED.findall(c.source)}
    tainted, flags = set(learner), []
    for cell in cells:
        tags = cell.metadata.get("tags", []) if cell.cell_type == "code" else []
        uses = _uses(tainted)
        runs = cell.cell_type == "code" and (BEGIN in cell.source or "check" in tags or TRAIN_YOURS in tags
                                             or (uses is not None and bool(uses.search(cell.source))))
        if runs:
            tainted |= _bound_names(cell.source) - {"_", "__"}
        flags.append(runs)
    return flags


def make_exercise(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise notebook for a solution notebook (outputs kept; see the module docstring).

    Raises:
        CourseError: the solution has no marked block, or no cell tagged ``check``.
    """
    nb = copy.deepcopy(solution)
    marked = checks = 0
    for cell, runs in zip(nb.cells, runs_learner_code(nb.cells)):
        if cell.cell_type != "code":
            continue
        is_check = "check" in cell.metadata.get("tags", [])
        if runs:
            tags = cell.metadata.setdefault("tags", [])
            if IGNORE_OUTPUT not in tags:
                tags.append(IGNORE_OUTPUT)
            cell.outputs, cell.execution_count = [], None      # no answer given away
        if BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
            marked += 1
        checks += is_check
    if not marked:
        raise CourseError("a solution notebook needs at least one '### BEGIN SOLUTION' block")
    if not checks:
        raise CourseError("a solution notebook needs at least one code cell tagged 'check'")
    nb.metadata["mpcourse"] = {"generated_from": "solutions (python -m mpcourse.course exercises)"}
    return nb


def exercise_pairs(root: Path = ROOT):
    """(solution path, exercise path) for every solution notebook."""
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        yield sol, root / "exercises" / sol.name


def locally_edited(path: Path, root: Path = ROOT) -> bool | None:
    """Whether ``path`` differs from its last committed version (or is not committed): True/False
    from ``git status``; None where that cannot be told (no git, or not a git checkout)."""
    import subprocess

    try:
        proc = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return bool(proc.stdout.strip())


def write_exercises(root: Path = ROOT, force: bool = False, echo=print) -> tuple[list[Path], list[Path]]:
    """Regenerate ``exercises/`` from ``solutions/``; returns (written, kept).

    Never overwrites someone's work: an exercise that differs from the generated version is only
    replaced if git says it is the committed version (so nothing is lost), or with ``force``.
    Otherwise it is kept and reported.
    """
    written, kept = [], []
    for sol, ex in exercise_pairs(root):
        text = nbformat.writes(make_exercise(nbformat.read(sol, as_version=4))).rstrip("\n") + "\n"
        if ex.exists():
            current = nbformat.writes(nbformat.read(ex, as_version=4)).rstrip("\n") + "\n"
            if current == text:
                continue                                   # already up to date
            if not force and locally_edited(ex, root) is not False:
                kept.append(ex)
                echo(f"kept {ex.relative_to(root)}: it has edits that are not committed (your work?), so it "
                     "was not overwritten. To get the regenerated version, commit or copy your file first, "
                     "or pass --force to overwrite it.")
                continue
        ex.write_text(text, encoding="utf-8")
        written.append(ex)
        echo(f"wrote {ex.relative_to(root)}")
    return written, kept


def check_drift(root: Path = ROOT) -> list[str]:
    """Problems found: exercises missing, stale or extra relative to ``solutions/``. Empty list: in sync."""
    problems = []
    for sol, ex in exercise_pairs(root):
        if not ex.exists():
            problems.append(f"{ex.relative_to(root)} is missing")
            continue
        want = make_exercise(nbformat.read(sol, as_version=4))
        have = nbformat.read(ex, as_version=4)
        if nbformat.writes(want) != nbformat.writes(have):
            problems.append(f"{ex.relative_to(root)} differs from what {sol.relative_to(root)} generates")
    solutions = {p.name for p in (root / "solutions").glob("*.ipynb")}
    for ex in sorted((root / "exercises").glob("*.ipynb")):
        if ex.name not in solutions:
            problems.append(f"{ex.relative_to(root)} has no solution notebook")
    return problems


def _normalise(nb: nbformat.NotebookNode) -> None:
    """Drop machine- and run-specific metadata so re-executing gives a stable file; collapse the predict-first
    answers (``predict_first.hide_answers``)."""
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.nbformat_minor = max(nb.nbformat_minor, 5)
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)            # view state (JupyterLab writes both keys), except where
        view = cell.metadata.get("jupyter", {})         # hide_answers sets them below
        view.pop("outputs_hidden", None)
        if "jupyter" in cell.metadata and not view:
            del cell.metadata["jupyter"]
        cell["id"] = f"cell-{i:03d}"                    # stable ids: re-executing changes no line
        if cell.cell_type == "code":                    # one stream output per run of prints, however the
            cell.outputs = _coalesce_streams(cell.outputs)   # kernel happened to flush them
    hide_answers(nb)                                    # predict-first answers stay collapsed


def _coalesce_streams(outputs: list) -> list:
    """Consecutive outputs of the same stream merged into one (the text a reader sees, unchanged)."""
    merged = []
    for out in outputs:
        if merged and out.output_type == "stream" and merged[-1].output_type == "stream" \
                and merged[-1].name == out.name:
            merged[-1].text += out.text
        else:
            merged.append(out)
    return merged


def execute(path: Path, timeout: int = 600) -> None:
    """Run a notebook top to bottom in its folder (fixed seeds are the notebook's job) and store its outputs."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    _normalise(nb)
    nbformat.write(nb, path)


def from_script(script: Path, out: Path) -> None:
    """Convert a jupytext percent-format script to a notebook and execute it (authoring helper)."""
    import jupytext

    nb = jupytext.read(script)
    nb.metadata.pop("jupytext", None)
    nbformat.write(nb, out)
    execute(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.course", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("execute", help="execute notebooks in place, storing outputs")
    e.add_argument("paths", nargs="+", type=Path)
    x = sub.add_parser("exercises", help="regenerate exercises/ from solutions/ (never overwrites uncommitted edits)")
    x.add_argument("--force", action="store_true", help="overwrite exercises even where they have uncommitted edits")
    sub.add_parser("check", help="exit 1 if exercises/ drifted from solutions/")
    s = sub.add_parser("from-script", help="jupytext percent script -> executed notebook")
    s.add_argument("script", type=Path)
    s.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "execute":
        for path in args.paths:
            execute(path)
            print(f"executed {path}")
    elif args.cmd == "exercises":
        written, kept = write_exercises(force=args.force)
        if not written and not kept:
            print("exercises/ is already in sync with solutions/")
        return 1 if kept else 0
    elif args.cmd == "check":
        problems = check_drift()
        for line in problems:
            print(line)
        if problems:
            print("contributors: python -m mpcourse.course exercises regenerates them (it keeps any exercise "
                  "with uncommitted edits); learners: your edited exercises are expected to differ, "
                  "grade them with `mpcourse grade exercises/NN_*.ipynb`")
            return 1
        print("exercises/ is in sync with solutions/")
    elif args.cmd == "from-script":
        from_script(args.script, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
