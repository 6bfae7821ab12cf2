"""``mpcourse recipes``: list the registered recipes, marking those a plain ``compare`` leaves out."""
from __future__ import annotations

import argparse

from ..recipes import NOT_IN_DEFAULT_RUN, RECIPES


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``recipes`` to ``sub`` (the ``mpcourse`` parser's sub-commands); its parser."""
    return sub.add_parser("recipes", help="list the registered recipes (marking those a plain compare leaves out)")


def recipes(args: argparse.Namespace) -> int:
    """Print one line per registered recipe: its name, what it does, and whether the default run leaves it out."""
    width = max(map(len, RECIPES))
    for name, cls in RECIPES.items():
        mark = "  [not in the default run: name it with --recipes]" if name in NOT_IN_DEFAULT_RUN else ""
        print(f"{name.ljust(width)}  {cls.description}{mark}")
    return 0
