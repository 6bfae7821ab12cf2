"""The ``[yours]`` rows of a compare job: a recipe trained with a learner's functions (loaded from exercise
notebooks by ``mpcourse.experiment.learner``), compared with the library's row bit for bit, and the verdict line
printed under the table.
"""
from __future__ import annotations

import math

from mpcourse.core.learner_table import OverrideError, OverrideRefused, learner_functions
from mpcourse.core.seams import SeamError

from ..gpt.data import Corpus
from ..recipes import get_recipe
from ..recipes.base import TrainingRecipe
from ..training.train import RunResult, TrainConfig, train


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _num(x) -> str:
    return "None" if x is None else format(x, ".8g")


def first_difference(library: RunResult, mine: RunResult) -> str | None:
    """The first place where ``mine`` differs from ``library`` (exact comparison), in words; None if nowhere.

    Compared in order: each step's record (``loss``, ``skipped``, ``loss_scale``, ``val_loss`` and any other
    key a recipe reports), the number of steps run, then the final train and validation losses.
    """
    for a, b in zip(library.history, mine.history):
        for key in sorted(set(a) | set(b), key=lambda k: (k != "loss", k)):
            if key != "step" and not _same(a.get(key), b.get(key)):
                return f"first at step {a['step']}, {key} {_num(b.get(key))} (library {_num(a.get(key))})"
    if len(library.history) != len(mine.history):
        return f"ran {len(mine.history)} steps (library {len(library.history)})"
    for key in ("final_train_loss", "final_val_loss"):
        if not _same(getattr(library, key), getattr(mine, key)):
            return f"{key.replace('_', ' ')} {_num(getattr(mine, key))} (library {_num(getattr(library, key))})"
    return None


def yours(name: str) -> str:
    """The row name of recipe ``name`` trained with a learner's functions."""
    return f"{name} [yours]"


def train_with_learner(name: str, corpus: Corpus, cfg: TrainConfig, functions: dict, *, progress: bool = False,
                       echo=print) -> RunResult | None:
    """Recipe ``name`` trained with those of ``functions`` it accepts, as the row ``"name [yours]"``.

    ``functions``: the learner's (a notebook's namespace, or the exercise functions ``compare --with`` loaded);
    the recipe takes those its ``OVERRIDABLE`` names (``mpcourse.core.learner_table.learner_functions``, the one
    filter). Returns None, after one line through ``echo``, when the recipe accepts none of them, or as
    ``train_yours_row`` does.
    """
    recipe_cls = get_recipe(name)
    mine = learner_functions(functions, recipe_cls.OVERRIDABLE)
    if not mine:
        accepted = ", ".join(recipe_cls.OVERRIDABLE) or "none"
        echo(f"{name}: cannot use any of {', '.join(sorted(functions)) or 'no functions'} "
             f"(it accepts: {accepted})")
        return None
    return train_yours_row(recipe_cls.with_functions(mine), corpus, cfg, progress=progress, echo=echo)


def train_yours_row(recipe: type[TrainingRecipe], corpus: Corpus, cfg: TrainConfig, *, progress: bool = False,
                    echo=print) -> RunResult | None:
    """``recipe``, a recipe class carrying the learner's functions for it (``get_recipe(name).with_functions``),
    trained as the row ``"name [yours]"``; the recipe checks them where it is built. Returns None, after one line
    through ``echo``, when one of them is refused (a wrong signature) or fails (it raised, e.g.
    NotImplementedError; it returned something the library cannot use): the line names the function and why,
    never a traceback from inside the training step."""
    row = yours(recipe.name)
    try:
        return train(recipe, corpus, cfg, progress=progress, label=row)
    except (OverrideRefused, OverrideError, SeamError) as e:
        echo(f"{row}: {e}")
    except (TypeError, ValueError) as e:                  # a library check on what a function returned
        echo(f"{row}: {', '.join(recipe.FUNCTIONS)}: {e}")
    return None


def learner_verdicts(rows: dict[int, list[RunResult]], recipes: list[str], messages: dict[str, str]) -> list[str]:
    """One line per recipe trained with a learner's functions, as a notebook's "train with your code" cell prints
    it: identical to the library's row bit for bit (on every seed), where it first differs, or why there is no
    ``[yours]`` row (``messages``: recipe -> the line ``train_with_learner`` gave)."""
    out = []
    for name in recipes:
        pairs = [(seed, {r.recipe: r for r in rs}) for seed, rs in rows.items()]
        pairs = [(seed, by[name], by[yours(name)]) for seed, by in pairs if name in by and yours(name) in by]
        if name in messages:
            out.append(messages[name] if messages[name].startswith(name) else f"{yours(name)}: {messages[name]}")
        elif pairs:
            diffs = [(seed, first_difference(lib, mine)) for seed, lib, mine in pairs]
            bad = [(seed, d) for seed, d in diffs if d is not None]
            seeds = f" on {len(pairs)} seeds" if len(pairs) > 1 else ""
            if not bad:
                out.append(f"{yours(name)}: identical to the library's bit for bit{seeds} "
                           f"({len(pairs[0][1].history)} training losses, loss scales, final losses)")
            else:
                where = f" (seed {bad[0][0]})" if len(pairs) > 1 else ""
                out.append(f"{yours(name)}: differs from the library's{where}: {bad[0][1]}")
    return out
