"""Lesson 11's last exercise cell: the learner's ``bytes_per_parameter`` against the memory of real training runs.

``memory_yours(globals(), ["bf16-pure-sr", "fp8-delayed"])`` trains the course's GPT under each named recipe (the
run of every exercise's last cell, ``mpcourse.course.yours.YOURS_CONFIG``: 2 layers, width 64, 20 steps), with the
training loop's own memory count (``Trainer`` counts the live tensors of its first step,
``mpcourse.experiment.measure.memory.measure_step``, and reports them as ``RunResult.bytes_per_param``, the ``B/param``
column of ``mpcourse compare``). It reads the dtypes the recipe keeps at that same moment, after the first ``step()`` and before
``zero_grad()`` (``mpcourse.course.grading.memory.recipe_dtypes``: parameters, gradient buffers, master copy,
AdamW's moments),
calls the learner's function with them, and prints, per recipe, the bytes the run measured, the learner's, what
the rule leaves out (``extra``: Kahan buffers, FP8 scales and amax histories) and one verdict line::

    the course's GPT (2 layers, width 64), 20 steps of 8 x 32 characters, seed 0; [yours]: with your bytes_per_parameter
    recipe        dtypes w / grad buffers / master / moments  measured w+g+m+o  yours w+g+m+o  extra    val
    ------------  ------------------------------------------  ----------------  -------------  -----  -----
    bf16-pure-sr  bfloat16 / float32 / - / bfloat16           2+4+0+4=10        2+4+0+4=10         0  3.319
    bf16-pure-sr [yours]: identical to the library's count from the live tensors (weights, grads, master, optimizer)

A count that differs says where first ("first at grads: yours 2, the run's 4 B per parameter"); a function that
raises or returns something that is not the dict of four ints gives one line naming it and no ``yours`` column,
never a traceback (``NotImplementedError``, as a shipped exercise does: "your bytes_per_parameter is not
implemented yet"). The runs do not depend on the learner, so they are trained once per process and ``cfg``.
``Comparison.wrong`` is what the cell asserts: True for a count that differs or a function that fails, False for a
stub, a notebook without the function, or an identical count. A recipe that keeps one kind in several dtypes
(``fp8-delayed-fp8-weights``, ``fp8-moments``) is outside the rule: ValueError naming the kind.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.core.learner_table import EXERCISE_FUNCTIONS, learner_functions
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.training.train import RunResult, Trainer

from .grading.memory import KINDS, recipe_dtypes
from .yours import YOURS_CONFIG, _default_corpus

NAME = "bytes_per_parameter"
ARGS = EXERCISE_FUNCTIONS[NAME].parameters          # weights, grad_buffers, master, moments

_NOTHING_TO_JUDGE = ("is not implemented yet", "defines no function")
_runs: dict = {}                  # (recipe, cfg) -> (RunResult, the recipe's dtypes)


def trained(recipe: str, cfg=None) -> tuple[RunResult, dict]:
    """(the run of ``recipe`` under ``cfg``, default ``YOURS_CONFIG``, and the dtypes its recipe keeps), trained
    once per process: one thread, tensor-core emulation on, as every exercise's last cell."""
    cfg = cfg or YOURS_CONFIG
    key = (recipe, repr(cfg))
    if key not in _runs:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            with tensor_cores(True):
                trainer, dtypes = Trainer(recipe, _default_corpus(), cfg), {}
                # the first step is the one the trainer counts; read the dtypes there too, before zero_grad()
                trainer.train_step(after_step=lambda step, r, result: dtypes.update(recipe_dtypes(r)))
                _runs[key] = (trainer.run().result(), dtypes)
        finally:
            torch.set_num_threads(threads)
    return _runs[key]


