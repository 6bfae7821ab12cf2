"""The ``mpcourse`` command: a dispatcher over its sub-commands, one function each. The experiment's (``compare``,
``recipes``: ``mpcourse.experiment.cli``) parse with one parser, built here from each sub-command's ``add_parser``;
the course's (``lab``, ``grade``, ``site``: ``mpcourse.course``) parse their own arguments. It sits above both
layers so that neither imports the other."""
from __future__ import annotations

import argparse
import sys

COURSE_COMMANDS = {"lab": "open the course in JupyterLab (lessons, exercises and solutions)",
                   "grade": "grade exercise notebooks (run fresh, one line per check cell)",
                   "site": "build the course as a static website, offline (needs the site extra)"}


def experiment_commands() -> dict:
    """The experiment's sub-commands, in ``--help``'s order: name -> (add_parser, the function that runs it)."""
    from mpcourse.experiment.cli import compare, recipes

    return {"compare": (compare.add_parser, compare.compare), "recipes": (recipes.add_parser, recipes.recipes)}


def course_command(name: str):
    """The function that runs course command ``name`` on the arguments after it."""
    if name == "lab":
        from mpcourse.course.learner import lab
        return lab
    if name == "grade":
        from mpcourse.course.grade import main as grade
        return grade
    from mpcourse.course.site import main as site
    return site


def build_parser() -> argparse.ArgumentParser:
    """The parser of the experiment's sub-commands (errors on one line: ``OneLineParser``)."""
    from mpcourse.experiment.cli.parser import OneLineParser

    p = OneLineParser(prog="mpcourse", description="Mixed-precision training, checked.")
    sub = p.add_subparsers(dest="command", required=True)
    for add_parser, _ in experiment_commands().values():
        add_parser(sub)
    return p


def unknown_command(word: str, commands: list[str]) -> str:
    """The one-line error for a word that is no sub-command: every sub-command, and the closest as a guess."""
    from mpcourse.experiment.cli.argtypes import did_you_mean

    close = did_you_mean(word, commands)
    guess = f"; did you mean {close}?" if close else ""
    return f"mpcourse: error: unknown command {word!r}{guess} (commands: {', '.join(commands)}; mpcourse --help)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COURSE_COMMANDS:
        return course_command(argv[0])(argv[1:])
    commands = experiment_commands()
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        print(unknown_command(argv[0], [*commands, *COURSE_COMMANDS]), file=sys.stderr)
        return 2
    parser = build_parser()
    if argv in ([], ["-h"], ["--help"]):
        code = 0
        try:
            parser.parse_args(["--help"])
        except SystemExit as e:
            code = e.code or 0
        print("\ncourse commands:")
        for name, text in COURSE_COMMANDS.items():
            print(f"  {name:<9} {text} (mpcourse {name} --help)")
        return code if argv else 2
    args = parser.parse_args(argv)
    return commands[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
