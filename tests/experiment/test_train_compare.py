"""The training loop, the recipe registry and `mpcourse compare` end to end (small runs)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from mpcourse.core.emulation import emulation_enabled
from mpcourse.experiment.compare.report import format_table, gap_percent
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import NOT_IN_DEFAULT_RUN, RECIPES, get_recipe
from mpcourse.experiment.training.train import TrainConfig, train

SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


# 1x128 / 128x128 blocks need widths and token counts in multiples of 128 (4 x 32 tokens, width 128)
BLOCK_SCALED = ("fp8-block", "mxfp8", "mxfp8-floor", "nvfp4", "moe-fp8-block", "moe-mxfp8")
SMALL_BLOCKS = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=128)


def small(steps=6, recipe=None, **kw):
    model = SMALL_BLOCKS if recipe in BLOCK_SCALED else SMALL
    return TrainConfig(steps=steps, batch_size=4, eval_interval=3, eval_batches=2, model=model, **kw)


def test_registry_has_the_anchor_recipes_in_order():
    assert list(RECIPES)[:4] == ["fp32", "torch-amp-bf16", "torch-amp-fp16", "fp16-pure"]
    assert all(cls.description for cls in RECIPES.values())
    with pytest.raises(KeyError, match="known recipes"):
        get_recipe("fp7")


def test_same_seed_same_bits_and_other_seed_differs(corpus):
    a = train("fp32", corpus, small(), progress=False)
    b = train("fp32", corpus, small(), progress=False)
    c = train("fp32", corpus, small(seed=1), progress=False)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert a.final_val_loss == b.final_val_loss
    assert [h["loss"] for h in a.history] != [h["loss"] for h in c.history]


def test_fp32_bytes_per_param_is_4_4_0_8(corpus):
    r = train("fp32", corpus, small(2), progress=False)
    assert r.bytes_per_param == {"weights": 4, "master": 0, "grads": 4, "optimizer": 8, "extra": 0}
    assert r.activation_bytes > 0 and r.tokens_per_s > 0


def test_fp16_pure_breaks_visibly(corpus):
    r = train("fp16-pure", corpus, small(), progress=False)
    # AdamW in FP16: eps 1e-8 is 0 and small g**2 underflows, so m / (sqrt(v) + eps) = 0/0 = NaN.
    assert r.bytes_per_param["weights"] == 2 and r.bytes_per_param["optimizer"] == 4
    assert r.diverged_at is not None and math.isnan(r.final_val_loss)
    assert r.steps_run == r.diverged_at + 1


def test_torch_amp_fp16_reports_scale_and_skips(corpus):
    r = train("torch-amp-fp16", corpus, small(), progress=False)
    scales = [h["loss_scale"] for h in r.history]
    assert scales[0] == 65536.0
    # GradScaler halves the scale exactly on skipped steps; the record must agree with it.
    for h, nxt in zip(r.history, r.history[1:]):
        assert h["skipped"] == (nxt["loss_scale"] < h["loss_scale"])
    assert r.skipped_steps == sum(h["skipped"] for h in r.history)


def test_autocast_anchor_keeps_fp32_weights(corpus):
    r = train("torch-amp-bf16", corpus, small(3), progress=False)
    assert r.bytes_per_param["weights"] == 4 and math.isfinite(r.final_val_loss)


def test_table_and_gap(corpus):
    a = train("fp32", corpus, small(2), progress=False)
    b = train("fp16-pure", corpus, small(2), progress=False)
    assert gap_percent(a, a) == 0.0
    text = format_table([a, b])
    assert "fp32" in text.splitlines()[2] and "nan@" in text.splitlines()[3]


def test_a_moe_rows_gap_is_against_moe_fp32_and_a_dense_rows_against_fp32():
    """The gap column, the seed table and results.json's seed summary take a moe- row's gap against moe-fp32 (the
    same model), a dense row's against fp32, per seed; a row whose reference did not run has none."""
    import dataclasses

    from mpcourse.experiment.compare.report import format_seed_table, seed_summary
    from mpcourse.experiment.training.train import RunResult
    base = RunResult(recipe="fp32", description="", final_train_loss=2.0, final_val_loss=2.0, skipped_steps=0,
                     final_loss_scale=None, tokens_per_s=1.0, bytes_per_param={}, activation_bytes=0, memory={},
                     flops_per_token=1.0, steps_run=1, diverged_at=None)
    row = lambda name, val: dataclasses.replace(base, recipe=name, final_val_loss=val)   # noqa: E731
    runs = {0: [row("fp32", 2.0), row("fp8-current", 2.2), row("moe-fp32", 4.0), row("moe-fp8-block", 4.2)],
            1: [row("fp32", 2.5), row("fp8-current", 2.5), row("moe-fp32", 5.0), row("moe-fp8-block", 5.0)]}
    summary = seed_summary(runs)
    assert summary["fp8-current"]["gap_percent"]["mean"] == pytest.approx(5.0)      # (10% + 0%) / 2
    assert summary["moe-fp8-block"]["gap_percent"]["mean"] == pytest.approx(2.5)    # (5% + 0%) / 2
    assert summary["moe-fp32"]["gap_percent"]["mean"] == 0.0
    lines = {ln.split()[0]: ln for ln in format_table(runs[0]).splitlines()[2:6]}
    assert "+10.0" in lines["fp8-current"] and "+5.0" in lines["moe-fp8-block"]
    assert "+2.5+-3.5" in format_seed_table(runs)
    alone = format_table([row("moe-fp8-block", 4.2), row("fp32", 2.0)]).splitlines()[2]
    assert alone.split()[3] == "-"                                                   # no moe-fp32: no gap


