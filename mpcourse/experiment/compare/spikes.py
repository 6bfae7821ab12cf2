"""Loss spikes of a compare job's runs: each run judged against the consensus of the runs of its seed (they all
trained on the same batches; the rule is ``mpcourse.experiment.measure.spikes``), and a run's highest loss after
the warm-up. The table's ``spike`` column, the plot's triangles and ``results.json``'s ``spikes`` come from here.
"""
from __future__ import annotations

from ..measure.spikes import SpikeReport, consensus, find_spikes, finite_losses
from ..training.train import RunResult


def spike_reports(results: list[RunResult], seeds: list[int] | None = None) -> list[SpikeReport]:
    """Each run's :class:`~mpcourse.experiment.measure.spikes.SpikeReport`, judged against the consensus of the runs
    of its seed (``seeds[i]`` is run i's; default: all one seed): they all trained on the same batches."""
    seeds = seeds if seeds is not None else [0] * len(results)
    groups: dict[int, list[list[dict]]] = {}
    for seed, r in zip(seeds, results):
        groups.setdefault(seed, []).append(r.history)
    expected = {seed: consensus(hs) for seed, hs in groups.items()}
    return [find_spikes(r.history, expected[seed]) for seed, r in zip(seeds, results)]


def peak_after(result: RunResult, warmup_steps: int) -> tuple[float | None, int | None]:
    """Highest finite training loss at or after ``warmup_steps``, and its step (None, None: none)."""
    losses = [(loss, step) for step, loss in finite_losses(result.history).items() if step >= warmup_steps]
    return max(losses) if losses else (None, None)