@dataclass
class Comparison:
    """One recipe's run and the learner's count: ``measured`` (bytes per parameter by kind, from the run's live
    tensors), ``yours`` (the learner's dict; None when there is none), ``message`` (why not)."""

    recipe: str
    dtypes: dict
    run: RunResult
    yours: dict | None
    message: str | None = None
    used: tuple[str, ...] = (NAME,)

    @property
    def measured(self) -> dict:
        return {k: self.run.bytes_per_param[k] for k in KINDS}

    @property
    def difference(self) -> str | None:
        if self.yours is None:
            return None
        for k in KINDS:
            if self.yours[k] != self.measured[k]:
                return f"first at {k}: yours {self.yours[k]}, the run's {self.measured[k]:g} B per parameter"
        return None

    @property
    def identical(self) -> bool:
        return self.yours is not None and self.difference is None

    @property
    def wrong(self) -> bool:
        """A count that differs, or a function that failed; not a stub that raises NotImplementedError, nor a
        notebook without the function (nothing to judge yet)."""
        if self.yours is not None:
            return self.difference is not None
        return self.message is not None and not any(p in self.message for p in _NOTHING_TO_JUDGE)

    def verdict(self) -> str:
        head = f"{self.recipe} [yours]: "
        if self.yours is None:
            return head + (self.message or "no count of yours")
        diff = self.difference
        if diff is None:
            return head + "identical to the library's count from the live tensors (" + ", ".join(KINDS) + ")"
        return head + f"differs from the library's: {diff}"


def _yours(fn, dtypes: dict) -> tuple[dict | None, str | None]:
    try:
        got = fn(*(dtypes[a] for a in ARGS))
    except NotImplementedError:
        return None, f"your {NAME} is not implemented yet (it raises NotImplementedError)"
    except Exception as e:                                 # the learner's code: one line, no traceback
        first = str(e).splitlines()[0] if str(e) else ""
        return None, f"your {NAME} raised {type(e).__name__}: {first}"
    if not isinstance(got, dict) or set(got) != set(KINDS) or any(type(got[k]) is not int for k in KINDS):
        return None, f"your {NAME} returned {got!r}; return a dict of {len(KINDS)} ints, keys {', '.join(KINDS)}"
    return got, None


def _sum(b: Mapping) -> str:
    return "+".join(f"{b[k]:g}" for k in KINDS) + f"={sum(b[k] for k in KINDS):g}"


def format_rows(comparisons: Sequence[Comparison]) -> str:
    """The table (one row per recipe) and one verdict line per recipe."""
    short = lambda d: "-" if d is None else str(d).replace("torch.", "")        # noqa: E731
    head = ["recipe", "dtypes w / grad buffers / master / moments", "measured w+g+m+o", "yours w+g+m+o", "extra",
            "val"]
    rows = []
    for c in comparisons:
        loss = c.run.final_val_loss
        rows.append([c.recipe, " / ".join(short(c.dtypes[a]) for a in ARGS), _sum(c.measured),
                     "-" if c.yours is None else _sum(c.yours), f"{c.run.bytes_per_param.get('extra', 0):.3g}",
                     f"{loss:.3f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 4 else c.rjust(w)         # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    return "\n".join(out + [c.verdict() for c in comparisons])


def memory_yours(namespace: Mapping[str, object], recipes: Sequence[str], *, cfg=None,
                 echo: Callable[[str], object] | None = print) -> list[Comparison]:
    """Train each of ``recipes`` (once per process), count its state with ``namespace["bytes_per_parameter"]`` from
    the dtypes the recipe keeps, print the run's count and the learner's and a verdict per recipe.

    Raises ValueError for an empty list or a string, KeyError for an unknown recipe (naming the known ones), both
    before anything trains. Nothing the learner's function does raises: that is the ``message``.
    """
    if isinstance(recipes, str) or not recipes:
        raise ValueError(f"recipes must be a non-empty list of recipe names, e.g. ['bf16-pure-sr'], got {recipes!r}")
    for name in recipes:
        get_recipe(name)                                   # unknown names fail before anything trains
    cfg = cfg or YOURS_CONFIG
    fn = learner_functions(namespace, (NAME,)).get(NAME)   # the learner's (the table's filter), or None
    out = []
    for name in recipes:
        run, dtypes = trained(name, cfg)
        if not callable(fn):
            yours, message = None, f"this notebook defines no function {NAME}({', '.join(ARGS)})"
        else:
            yours, message = _yours(fn, dtypes)
        out.append(Comparison(name, dtypes, run, yours, message))
    if echo is not None:
        m = cfg.model
        echo(f"the course's GPT ({m.n_layer} layers, width {m.n_embd}), {cfg.steps} steps of {cfg.batch_size} x "
             f"{m.block_size} characters, seed {cfg.seed}; [yours]: with your {NAME}\n" + format_rows(out))
    return out
