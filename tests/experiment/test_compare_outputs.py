"""What ``mpcourse compare`` writes: strict JSON, the environment, the spike flag, a readable plot.

Built from hand-made ``RunResult`` histories (a spike, a divergence), so each case is known.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mpcourse.experiment.compare.outputs import results_payload, strict_json
from mpcourse.experiment.compare.plot import family, plot_curves
from mpcourse.experiment.compare.report import format_seed_table, format_table
from mpcourse.experiment.compare.spikes import peak_after, spike_reports
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.training.train import RunResult, TrainConfig


def reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def run(name, losses, diverged_at=None):
    hist = [{"step": i, "loss": l, "skipped": False, "loss_scale": None} for i, l in enumerate(losses)]
    if diverged_at is None:
        hist[-1]["val_loss"] = losses[-1] * 0.9
    final = losses[-1] if diverged_at is None else math.nan
    fields = {f.name for f in dataclasses.fields(RunResult)}
    values = dict(recipe=name, description="", final_train_loss=final,
                  final_val_loss=final * 0.9 if diverged_at is None else math.nan, skipped_steps=0,
                  final_loss_scale=None, tokens_per_s=1000.0,
                  bytes_per_param={"weights": 4, "grads": 4, "master": 0, "optimizer": 8},
                  activation_bytes=1024, memory={}, flops_per_token=1.0, steps_run=len(losses),
                  diverged_at=diverged_at, history=hist)
    return RunResult(**{k: v for k, v in values.items() if k in fields})


SMOOTH = [4.6 - 0.04 * i for i in range(50)]                       # 4.6 -> 2.64, steady
SPIKY = SMOOTH[:30] + [5.4] + SMOOTH[31:]                            # one spike at step 30


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def test_peak_after_warm_up():
    assert peak_after(run("a", SMOOTH), 20) == (pytest.approx(SMOOTH[20]), 20)
    assert peak_after(run("b", SPIKY), 20) == (5.4, 30)
    assert peak_after(run("e", SMOOTH), 0) == (SMOOTH[0], 0)       # the untrained first steps are warm-up
    assert peak_after(run("f", [4.6, math.nan], diverged_at=1), 5) == (None, None)


def test_spikes_are_judged_per_seed_against_that_seeds_runs():
    """Three runs of seed 0 make a consensus; seed 1's two runs are judged on their own."""
    runs = [run("fp32", SMOOTH), run("fp16-master", SMOOTH), run("fp8-delayed", SPIKY),
            run("fp32", SMOOTH), run("fp8-delayed", SPIKY)]
    reports = spike_reports(runs, [0, 0, 0, 1, 1])
    assert [r.against for r in reports] == ["consensus"] * 3 + ["itself"] * 2
    assert [r.spike_steps for r in reports] == [[], [], [30], [], [30]]


def test_table_shows_the_spike():
    text = format_table([run("fp32", SMOOTH), run("fp8-delayed", SPIKY)])
    rows = {line.split()[0]: line for line in text.splitlines()[2:4]}
    assert "x1.49@30" in rows["fp8-delayed"] and "@" not in rows["fp32"]
    assert "spike" in text.splitlines()[0]
    seeds = format_seed_table({0: [run("fp32", SMOOTH), run("fp8-delayed", SPIKY)],
                               1: [run("fp32", SMOOTH), run("fp8-delayed", SMOOTH)]})
    rows = {line.split()[0]: line for line in seeds.splitlines()[2:4]}
    assert "x1.49@30/-" in rows["fp8-delayed"] and "-/-" in rows["fp32"]


def test_results_json_is_strict_and_says_why(corpus, tmp_path):
    cfg = TrainConfig(steps=50)
    results = [run("fp32", SMOOTH), run("fp16-pure", [4.6, math.nan], diverged_at=1), run("fp8-delayed", SPIKY)]
    text = json.dumps(results_payload(results, corpus, cfg), allow_nan=False)   # raises on NaN
    data = json.loads(text, parse_constant=reject)
    pure = data["results"][1]
    assert pure["final_val_loss"] is None and pure["nonfinite"]["final_val_loss"] == "nan"
    assert "step 1" in pure["null_reason"]
    assert pure["history"][1]["loss"] is None and pure["history"][1]["nonfinite"] == {"loss": "nan"}
    assert data["results"][2]["loss_spiked"] is True and data["results"][0]["loss_spiked"] is False
    assert data["results"][2]["spikes"]["spike_steps"] == [30] and data["results"][2]["peak_loss"] == 5.4
    assert data["results"][1]["spikes"]["jump"] is None                 # diverged at step 1: nothing to judge
    env = data["environment"]
    import torch
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert set(env["emulation"]) == {"bfloat16", "float16"}
    assert all(isinstance(v["emulated"], bool) for v in env["emulation"].values())


