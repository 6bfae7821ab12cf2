"""``mpcourse compare``: train one model under every precision recipe and report side by side.

For each recipe: final train and validation loss and the gap to FP32, skipped steps, the final
loss scale, tokens per second, bytes per parameter (weights + gradients + master copy + optimizer
state) and the activation bytes of one step. Writes ``DIR/results.json`` (one object per recipe,
``RunResult.to_dict()``) and ``DIR/loss_curves.png``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .data import Corpus
from mpcourse.core.seams import SeamError
from .learner import overrides_for
from .recipes import get_recipe
from .recipes.base import OverrideError
from .train import RunResult, TrainConfig, train


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


def format_table(results: list[RunResult]) -> str:
    """The comparison table as monospaced text (one row per recipe)."""
    ref = next((r for r in results if r.recipe == "fp32"), None)
    head = ["recipe", "train", "val", "gap%", "skipped", "scale", "tok/s",
            "B/param w+g+m+o=total", "act MB"]
    rows = []
    for r in results:
        b = r.bytes_per_param
        total = sum(b.get(k, 0) for k in ("weights", "grads", "master", "optimizer", "extra"))
        parts = [b.get(k, 0) for k in ("weights", "grads", "master", "optimizer")]
        if b.get("extra"):
            parts.append(b["extra"])
        mem = "+".join(f"{p:.3g}" for p in parts) + f"={total:.3g}"
        val = _fmt(r.final_val_loss, ".3f")
        if r.diverged_at is not None:
            val = f"nan@{r.diverged_at}"
        rows.append([r.recipe, _fmt(r.final_train_loss, ".3f"), val, _fmt(gap_percent(r, ref), "+.1f"),
                     str(r.skipped_steps), _fmt(r.final_loss_scale, "g"), _fmt(r.tokens_per_s, ",.0f"),
                     mem, _fmt(r.activation_bytes / 2**20, ".1f")])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    legend = ("train/val: final loss in nats/char on fixed batches of each split; gap%: val loss vs fp32 "
              "(negative = lower); nan@N: diverged at step N;\nscale: final loss scale; B/param: bytes per "
              "parameter of weights+grads+master copy+optimizer state(+extra state); act MB: saved activations of one step")
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows] + [legend])


def plot_curves(results: list[RunResult], path: Path) -> None:
    """Save training-loss curves (thin) and validation points (markers) of every recipe."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(results):
        steps = [h["step"] for h in r.history]
        losses = [h["loss"] for h in r.history]
        label = r.recipe + (f" (diverged at step {r.diverged_at})" if r.diverged_at is not None else "")
        (line,) = ax.plot(steps, losses, lw=0.9, alpha=0.85, label=label, color=colors[i % len(colors)],
                          linestyle=("-", "--", ":")[(i // len(colors)) % 3])
        val = [(h["step"], h["val_loss"]) for h in r.history if "val_loss" in h]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char); dots: validation")
    ax.set_ylim(top=4.0)
    ax.set_title("mpcourse compare: one model, every precision recipe")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def yours(name: str) -> str:
    """The row name of recipe ``name`` trained with a learner's functions."""
    return f"{name} [yours]"


def train_with_learner(name: str, corpus: Corpus, cfg: TrainConfig, functions: dict, *, progress: bool = False,
                       echo=print) -> RunResult | None:
    """Recipe ``name`` trained with those of ``functions`` it accepts, as the row ``"name [yours]"``.

    Returns None, after one line through ``echo``, when the recipe accepts none of them or when one of
    them fails (it raised, e.g. NotImplementedError, or returned something the library cannot use): the
    line names the function and why, never a traceback from inside the training step.
    """
    recipe_cls = get_recipe(name)
    overrides = overrides_for(recipe_cls, functions)
    if not overrides:
        accepted = ", ".join(recipe_cls.OVERRIDABLE) or "none"
        echo(f"{name}: cannot use any of {', '.join(sorted(functions)) or 'no functions'} "
             f"(it accepts: {accepted})")
        return None
    try:
        return train(name, corpus, cfg, progress=progress, overrides=overrides, label=yours(name))
    except (OverrideError, SeamError) as e:
        echo(f"{yours(name)}: {e}")
    except (TypeError, ValueError) as e:                  # a library check on what a function returned
        echo(f"{yours(name)}: {', '.join(overrides)}: {e}")
    return None


def run_compare(recipes: list[str], corpus: Corpus, cfg: TrainConfig, out: Path, *,
                progress: bool = True, echo=print, learner: dict | None = None) -> list[RunResult]:
    """Train every recipe in ``recipes`` on ``corpus``; print the table; write JSON and plot to ``out``.

    ``learner``: functions loaded from exercise notebooks (``mpcourse.experiment.learner``); each recipe
    that accepts some of them gets a second row, ``"name [yours]"``, trained with them.
    """
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in recipes:
        results.append(train(name, corpus, cfg, progress=progress))
        if learner:
            mine = train_with_learner(name, corpus, cfg, learner, progress=progress, echo=echo)
            if mine is not None:
                results.append(mine)
    echo(format_table(results))
    write_outputs(results, corpus, cfg, out)
    return results


def write_outputs(results: list[RunResult], corpus: Corpus, cfg: TrainConfig, out: Path, extra: dict | None = None) -> None:
    """Write ``out/results.json`` (config, ``extra`` keys, one object per recipe) and ``out/loss_curves.png``."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"corpus": corpus.name, "unigram_entropy": corpus.unigram_entropy(),
               "config": {"steps": cfg.steps, "batch_size": cfg.batch_size, "seed": cfg.seed,
                          "block_size": cfg.model.block_size, "n_layer": cfg.model.n_layer,
                          "n_embd": cfg.model.n_embd, "n_head": cfg.model.n_head, "lr": cfg.optim.lr},
               **(extra or {}),
               "results": [r.to_dict() for r in results]}
    (out / "results.json").write_text(json.dumps(payload, indent=1, allow_nan=True))
    plot_curves(results, out / "loss_curves.png")
