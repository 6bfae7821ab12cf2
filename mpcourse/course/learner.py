"""``mpcourse lab``: JupyterLab rooted at the course folder (the one holding ``notebooks/``,
``exercises/`` and ``solutions/``), so a lesson's link to its exercise can be opened from the same
file browser. The learner's other commands: ``mpcourse grade`` (:mod:`mpcourse.course.grade`) and
``mpcourse site``, the course as a website (:mod:`mpcourse.course.site`); ``mpcourse.cli`` dispatches.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .root import course_root


def lab_command(root: Path, extra: list[str]) -> list[str]:
    """The jupyter command: this interpreter's JupyterLab (so its kernels see this install), rooted at ``root``."""
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *extra]


def refused_as_root(extra: list[str]) -> str | None:
    """The error line when JupyterLab would refuse to start (it does as root unless told ``--allow-root``)."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return None
    if any(a == "--allow-root" or a.startswith("--ServerApp.allow_root") for a in extra):
        return None
    return ("mpcourse lab: error: you are root, and JupyterLab refuses to run as root (notebook code would run with "
            "root's rights). Run it as your own user; where root is the only user (a container), add --allow-root.")


def lab(argv: list[str]) -> int:
    """``mpcourse lab ARGS``: start JupyterLab at the course root (``--print-command``: print the command)."""
    p = argparse.ArgumentParser(prog="mpcourse lab", description="Open the course in JupyterLab, rooted at the "
                                "repository so notebooks/, exercises/ and solutions/ are all reachable. "
                                "Other arguments go to jupyter lab (e.g. --no-browser, --port 8899, "
                                "--allow-root where root is the only user).")
    p.add_argument("--print-command", action="store_true", help="print the jupyter command instead of running it")
    args, extra = p.parse_known_args(argv)
    cmd = lab_command(course_root(), extra)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    refusal = refused_as_root(extra)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    print(f"opening JupyterLab at {cmd[3].split('=', 1)[1]} (start with notebooks/00_number_formats.ipynb); "
          "without a browser, open the http://127.0.0.1:PORT/lab?token=... address it prints; Ctrl-C stops it")
    os.execv(cmd[0], cmd)          # replaces this process; Ctrl-C stops JupyterLab as usual
    return 0                       # not reached
