"""The ``mpcourse`` parser: ``argparse`` whose errors are one line with exit code 2, and a "did you mean" for a
misspelled flag.
"""
from __future__ import annotations

import argparse

from .argtypes import did_you_mean


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
        self.exit(2, f"{self.prog}: error: {message}\n")
