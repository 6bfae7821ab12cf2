"""The peak FLOP/s each row of a compare job is measured against (%peak): one number for every row, or each
row against the peak of the dtype its GEMMs run in (``mpcourse.experiment.measure.speed.row_peaks``), measured
again when a row ran faster than it.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..training.train import RunResult, TrainConfig


def peak_for_row(name: str, peak_flops) -> float | None:
    """``peak_flops`` for row ``name``: one number for every row, or a mapping row name -> FLOP/s (None: unknown)."""
    if isinstance(peak_flops, Mapping):
        return peak_flops.get(name)
    return peak_flops


def settle_peaks(flat: list[tuple[int, RunResult]], peaks, cfg: TrainConfig, remeasure_peak) -> dict | float | None:
    """Each row's peak for %peak (``speed.row_peaks``; a single number stays one for every row). A row faster than
    its peak has that peak measured again with ``remeasure_peak(key)`` (where given), the better of the two kept
    in ``peaks``; a row still above it is clamped when the table is printed."""
    if not isinstance(peaks, dict):
        return peaks
    from ..measure.speed import emulated_dtypes, peak_key, row_peaks

    device, emulated = getattr(cfg, "device", "cpu"), emulated_dtypes()
    names = list(dict.fromkeys(r.recipe for _, r in flat))
    row_peak = row_peaks(names, peaks, device, emulated)
    if remeasure_peak is not None:
        from ..recipes import get_recipe
        over = {peak_key(get_recipe(r.recipe.removesuffix(" [yours]")).gemm_dtype, device, emulated)
                for _, r in flat if row_peak.get(r.recipe) and r.flops_per_token
                and r.tokens_per_s * r.flops_per_token > row_peak[r.recipe]}
        for key in sorted(over):
            peaks[key] = max(peaks[key], remeasure_peak(key))
        if over:
            row_peak = row_peaks(names, peaks, device, emulated)
    return row_peak