@pytest.mark.slow
def test_cli_compare_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "compare", "--recipes", "fp32,torch-amp-bf16",
                           "--steps", "2", "--batch-size", "2", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch-amp-bf16" in proc.stdout and "gap%" in proc.stdout
    def reject(name):
        raise ValueError(f"results.json is not strict JSON: {name}")
    data = json.loads((out / "results.json").read_text(), parse_constant=reject)
    assert data["environment"]["torch"] and "emulation" in data["environment"]
    keys = {"final_train_loss", "final_val_loss", "skipped_steps", "final_loss_scale", "tokens_per_s",
            "bytes_per_param", "activation_bytes", "history"}
    assert [r["recipe"] for r in data["results"]] == ["fp32", "torch-amp-bf16"]
    assert all(keys <= set(r) for r in data["results"])
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,msg", [
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--recipes", "fp32,nope"], "unknown recipe"),
    (["--steps", "0"], "positive integer"),
])
@pytest.mark.slow
def test_cli_errors_name_the_fix(args, msg):
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "compare", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and msg in proc.stderr


@pytest.mark.slow
def test_cli_lists_recipes():
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "recipes"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert all(name in proc.stdout for name in RECIPES)
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert NOT_IN_DEFAULT_RUN and set(lines) == set(RECIPES)
    for name, line in lines.items():     # a plain compare's recipes unmarked, the others marked
        assert ("not in the default run" in line) == (name in NOT_IN_DEFAULT_RUN), line


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_checkpoint_resumes_bit_for_bit(recipe, corpus, tmp_path):
    """Every registered recipe: 3 steps, save (Trainer.save: torch.save with a checksum), load into a fresh Trainer,
    3 more steps == 6 uninterrupted steps, bit for bit (losses, scales, every parameter)."""
    from mpcourse.experiment.training.train import Trainer

    cfg = small(6, recipe)
    straight = Trainer(recipe, corpus, cfg).run()
    first = Trainer(recipe, corpus, cfg).run(3)
    first.save(tmp_path / "ckpt.pt")                         # torch.save behind a SHA-256 header
    torch.manual_seed(123)                                   # disturb global RNG: the checkpoint restores it
    resumed = Trainer(recipe, corpus, cfg)
    resumed.load(tmp_path / "ckpt.pt")                       # verified, then torch.load(weights_only=True)
    resumed.run()
    nan_safe = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else v
    strip = lambda hist: [{k: nan_safe(v) for k, v in h.items()} for h in hist]
    assert strip(resumed.history) == strip(straight.history)
    for (name, a), b in zip(straight.recipe.model.state_dict().items(), resumed.recipe.model.state_dict().values()):
        if isinstance(a, torch.Tensor):
            if a.dtype.itemsize == 1 and a.is_floating_point():       # FP8 weights: compare their bits
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), name


def test_checkpoint_from_another_recipe_is_refused(corpus):
    from mpcourse.experiment.training.train import Trainer

    sd = Trainer("fp32", corpus, small(1)).state_dict()
    with pytest.raises(ValueError, match="from recipe 'fp32'"):
        Trainer("fp16-pure", corpus, small(1)).load_state_dict(sd)


