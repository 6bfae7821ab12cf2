"""``mpcourse compare``: train one model under every precision recipe and report side by side.

For each recipe: final train and validation loss and the gap to FP32, its largest loss spike
(``mpcourse.experiment.measure.spikes``, judged against the runs of the same seed on the same batches), skipped steps, the final
loss scale, tokens per second, bytes per parameter (weights + gradients + master copy + optimizer
state), the activation bytes and the peak bytes of one step (``mpcourse.experiment.measure.memory``), and the
fraction of the machine's peak FLOP/s the step reaches (``mpcourse.experiment.measure.speed``). With several
seeds (``seeds=[0, 1, 2]``) every recipe runs once per seed and the table shows mean +- standard
deviation (sample std, n-1) of the final losses and of the gap to FP32 (the gap is taken per seed, each
recipe against the FP32 run of the same seed). Writes ``DIR/results.json`` (one object per run,
``RunResult.to_dict()`` plus its ``seed``) and ``DIR/loss_curves.png`` (the first seed).

``results.json`` is strict JSON (RFC 8259 has no NaN or Infinity): a non-finite number is written
as ``null`` and named, with its value, in the enclosing object's ``"nonfinite"`` field (for example
``{"loss": null, "nonfinite": {"loss": "nan"}}``); a diverged run also says where in ``"null_reason"``.
The file records what produced it: torch version, device, tensor-core emulation per dtype.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path

from .gpt.data import Corpus
from mpcourse.core.learner_table import OverrideRefused, learner_functions
from mpcourse.core.seams import SeamError
from .recipes import get_recipe
from .recipes.base import OverrideError
from .measure.spikes import SPIKE_MIN_JUMP, SpikeReport, consensus, find_spikes, finite_losses
from .training.train import RunResult, TrainConfig, train, train_inspected


def gap_percent(result: RunResult, reference: RunResult | None) -> float | None:
    """Relative gap of the final validation loss to the reference's, in percent (positive: worse)."""
    if reference is None or not math.isfinite(reference.final_val_loss):
        return None
    return 100.0 * (result.final_val_loss - reference.final_val_loss) / reference.final_val_loss


def _fmt(x, spec):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf"
    return format(x, spec)


def spike_reports(results: list[RunResult], seeds: list[int] | None = None) -> list[SpikeReport]:
    """Each run's :class:`~mpcourse.experiment.measure.spikes.SpikeReport`, judged against the consensus of the runs
    of its seed (``seeds[i]`` is run i's; default: all one seed): they all trained on the same batches."""
    seeds = seeds if seeds is not None else [0] * len(results)
    groups: dict[int, list[list[dict]]] = {}
    for seed, r in zip(seeds, results):
        groups.setdefault(seed, []).append(r.history)
    expected = {seed: consensus(hs) for seed, hs in groups.items()}
    return [find_spikes(r.history, expected[seed]) for seed, r in zip(seeds, results)]


def _spike_cell(s: SpikeReport) -> str:
    return f"x{s.jump:.2f}@{s.jump_step}" if s.spiked else "-"


def peak_after(result: RunResult, warmup_steps: int) -> tuple[float | None, int | None]:
    """Highest finite training loss at or after ``warmup_steps``, and its step (None, None: none)."""
    losses = [(loss, step) for step, loss in finite_losses(result.history).items() if step >= warmup_steps]
    return max(losses) if losses else (None, None)


def _bytes_cell(b: dict) -> str:
    total = sum(b.get(k, 0) for k in ("weights", "grads", "master", "optimizer", "extra"))
    parts = [b.get(k, 0) for k in ("weights", "grads", "master", "optimizer")]
    if b.get("extra"):
        parts.append(b["extra"])
    return "+".join(f"{p:.3g}" for p in parts) + f"={total:.3g}"


def _mb(r: RunResult, key: str) -> str:
    return _fmt(r.memory.get(key, 0) / 2**20, ".2f") if r.memory else "-"


def _row_peak(name: str, peak_flops) -> float | None:
    """``peak_flops`` for row ``name``: one number for every row, or a mapping row name -> FLOP/s (None: unknown)."""
    if isinstance(peak_flops, Mapping):
        return peak_flops.get(name)
    return peak_flops


