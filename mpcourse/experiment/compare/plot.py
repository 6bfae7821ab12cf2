"""The loss curves of a compare job (``loss_curves.png``): one panel per recipe family, the FP32 run as the
reference in each, spikes and divergences marked.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..training.train import RunResult
from .spikes import spike_reports


def family(recipe: str) -> str:
    """The plot panel a recipe goes in: ``torch-amp-*`` (the oracle), else the part before the first dash."""
    return "torch.amp" if recipe.startswith("torch-amp") else recipe.split("-")[0]


def plot_curves(results: list[RunResult], path: Path) -> None:
    """Save one small panel per recipe family (fp16, bf16, fp8, ...): training loss per step on a
    log y-axis (so a spike or a climb is visible at any height), validation losses as dots, the
    fp32 run as a grey reference in every panel, a triangle on each spike of the table's ``spike``
    column (:func:`spike_reports`) and a cross where a run diverged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next((r for r in results if r.recipe == "fp32"), None)
    groups = _panels(results, ref)
    ncols = min(2, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 3.6 * nrows), sharex=True, sharey=True,
                             squeeze=False)
    lo, hi = _loss_range(results)
    ticks = _half_nat_ticks(lo, hi)
    spikes = {id(r): rep.spike_steps for r, rep in zip(results, spike_reports(results))}
    colors = plt.get_cmap("tab10").colors
    for ax, (fam, runs) in zip(axes.flat, groups.items()):
        _draw_panel(ax, fam, runs, ref, spikes, hi, ticks, colors)
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


def _panels(results: list[RunResult], ref: RunResult | None) -> dict[str, list[RunResult]]:
    """The runs of each panel (family), the reference left out; fp32 alone gets a panel of its own."""
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        if r is not ref:
            groups.setdefault(family(r.recipe), []).append(r)
    if not groups and ref is not None:
        groups["fp32"] = []
    return groups


def _loss_range(results: list[RunResult]) -> tuple[float, float]:
    """(lowest, highest) finite training or validation loss of any run; (1, 10) when there is none."""
    finite = [h[k] for r in results for h in r.history for k in ("loss", "val_loss")
              if k in h and math.isfinite(h[k])]
    return (min(finite), max(finite)) if finite else (1.0, 10.0)


def _half_nat_ticks(lo: float, hi: float) -> list[float]:
    """The y-axis labels: every half nat in the plotted range, at most about 12 of them."""
    ticks = [t / 2 for t in range(1, 200) if lo * 0.95 <= t / 2 <= hi * 1.08] or [lo, hi]
    if len(ticks) > 12:                                   # a run that went far up: fewer labels
        ticks = ticks[::math.ceil(len(ticks) / 12)]
    return ticks


def _draw_panel(ax, fam: str, runs: list[RunResult], ref: RunResult | None, spikes: dict, hi: float,
                ticks: list[float], colors) -> None:
    """One family's panel: the fp32 reference in grey, each run in its own colour and line style, log y-axis."""
    import matplotlib.ticker

    styles = ["-", "--", "-.", ":"]
    if ref is not None:
        _draw_run(ax, ref, spikes[id(ref)], hi, color="0.55", lw=1.6, label="fp32 (reference)")
    for i, r in enumerate(runs):
        label = r.recipe + (f" (diverged at step {r.diverged_at})" if r.diverged_at is not None else "")
        _draw_run(ax, r, spikes[id(r)], hi, color=colors[i % len(colors)], ls=styles[i % len(styles)], lw=1.1,
                  label=label)
    ax.set_title(fam, fontsize=10)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))     # labelled every half nat
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")


def _draw_run(ax, r: RunResult, spike_steps, top: float, **kw):
    """One run's training loss line, its validation losses as dots, its spikes as triangles and, where it
    diverged, a cross at the top of the panel (``top``)."""
    steps = [h["step"] for h in r.history]
    losses = [h["loss"] if math.isfinite(h["loss"]) else math.nan for h in r.history]
    (line,) = ax.plot(steps, losses, **kw)
    val = [(h["step"], h["val_loss"]) for h in r.history if "val_loss" in h and math.isfinite(h["val_loss"])]
    if val:
        ax.plot(*zip(*val), "o", color=line.get_color(), ms=4)
    at = [(s, loss) for s, loss in zip(steps, losses) if s in spike_steps]
    if at:
        ax.plot(*zip(*at), "^", color=line.get_color(), ms=8, mec="black", mew=0.6)
    if r.diverged_at is not None:
        ax.plot([r.diverged_at], [top], "x", color=line.get_color(), ms=9, mew=2, clip_on=False)
    return line
