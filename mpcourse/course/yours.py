"""The last cell of every exercise: train the course's GPT with your functions beside the library's.

``train_yours(globals(), ["bf16-pure", "fp16-master"])`` takes, from a notebook's namespace, the
functions the named recipes accept (their ``OVERRIDABLE``: ``round_to_bf16``, ``update_scale``, ...; picked by
``mpcourse.core.learner_table.learner_functions``, the one filter, once per recipe),
trains each recipe twice on the same short, seeded run of the course's GPT (``YOURS_CONFIG``: a
2-layer, width-64 model, 20 steps of 8 x 32 characters, about a second per row on a laptop CPU), once
with the library's own code and once with yours (the row ``NAME [yours]``,
``mpcourse.experiment.compare.learner_rows.train_yours_row``), and prints a small table and one verdict line
per recipe::

    the course's GPT (2 layers, width 64), 20 steps of 8 x 32 characters, seed 0; [yours]: with your round_to_bf16
    recipe             loss@0  loss@9  loss@19    val  skipped  scale
    -----------------  ------  ------  -------  -----  -------  -----
    bf16-pure           4.474   3.549    3.045  3.325        0      -
    bf16-pure [yours]   4.474   3.549    3.045  3.325        0      -
    bf16-pure [yours]: identical to the library's bit for bit (20 training losses, loss scales, final losses)

A different row says where it first differs (a round_to_bf16 that truncates: "differs from the library's:
first at step 1, loss 4.43648 (library 4.4340181)"), so a planted bug is visible even where three
decimals agree. A function
that raises (``NotImplementedError``, as a shipped exercise does), or returns something the library
cannot use (another dtype, shape or type, a value off the format's grid), gives one line naming the
function and why, and no row; never a traceback from inside the training step. So in a shipped
exercise this cell prints the library's rows and "your ... is not implemented yet", and it never
raises, so it cannot stop the check cells above it from being graded.

A recipe may report an opt-in statistic when given one of the learner's rules (its ``STATISTICS``: lesson
01's ``is_update_lost`` makes ``fp16-master`` measure ``lost_updates`` after every step): the library's row
is then trained with the library's own rule, both rows get the column (``lost%``: its mean over the steps,
in percent), and the statistic is compared like the losses. A run without such a rule computes none.

Comparisons are exact: float equality of every step's training loss, skipped flag and loss scale,
every validation loss and the final train and validation losses (NaN equal to NaN: two runs that
diverge at the same step are the same run). Both rows run in this process, with tensor-core emulation
on and one thread, so both rows see the same kernels and reduction order and the verdict holds on any machine; the
printed numbers (three decimals) still depend on the CPU's FP32 GEMM kernels (AVX2 and AVX-512 sum in another
order), so the cell is tagged ``nbval-ignore-output`` and asserts the verdict instead
(``assert not any(c.wrong for c in _)``: ``Comparison.wrong``).

The cell is tagged ``train-yours``: ``mpcourse.experiment.learner.load_functions`` skips it (so
``mpcourse compare --with NOTEBOOK`` does not train from inside a notebook load).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.core.learner_table import learner_functions
from mpcourse.experiment.compare.learner_rows import first_difference, train_yours_row, yours
from mpcourse.experiment.gpt.data import Corpus, load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.recipes.base import OptimConfig
from mpcourse.experiment.training.train import RunResult, TrainConfig, train

#: The run every exercise's last cell trains: the course's GPT at 2 layers x width 64 (about 108k
#: parameters), 20 AdamW steps of 8 sequences x 32 characters, warm-up 5 steps, validation at steps 10
#: and 20 on 2 fixed batches, seed 0.
YOURS_CONFIG = TrainConfig(steps=20, batch_size=8, eval_interval=10, eval_batches=2, seed=0,
                           optim=OptimConfig(warmup_steps=5),
                           model=GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
#: The run for block-scaled recipes (fp8-block, mxfp8, mxfp8-floor, nvfp4): their blocks need widths and token
#: counts in multiples of 128, and their GEMMs run in the slower exact emulation on a CPU, so one block of width
#: 128, 10 steps of 4 x 32 characters (128 tokens), validation at step 10 on one batch, seed 0.
YOURS_BLOCK_CONFIG = TrainConfig(steps=10, batch_size=4, eval_interval=10, eval_batches=1, seed=0,
                                 optim=OptimConfig(warmup_steps=3),
                                 model=GPTConfig(n_layer=1, n_head=4, n_embd=128, block_size=32))
#: The run for lesson 10 (``nproc=2``): starting two processes is the slow part, so 4 steps, validation on one batch.
YOURS_DIST_CONFIG = TrainConfig(steps=4, batch_size=8, eval_interval=4, eval_batches=1, seed=0,
                                optim=OptimConfig(warmup_steps=2),
                                model=GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))
LOSS_STEPS_SHOWN = 3          # training losses shown per row: first, middle, last step

_corpus: Corpus | None = None


def _default_corpus() -> Corpus:
    global _corpus
    if _corpus is None:
        _corpus = load_corpus()
    return _corpus


@dataclass
class Comparison:
    """One recipe trained with the library's code and with the learner's.

    Attributes:
        recipe: the recipe's name.
        used: the learner's functions this recipe was given (names, in the recipe's ``OVERRIDABLE`` order).
        library: the library's run.
        yours: the run with the learner's functions (row ``NAME [yours]``); None when there is none.
        message: why there is no ``yours`` run (one line naming the function), else None.
    """

    recipe: str
    used: tuple[str, ...]
    library: RunResult
    yours: RunResult | None
    message: str | None = None

    @property
    def difference(self) -> str | None:
        """Where the learner's run first differs from the library's (None: identical bit for bit, or no run)."""
        return None if self.yours is None else first_difference(self.library, self.yours)

    @property
    def identical(self) -> bool:
        """True when the learner's run exists and equals the library's bit for bit."""
        return self.yours is not None and self.difference is None

    @property
    def wrong(self) -> bool:
        """True when the learner's functions ran and gave a different row, or failed (raised, or returned something
        the library cannot use); False when the row is identical, or when there is nothing to judge yet (a stub that
        raises ``NotImplementedError``, no function of the learner's defined). What the cell asserts: the losses it
        prints depend on the machine's matmul kernels, this verdict does not."""
        if self.yours is not None:
            return self.difference is not None
        return self.message is not None and not any(p in self.message for p in _NOTHING_TO_JUDGE)

    def verdict(self) -> str:
        """The one line printed under the table for this recipe."""
        if self.yours is None:
            msg = self.message or "no run with your functions"
            return msg if msg.startswith(self.recipe) else f"{yours(self.recipe)}: {msg}"
        diff = self.difference
        if diff is None:
            return (f"{yours(self.recipe)}: identical to the library's bit for bit ({len(self.library.history)} "
                    "training losses, loss scales, final losses)")
        return f"{yours(self.recipe)}: differs from the library's: {diff}"


#: the messages of a comparison without a ``[yours]`` row that are not a wrong function (``Comparison.wrong``)
_NOTHING_TO_JUDGE = ("is not implemented yet", "defines none of the functions", "can use none of the exercises'")


def statistics_for(overrides: Mapping[str, Callable], recipe: str) -> dict[str, Callable]:
    """The library's own rules for the opt-in statistics (the recipe's ``STATISTICS``, e.g. ``is_update_lost``)
    whose learner's version is in ``overrides`` (the learner's functions for ``recipe``): the library's row is
    trained with them, so both rows report the same statistic, each through its own rule. Empty (nothing extra
    computed) otherwise."""
    rules = getattr(get_recipe(recipe), "STATISTICS", {})
    return {name: rules[name] for name in overrides if name in rules}


#: opt-in per-step statistics shown as a column (history key -> header), only when a row reports them;
#: the cell shows their mean over the run's steps, in percent.
STAT_COLUMNS = {"lost_updates": "lost%"}


def _stat_mean(r: RunResult, key: str) -> float | None:
    values = [h[key] for h in r.history if key in h]
    return 100.0 * sum(values) / len(values) if values else None


def _fmt(x, spec=".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf"
    return format(x, spec)


def describe(cfg: TrainConfig, comparisons: Sequence[Comparison]) -> str:
    """The line above the table: the run, and which of the learner's functions the ``[yours]`` rows use."""
    m = cfg.model
    used = list(dict.fromkeys(n for c in comparisons for n in c.used))
    return (f"the course's GPT ({m.n_layer} layers, width {m.n_embd}), {cfg.steps} steps of {cfg.batch_size} x "
            f"{m.block_size} characters, seed {cfg.seed}; [yours]: with your {', '.join(used) or 'nothing'}")


def format_rows(comparisons: Sequence[Comparison]) -> str:
    """The table (one library row and one ``[yours]`` row per recipe) and a verdict line per recipe."""
    steps = max((len(c.library.history) for c in comparisons), default=0)
    shown = sorted({0, (steps - 1) // 2, steps - 1}) if steps else []
    runs = [r for c in comparisons for r in (c.library, c.yours) if r is not None]
    stats = [k for k in STAT_COLUMNS if any(k in h for r in runs for h in r.history)]   # none by default
    head = ["recipe"] + [f"loss@{s}" for s in shown] + ["val", "skipped", "scale"] + [STAT_COLUMNS[k] for k in stats]
    rows = []
    for r in runs:
        losses = {h["step"]: h["loss"] for h in r.history}
        val = f"nan@{r.diverged_at}" if r.diverged_at is not None else _fmt(r.final_val_loss)
        rows.append([r.recipe] + [_fmt(losses.get(s)) for s in shown]
                    + [val, str(r.skipped_steps), _fmt(r.final_loss_scale, "g")]
                    + [_fmt(_stat_mean(r, k), ".4f") for k in stats])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)       # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    return "\n".join(out + [c.verdict() for c in comparisons])


def train_yours(namespace: Mapping[str, object], recipes: Sequence[str], *, cfg: TrainConfig | None = None,
                corpus: Corpus | None = None, echo: Callable[[str], object] | None = print,
                library_runs: dict[str, RunResult] | None = None, nproc: int = 1,
                parallel: str = "fsdp") -> list[Comparison]:
    """Train each of ``recipes`` with the library's code and with the learner's, print both rows and a verdict.

    Args:
        namespace: where the learner's functions live: a notebook's ``globals()``, or the dict
            ``mpcourse.experiment.learner.load_functions`` returns. Only the names a recipe accepts
            (its ``OVERRIDABLE``) are taken from it (``learner_table.learner_functions``); everything else is
            ignored.
        recipes: recipe names (``mpcourse recipes`` lists them), e.g. ``["bf16-pure", "fp16-master"]``.
        cfg: the training run (default ``YOURS_CONFIG``: 20 steps of a 2-layer GPT, seed 0).
        corpus: the text (default: the embedded default corpus, loaded once per process).
        echo: where the table goes (default ``print``; None: print nothing).
        library_runs: a cache of the library's runs by recipe name, made with the same ``cfg`` and ``corpus``
            (tests reuse one run across many learners); recipes missing from it are trained and added.
        nproc, parallel: with ``nproc`` > 1, both rows train data-parallel over ``nproc`` gloo processes
            spawned here (``mpcourse.experiment.parallel.distributed``, ``parallel`` "fsdp" or "ddp"), for the functions
            that only run with several ranks (lesson 10's ``all_reduce_found_inf_``). The functions reach the
            processes as their source (``inspect.getsource``): they may use ``torch`` and ``dist`` only.
            ``library_runs`` is not used then.

    Returns:
        One ``Comparison`` per recipe, in order (``.identical``, ``.difference``, ``.message``, the two runs).

    Raises:
        KeyError: an unknown recipe name (the message lists the known ones).
        ValueError: ``recipes`` is empty, or is a single string instead of a list.
        Nothing the learner's functions do raises: that is the ``message`` of the comparison.
    """
    _check_recipes(recipes)
    cfg = cfg or YOURS_CONFIG
    corpus = corpus or _default_corpus()
    if nproc > 1:
        comparisons = _compare_distributed(namespace, recipes, cfg, corpus, nproc, parallel)
        if echo is not None:
            echo(describe(cfg, comparisons) + f" ({parallel} over {nproc} processes)\n" + format_rows(comparisons))
        return comparisons
    comparisons = _compare_in_process(namespace, recipes, cfg, corpus, library_runs)
    if echo is not None:
        echo(describe(cfg, comparisons) + "\n" + format_rows(comparisons))
    return comparisons


def _check_recipes(recipes: Sequence[str]) -> None:
    """A non-empty list of known recipe names, checked before anything trains."""
    if isinstance(recipes, str) or not recipes:
        raise ValueError(f"recipes must be a non-empty list of recipe names, e.g. ['bf16-pure'], got {recipes!r}")
    for name in recipes:
        get_recipe(name)                                   # unknown names fail before anything trains


def _compare_in_process(namespace: Mapping[str, object], recipes: Sequence[str], cfg: TrainConfig, corpus: Corpus,
                        library_runs: dict[str, RunResult] | None) -> list[Comparison]:
    """Both rows of every recipe trained here, on one thread with tensor-core emulation on."""
    threads = torch.get_num_threads()
    comparisons = []
    try:
        torch.set_num_threads(1)                           # the same bits whatever the machine's core count
        with tensor_cores(True):                           # and whatever its BF16/FP16 units
            for name in recipes:
                overrides = learner_functions(namespace, get_recipe(name).OVERRIDABLE)   # the learner's, for it
                run = _library_run(name, statistics_for(overrides, name), cfg, corpus, library_runs)
                comparisons.append(_compare_one(name, run, overrides, cfg, corpus))
    finally:
        torch.set_num_threads(threads)
    return comparisons


def _library_run(name: str, stats: dict[str, Callable], cfg: TrainConfig, corpus: Corpus,
                 library_runs: dict[str, RunResult] | None) -> RunResult:
    """The library's run of recipe ``name`` with ``stats`` (the library's rules for the learner's statistics),
    from ``library_runs`` when it holds one, else trained (and added to it)."""
    key = "+".join([name, *stats])
    if library_runs is None or key not in library_runs:
        run = train(get_recipe(name).with_functions(stats), corpus, cfg, progress=False)
        if library_runs is not None:
            library_runs[key] = run
        return run
    return library_runs[key]


def _compare_one(name: str, library: RunResult, functions: dict[str, Callable], cfg: TrainConfig,
                 corpus: Corpus) -> Comparison:
    """``functions``: the learner's functions for recipe ``name`` (``learner_functions``, in OVERRIDABLE's order)."""
    used = tuple(functions)
    if not functions:
        accepted = get_recipe(name).OVERRIDABLE
        why = (f"this notebook defines none of the functions it can use ({', '.join(accepted)})" if accepted
               else "it can use none of the exercises' functions")
        return Comparison(name, used, library, None, f"{name}: {why}")
    lines: list[str] = []
    try:
        mine = train_yours_row(get_recipe(name).with_functions(functions), corpus, cfg, echo=lines.append)
    except Exception as e:                                 # anything else a wrong function provoked downstream
        first = str(e).splitlines()[0] if str(e) else ""
        lines.append(f"{yours(name)}: training with your {', '.join(used)} failed: {type(e).__name__}: {first}")
        mine = None
    return Comparison(name, used, library, mine, lines[0] if mine is None and lines else None)


def _compare_distributed(namespace, recipes, cfg: TrainConfig, corpus: Corpus, nproc: int,
                         parallel: str) -> list[Comparison]:
    """Both rows of every recipe trained over ``nproc`` spawned gloo processes (one job, rank 0's results)."""
    import inspect
    import tempfile
    import textwrap
    from pathlib import Path

    from mpcourse.experiment.parallel.distributed import Job, RankFailed, run_distributed_compare
    from mpcourse.experiment.parallel.data_parallel import overridable

    used = {r: tuple(learner_functions(namespace, overridable(get_recipe(r), parallel))) for r in recipes}
    sources = {}
    for name in dict.fromkeys(n for names in used.values() for n in names):
        try:
            fn = namespace[name]
            sources[name] = getattr(fn, "__learner_source__", None) or textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as e:
            raise ValueError(f"the source of your {name} cannot be read ({e}): define it with def in a cell") from None
    with tempfile.TemporaryDirectory() as d:
        job = Job(recipes=list(recipes), corpus=corpus, cfg=cfg, out=Path(d), parallel=parallel,
                  learner_sources=sources, quiet=True)
        try:
            rows = run_distributed_compare(job, nproc)
        except RankFailed as e:
            rows, job.messages[:] = [], [f"{e.message}"]
    runs = {r["recipe"]: RunResult(**r) for r in rows}
    out = []
    for name in recipes:
        if name not in runs:
            raise RuntimeError(f"{name}: no library run came back from the {nproc} processes: "
                               f"{'; '.join(job.messages) or 'unknown reason'}")
        mine = runs.get(yours(name))
        message = next((m for m in job.messages if m.startswith(yours(name))), None)
        if mine is None and message is None:
            message = (f"{name}: this notebook defines none of the functions it can use under {parallel} "
                       f"({', '.join(overridable(get_recipe(name), parallel))})")
        out.append(Comparison(name, used[name], runs[name], mine, message))
    return out