def test_strict_json_names_each_kind():
    assert strict_json({"a": math.inf, "b": -math.inf, "c": [1.0, math.nan], "d": 2.0}) == \
        {"a": None, "b": None, "c": [1.0, None], "d": 2.0, "nonfinite": {"a": "inf", "b": "-inf"}}


def test_families_and_plot(tmp_path):
    assert [family(n) for n in ("fp32", "torch-amp-fp16", "fp16-static", "bf16-pure-sr", "fp8-delayed")] == \
        ["fp32", "torch.amp", "fp16", "bf16", "fp8"]
    results = [run("fp32", SMOOTH), run("torch-amp-fp16", SMOOTH), run("fp16-pure", [4.6, math.nan], 1),
               run("fp16-master", SMOOTH), run("bf16-pure", SMOOTH), run("fp8-delayed", SPIKY)]
    path = tmp_path / "loss_curves.png"
    plot_curves(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_curves([run("fp32", SMOOTH)], tmp_path / "one.png")          # fp32 alone still plots


# -- %peak: per GEMM dtype, measured robustly, never printed above 100 -------------------------------------------

def _peak_cells(text):
    head = text.splitlines()[0].split()
    i = head.index("%peak")
    return {line.split()[0]: line.split()[i] for line in text.splitlines()[2:] if line and not line.startswith("-")
            and line.split()[0] in ("fp32", "bf16-pure", "fp8-delayed")}


def test_percent_of_peak_is_per_row_and_never_above_100():
    """Each row against its own peak (a mapping row -> FLOP/s); a row faster than its peak prints 100.0* and a
    note naming it, never a number above 100. The hand-made runs reach 1000 x 1.0 = 1000 model FLOP/s."""
    rows = [run("fp32", SMOOTH), run("bf16-pure", SMOOTH)]
    text = format_table(rows, peak_flops={"fp32": 4000.0, "bf16-pure": 800.0})
    assert _peak_cells(text) == {"fp32": "25.0", "bf16-pure": "100.0*"}
    note = [ln for ln in text.splitlines() if ln.startswith("*")]
    assert len(note) == 1 and "bf16-pure" in note[0] and "fp32" not in note[0], text
    assert _peak_cells(format_table(rows, peak_flops={"fp32": 1000.0, "bf16-pure": 1000.0})) == \
        {"fp32": "100.0", "bf16-pure": "100.0"}                         # exactly the peak: no clamp, no note
    text = format_table(rows, peak_flops=500.0)                           # one peak for every row (older files)
    assert _peak_cells(text) == {"fp32": "100.0*", "bf16-pure": "100.0*"}
    seeds = format_seed_table({0: rows, 1: [run("fp32", SMOOTH), run("bf16-pure", SMOOTH)]},
                              {"fp32": 2000.0, "bf16-pure": 999.0})
    assert _peak_cells(seeds) == {"fp32": "50.0", "bf16-pure": "100.0*"}
    assert all(float(c.rstrip("*")) <= 100 for t in (text, seeds) for c in _peak_cells(t).values())


def test_peak_key_rule():
    """Which peak a row is measured against: on a CPU its GEMM dtype where that dtype's GEMMs run on native units,
    FP32 where they are emulated (FP32 GEMMs plus one rounding) and for FP8/MX/NVFP4 (computed as FP32 GEMMs of
    the upcast codes on a CPU); on a GPU the FP8 tensor-core peak for quantized rows, the BF16 one otherwise."""
    from mpcourse.experiment.measure.speed import peak_key

    native = {"bf16": True, "fp16": True}
    emulated = {"bf16": True, "fp16": False}            # emulated[dtype]: True where the emulation computes it
    assert [peak_key(d, "cpu", {"bf16": False, "fp16": False}) for d in ("fp32", "bf16", "fp16", "fp8")] == \
        ["fp32", "bf16", "fp16", "fp32"]
    assert [peak_key(d, "cpu", native) for d in ("fp32", "bf16", "fp16", "fp8")] == ["fp32"] * 4
    assert [peak_key(d, "cpu", emulated) for d in ("fp32", "bf16", "fp16", "fp8")] == ["fp32", "fp32", "fp16", "fp32"]
    assert [peak_key(d, "cuda", native) for d in ("fp32", "bf16", "fp16", "fp8")] == ["bf16", "bf16", "bf16", "fp8"]
    with pytest.raises(ValueError, match="gemm dtype"):
        peak_key("int4", "cpu", native)


def test_gemm_peak_is_the_best_of_several_timings_in_its_dtype(monkeypatch):
    """The peak is 2 n^3 over the shortest of ``repeats`` timed GEMMs (after a warm-up), in the dtype asked for:
    a slow timing (a busy machine) never lowers it. A fake clock gives known intervals; a dispatch mode sees the
    GEMMs' operand dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mpcourse.experiment.measure import speed

    intervals = [0.5, 0.25, 0.9, 0.2, 0.3, 0.4, 0.35, 0.6]
    ticks = iter([t for d in intervals for t in (0.0, d)])
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("mm"):
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    import torch
    with Record():
        flops = speed.measure_gemm_peak("bf16", n=8, repeats=len(intervals), clock=lambda: next(ticks))
    assert flops == 2 * 8 ** 3 / 0.2
    assert seen and set(seen) == {torch.bfloat16} and len(seen) > len(intervals)      # warm-up, then the timings
    assert speed.measure_gemm_peak("fp32", n=64, repeats=3) > 0


def _gemm_flops_by_dtype(name, corpus):
    """FLOPs of every matmul in one forward and backward of recipe ``name`` on a small GPT, by operand dtype,
    recorded by a dispatch mode below the recipe's own regions (autocast, FP8 autocast), emulation off."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from mpcourse.core import emulation
    from mpcourse.experiment.gpt.model import GPT, GPTConfig
    from mpcourse.experiment.recipes import OptimConfig, get_recipe

    flops: dict = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = func.__name__.split(".")[0]
            if op in ("mm", "addmm", "bmm", "baddbmm"):
                a, b = (args[1], args[2]) if op in ("addmm", "baddbmm") else (args[0], args[1])
                n = 2 * a.numel() * b.shape[-1]
                flops[a.dtype] = flops.get(a.dtype, 0) + n
            return out

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=128, vocab_size=corpus.vocab_size))
    recipe = get_recipe(name)(model, OptimConfig())
    x, y = corpus.batch("train", 8, 16, torch.Generator().manual_seed(0))   # 8 x 16 = 128 tokens: every block fits
    emulation.set_emulation(False)
    try:
        with Record():
            with recipe.forward_context():
                _, loss = recipe.model(x, y)
            recipe.backward(loss)
    finally:
        emulation.set_emulation(None)
    return flops


