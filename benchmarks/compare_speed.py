"""Wall time of the default ``mpcourse compare`` on two source trees, in one run: the ratio new / old.

A refactor that changes no number must also cost no time. This script runs the same ``mpcourse compare``
command (default: the default run at ``--steps 8``, the 19 recipes with their start-up, 2 jobs x 1 thread) from
two checkouts, alternating them ``--rounds`` times so that a busy machine slows both alike, and prints each wall
and CPU time (the command and its workers), the medians and the ratios new / old. It also checks that both trees wrote the same loss histories (bit for
bit), so the two runs timed are the same work.

    git worktree add /tmp/old <commit-before>
    python benchmarks/compare_speed.py --old /tmp/old --new . --rounds 2
    python benchmarks/compare_speed.py --old /tmp/old --new . --args "--steps 80"     # the full default run

Exit status 0 (the ratio is printed, whatever it is), 1 when the histories differ, 2 for a bad path.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(tree: Path, args: list[str], out: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``python -m mpcourse compare ARGS --out OUT --no-progress`` with ``tree`` first on
    the path; CPU counts the command and its worker processes (user + system), which a shared machine moves less."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-m", "mpcourse", "compare", *args, "--out", str(out), "--no-progress"],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, _children_cpu() - c0


def histories(out: Path) -> dict[str, list]:
    rows = json.loads((out / "results.json").read_text())["results"]
    return {r["recipe"]: r["history"] for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the tree before the change")
    p.add_argument("--new", type=Path, required=True, help="the tree after it")
    p.add_argument("--args", default="--steps 8", help="arguments of mpcourse compare (default: --steps 8)")
    p.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternating (default 2)")
    a = p.parse_args(argv)
    for tree in (a.old, a.new):
        if not (tree / "mpcourse" / "__init__.py").is_file():
            print(f"compare_speed: error: {tree} holds no mpcourse/ package; give a checkout's root", file=sys.stderr)
            return 2
    args = shlex.split(a.args)
    times: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, tree in (("old", a.old), ("new", a.new)) if r % 2 == 0 else (("new", a.new), ("old", a.old)):
                out = Path(d) / f"{name}{r}"
                wall, used = run_once(tree.resolve(), args, out)
                times[name].append(wall)
                cpu[name].append(used)
                print(f"round {r + 1} {name}: {wall:.1f} s wall, {used:.1f} s CPU", flush=True)
        same = histories(Path(d) / "old0") == histories(Path(d) / "new0")
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    cold, cnew = statistics.median(cpu["old"]), statistics.median(cpu["new"])
    print(f"median wall old {old:.1f} s, new {new:.1f} s: new / old = {new / old:.3f}; median CPU old {cold:.1f} s, "
          f"new {cnew:.1f} s: new / old = {cnew / cold:.3f}; histories {'bit-identical' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
