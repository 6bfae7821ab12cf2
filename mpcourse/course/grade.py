"""``mpcourse grade NOTEBOOK...``: grade an exercise the way a learner can trust.

The notebook is executed *fresh*: its stored outputs are discarded and every cell runs top to
bottom in a new kernel, in the notebook's own folder, so it does not matter in which order the
learner ran cells, what they re-ran, or which outputs JupyterLab saved. Then each check cell (a
code cell tagged ``check``) is reported by name, the nearest markdown heading above it (or its
first tag other than ``check``), with one line: the grader's ``PASS ...`` line, or the first line
of the error (``GradingError: FAIL ...``). A cell of the learner's that raised before the checks
is reported too, since it explains the checks that follow. Tracebacks only with ``--verbose``.
Exit code 0 when every check passes, 1 otherwise.

This is a different question from nbval's (``pytest --nbval``): nbval asks "does re-running
reproduce every stored output?", which is right for the course's own notebooks and solutions (CI
runs it) and wrong for a learner's working copy, whose outputs are their own.

Execution uses ``nbclient`` (the engine under ``jupyter nbconvert --execute`` and nbval).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass
class CellReport:
    """One graded (or failing) cell: its name, whether it passed, the one-line verdict, the traceback."""

    name: str
    index: int            # position among all cells, 1-based, as JupyterLab numbers them top to bottom
    passed: bool
    verdict: str
    is_check: bool = True
    traceback: str = ""


@dataclass
class GradeReport:
    path: Path
    cells: list[CellReport] = field(default_factory=list)

    @property
    def checks(self) -> list[CellReport]:
        return [c for c in self.cells if c.is_check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.cells)


def _heading(cells, i: int) -> str | None:
    for cell in reversed(cells[:i]):
        if cell.cell_type == "markdown":
            found = _HEADING.findall(cell.source)
            if found:
                return re.sub(r"[*`]", "", found[-1])
    return None


def _cell_name(cells, i: int) -> str:
    tags = [t for t in cells[i].metadata.get("tags", []) if t not in ("check", "nbval-ignore-output")]
    head = _heading(cells, i)
    if tags:
        return tags[0] + (f" ({head})" if head else "")
    return head or f"cell {i + 1}"


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def _error(cell):
    return next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)


def _one_line(err) -> str:
    first = (err.evalue or "").strip().splitlines()
    return f"{err.ename}: {first[0]}" if first else err.ename


def execute_fresh(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Clear every output and run all cells in a new kernel in ``cwd``; errors are kept, not raised."""
    from nbclient import NotebookClient

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # the kernel's own log (e.g. ipykernel 7's warning that it talks over local TCP) would print above the
    # verdicts; the learner's errors and warnings come back as cell outputs, not through that log
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   extra_arguments=["--IPKernelApp.log_level=ERROR"],
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def grade(path: Path, timeout: int = 600) -> GradeReport:
    """Execute ``path`` fresh (the file is not modified) and report every check cell and every
    earlier failing cell."""
    path = Path(path)
    nb = execute_fresh(nbformat.read(path, as_version=4), path.resolve().parent, timeout)
    report = GradeReport(path)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        is_check = "check" in cell.metadata.get("tags", [])
        err = _error(cell)
        if err is None and not is_check:
            continue
        tb = _ANSI.sub("", "\n".join(err.traceback)) if err is not None else ""
        if err is None:
            passes = [ln for ln in _stream_text(cell).splitlines() if ln.startswith("PASS")]
            verdict = passes[-1] if passes else "ran without error"
        else:
            verdict = _one_line(err)
        report.cells.append(CellReport(_cell_name(nb.cells, i), i + 1, err is None, verdict, is_check, tb))
    return report


def format_report(report: GradeReport, verbose: bool = False) -> str:
    lines = [f"{report.path}:"]
    for c in report.cells:
        mark = "PASS" if c.passed else "FAIL"
        kind = "check" if c.is_check else "your code"
        verdict = c.verdict[5:] if c.passed and c.verdict.startswith("PASS ") else c.verdict
        lines.append(f"  {mark}  [{kind}, cell {c.index}] {c.name}: {verdict}")
        if verbose and c.traceback:
            lines.extend("        " + ln for ln in c.traceback.splitlines())
    n_ok = sum(c.passed for c in report.checks)
    if not report.checks:
        lines.append("  no check cells (tag: check) in this notebook: nothing to grade")
    else:
        lines.append(f"  {n_ok}/{len(report.checks)} checks passed"
                     + ("" if report.passed or verbose else "  (--verbose shows the tracebacks)"))
    return "\n".join(lines)


def build_parser(prog: str = "mpcourse grade") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Grade exercise notebooks: run each fresh (stored "
                                "outputs ignored, the file untouched) and report every check cell.")
    p.add_argument("notebooks", nargs="+", type=Path, help="exercise notebooks, e.g. exercises/04_*.ipynb")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failure")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default %(default)s)")
    return p


def main(argv: list[str] | None = None, prog: str = "mpcourse grade") -> int:
    args = build_parser(prog).parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        print(f"{prog}: error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    from mpcourse.experiment.learner import LearnerLoadError, read_notebook
    for path in args.notebooks:                  # every file checked before any is run
        try:
            read_notebook(path)
        except LearnerLoadError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    ok = True
    for path in args.notebooks:
        report = grade(path, timeout=args.timeout)
        print(format_report(report, args.verbose), flush=True)
        ok &= report.passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
