"""The ``mpcourse`` command: the experiment's commands (``compare``, ``recipes``) and the course's
(``lab``, ``grade``, ``site``). It sits above both layers so that neither imports the other."""
from __future__ import annotations

import sys

COURSE_COMMANDS = {"lab": "open the course in JupyterLab (lessons, exercises and solutions)",
                   "grade": "grade exercise notebooks (run fresh, one line per check cell)",
                   "site": "build the course as a static website, offline (needs the site extra)"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COURSE_COMMANDS:
        from mpcourse.course.learner import main as course_main
        return course_main(argv)
    from mpcourse.experiment.cli import main as experiment_main
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
