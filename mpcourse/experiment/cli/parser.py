"""The ``mpcourse`` parser: ``argparse`` whose errors are one line with exit code 2, and a "did you mean" for a
misspelled flag; ``refuse``, the same one line for a check of ``mpcourse compare``'s own. Under torchrun either
line is printed once, by rank 0 (``mpcourse.experiment.parallel.launcher.say_once``), and every rank exits 2.
"""
from __future__ import annotations

import argparse

from ..parallel.launcher import say_once
from .argtypes import did_you_mean


def refuse(text: str, prog: str = "mpcourse compare") -> int:
    """Say ``PROG: error: TEXT`` on one line of stderr (once under torchrun); the exit code, 2."""
    say_once(f"{prog}: error: {text}")
    return 2


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE`` with exit code 2 (no usage
    block: ``PROG --help`` prints it); an unrecognized flag close to a known one (of this parser or a
    sub-command's) gets a "did you mean"."""

    def _flags(self) -> list[str]:
        flags = [o for a in self._actions for o in a.option_strings]
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                flags += [f for sub in a.choices.values() for f in sub._flags()]
        return flags

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            guesses = [f"{w} (did you mean {g}?)" for w in message.split(": ", 1)[1].split()
                       if w.startswith("--") and (g := did_you_mean(w.split("=")[0], self._flags()))]
            if guesses:
                message += "; " + "; ".join(guesses)
        say_once(f"{self.prog}: error: {message}")
        self.exit(2)
