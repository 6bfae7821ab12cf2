"""The comparison table as monospaced text: one row per recipe for one seed (``format_table``), mean +- std over
seeds (``format_seed_table``), with its legend; and the seed table's numbers as data (``seed_summary``, for
``results.json``).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping

from ..measure.spikes import SPIKE_MIN_JUMP, SpikeReport
from ..training.train import RunResult
from .peaks import peak_for_row
from .spikes import spike_reports


def gap_percent(result: RunResult, reference: RunResult | None) -> float | None:
    """Relative gap of the final validation loss to the reference's, in percent (positive: worse)."""
    if reference is None or not math.isfinite(reference.final_val_loss):
        return None
    return 100.0 * (result.final_val_loss - reference.final_val_loss) / reference.final_val_loss


def reference_of(recipe: str) -> str:
    """The row a row's gap% is taken against: a mixture-of-experts row's ``moe-fp32`` (the same MoE model in FP32),
    every other row's ``fp32``."""
    return "moe-fp32" if recipe.startswith("moe-") else "fp32"


def gap_to_reference(result: RunResult, rows: Mapping[str, RunResult]) -> float | None:
    """``gap_percent`` of ``result`` against its reference row among ``rows`` (name -> result; None if absent)."""
    return gap_percent(result, rows.get(reference_of(result.recipe)))


def _fmt(x, spec):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf"
    return format(x, spec)


def _spike_cell(s: SpikeReport) -> str:
    return f"x{s.jump:.2f}@{s.jump_step}" if s.spiked else "-"


def _bytes_cell(b: dict) -> str:
    total = sum(b.get(k, 0) for k in ("weights", "grads", "master", "optimizer", "extra"))
    parts = [b.get(k, 0) for k in ("weights", "grads", "master", "optimizer")]
    if b.get("extra"):
        parts.append(b["extra"])
    return "+".join(f"{p:.3g}" for p in parts) + f"={total:.3g}"


def _mb(r: RunResult, key: str) -> str:
    return _fmt(r.memory.get(key, 0) / 2**20, ".2f") if r.memory else "-"


def _peak_pct(r: RunResult, peak_flops, clamped: list[str]) -> str:
    """The %peak cell of ``r`` against its peak (``peaks.peak_for_row``); a row above it is clamped to ``100.0*``
    and its name appended to ``clamped`` (``speed.percent_of_peak``)."""
    from ..measure.speed import percent_of_peak

    peak = peak_for_row(r.recipe, peak_flops)
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
          "(a moe- row: vs moe-fp32; negative = lower); nan@N: diverged at step N;\nspike: the largest loss spike, xSIZE@STEP (a training "
          f"loss over {1 + SPIKE_MIN_JUMP:g}x the expected one: the median of the runs on that batch, times the run's "
          "recent ratio to it; -: none); scale: final loss scale; B/param: bytes per "
          "parameter of weights+grads+master copy+optimizer state(+extra state); act MB: tensors saved for "
          "backward in one step (FP8 weight copies included);\npeak MB: most bytes alive during one step, state "
          "included; %peak: model FLOP/s over the machine's peak FLOP/s for the dtype the row's GEMMs run in")


def expert_load_note(results: list[RunResult]) -> str:
    """One line per MoE row, from the ``tokens_per_expert`` of its history (per step, per block, per expert): the
    tokens an expert receives per step on average (balanced: every expert that), the busiest expert of a block on
    average over the blocks and steps, and how often a block left an expert without a token ("" if no MoE row)."""
    lines = []
    for r in results:
        blocks = [block for h in r.history for block in h.get("tokens_per_expert", [])]
        if blocks:
            mean = sum(map(sum, blocks)) / sum(map(len, blocks))
            busiest = sum(map(max, blocks)) / len(blocks)
            empty = sum(min(b) == 0 for b in blocks) / len(blocks)
            lines.append(f"{r.recipe}: tokens per expert per step {mean:,.0f} on average, the busiest expert of a "
                         f"block {busiest:,.0f}; a block left an expert without a token in {empty:.0%} of steps")
    return "\n".join(lines)


def _layout(head, rows, legend):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows] + [legend])


def format_table(results: list[RunResult], *, peak_flops: float | Mapping[str, float] | None = None) -> str:
    """The comparison table as monospaced text (one row per recipe; the runs of one seed). ``peak_flops``: the
    peak for %peak, one number for every row or a mapping row name -> FLOP/s (``speed.row_peaks``); a row above
    its peak prints ``100.0*`` and a note names it."""
    by_name = {r.recipe: r for r in results}
    head = ["recipe", "train", "val", "gap%", "spike", "skipped", "scale", "tok/s", "%peak",
            "B/param w+g+m+o=total", "act MB", "peak MB"]
    rows, clamped = [], []
    for r, spikes in zip(results, spike_reports(results)):
        val = _fmt(r.final_val_loss, ".3f")
        if r.diverged_at is not None:
            val = f"nan@{r.diverged_at}"
        rows.append([r.recipe, _fmt(r.final_train_loss, ".3f"), val, _fmt(gap_to_reference(r, by_name), "+.1f"),
                     _spike_cell(spikes), str(r.skipped_steps), _fmt(r.final_loss_scale, "g"), _fmt(r.tokens_per_s, ",.0f"),
                     _peak_pct(r, peak_flops, clamped), _bytes_cell(r.bytes_per_param),
                     _fmt(r.activation_bytes / 2**20, ".2f"), _mb(r, "peak")])
    load = expert_load_note(results)
    return _layout(head, rows, LEGEND + _clamp_note(clamped) + (f"\n{load}" if load else ""))


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
        gaps = [gap_to_reference(by[s][n], by[s]) for s in have]
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
    legend = (f"mean+-std over seeds {','.join(map(str, seeds))} (gap%: per seed against that seed's fp32 run, moe-fp32 for a moe- row); "
              "spikes, skipped: per seed\n" + LEGEND + _clamp_note(clamped))
    load = expert_load_note(runs[seeds[0]])
    return _layout(head, rows, legend + (f"\n{load} (seed {seeds[0]})" if load else ""))


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
                  "gap_percent": _stat([gap_to_reference(by[s][n], by[s]) for s in have]),
                  "tokens_per_s": statistics.mean(r.tokens_per_s for r in rs),
                  "diverged_at": [r.diverged_at for r in rs]}
    return out
