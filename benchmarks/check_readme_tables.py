"""Check the published ``mpcourse compare`` tables (``docs/results.md``, linked from the README) against a run:
every number in a deterministic column must be the one the command beside it prints now.

Each table (in ``docs/results.md``, or the file ``--readme`` names) is a fenced block whose first line is the
command (``$ mpcourse compare --quick  # 107 s ...``) followed by the table ``mpcourse compare`` printed (a ``recipe ...`` header, a dashed line, one row per
recipe). This script reads those blocks, gets a fresh table for one of them (``--run``: runs its command with
``--out`` in a temporary folder; or ``--results``: a ``results.json`` that command wrote) and compares them
column by column, by recipe name. Every message names the file the table is in.

Columns compared (``--columns``):
  deterministic (default): every column but tok/s and %peak (wall clock). Exact only on the CPU kind the
      published table was measured on: FP32 GEMMs sum in another order on AVX2 and AVX-512, and BF16/FP16 GEMMs
      run native or emulated (``results.json``'s ``environment.cpu`` says which).
  memory: the byte columns (B/param, act MB, peak MB), counted from live tensors: the same on any CPU. peak MB
      also counts the temporaries of the kernels that ran (``results.json``'s ``environment.kernels``: numba's
      compiled passes, the torch fast paths without numba, the rules with MPCOURSE_FUSED=0: the same bits, other
      temporaries), so it is compared only for a run on the tables' kernels (``TABLE_KERNELS``); a note says
      when it is left out.
  all: every column (a timing column will differ).

The fresh table is formatted by the same functions ``mpcourse compare`` prints with
(``mpcourse.experiment.compare.report.format_table``, ``format_seed_table``), so a difference is a difference in the
numbers, never in the layout.

    python benchmarks/check_readme_tables.py --list                          # the published tables, numbered
    python benchmarks/check_readme_tables.py --table "compare --quick" --run # rerun the quick table's command
    python benchmarks/check_readme_tables.py --table "compare --quick" --results mpcourse-out-quick/results.json
    python benchmarks/check_readme_tables.py --spread --results mpcourse-out/results.json   # a default run, any CPU

``--spread``: a one-seed run on any CPU against a seeds table (``--table``; default the ``--seeds`` table at the
default settings measured on the run's CPU kind, read from the table's comment ``gemm: bfloat16 native|emulated,
float16 native|emulated`` and from ``results.json``'s ``environment.cpu.gemm``; where no table of that kind exists,
the one with the same BF16 kind, and the verdict says so). Each recipe's gap% must lie inside the 95% prediction
interval for one more seed, ``mean +- t(0.975, n-1) * sqrt(1 + 1/n) * std`` over the table's n seeds (plus half
a unit of the printed last digit): with 3 seeds that is 4.97 std, with 5 seeds 3.04 (a plain "2 std" from 3 seeds
is far too narrow: the std itself is that uncertain). val moves with the seed for every recipe alike, so its
interval uses the std pooled over the recipes (``pooled_val_std``) where that is the larger. A recipe that
diverges on every seed (``nan``) must diverge too.

``--spread`` refuses a run whose steps or batch size are not the table's (a ``--quick`` run against the 80-step
table): its losses are not drawn from that table's distribution.

Exit status: 0 all compared cells agree; 1 some differ (one line each: table, recipe, column, the published value
with its file's name, fresh); 2 bad input (no such table, an unreadable results.json, a run of other settings
than the table's for ``--spread``), one line naming the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("tok/s", "%peak")
MEMORY = ("B/param w+g+m+o=total", "act MB", "peak MB")
#: the quantizers' kernels the published tables were measured with (``mpcourse.core.quant.kernels.in_use``); peak MB
#: counts the kernels' temporaries, so a run on other kernels is not compared in that column
TABLE_KERNELS = "numba"
PEAK = "peak MB"


@dataclasses.dataclass
class Table:
    """One published table: the command line (comment dropped), its header cells and its rows by recipe."""

    command: str
    header: list[str]
    rows: dict[str, list[str]]
    line: int                      # 1-based line of the command in its file
    kind: dict = dataclasses.field(default_factory=dict)   # a seeds table's CPU kind (``table_kind``)


def _cells(line: str, starts: list[int]) -> list[str]:
    """Split a monospaced table line at the column starts found from its dashed line."""
    bounds = starts[1:] + [len(line) + 1]
    return [line[a:b].strip() for a, b in zip(starts, bounds)]


def parse_table(lines: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Header cells and rows (recipe -> cells) of a printed table: ``recipe`` header, dashed line, rows until a
    line that is not a row (blank, a legend, another command)."""
    head_i = next(i for i, ln in enumerate(lines) if ln.startswith("recipe "))
    dashes = lines[head_i + 1]
    if not set(dashes) <= {"-", " "} or not dashes.strip():
        raise ValueError("a table's header must be followed by its dashed line")
    starts = [i for i, ch in enumerate(dashes) if ch == "-" and (i == 0 or dashes[i - 1] == " ")]
    header = _cells(lines[head_i], starts)
    rows = {}
    for ln in lines[head_i + 2:]:
        if not ln.strip() or ln.startswith(("$", "train/val:", "mean+-std")):
            break
        cells = _cells(ln, starts)
        rows[cells[0]] = cells
    return header, rows


