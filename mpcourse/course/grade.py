"""``mpcourse grade NOTEBOOK...``: grade an exercise the way a learner can trust.

The notebook is executed *fresh*: its stored outputs are discarded and every cell runs top to
bottom in a new kernel, in the notebook's own folder, so it does not matter in which order the
learner ran cells, what they re-ran, or which outputs JupyterLab saved. Then each check cell (a
code cell tagged ``check``) is reported by name, the nearest markdown heading above it (or its
first tag other than ``check``), with one line: the grader's ``PASS ...`` line, or the first line
of the error (``GradingError: FAIL ...``). A cell of the learner's that raised before the checks
is reported too, since it explains the checks that follow. A cell still running after ``--timeout``
seconds (a loop that never ends) is interrupted and reported as one FAIL line naming the timeout; the
cells after it still run and the summary still prints. Cells are numbered by ``cell_number`` (their
position from the top, every cell counted, from 1), as ``compare --with`` numbers them. Tracebacks only
with ``--verbose``. Exit code 0 when every check passes, 1 otherwise.

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

from mpcourse.experiment.learner import cell_number

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass
class CellReport:
    """One graded (or failing) cell: its name, whether it passed, the one-line verdict, the traceback."""

    name: str
    index: int            # the cell's number (``learner.cell_number``: its position among all cells, from 1)
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
    return head or f"cell {cell_number(i)}"


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def _error(cell):
    return next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)


def _one_line(err) -> str:
    first = (err.evalue or "").strip().splitlines()
    return f"{err.ename}: {first[0]}" if first else err.ename


def _client(nb: nbformat.NotebookNode, cwd: Path, timeout: int):
    """An ``nbclient.NotebookClient`` that keeps going past errors and past a cell that runs longer than
    ``timeout`` seconds: that cell's kernel is interrupted (nbclient's ``interrupt_on_timeout``), the cell gets
    ``TIMEOUT_ERROR`` instead of a reply (``error_on_timeout``: no waiting for a kernel that ignores the interrupt),
    its index is recorded in ``client.timed_out``, and the next cell runs."""
    from nbclient import NotebookClient

    class GradingClient(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            self.running = cell_index
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

        async def _async_handle_timeout(self, timeout, cell=None):
            self.timed_out.add(next(i for i, c in enumerate(self.nb.cells) if c is cell))
            return await super()._async_handle_timeout(timeout, cell)

    # the kernel's own log (e.g. ipykernel 7's warning that it talks over local TCP) would print above the
    # verdicts; the learner's errors and warnings come back as cell outputs, not through that log
    client = GradingClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                           interrupt_on_timeout=True, error_on_timeout=dict(TIMEOUT_ERROR),
                           extra_arguments=["--IPKernelApp.log_level=ERROR"],
                           resources={"metadata": {"path": str(cwd)}})
    client.timed_out, client.running = set(), None
    return client


TIMEOUT_ERROR = {"ename": "Timeout", "evalue": "the cell ran past --timeout and was interrupted", "traceback": []}


def execute_fresh(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> tuple[nbformat.NotebookNode, dict]:
    """Clear every output and run all cells in a new kernel in ``cwd``; errors are kept, not raised. Returns the
    notebook and what stopped cells, by cell index: "timeout" (ran past ``timeout`` seconds, interrupted; the
    next cells still ran), "died" (the kernel died while it ran, e.g. ``os._exit``) and "not run" (after that)."""
    from nbclient.exceptions import DeadKernelError

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = _client(nb, cwd, timeout)
    stopped = {}
    try:
        client.execute()
    except DeadKernelError:
        stopped = {i: "not run" for i in range(client.running + 1, len(nb.cells))}
        stopped[client.running] = "died"
    stopped.update({i: "timeout" for i in client.timed_out})
    return nb, stopped


def grade(path: Path, timeout: int = 600) -> GradeReport:
    """Execute ``path`` fresh (the file is not modified) and report every check cell and every
    earlier failing cell."""
    path = Path(path)
    nb, stopped = execute_fresh(nbformat.read(path, as_version=4), path.resolve().parent, timeout)
    died = next((i for i, why in stopped.items() if why == "died"), None)
    said = {"timeout": f"timed out: still running after {timeout} s (--timeout {timeout}), interrupted (a loop "
                       "that never ends?)",
            "died": "the kernel died while this cell ran (os._exit, a crash, out of memory?); the cells after it "
                    "did not run",
            "not run": f"not run: the kernel died in cell {cell_number(died or 0)}"}
    report = GradeReport(path)
    for i, cell in enumerate(nb.cells):
        is_check = "check" in cell.metadata.get("tags", [])
        err = _error(cell)
        if cell.cell_type != "code" or (err is None and i not in stopped and not is_check) or \
                (stopped.get(i) == "not run" and not is_check):
            continue
        tb = _ANSI.sub("", "\n".join(err.traceback)) if err is not None else ""
        if i in stopped:             # a timed-out cell's KeyboardInterrupt (if it came back) is not the learner's
            verdict = said[stopped[i]]
        elif err is None:
            passes = [ln for ln in _stream_text(cell).splitlines() if ln.startswith("PASS")]
            verdict = passes[-1] if passes else "ran without error"
        else:
            verdict = _one_line(err)
        report.cells.append(CellReport(_cell_name(nb.cells, i), cell_number(i), err is None and i not in stopped,
                                       verdict, is_check, tb))
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
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds per cell (default %(default)s); a cell still running then is interrupted and FAILs, "
                        "and the cells after it still run")
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
