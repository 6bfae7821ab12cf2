"""What a compare job writes into its folder: ``results.json`` (config, extra keys, environment, one object per
run) and ``loss_curves.png`` (``plot``). An interrupted run whose folder already holds a ``results.json`` writes
``results.partial.json`` and ``loss_curves.partial.png`` beside it instead (``PARTIAL_FILES``), so that the
earlier run's files stay until a run completes (``mpcourse.experiment.compare.run``).

``results.json`` is strict JSON (RFC 8259 has no NaN or Infinity): a non-finite number is written
as ``null`` and named, with its value, in the enclosing object's ``"nonfinite"`` field (for example
``{"loss": null, "nonfinite": {"loss": "nan"}}``); a diverged run also says where in ``"null_reason"``.
The file records what produced it: torch version, device, tensor-core emulation per dtype, the quantizers' kernels
(``kernels``: "numba", "torch" or "rules"; ``mpcourse.core.quant.kernels.in_use``: the same bits, not the same
temporaries, so the FP8/MX/NVFP4 rows' peak bytes depend on it).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..gpt.data import Corpus
from ..training.train import RunResult, TrainConfig
from .plot import plot_curves
from .spikes import peak_after, spike_reports


#: (results, plot): the files of a run, and of an interrupted run written beside an earlier one's
OUT_FILES = ("results.json", "loss_curves.png")
PARTIAL_FILES = ("results.partial.json", "loss_curves.partial.png")


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
    from mpcourse.core.quant import kernels

    from ..measure import machine
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": device,
            "emulation": {str(dt).replace("torch.", ""): {"emulated": emulation.emulation_enabled(dt),
                                                         "cpu_has_native_units": emulation.cpu_has_native(dt)}
                          for dt in emulation.LOW_PRECISION},
            "emulation_summary": emulation.status(),
            "kernels": kernels.in_use(),
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


def write_outputs(results: list[RunResult], corpus: Corpus, cfg: TrainConfig, out: Path, extra: dict | None = None,
                  seeds: list[int] | None = None, plot_results: list[RunResult] | None = None,
                  files: tuple[str, str] = OUT_FILES) -> Path:
    """Write ``out/results.json`` (strict JSON: config, ``extra`` keys, environment, one object per
    run) and ``out/loss_curves.png`` (``plot_results``, default all ``results``); ``files``: other names for the
    two (``PARTIAL_FILES``). Returns the results file's path."""
    out.mkdir(parents=True, exist_ok=True)
    payload = results_payload(results, corpus, cfg, extra, seeds)
    (out / files[0]).write_text(json.dumps(payload, indent=1, allow_nan=False))
    plot_curves(plot_results if plot_results is not None else results, out / files[1])
    return out / files[0]