def _peak_pct(r: RunResult, peak_flops, clamped: list[str]) -> str:
    """The %peak cell of ``r`` against its peak (``_row_peak``); a row above it is clamped to ``100.0*`` and its
    name appended to ``clamped`` (``speed.percent_of_peak``)."""
    from .measure.speed import percent_of_peak

    peak = _row_peak(r.recipe, peak_flops)
    if not peak or not r.flops_per_token or not math.isfinite(r.tokens_per_s):
        return "-"
    pct, over = percent_of_peak(r.tokens_per_s, r.flops_per_token, peak)
    if over:
        clamped.append(r.recipe)
        return f"{pct:.1f}*"
    return _fmt(pct, ".1f")


def _clamp_note(clamped: list[str]) -> str:
    return ("\n*: ran faster than the peak measured for its GEMM dtype, shown as 100.0: "
            f"{', '.join(clamped)} (the peak measured low, e.g. on a busy machine; that dtype's %peak reads high)"
            if clamped else "")


LEGEND = ("train/val: final loss in nats/char on fixed batches of each split; gap%: val loss vs fp32 "
          "(negative = lower); nan@N: diverged at step N;\nspike: the largest loss spike, xSIZE@STEP (a training "
          f"loss over {1 + SPIKE_MIN_JUMP:g}x the expected one: the median of the runs on that batch, times the run's "
          "recent ratio to it; -: none); scale: final loss scale; B/param: bytes per "
          "parameter of weights+grads+master copy+optimizer state(+extra state); act MB: tensors saved for "
          "backward in one step (FP8 weight copies included);\npeak MB: most bytes alive during one step, state "
          "included; %peak: model FLOP/s over the machine's peak FLOP/s for the dtype the row's GEMMs run in")


def _layout(head, rows, legend):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows] + [legend])


def family(recipe: str) -> str:
    """The plot panel a recipe goes in: ``torch-amp-*`` (the oracle), else the part before the first dash."""
    return "torch.amp" if recipe.startswith("torch-amp") else recipe.split("-")[0]


def format_table(results: list[RunResult], *, peak_flops: float | Mapping[str, float] | None = None) -> str:
    """The comparison table as monospaced text (one row per recipe; the runs of one seed). ``peak_flops``: the
    peak for %peak, one number for every row or a mapping row name -> FLOP/s (``speed.row_peaks``); a row above
    its peak prints ``100.0*`` and a note names it."""
    ref = next((r for r in results if r.recipe == "fp32"), None)
    head = ["recipe", "train", "val", "gap%", "spike", "skipped", "scale", "tok/s", "%peak",
            "B/param w+g+m+o=total", "act MB", "peak MB"]
    rows, clamped = [], []
    for r, spikes in zip(results, spike_reports(results)):
        val = _fmt(r.final_val_loss, ".3f")
        if r.diverged_at is not None:
            val = f"nan@{r.diverged_at}"
        rows.append([r.recipe, _fmt(r.final_train_loss, ".3f"), val, _fmt(gap_percent(r, ref), "+.1f"),
                     _spike_cell(spikes), str(r.skipped_steps), _fmt(r.final_loss_scale, "g"), _fmt(r.tokens_per_s, ",.0f"),
                     _peak_pct(r, peak_flops, clamped), _bytes_cell(r.bytes_per_param),
                     _fmt(r.activation_bytes / 2**20, ".2f"), _mb(r, "peak")])
    return _layout(head, rows, LEGEND + _clamp_note(clamped))


