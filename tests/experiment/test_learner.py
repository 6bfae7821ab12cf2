"""A learner's functions train the GPT: solution functions give the library's row bit for bit; planted bugs
give a different row or one line naming the function (``mpcourse.experiment.learner``, ``compare --with``)."""
import math
from pathlib import Path

import pytest
import torch

from mpcourse.experiment.compare.learner_rows import train_with_learner
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.learner import LearnerLoadError, load_functions
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.training.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
CFG = TrainConfig(steps=3, batch_size=2, eval_interval=3, eval_batches=1, model=TINY)

# recipe -> (solution notebook, the functions it uses)
CASES = {
    "fp16-dynamic": ("04_dynamic_loss_scaling", ("update_scale",)),
    "fp16-master": ("00_number_formats", ("round_to_fp16",)),
    "bf16-master": ("00_number_formats", ("round_to_bf16",)),
    "bf16-pure": ("00_number_formats", ("round_to_bf16",)),
    "bf16-pure-sr": ("06_bf16_training", ("stochastic_round_bf16",)),
    "bf16-pure-kahan": ("06_bf16_training", ("kahan_add_",)),
}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def library_rows(corpus):
    return {name: train(name, corpus, CFG, progress=False) for name in CASES}


def _row(r):
    return ([h["loss"] for h in r.history], [h["loss_scale"] for h in r.history], r.final_val_loss)


@pytest.mark.parametrize("name", CASES)
def test_solution_functions_give_the_library_row_bit_for_bit(name, corpus, library_rows):
    nb, used = CASES[name]
    functions = load_functions(ROOT / "solutions" / f"{nb}.ipynb")
    assert set(used) <= set(functions)
    lines = []
    mine = train_with_learner(name, corpus, CFG, functions, echo=lines.append)
    assert lines == [] and mine.recipe == f"{name} [yours]"
    assert _row(mine) == _row(library_rows[name])


def _buggy_update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=2000):
    return scale * backoff_factor, 0                     # backs off every step


def _truncating_round_to_bf16(x):
    return (x.view(torch.int32) & -65536).view(torch.float32)   # round toward zero, not to nearest


def _round_down_sr(x, generator):
    return _truncating_round_to_bf16(x).to(torch.bfloat16)  # never rounds up: not stochastic


def _plain_add_(w, comp, update):
    w.copy_((w.float() + update).to(torch.bfloat16))         # drops the compensation


@pytest.mark.parametrize("name,fn", [("fp16-dynamic", _buggy_update_scale), ("bf16-pure", _truncating_round_to_bf16),
                                     ("bf16-pure-sr", _round_down_sr), ("bf16-pure-kahan", _plain_add_)])
def test_a_planted_bug_gives_a_different_row(name, fn, corpus, library_rows):
    used = CASES[name][1][0]
    mine = train_with_learner(name, corpus, CFG, {used: fn}, echo=pytest.fail)
    assert _row(mine) != _row(library_rows[name])


def _not_a_tuple(scale, growth_tracker, found_inf, *rest):
    return scale


def _inf_scale(scale, growth_tracker, found_inf, *rest):
    return math.inf, 0


def _wrong_dtype(x):
    return x.half()


def _off_grid(x):
    return x + 1e-3


def _crashes(x, generator):
    return x.bogus


@pytest.mark.parametrize("name,used,fn,words", [
    ("fp16-dynamic", "update_scale", _not_a_tuple, "update_scale returned float, expected a tuple"),
    ("fp16-dynamic", "update_scale", _inf_scale, "update_scale returned scale inf"),
    ("bf16-pure", "round_to_bf16", _wrong_dtype, "round_to_bf16 returned dtype torch.float16"),
    ("bf16-master", "round_to_bf16", _off_grid, "is not a bfloat16 value"),
    ("bf16-pure-sr", "stochastic_round_bf16", _crashes, "your stochastic_round_bf16 raised AttributeError"),
])
def test_a_broken_function_gives_one_line_naming_it(name, used, fn, words, corpus):
    lines = []
    assert train_with_learner(name, corpus, CFG, {used: fn}, echo=lines.append) is None
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"{name} [yours]: ")


def test_the_shipped_exercise_stub_says_not_implemented_and_other_recipes_say_what_they_accept(corpus):
    functions = load_functions(ROOT / "exercises" / "04_dynamic_loss_scaling.ipynb")
    lines = []
    assert train_with_learner("fp16-dynamic", corpus, CFG, functions, echo=lines.append) is None
    assert lines == ["fp16-dynamic [yours]: your update_scale is not implemented yet (it raises "
                     "NotImplementedError)"]
    lines.clear()
    assert train_with_learner("fp32", corpus, CFG, functions, echo=lines.append) is None
    assert lines == ["fp32: cannot use any of scaled_step, update_scale (it accepts: none)"]


def test_loading_runs_only_definitions(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import math\nLIMIT = 2\nraise SystemExit('ran a statement')"),
                nbformat.v4.new_code_cell("def f(x):\n    return x * LIMIT\n\nprint('side effect')\nf(1)"),
                nbformat.v4.new_code_cell("def g():\n    pass", metadata={"tags": ["check"]})]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    functions = load_functions(path)
    assert list(functions) == ["f"] and functions["f"](3) == 6
    nb.cells.append(nbformat.v4.new_code_cell("def broken(:\n    pass"))
    nbformat.write(nb, path)
    with pytest.raises(LearnerLoadError, match="cell 4: syntax error"):     # the 4th cell (cell_number)
        load_functions(path)
    with pytest.raises(LearnerLoadError, match="no such notebook"):
        load_functions(tmp_path / "missing.ipynb")