@pytest.mark.parametrize("name", sorted(__import__("mpcourse.experiment.recipes", fromlist=["RECIPES"]).RECIPES))
def test_each_recipes_declared_gemm_dtype_is_what_its_gemms_compute_in(name, corpus):
    """The oracle for ``gemm_dtype``: the dtype most of a step's matmul FLOPs run in (native kernels) is the one the
    recipe declares, as a CPU with native units for every dtype would key its peak (FP8 rows: FP32 GEMMs here)."""
    import torch

    from mpcourse.experiment.recipes import get_recipe
    from mpcourse.experiment.measure.speed import peak_key

    flops = _gemm_flops_by_dtype(name, corpus)
    most = max(flops, key=flops.get)
    want = peak_key(get_recipe(name).gemm_dtype, "cpu", {"bf16": False, "fp16": False})
    assert {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[most] == want, (name, flops)


def test_a_row_above_its_peak_has_the_peak_measured_again(corpus, tmp_path):
    """run_compare: a row faster than its peak makes it measure that dtype's peak again (the better of the two
    counts); a row below its peak measures nothing; a row still above after that prints 100.0* with the note."""
    from mpcourse.experiment.compare.run import Execution, Measurement, run_compare
    from mpcourse.experiment.gpt.model import GPTConfig

    cfg = TrainConfig(steps=2, batch_size=4, eval_interval=2, eval_batches=1,
                      model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    for start, again, cell in [(1.0, 1e30, "0.0"), (1.0, 2.0, "100.0*"), (1e30, None, "0.0")]:
        calls, lines = [], []

        def remeasure(key, again=again):
            calls.append(key)
            return again
        run_compare(["fp32"], corpus, cfg, tmp_path, execution=Execution(progress=False, echo=lines.append),
                    measurement=Measurement(peak_flops={"fp32": start}, remeasure_peak=remeasure))
        assert calls == ([] if again is None else ["fp32"])
        assert _peak_cells(lines[0]) == {"fp32": cell}
        assert ("*: ran faster than the peak" in lines[0]) == cell.endswith("*")
        stored = json.loads((tmp_path / "results.json").read_text())
        assert stored["peak_flops"] == {"fp32": max(start, again or 0)} == {"fp32": stored["row_peak_flops"]["fp32"]}