def _mean_std(xs: list[float], spec: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if any(not math.isfinite(x) for x in xs):
        return "nan"
    if len(xs) == 1:
        return format(xs[0], spec)
    return f"{format(statistics.mean(xs), spec)}+-{format(statistics.stdev(xs), spec.lstrip('+'))}"


def format_seed_table(runs: dict[int, list[RunResult]], peak_flops: float | Mapping[str, float] | None = None) -> str:
    """Mean +- std over seeds (one row per recipe) of the final losses, the gap to FP32 (per seed) and tok/s
    (%peak of the mean tok/s; ``peak_flops`` as in ``format_table``)."""
    seeds = list(runs)
    names = list(dict.fromkeys(r.recipe for s in seeds for r in runs[s]))   # a run that failed has no row
    by = {s: {r.recipe: r for r in rs} for s, rs in runs.items()}
    head = ["recipe", "train", "val", "gap%", "spikes", "skipped", "tok/s", "%peak", "B/param w+g+m+o=total",
            "act MB", "peak MB"]
    spikes = {(s, r.recipe): rep for s in seeds for r, rep in zip(runs[s], spike_reports(runs[s]))}
    rows, clamped = [], []
    for n in names:
        have = [s for s in seeds if n in by[s]]
        rs = [by[s][n] for s in have]
        gaps = [gap_percent(by[s][n], by[s].get("fp32")) for s in have]
        diverged = [r.diverged_at for r in rs if r.diverged_at is not None]
        val = _mean_std([r.final_val_loss for r in rs], ".3f")
        if diverged:
            val = f"nan@{min(diverged)} ({len(diverged)}/{len(rs)})"
        first = rs[0]
        rows.append([n, _mean_std([r.final_train_loss for r in rs], ".3f"), val, _mean_std(gaps, "+.1f"),
                     "/".join(_spike_cell(spikes[s, n]) for s in have), "/".join(str(r.skipped_steps) for r in rs), _fmt(statistics.mean(r.tokens_per_s for r in rs), ",.0f"),
                     _peak_pct(dataclasses.replace(first, tokens_per_s=statistics.mean(r.tokens_per_s for r in rs)),
                               peak_flops, clamped),
                     _bytes_cell(first.bytes_per_param), _fmt(first.activation_bytes / 2**20, ".2f"), _mb(first, "peak")])
    legend = (f"mean+-std over seeds {','.join(map(str, seeds))} (gap%: per seed against that seed's fp32 run); "
              "spikes, skipped: per seed\n" + LEGEND + _clamp_note(clamped))
    return _layout(head, rows, legend)


def _stat(xs: list[float | None]) -> dict:
    """Mean and sample std (n-1) of the values as ``format_seed_table`` prints them (None values left out; a
    non-finite value makes both NaN; one value: std None)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    if any(not math.isfinite(x) for x in xs):
        return {"mean": math.nan, "std": math.nan, "n": len(xs)}
    return {"mean": statistics.mean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}


def seed_summary(runs: dict[int, list[RunResult]]) -> dict[str, dict]:
    """Per recipe, over the seeds: mean and sample std of the final train and validation losses and of the gap to
    FP32 in percent (per seed, against that seed's fp32 run), the mean tok/s, the seeds it ran and where it
    diverged: the numbers the ``--seeds`` table prints, for ``results.json``'s ``seed_summary``."""
    seeds = list(runs)
    by = {s: {r.recipe: r for r in rs} for s, rs in runs.items()}
    out = {}
    for n in dict.fromkeys(r.recipe for s in seeds for r in runs[s]):
        have = [s for s in seeds if n in by[s]]
        rs = [by[s][n] for s in have]
        out[n] = {"seeds": have,
                  "train": _stat([r.final_train_loss for r in rs]), "val": _stat([r.final_val_loss for r in rs]),
                  "gap_percent": _stat([gap_percent(by[s][n], by[s].get("fp32")) for s in have]),
                  "tokens_per_s": statistics.mean(r.tokens_per_s for r in rs),
                  "diverged_at": [r.diverged_at for r in rs]}
    return out


def plot_curves(results: list[RunResult], path: Path) -> None:
    """Save one small panel per recipe family (fp16, bf16, fp8, ...): training loss per step on a
    log y-axis (so a spike or a climb is visible at any height), validation losses as dots, the
    fp32 run as a grey reference in every panel, a triangle on each spike of the table's ``spike``
    column (:func:`spike_reports`) and a cross where a run diverged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ref = next((r for r in results if r.recipe == "fp32"), None)
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        if r is not ref:
            groups.setdefault(family(r.recipe), []).append(r)
    if not groups and ref is not None:
        groups["fp32"] = []
    ncols = min(2, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 3.6 * nrows), sharex=True, sharey=True,
                             squeeze=False)
    finite = [h[k] for r in results for h in r.history for k in ("loss", "val_loss")
              if k in h and math.isfinite(h[k])]
    lo, hi = (min(finite), max(finite)) if finite else (1.0, 10.0)
    ticks = [t / 2 for t in range(1, 200) if lo * 0.95 <= t / 2 <= hi * 1.08] or [lo, hi]
    if len(ticks) > 12:                                   # a run that went far up: fewer labels
        ticks = ticks[::math.ceil(len(ticks) / 12)]
    styles = ["-", "--", "-.", ":"]
    colors = plt.get_cmap("tab10").colors
    spikes = {id(r): rep.spike_steps for r, rep in zip(results, spike_reports(results))}

    def draw(ax, r, **kw):
        steps = [h["step"] for h in r.history]
        losses = [h["loss"] if math.isfinite(h["loss"]) else math.nan for h in r.history]
        (line,) = ax.plot(steps, losses, **kw)
        val = [(h["step"], h["val_loss"]) for h in r.history if "val_loss" in h and math.isfinite(h["val_loss"])]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), ms=4)
        at = [(s, loss) for s, loss in zip(steps, losses) if s in spikes[id(r)]]
        if at:
            ax.plot(*zip(*at), "^", color=line.get_color(), ms=8, mec="black", mew=0.6)
        if r.diverged_at is not None:
            ax.plot([r.diverged_at], [hi], "x", color=line.get_color(), ms=9, mew=2, clip_on=False)
        return line

    for ax, (fam, runs) in zip(axes.flat, groups.items()):
        if ref is not None:
            draw(ax, ref, color="0.55", lw=1.6, label="fp32 (reference)")
        for i, r in enumerate(runs):
            label = r.recipe + (f" (diverged at step {r.diverged_at})" if r.diverged_at is not None else "")
            draw(ax, r, color=colors[i % len(colors)], ls=styles[i % len(styles)], lw=1.1, label=label)
        ax.set_title(fam, fontsize=10)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))     # labelled every half nat
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    axes[0, 0].set_ylim(lo * 0.95, hi * 1.08)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("train loss (nats/char, log)")
    fig.suptitle("mpcourse compare: one model, every precision recipe (dots: validation; triangles: spikes; x: diverged)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ``train_overrides`` does.
    """
    recipe_cls = get_recipe(name)
    overrides = learner_functions(functions, recipe_cls.OVERRIDABLE)
    if not overrides:
        accepted = ", ".join(recipe_cls.OVERRIDABLE) or "none"
        echo(f"{name}: cannot use any of {', '.join(sorted(functions)) or 'no functions'} "
             f"(it accepts: {accepted})")
        return None
    return train_overrides(name, corpus, cfg, overrides, progress=progress, echo=echo)


def train_overrides(name: str, corpus: Corpus, cfg: TrainConfig, overrides: dict, *, progress: bool = False,
                    echo=print) -> RunResult | None:
    """Recipe ``name`` trained with the learner's ``overrides`` (its functions for this recipe, as
    ``learner_functions`` picks them), as the row ``"name [yours]"``; the recipe checks them where it is built.
    Returns None, after one line through ``echo``, when one of them is refused (a wrong signature) or fails (it
    raised, e.g. NotImplementedError; it returned something the library cannot use): the line names the
    function and why, never a traceback from inside the training step."""
    try:
        return train(name, corpus, cfg, progress=progress, overrides=overrides, label=yours(name))
    except (OverrideRefused, OverrideError, SeamError) as e:
        echo(f"{yours(name)}: {e}")
    except (TypeError, ValueError) as e:                  # a library check on what a function returned
        echo(f"{yours(name)}: {', '.join(overrides)}: {e}")
    return None


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None, named in its object's ``"nonfinite"``."""
    if isinstance(obj, dict):
        out, bad = {}, {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k], bad[k] = None, "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            else:
                out[k] = strict_json(v)
        if bad:
            out["nonfinite"] = bad
        return out
    if isinstance(obj, (list, tuple)):
        return [None if isinstance(v, float) and not math.isfinite(v) else strict_json(v) for v in obj]
    return obj


def environment(device: str = "cpu") -> dict:
    """What produced the numbers: versions, device, tensor-core emulation per low-precision dtype, and the CPU's
    kind (``cpu``: instruction set, flags, BF16/FP16 GEMMs native or emulated; ``mpcourse.experiment.measure.machine``)."""
    import platform

    import torch

    from mpcourse.core import emulation

    from .measure import machine
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": device,
            "emulation": {str(dt).replace("torch.", ""): {"emulated": emulation.emulation_enabled(dt),
                                                         "cpu_has_native_units": emulation.cpu_has_native(dt)}
                          for dt in emulation.LOW_PRECISION},
            "emulation_summary": emulation.status(),
            "cpu": machine.describe()}


def results_payload(results: list[RunResult], corpus: Corpus, cfg: TrainConfig, extra: dict | None = None,
                    seeds: list[int] | None = None) -> dict:
    """The ``results.json`` object, strict JSON (see the module docstring); ``seeds[i]`` is run i's seed."""
    rows = []
    seeds = list(seeds) if seeds is not None else [cfg.seed] * len(results)
    for i, (r, spikes) in enumerate(zip(results, spike_reports(results, seeds))):
        d = r.to_dict()
        d["seed"] = seeds[i]
        peak, peak_step = peak_after(r, cfg.optim.warmup_steps)
        d.update(peak_loss=peak, peak_loss_step=peak_step, loss_spiked=spikes.spiked, spikes=spikes.to_dict())
        if r.diverged_at is not None:
            d["null_reason"] = f"the run diverged at step {r.diverged_at} (non-finite loss); its null values are the non-finite ones named in nonfinite"
        rows.append(d)
    payload = {"corpus": corpus.name, "unigram_entropy": corpus.unigram_entropy(),
               "config": {"steps": cfg.steps, "batch_size": cfg.batch_size, "seed": cfg.seed,
                          "block_size": cfg.model.block_size, "n_layer": cfg.model.n_layer,
                          "n_embd": cfg.model.n_embd, "n_head": cfg.model.n_head, "lr": cfg.optim.lr,
                          "min_lr_ratio": cfg.optim.min_lr_ratio, "warmup_steps": cfg.optim.warmup_steps},
               **(extra or {}),
               "environment": environment(getattr(cfg, "device", "cpu")),
               "results": rows}
    return strict_json(payload)

class CompareFailed(RuntimeError):
    """Some runs of a compare job failed; the finished ones are in ``results.json`` (``failed`` names the others).
    When none finished nothing was written (an earlier ``results.json`` in the folder is kept as it was).

    Attributes:
        failed: ``[{"recipe", "seed", "error"}]``, one per failed run, in the order of the job.
        results: the rows that finished.
    """

    def __init__(self, failed: list[dict], results: list[RunResult]):
        self.failed, self.results = failed, results
        super().__init__("; ".join(f"{f['recipe']} (seed {f['seed']}): {f['error']}" for f in failed))


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C during a compare job: the rows that finished are in ``results.json`` (its ``failed`` names the runs
    that did not finish, ``interrupted`` is true); nothing was written when none had finished.

    A ``KeyboardInterrupt``, so a caller that does not know it still stops. Attributes as ``CompareFailed``'s.
    """

    def __init__(self, failed: list[dict], results: list[RunResult]):
        self.failed, self.results = failed, results
        super().__init__(f"interrupted: {len(results)} finished run(s) kept, {len(failed)} not finished")


INTERRUPTED = "interrupted before it finished"


def _error_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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


def run_compare(recipes: list[str], corpus: Corpus, cfg: TrainConfig, out: Path, *,
                progress: bool = True, echo=print, seeds: list[int] | None = None,
                peak_flops: float | Mapping[str, float] | None = None, inspect_every: int = 0,
                learner: dict | None = None, jobs: int = 1, threads: int | None = None,
                remeasure_peak=None) -> list[RunResult]:
    """Train every recipe in ``recipes`` on ``corpus`` (once per seed in ``seeds``; default: ``cfg.seed``); print
    the table; write JSON and plot to ``out``. ``peak_flops``: the machine's peaks for the %peak column, by GEMM
    dtype key (``speed.cpu_peaks`` / ``gpu_peaks``: each row against its dtype's, ``speed.peak_key``), or one
    number for every row; ``remeasure_peak(key)``: measures a peak again when a row beat it (the better one counts;
    a row still above it prints ``100.0*``, see ``format_table``).
    ``inspect_every=N`` runs the numerics inspector on the first seed's runs and writes, per recipe,
    ``inspect-RECIPE.json`` and ``inspect-RECIPE.png`` (layer x step: fraction of the output gradients that are
    FP16 subnormals; in an FP16 run the ones that underflowed are already zeros, counted in ``zeros``).
    ``learner``: functions loaded from exercise notebooks (``mpcourse.experiment.learner``); each recipe
    that accepts some of them gets a second row, ``"name [yours]"``, trained with them (every seed), and one
    verdict line under the table (``learner_verdicts``).
    ``jobs`` > 1: the library's rows train in that many worker processes (``mpcourse.experiment.pool``); the
    learner's rows train afterwards in this process. Every run, wherever it trains, uses ``TRAINING_THREADS``
    intra-op threads (``mpcourse.experiment.training.threads``): a row's bits do not depend on ``jobs``, on the other
    recipes of the job or on the process. ``threads`` is accepted for old callers and must be that count.

    A run that fails does not stop the others: the table and ``results.json`` hold every finished row,
    ``results.json``'s ``failed`` names each failed run and why, and ``CompareFailed`` is raised after the
    files are written. Ctrl-C (``KeyboardInterrupt``, in this process or while workers train) stops the job the
    same way: the finished rows are written, the others named in ``failed`` as interrupted, and
    ``CompareInterrupted`` is raised. When no run finished nothing is written (``out`` keeps what it held).
    """
    from .training.threads import TRAINING_THREADS, training_threads

    if threads not in (None, TRAINING_THREADS):
        raise ValueError(f"threads={threads}: every training run uses {TRAINING_THREADS} intra-op thread(s) "
                         "(mpcourse.experiment.training.threads); drop the argument")
    seeds = list(seeds) if seeds else [cfg.seed]
    pooled: dict[tuple[int, str], RunResult] = {}
    failed: dict[tuple[int, str], str] = {}
    interrupted = False
    if jobs > 1:
        from .pool import Task, run_pool
        if inspect_every:
            out.mkdir(parents=True, exist_ok=True)           # the workers' inspector files go there
        tasks = [Task(name, dataclasses.replace(cfg, seed=seed), inspect_every if seed == seeds[0] else 0, out)
                 for seed in seeds for name in recipes]
        errors: dict[int, str] = {}
        finished: dict[int, RunResult] = {}
        try:
            run_pool(tasks, corpus, jobs, TRAINING_THREADS, progress=progress, failures=errors, finished=finished)
        except KeyboardInterrupt:                # keep what the workers finished: written below
            interrupted = True
        for i, t in enumerate(tasks):
            if i in finished:
                pooled[t.cfg.seed, t.name] = finished[i]
            elif i in errors:
                failed[t.cfg.seed, t.name] = errors[i]
    runs: dict[int, list[RunResult]] = {}
    messages: dict[str, str] = {}
    with training_threads():
        for seed in seeds:
            if interrupted:
                runs[seed] = [pooled[seed, n] for n in recipes if (seed, n) in pooled]
                continue
            scfg = dataclasses.replace(cfg, seed=seed)
            rows = runs[seed] = []
            try:
                for name in recipes:
                    if (seed, name) in failed:
                        continue
                    try:
                        if (seed, name) in pooled:
                            rows.append(pooled[seed, name])
                        elif inspect_every and seed == seeds[0]:
                            out.mkdir(parents=True, exist_ok=True)
                            rows.append(train_inspected(name, corpus, scfg, out, inspect_every, progress))
                        else:
                            rows.append(train(name, corpus, scfg, progress=progress))
                    except Exception as e:          # keep the other rows: this one is named in results.json
                        failed[seed, name] = _error_line(e)
                        continue
                    if learner:
                        said: list[str] = []
                        mine = train_with_learner(name, corpus, scfg, learner, progress=progress, echo=said.append)
                        if mine is not None:
                            rows.append(mine)
                        elif said:
                            messages.setdefault(name, said[0])
            except KeyboardInterrupt:               # Ctrl-C: keep the finished rows, name the others
                interrupted = True
    done = {(s, r.recipe) for s, rs in runs.items() for r in rs}
    failures = [{"recipe": name, "seed": seed, "error": failed[seed, name]}
                for seed in seeds for name in recipes if (seed, name) in failed]
    failures += [{"recipe": name, "seed": seed, "error": INTERRUPTED} for seed in seeds for name in recipes
                 if interrupted and (seed, name) not in failed and (seed, name) not in done]
    flat = [(s, r) for s, rs in runs.items() for r in rs]
    peaks = dict(peak_flops) if isinstance(peak_flops, Mapping) else peak_flops
    row_peak = _settle_peaks(flat, peaks, cfg, remeasure_peak)
    if len(seeds) == 1:
        echo(format_table(runs.get(seeds[0], []), peak_flops=row_peak))
    else:
        echo(format_seed_table(runs, row_peak))
    if learner:
        for line in learner_verdicts(runs, recipes, messages):
            echo(line)
    for f in failures:
        said = "NOT FINISHED" if f["error"] == INTERRUPTED else "FAILED"
        echo(f"{said} {f['recipe']} (seed {f['seed']}): {f['error']}")
    results = [r for _, r in flat]
    if results:                      # nothing finished: write nothing, so an earlier run's files stay as they were
        extra = {"seeds": seeds, "peak_flops": peaks, "row_peak_flops": row_peak, "jobs": jobs,
                 "threads": TRAINING_THREADS, "failed": failures, "interrupted": interrupted}
        if len(seeds) > 1:
            extra["seed_summary"] = seed_summary(runs)
        write_outputs(results, corpus, cfg, out, extra=extra, seeds=[s for s, _ in flat],
                      plot_results=runs.get(seeds[0]) or results)
    if interrupted:
        raise CompareInterrupted(failures, results)
    if failures:
        raise CompareFailed(failures, results)
    return results


def _settle_peaks(flat: list[tuple[int, RunResult]], peaks, cfg: TrainConfig, remeasure_peak) -> dict | float | None:
    """Each row's peak for %peak (``speed.row_peaks``; a single number stays one for every row). A row faster than
    its peak has that peak measured again with ``remeasure_peak(key)`` (where given), the better of the two kept
    in ``peaks``; a row still above it is clamped when the table is printed."""
    if not isinstance(peaks, dict):
        return peaks
    from .measure.speed import emulated_dtypes, peak_key, row_peaks

    device, emulated = getattr(cfg, "device", "cpu"), emulated_dtypes()
    names = list(dict.fromkeys(r.recipe for _, r in flat))
    row_peak = row_peaks(names, peaks, device, emulated)
    if remeasure_peak is not None:
        from .recipes import get_recipe
        over = {peak_key(get_recipe(r.recipe.removesuffix(" [yours]")).gemm_dtype, device, emulated)
                for _, r in flat if row_peak.get(r.recipe) and r.flops_per_token
                and r.tokens_per_s * r.flops_per_token > row_peak[r.recipe]}
        for key in sorted(over):
            peaks[key] = max(peaks[key], remeasure_peak(key))
        if over:
            row_peak = row_peaks(names, peaks, device, emulated)
    return row_peak


def write_outputs(results: list[RunResult], corpus: Corpus, cfg: TrainConfig, out: Path, extra: dict | None = None,
                  seeds: list[int] | None = None, plot_results: list[RunResult] | None = None) -> None:
    """Write ``out/results.json`` (strict JSON: config, ``extra`` keys, environment, one object per
    run) and ``out/loss_curves.png`` (``plot_results``, default all ``results``)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = results_payload(results, corpus, cfg, extra, seeds)
    (out / "results.json").write_text(json.dumps(payload, indent=1, allow_nan=False))
    plot_curves(plot_results if plot_results is not None else results, out / "loss_curves.png")
