"""``mpcourse compare --with``'s door: a learner's exercise functions, checked against the recipes asked for.

``exercise_functions(paths, recipes)``: the notebooks' definitions (``mpcourse.experiment.learner.load_functions``),
of which the table of the exercises' functions keeps the learner's (``mpcourse.core.learner_table.learner_functions``,
the one filter), each checked against the signature the table gives it, and refused when no recipe asked for
takes any of them (``OverrideRefused``: the command line prints it and exits 2, before anything trains). Each
recipe then takes those its ``OVERRIDABLE`` names and adds a row trained with them (``mpcourse.experiment.compare``).
It sits in ``cli`` because it reads every floor below: the recipes and, under ``--parallel``, which of a recipe's
functions a data-parallel run takes (``mpcourse.experiment.parallel.data_parallel.overridable``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..learner import load_functions

#: a notebook function this close to a name the recipes take (``difflib`` ratio) is taken for a misspelling of it;
#: no helper of the course's notebooks comes this close to an exercise function it does not define
MISSPELLED = 0.85


def exercise_functions(paths: Sequence[str | Path], recipes: Sequence[str], parallel: str | None = None
                       ) -> dict[str, Callable]:
    """The learner's exercise functions the notebooks at ``paths`` define (``load_functions``, then the table's
    ``learner_functions``), for ``mpcourse compare --with`` on ``recipes`` (under ``parallel``: "ddp" or "fsdp").

    Raises ``LearnerLoadError`` when a notebook cannot be loaded, and ``OverrideRefused`` (one line naming the fix)
    when a function cannot be called with its exercise's signature, when a function's name is a near miss of one
    that ``recipes`` take and the notebooks do not define (``updat_scale``: a misspelling, which would otherwise
    train the library's function in its place), or when none of ``recipes`` takes any of them (naming the recipes
    that do), so that a wrong ``--with`` stops before anything trains."""
    import difflib

    from mpcourse.core.learner_table import EXERCISE_FUNCTIONS, OverrideRefused, check_signature, learner_functions
    from ..recipes import RECIPES, get_recipe

    loaded: dict[str, Callable] = {}
    for path in paths:
        loaded.update(load_functions(path))
    functions = learner_functions(loaded)
    for name, fn in functions.items():
        check_signature(name, fn)
    if parallel is None:
        def accepts(cls):
            return cls.OVERRIDABLE
    else:
        from ..parallel.data_parallel import overridable

        def accepts(cls):
            return overridable(cls, parallel)
    missing = sorted({n for r in recipes for n in accepts(get_recipe(r)) if n not in functions})
    for name in loaded:
        close = difflib.get_close_matches(name, missing, n=1, cutoff=MISSPELLED)
        if name not in EXERCISE_FUNCTIONS and close:
            raise OverrideRefused(f"your {name} is not one of the exercises' functions: did you mean {close[0]} "
                                  f"(lesson {EXERCISE_FUNCTIONS[close[0]].lesson})? The recipes call it by that name")
    if functions and not any(learner_functions(functions, accepts(get_recipe(r))) for r in recipes):
        under = f" under --parallel {parallel}" if parallel else ""
        takers = {n: [r for r, cls in RECIPES.items() if n in accepts(cls)] for n in functions}
        used = [f"{n} (lesson {EXERCISE_FUNCTIONS[n].lesson}) to {', '.join(t)}" for n, t in takers.items() if t]
        fix = (f": {'; '.join(used)} (name one with --recipes)" if used
               else f": no recipe takes them{under}" if parallel else ": they are not part of a training run")
        raise OverrideRefused(f"none of the recipes asked for ({', '.join(recipes)}) takes your "
                              f"{', '.join(functions)}{under}{fix}")
    return functions