def test_run_enters_emulation_once_and_hooks_see_inside_the_step(corpus, monkeypatch):
    import contextlib

    from mpcourse.experiment.training import train as train_mod
    from mpcourse.experiment.training.train import Trainer
    entered, real = [], train_mod.tensor_cores

    @contextlib.contextmanager
    def counting(*args, **kwargs):
        entered.append(kwargs.get("fast", False))
        with real(*args, **kwargs):
            yield
    monkeypatch.setattr(train_mod, "tensor_cores", counting)
    t = Trainer("fp16-dynamic", corpus, small(steps=4))
    before = len(entered)                                  # building the recipe: once
    seen = []
    t.train_step(after_backward=lambda step, r: seen.append(("grads", step, all(
                     p.grad is not None for p in r.model.parameters()))),
                 after_step=lambda step, r, res: seen.append(("result", step, res.loss_scale)))
    assert seen == [("grads", 0, True), ("result", 0, 2.0**16)]
    assert len(entered) == before + 1                      # a lone step enters it itself
    assert t.needs_emulation is emulation_enabled(torch.float16)   # FP16 matmuls: emulated where the CPU lacks units
    t.run()                                                # the other three steps and their evaluations
    assert len(entered) == before + (4 if t.needs_emulation else 1) and t.step == 4
    assert all(entered)                                    # the training loop takes the emulation's fast path
    ref = Trainer("fp16-dynamic", corpus, small(steps=4)).run()
    assert [h["loss"] for h in t.history] == [h["loss"] for h in ref.history]   # hooks that only look change nothing


@pytest.mark.parametrize("recipe", ["fp32", "fp8-current"])
def test_runs_without_low_precision_matmuls_drop_the_emulation_after_one_step_same_bits(recipe, corpus):
    from mpcourse.core.emulation import set_emulation
    from mpcourse.experiment.training.train import Trainer
    set_emulation(True)                                    # the dispatch mode is active where it is entered
    try:
        fast = Trainer(recipe, corpus, small(steps=4)).run()
        slow = Trainer(recipe, corpus, small(steps=4))
        slow.train_step()
        assert slow.needs_emulation is False               # nothing was emulated in the first step
        slow.needs_emulation = True                        # keep entering it anyway
        slow.run()
    finally:
        set_emulation(None)
    assert fast.needs_emulation is False
    assert fast.history == slow.history
    assert all(torch.equal(a, b) for a, b in zip(fast.recipe.model.state_dict().values(),
                                                  slow.recipe.model.state_dict().values()))
    r_fast, r_slow = fast.result(), slow.result()          # the final evaluation reuses the last step's
    assert (r_fast.final_train_loss, r_fast.final_val_loss) == (r_slow.final_train_loss, r_slow.final_val_loss)
    slow._last_eval = None
    assert slow.result().final_val_loss == r_slow.final_val_loss


def test_one_training_step_the_memory_measurement_wraps_it(corpus, monkeypatch):
    """The first step's memory is measured around the trainer's own step function, not a copy of it: every step,
    measured or timed, is one call of ``step.training_step`` (the measured one through ``memory.measure_step``)."""
    from mpcourse.experiment.recipes import step
    from mpcourse.experiment.training import train as train_mod
    from mpcourse.experiment.measure import memory
    from mpcourse.experiment.training.train import Trainer

    assert memory.training_step is step.training_step and train_mod.training_step is step.training_step
    calls = []

    def spy(where):
        def wrapped(*args, **kwargs):
            calls.append((where, kwargs.get("forward_region") is not None))
            return step.training_step(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(memory, "training_step", spy("memory"))
    monkeypatch.setattr(train_mod, "training_step", spy("train"))
    trainer = Trainer("fp16-dynamic", corpus, small(steps=3)).run()
    assert calls == [("memory", True), ("train", False), ("train", False)]
    assert trainer.step_memory.activations > 0 and trainer.timed_steps == 2


def test_the_expert_load_note_reads_tokens_per_expert_from_the_history():
    """Per MoE row: the mean tokens per expert, the busiest expert of a block on average, the share of block-steps
    with an empty expert, computed here by hand from a planted history; a dense row adds no line."""
    import dataclasses

    from mpcourse.experiment.compare.report import expert_load_note
    from mpcourse.experiment.training.train import RunResult
    dense = RunResult(recipe="fp32", description="", final_train_loss=2.0, final_val_loss=2.0, skipped_steps=0,
                      final_loss_scale=None, tokens_per_s=1.0, bytes_per_param={}, activation_bytes=0, memory={},
                      flops_per_token=1.0, steps_run=2, diverged_at=None, history=[{"step": 0}, {"step": 1}])
    moe = dataclasses.replace(dense, recipe="moe-fp32", history=[
        {"step": 0, "tokens_per_expert": [[4, 0, 2, 2], [2, 2, 2, 2]]},
        {"step": 1, "tokens_per_expert": [[1, 3, 3, 1], [8, 0, 0, 0]]}])
    assert expert_load_note([dense]) == ""
    note = expert_load_note([dense, moe])
    # mean (8 * 4 / 16) = 2; busiest (4 + 2 + 3 + 8) / 4 = 4.25 -> "4"; empty 2 of 4 block-steps
    assert note == ("moe-fp32: tokens per expert per step 2 on average, the busiest expert of a block 4; a block "
                    "left an expert without a token in 50% of steps")