def test_update_scale_seam_follows_the_library_through_overflows_and_growth():
    from mpcourse.core.scaling import DynamicLossScaler
    rule = load_functions(ROOT / "solutions" / "04_dynamic_loss_scaling.ipynb")["update_scale"]
    trajectories = {}
    for who, kw in (("library", {}), ("yours", {"update_scale": rule})):
        scaler = DynamicLossScaler(init_scale=2.0**4, growth_interval=3, **kw)
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scales = []
        for bad in (0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0):
            scaler.scale(p.sum()).backward()
            if bad:
                p.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append((scaler.get_scale(), scaler.last_step_skipped))
            opt.zero_grad()
        trajectories[who] = scales
    assert trajectories["library"] == trajectories["yours"]
    assert len({s for s, _ in trajectories["library"]}) >= 3          # grew and backed off: the test can fail
    with pytest.raises(ValueError, match="hysteresis=1"):
        DynamicLossScaler(hysteresis=2, update_scale=rule)


# -- a wrong function is one line naming the fix: where the recipe is built, and from the command line (exit 2) --

def _two_parameters(scale, growth_tracker):                  # lesson 04's update_scale takes six
    return scale, growth_tracker


def test_a_function_of_the_wrong_signature_is_one_line_naming_the_signature(corpus):
    lines = []
    assert train_with_learner("fp16-dynamic", corpus, CFG, {"update_scale": _two_parameters}, echo=lines.append) is None
    assert lines == ["fp16-dynamic [yours]: your update_scale(scale, growth_tracker) cannot be called as the library "
                     "calls it, update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, "
                     "growth_interval) (lesson 04's signature: def update_scale(scale: float, growth_tracker: int, "
                     "found_inf: bool, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int "
                     "= 2000) -> tuple): give it those parameters, in that order"]


def _notebook(tmp_path, source: str) -> Path:
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    path = tmp_path / "04_mine.ipynb"
    nbformat.write(nb, path)
    return path


SOLUTION_04 = str(ROOT / "solutions" / "04_dynamic_loss_scaling.ipynb")
SIX = "scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000"


@pytest.mark.parametrize("flags,source,words", [
    (["--recipes", "fp32,bf16-pure"], None,
     "none of the recipes asked for (fp32, bf16-pure) takes your update_scale, scaled_step: update_scale (lesson 04) "
     "to fp16-dynamic (name one with --recipes)"),
    (["--recipes", "fp16-master", "--nproc", "2", "--parallel", "fsdp"], "def make_master(model_params):\n    return 1",
     "none of the recipes asked for (fp16-master) takes your make_master under --parallel fsdp: no recipe takes "
     "them under --parallel fsdp"),
    (["--recipes", "fp16-dynamic"], "def update_scale(scale, growth_tracker):\n    return scale, 0",
     "your update_scale(scale, growth_tracker) cannot be called as the library calls it, update_scale(scale, "),
    (["--recipes", "fp16-dynamic", "--nproc", "2", "--parallel", "ddp"],
     "def update_scale(scale, growth_tracker):\n    return scale, 0",
     "your update_scale(scale, growth_tracker) cannot"),
    (["--recipes", "fp32,fp16-dynamic"], f"def updat_scale({SIX}):\n    return scale, 0",
     "your updat_scale is not one of the exercises' functions: did you mean update_scale (lesson 04)? The recipes "
     "call it by that name"),
])
def test_a_wrong_with_exits_2_in_one_line_before_anything_trains(flags, source, words, tmp_path, monkeypatch, capsys):
    from mpcourse.cli import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("trained despite a refused --with")
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", must_not_run)
    monkeypatch.setattr("mpcourse.experiment.parallel.distributed.run_distributed_compare", must_not_run)
    nb = SOLUTION_04 if source is None else str(_notebook(tmp_path, source))
    assert main(["compare", *flags, "--with", nb, "--steps", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpcourse compare: error: --with: {words}") and len(err.splitlines()) == 1, err


def test_a_right_with_names_the_learners_functions_only(tmp_path, monkeypatch, capsys):
    from mpcourse.cli import main

    seen = {}

    def fake(recipes, corpus, cfg, out, **kwargs):
        seen.update(kwargs["learner"])
        return []
    monkeypatch.setattr("mpcourse.experiment.compare.run.run_compare", fake)
    monkeypatch.setattr("mpcourse.experiment.cli.compare._peak_flops", lambda device, threads=None: {"fp32": 1e11})
    source = f"def helper(x):\n    return x\n\ndef update_scale({SIX}):\n    return helper(scale), 0"
    assert main(["compare", "--recipes", "fp16-dynamic", "--with", str(_notebook(tmp_path, source)), "--jobs", "1",
                 "--out", str(tmp_path / "out")]) == 0
    assert list(seen) == ["update_scale"] and "your functions: update_scale\n" in capsys.readouterr().out
