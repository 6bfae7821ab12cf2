"""The ``mpcourse`` command: the experiment's commands (``compare``, ``recipes``) and the course's
(``lab``, ``grade``, ``site``). It sits above both layers so that neither imports the other."""
from __future__ import annotations

import sys

COURSE_COMMANDS = {"lab": "open the course in JupyterLab (lessons, exercises and solutions)",
                   "grade": "grade exercise notebooks (run fresh, one line per check cell)",
                   "site": "build the course as a static website, offline (needs the site extra)"}


def unknown_command(word: str, commands: list[str]) -> str:
    """The one-line error for a word that is no sub-command: every sub-command, and the closest as a guess."""
    from mpcourse.experiment.argtypes import did_you_mean

    close = did_you_mean(word, commands)
    guess = f"; did you mean {close}?" if close else ""
    return f"mpcourse: error: unknown command {word!r}{guess} (commands: {', '.join(commands)}; mpcourse --help)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COURSE_COMMANDS:
        from mpcourse.course.learner import main as course_main
        return course_main(argv)
    from mpcourse.experiment.cli import build_parser, main as experiment_main
    if argv and not argv[0].startswith("-"):
        sub = next(a for a in build_parser()._actions if a.dest == "command")
        commands = [*sub.choices, *COURSE_COMMANDS]
        if argv[0] not in commands:
            print(unknown_command(argv[0], commands), file=sys.stderr)
            return 2
    if argv in ([], ["-h"], ["--help"]):
        code = 0
        try:
            experiment_main(argv or ["--help"])
        except SystemExit as e:
            code = e.code or 0
        print("\ncourse commands:")
        for name, text in COURSE_COMMANDS.items():
            print(f"  {name:<9} {text} (mpcourse {name} --help)")
        return code if argv else 2
    return experiment_main(argv)


if __name__ == "__main__":
    sys.exit(main())
