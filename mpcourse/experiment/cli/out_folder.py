"""Where ``mpcourse compare`` writes: the default run to ``mpcourse-out/``, ``--quick`` alone to
``mpcourse-out-quick/``, every other run to ``mpcourse-out-runs/NAME/``, NAME the flags that change what it computes
(``run_changes``, ``run_name``), so that a side run (one recipe, a notebook's functions, a few steps) never replaces
the main run's ``results.json`` and plot; ``--out`` chooses. Also: why a folder cannot take a run (checked before
the training), the folders a run created (removed again when it wrote nothing), and the note when a run replaced an
earlier ``results.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

from ..recipes import OptimConfig
from ..training.train import TrainConfig
from .presets import PRESET_BATCH, QUICK

DEFAULT_OUT, QUICK_OUT = Path("mpcourse-out"), Path("mpcourse-out-quick")
#: where a run other than the default one (or --quick alone) writes: RUNS_OUT/NAME, NAME from ``run_name``
RUNS_OUT = Path("mpcourse-out-runs")
OUT_FILES = ("results.json", "loss_curves.png")     # what a run writes into its folder (compare.outputs)
MAX_RUN_NAME = 80


def run_changes(args: argparse.Namespace) -> list[str]:
    """What a ``compare`` run changes against the default run (with ``--quick``: against the quick run): one
    ``flag=value`` part per flag that changes what the run computes, in ``--help``'s order; [] for the default run.

    A flag given its default value changes nothing (``--steps 80``, ``--seeds 0``, ``--recipes`` naming exactly
    the default run's recipes); ``--jobs``, ``--no-progress`` and ``--dist-timeout`` never do (a row's bits do not
    depend on ``--jobs``). A notebook (``--with``) or a text file (``--data``) is named by its file name without
    the suffix. ``args``: the parsed flags, ``steps`` and ``batch_size`` already resolved."""
    from ..recipes import default_recipes

    base = QUICK if args.quick else {"steps": TrainConfig.steps, "batch_size": PRESET_BATCH[args.preset]}
    parts = []
    if args.recipes and sorted(set(args.recipes)) != sorted(default_recipes()):
        parts.append("recipes=" + ",".join(args.recipes))
    rest = []
    if args.steps != base["steps"]:
        rest.append(f"steps={args.steps}")
    if args.batch_size != base["batch_size"]:
        rest.append(f"batch-size={args.batch_size}")
    if args.lr != OptimConfig.lr:
        rest.append(f"lr={args.lr:g}")
    if args.min_lr_ratio != OptimConfig.min_lr_ratio:
        rest.append(f"min-lr-ratio={args.min_lr_ratio:g}")
    if args.data is not None:
        rest.append(f"data={Path(args.data).stem}")
    if (args.seeds or [args.seed]) != [0]:
        rest.append(f"seeds={','.join(map(str, args.seeds))}" if args.seeds else f"seed={args.seed}")
    if args.device != "cpu":
        rest.append(f"device={args.device}")
    if args.preset != "small":
        rest.append(f"preset={args.preset}")
    if args.inspect:
        rest.append(f"inspect={args.inspect}")
    if getattr(args, "autoswitch", None):
        rest.append(f"autoswitch={args.autoswitch}")
    if args.with_notebooks:
        rest.append("with=" + ",".join(Path(nb).stem for nb in args.with_notebooks))
    if args.nproc != 1:
        rest.append(f"nproc={args.nproc}")
    for flag in ("parallel", "reduce_dtype", "dispatch"):
        if getattr(args, flag, None):
            rest.append(f"{flag.replace('_', '-')}={getattr(args, flag)}")
    if args.fp8_all_gather:
        rest.append("fp8-all-gather")
    if args.quick and (parts or rest):
        parts.append("quick")
    return [re.sub(r"[^A-Za-z0-9_.,=+-]", "_", part) for part in parts + rest]


def run_name(changes: list[str]) -> str:
    """The folder name of a run with these ``run_changes``: the parts joined by ``+``; past ``MAX_RUN_NAME``
    characters, its start, ``~`` and 8 hex digits of its SHA-1 (the same run, the same name, every time)."""
    name = "+".join(changes)
    if len(name) > MAX_RUN_NAME:
        name = name[:MAX_RUN_NAME - 9] + "~" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def output_folder(args: argparse.Namespace) -> Path:
    """Where a run writes when ``--out`` is not given: ``DEFAULT_OUT`` for the default run, ``QUICK_OUT`` for
    ``--quick`` alone, ``RUNS_OUT/run_name(...)`` for any other, so that no other run replaces their results."""
    changes = run_changes(args)
    if changes:
        return RUNS_OUT / run_name(changes)
    return QUICK_OUT if args.quick else DEFAULT_OUT


def out_folder_error(out: Path) -> str | None:
    """Why ``out`` cannot be the output folder (a file, under a file, not writable, holding a folder where a file
    of ``OUT_FILES`` goes), as the error's text; None if it can. Creates nothing."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a folder"
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"--out {out}: {parent} is a file; give a folder"
            if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
                return f"--out {out}: cannot create it in {parent} (permission denied); pass another folder"
            break
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: cannot write there (permission denied); pass another folder"
    for name in OUT_FILES:                   # the run writes these files; a folder of the name fails it at the end
        if (out / name).is_dir():
            return f"--out {out}: {out / name} is a folder, where the run writes a file; pass another folder"
    return None


def make_folder(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; the folders created, ``out`` first."""
    created = [d for d in (out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    return created


def remove_if_empty(created: list[Path]) -> None:
    """Remove the folders ``make_folder`` created, while they are empty (a run that wrote nothing leaves none)."""
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break


def earlier_run(out: Path) -> tuple[bytes, str] | None:
    """The bytes of ``out/results.json`` and what run it holds (rows, steps), or None where there is none."""
    f = out / "results.json"
    try:
        raw = f.read_bytes()
    except OSError:
        return None
    try:
        old = json.loads(raw)
        what = f"{len(old['results'])} rows, {old['config']['steps']} steps x {old['config']['batch_size']}"
    except (ValueError, KeyError, TypeError):
        what = "unreadable"
    return raw, what


def _overwrite_note(out: Path, earlier: tuple[bytes, str] | None) -> str | None:
    """The note for a run that replaced an earlier ``results.json`` (its bytes changed); None if it did not."""
    f = out / "results.json"
    if earlier is None or not f.is_file() or f.read_bytes() == earlier[0]:
        return None
    return f"note: this run overwrote {f}, which held an earlier run ({earlier[1]}); pass --out to keep a run elsewhere"


def where_line(out: Path, side: bool) -> str:
    """The line that says, before the run, where its results go."""
    if side:
        return (f"results go to {out}/ (a run other than the default one gets a folder of its own, named after what "
                f"it changes, so {DEFAULT_OUT}/ keeps the default run's; --out to choose)")
    return f"results go to {out}/ (--out to choose another folder)"


def say_overwrite(out: Path, earlier) -> None:
    note = _overwrite_note(out, earlier)
    if note:
        print(note)