def _command(line: str) -> str:
    """``$ [VAR=value ...] mpcourse compare ...`` -> ``mpcourse compare ...`` (a shell prompt line; '' otherwise)."""
    if not line.startswith("$ "):
        return ""
    words = line[2:].split()
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    return " ".join(words)


def readme_tables(text: str) -> list[Table]:
    """Every fenced block of ``text`` whose first line is ``$ mpcourse compare ...`` and that holds a dashed table."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), len(lines))
            block = lines[i + 1:j]
            for k, ln in enumerate(block):
                if _command(ln).startswith("mpcourse compare") and k + 2 < len(block) and block[k + 1].startswith("recipe ") \
                        and block[k + 2].strip() and set(block[k + 2]) <= {"-", " "}:
                    header, rows = parse_table(block[k + 1:])
                    command, _, comment = ln[2:].partition("#")
                    out.append(Table(command.strip(), header, rows, i + 2 + k, table_kind(comment, command)))
            i = j + 1
        else:
            i += 1
    return out


def _restore(d: dict) -> dict:
    """A ``results.json`` object with its non-finite numbers back (``strict_json`` wrote them as null)."""
    return {**d, **{k: float(v) for k, v in d.get("nonfinite", {}).items()}}


def fresh_table(payload: dict) -> tuple[list[str], dict[str, list[str]]]:
    """The table ``mpcourse compare`` printed for a ``results.json`` payload (one seed or several)."""
    from mpcourse.experiment.compare.report import format_seed_table, format_table
    from mpcourse.experiment.training.train import RunResult

    names = {f.name for f in dataclasses.fields(RunResult)}
    by_seed: dict[int, list] = {}
    for row in payload["results"]:
        r = _restore(row)
        r["history"] = [_restore(h) for h in r.get("history", [])]
        by_seed.setdefault(row.get("seed", 0), []).append(RunResult(**{k: v for k, v in r.items() if k in names}))
    peak = payload.get("row_peak_flops", payload.get("peak_flops"))      # per row; older files: one number
    text = (format_table(next(iter(by_seed.values())), peak_flops=peak) if len(by_seed) == 1
            else format_seed_table(by_seed, peak))
    return parse_table(text.splitlines())


def columns_to_check(header: list[str], which: str, kernels: str | None = None) -> list[str]:
    """The columns compared: ``which`` (see the module docstring), without peak MB for a run whose ``kernels``
    (``results.json``'s ``environment.kernels``; None: not recorded) are not ``TABLE_KERNELS``."""
    if which == "all":
        cols = header[1:]
    elif which == "memory":
        cols = [c for c in header if c in MEMORY]
    else:
        cols = [c for c in header[1:] if c not in TIMING]
    return [c for c in cols if c != PEAK or kernels in (None, TABLE_KERNELS)]


def differences(table: Table, header: list[str], rows: dict[str, list[str]], which: str = "deterministic",
                published: str = "README", kernels: str | None = None) -> list[str]:
    """One line per cell that differs (and per recipe in one table only), in the table's order; ``published``: the
    name of the file the table is in, as the lines say it."""
    out = []
    if header != table.header:
        out.append(f"header: {published} {table.header} vs fresh {header}")
        return out
    cols = columns_to_check(header, which, kernels)
    for name in list(table.rows) + [n for n in rows if n not in table.rows]:
        if name not in rows or name not in table.rows:
            out.append(f"{name}: only in the {published if name in table.rows else 'fresh run'}")
            continue
        for c in cols:
            i = header.index(c)
            if table.rows[name][i] != rows[name][i]:
                out.append(f"{name} {c}: {published} {table.rows[name][i]}, fresh {rows[name][i]}")
    return out


SEEDS_COMMAND = "mpcourse compare --seeds "      # a seeds table at the default settings: this and the seed list
# Student's t, 0.975 quantile, by degrees of freedom (any statistics table; scipy.stats.t.ppf(0.975, df) in the test)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def spread_k(n: int) -> float:
    """How many standard deviations of n seeds one more seed may lie from their mean: the 95% prediction
    interval of a normal sample, ``t(0.975, n-1) * sqrt(1 + 1/n)``."""
    if n < 2:
        raise ValueError("a spread needs at least two seeds")
    return T_975.get(n - 1, 1.96) * (1 + 1 / n) ** 0.5


def n_seeds(command: str) -> int:
    """The number of seeds of a ``--seeds a,b,c`` command."""
    words = command.split()
    return len(words[words.index("--seeds") + 1].split(","))


def table_kind(comment: str, command: str) -> dict[str, str]:
    """A seeds table's CPU kind, ``{"bfloat16": "native"|"emulated", "float16": ...}``, from its comment's
    ``gemm: bfloat16 X, float16 Y``; a table forced onto the AVX2 path emulates both."""
    import re

    kind = dict(re.findall(r"\b(bfloat16|float16) (native|emulated)\b", comment))
    if "ATEN_CPU_CAPABILITY=avx2" in command:
        kind = {"bfloat16": "emulated", "float16": "emulated"}
    return kind
SPREAD_COLUMNS = {"val": 0.0005, "gap%": 0.05}     # column -> half a unit of its printed last digit


def _mean_std(cell: str) -> tuple[float, float] | None:
    """``"2.398+-0.039"`` -> (2.398, 0.039); a diverged cell (``nan``, ``nan@1 (3/3)``) -> None."""
    if "+-" not in cell:
        return None
    mean, std = cell.split("+-")
    return float(mean), float(std)


def pooled_val_std(table: Table) -> float:
    """The val column's standard deviation pooled over the recipes that trained on every seed: sqrt(mean of their
    variances). Every recipe of a seed trains the same initial model on the same batches, so its val moves with
    the seed much as fp32's does; one recipe's own std from n seeds is a poor estimate of that (with 3 seeds one
    recipe's can come out a third of fp32's). The recipes move together with the seed, so pooling them does not
    add degrees of freedom: the interval keeps t with n - 1."""
    col = table.header.index("val")
    stds = [b[1] for cells in table.rows.values() if (b := _mean_std(cells[col])) is not None]
    return (sum(x * x for x in stds) / len(stds)) ** 0.5 if stds else 0.0


def outside_spread(table: Table, header: list[str], rows: dict[str, list[str]], k: float | None = None) -> list[str]:
    """One line per value of a one-seed run (``header``, ``rows``) outside ``table``'s 95% prediction interval.

    gap% (the seed's own fp32 taken out): the recipe's mean +- k std, k = ``spread_k`` of the table's n seeds.
    val: the recipe's mean +- k x the larger of its std and the pooled val std (``pooled_val_std``)."""
    k = spread_k(n_seeds(table.command)) if k is None else k
    pooled = pooled_val_std(table)
    out = []
    for name, cells in table.rows.items():
        if name not in rows:
            out.append(f"{name}: not in the fresh run")
            continue
        for col, half_unit in SPREAD_COLUMNS.items():
            band, fresh = _mean_std(cells[table.header.index(col)]), rows[name][header.index(col)]
            if band is None:                              # diverged on every seed: it must diverge here too
                if not fresh.startswith("nan"):
                    out.append(f"{name} {col}: every seed diverged, the fresh run gives {fresh}")
                continue
            mean, std = band
            kk, ss = (k, max(std, pooled)) if col == "val" else (k, std)
            value = float(fresh.split("@")[0])
            if not abs(value - mean) <= kk * ss + half_unit:   # NaN fails too
                out.append(f"{name} {col}: {fresh} is outside {mean:g} +- {kk:.2f} x {ss:.3g}")
    return out


def table_settings(command: str) -> tuple[int, int]:
    """(steps, batch size) a table's ``mpcourse compare`` command trains with (``--quick``, ``--steps``,
    ``--batch-size`` and ``--preset`` resolved as ``mpcourse compare`` resolves them)."""
    from mpcourse.cli import build_parser
    from mpcourse.experiment.cli.presets import PRESET_BATCH, QUICK
    from mpcourse.experiment.training.train import TrainConfig

    args = build_parser().parse_args(_command("$ " + command).split()[1:])
    steps = args.steps or (QUICK["steps"] if args.quick else TrainConfig.steps)
    return steps, args.batch_size or (QUICK["batch_size"] if args.quick else PRESET_BATCH[args.preset])


def settings_error(table: Table, payload: dict) -> str | None:
    """Why a run cannot be held against ``table``'s spread: other steps or batch size (None: the same)."""
    steps, batch = table_settings(table.command)
    config = payload.get("config", {})
    if (config.get("steps"), config.get("batch_size")) == (steps, batch):
        return None
    return (f"--spread: this run trained {config.get('steps')} steps x {config.get('batch_size')} sequences, the "
            f"table `{table.command}` {steps} x {batch}: rerun with the table's settings (e.g. without --quick), "
            "or name a table of this run's settings with --table")


def _is_seeds_table(t: Table) -> bool:
    words = _command("$ " + t.command).split()
    return " ".join(words[:3]) + " " == SEEDS_COMMAND and len(words) == 4


def spread_table(tables: list[Table], gemm: dict[str, str]) -> tuple[str | None, bool]:
    """(the command of the default-settings seeds table measured on the CPU kind ``gemm`` of a run, whether its
    kind matches exactly). Fallback: the same BF16 kind (the rows BF16 moves), then any; (None, False): none."""
    seeds = [t for t in tables if _is_seeds_table(t)]
    want = {d: gemm.get(d, "emulated") for d in ("bfloat16", "float16")}
    exact = [t for t in seeds if t.kind == want]
    near = [t for t in seeds if t.kind.get("bfloat16") == want["bfloat16"]]
    pick = exact or near or seeds
    return (pick[0].command, bool(exact)) if pick else (None, False)


def run_command(command: str, out: Path) -> dict:
    """Run a published table's command (``mpcourse compare ...``) with ``--out out --no-progress``; its results.json."""
    words = shlex.split(command)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):    # VAR=value before the command
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    subprocess.run([sys.executable, "-m", "mpcourse", *words[1:], "--out", str(out), "--no-progress"], check=True,
                   env=env)
    return json.loads((out / "results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", type=Path, default=ROOT / "docs" / "results.md",
                   help="the markdown file holding the tables (default docs/results.md)")
    p.add_argument("--list", action="store_true", help="list the file's tables and exit")
    p.add_argument("--table", default=None, help="the table whose command contains this text, e.g. 'compare --quick'")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--results", type=Path, default=None, help="a results.json written by the table's command")
    src.add_argument("--run", action="store_true", help="run the table's command now (minutes) and use its results")
    p.add_argument("--columns", choices=("deterministic", "memory", "all"), default="deterministic")
    p.add_argument("--spread", action="store_true",
                   help="check a one-seed --results against a seeds table's 95%% prediction interval (any CPU)")
    a = p.parse_args(argv)
    try:
        tables = readme_tables(a.readme.read_text())
    except OSError as e:
        print(f"check_readme_tables: error: --readme {a.readme}: {e.strerror}", file=sys.stderr)
        return 2
    if a.spread and a.table is None and a.results is not None:   # the default-settings seeds table of this CPU kind
        try:
            gemm = json.loads(a.results.read_text()).get("environment", {}).get("cpu", {}).get("gemm", {})
        except (OSError, ValueError):
            gemm = {}                                 # reported below, where the results are read
        a.table, exact_kind = spread_table(tables, gemm)
        if a.table is not None and not exact_kind:
            print(f"check_readme_tables: note: no seeds table was measured on this CPU kind ({gemm}); "
                  "using the nearest one", file=sys.stderr)
    if a.list or a.table is None:
        for t in tables:
            print(f"line {t.line}: {t.command} ({len(t.rows)} rows)")
        if a.table is None and not a.list:
            print("check_readme_tables: error: name a table with --table TEXT (one of the commands above)",
                  file=sys.stderr)
            return 2
        return 0
    chosen = [t for t in tables if t.command == a.table] or [t for t in tables if a.table in t.command]
    if len(chosen) != 1:
        print(f"check_readme_tables: error: --table {a.table!r} matches {len(chosen)} tables "
              f"({'; '.join(t.command for t in chosen) or 'none'}); pass text that names one (--list)", file=sys.stderr)
        return 2
    table = chosen[0]
    if a.results is None and not a.run:
        print("check_readme_tables: error: pass --results RESULTS_JSON or --run", file=sys.stderr)
        return 2
    if a.run:
        with tempfile.TemporaryDirectory() as d:
            payload = run_command(table.command, Path(d))
    else:
        try:
            payload = json.loads(a.results.read_text())
        except (OSError, ValueError) as e:
            print(f"check_readme_tables: error: --results {a.results}: not a readable results.json ({e})",
                  file=sys.stderr)
            return 2
    header, rows = fresh_table(payload)
    cpu = payload.get("environment", {}).get("cpu", {})
    where = f" (fresh run on {cpu.get('capability')}, {cpu.get('gemm')})" if cpu else ""
    if a.spread:
        return _check_spread(table, payload, header, rows, a.readme, where)
    kernels = payload.get("environment", {}).get("kernels")
    if PEAK in columns_to_check(header, a.columns) and PEAK not in columns_to_check(header, a.columns, kernels):
        print(f"check_readme_tables: note: {PEAK} not compared: this run's quantizers took the {kernels} kernels, the "
              f"tables' the {TABLE_KERNELS} ones ({PEAK} counts the kernels' temporaries; the other columns do not)")
    published = _shown(a.readme)
    return _report(f"{published} line {table.line} `{table.command}`: ",
                   differences(table, header, rows, a.columns, a.readme.name, kernels), f"cell(s) differ{where}",
                   f"{len(table.rows)} rows agree in {', '.join(columns_to_check(header, a.columns, kernels))}{where}")


def _check_spread(table: Table, payload: dict, header: list[str], rows: dict[str, list[str]], readme: Path,
                  where: str) -> int:
    """``--spread``: a one-seed run of the table's settings against a seeds table's prediction interval."""
    if not any("+-" in c for row in table.rows.values() for c in row):
        print(f"check_readme_tables: error: --spread needs a --seeds table; {table.command!r} is not one",
              file=sys.stderr)
        return 2
    if len({r.get("seed", 0) for r in payload["results"]}) != 1:
        print("check_readme_tables: error: --spread checks a one-seed run; this results.json has several seeds",
              file=sys.stderr)
        return 2
    bad = settings_error(table, payload)
    if bad:
        print(f"check_readme_tables: error: {bad}", file=sys.stderr)
        return 2
    outside = outside_spread(table, header, rows)
    return _report(f"{_shown(readme)} line {table.line} `{table.command}`: ", outside,
                   f"value(s) outside the spread{where}",
                   f"all {len(table.rows)} recipes' val and gap% lie within mean +- "
                   f"{spread_k(n_seeds(table.command)):.2f} std ({n_seeds(table.command)} seeds){where}")


def _shown(path: Path) -> str:
    """``path`` as the messages name it: relative to the repository where it is inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _report(head: str, problems: list[str], bad: str, good: str) -> int:
    """Print the verdict line (and one indented line per problem); the exit status, 1 with problems, else 0."""
    if problems:
        print(f"{head}{len(problems)} {bad}:")
        for d in problems:
            print(f"  {d}")
        return 1
    print(head + good)
    return 0


if __name__ == "__main__":
    sys.exit(main())
