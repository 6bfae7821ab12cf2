"""Sturdy checkpoints: a model-only load is not undone by the FP32 master (MasterWeights' and the FP8 weights'
masters, whichever call comes next); optimizer, BF16Optimizer and recipe state is checked (keys, shapes) before
anything loads; the Trainer's checkpoint file carries a SHA-256 and resumes every master-keeping recipe bit for bit.

Oracles: torch.optim's own load_state_dict (which accepts a wrongly shaped state tensor and then broadcasts it:
the failure mode checked here), a fresh MasterWeights built from the loaded model (what a step from loaded
weights must give), and hashlib's SHA-256.
"""
import copy
import hashlib

import pytest
import torch

from mpcourse.core.bf16 import BF16Optimizer
from mpcourse.core.checkpoint import CheckpointError, check_optimizer_state_dict, load_checkpoint, save_checkpoint
from mpcourse.core.master import MasterWeights, cast_model
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.training.train import TrainConfig, Trainer


def fp16_model(seed=0):
    torch.manual_seed(seed)
    return cast_model(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), torch.float16)


def train_steps(model, master, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 4, generator=g)
        model(x).float().pow(2).mean().backward()
        master.step()
        master.zero_grad()


# -- MasterWeights: loading only the model's weights ---------------------------------------------------------
def test_model_only_load_is_not_undone_by_the_next_step():
    model = fp16_model()
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    train_steps(model, master, 2)
    saved = copy.deepcopy(model.state_dict())          # fp16 weights at step 2
    train_steps(model, master, 3, seed=2)
    model.load_state_dict(saved)                       # model only: the master still holds step 5
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))
    model(x).float().pow(2).mean().backward()
    with pytest.warns(UserWarning, match="MasterWeights.load_state_dict"):
        master.step()
    # oracle: a fresh MasterWeights over a model holding the loaded weights, same batch, one step
    oracle_model = fp16_model()
    oracle_model.load_state_dict(saved)
    oracle = MasterWeights(oracle_model, torch.optim.SGD, lr=0.1)
    oracle_model(x).float().pow(2).mean().backward()
    oracle.step()
    for a, b in zip(model.parameters(), oracle_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(master.master_params, oracle.master_params):
        assert torch.equal(a, b)


def _load_by_data(model, saved):
    """Write ``saved`` into the parameters through ``.data`` (as torch.nn.utils.vector_to_parameters does): no
    in-place op on the parameter, so autograd's version counter does not move."""
    for name, p in model.named_parameters():
        p.data = saved[name].clone()


@pytest.mark.parametrize("load", [lambda m, sd: m.load_state_dict(sd), _load_by_data],
                         ids=["load_state_dict", "data_assignment"])
@pytest.mark.parametrize("then", ["step", "copy_master_to_model", "state_dict"])
def test_every_way_in_sees_the_loaded_weights(load, then):
    """After a model-only load the master is refreshed whichever MasterWeights call comes next: a step (grads copied
    up), ``copy_master_to_model`` alone (which wrote the stale master over the load), ``state_dict`` (which saved the
    stale master, so a resume from that checkpoint undid the load). Oracle: a fresh MasterWeights over the loaded
    weights. Before the fix, only load_state_dict followed by a step was seen."""
    model = fp16_model()
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    train_steps(model, master, 2)
    saved = copy.deepcopy(model.state_dict())
    train_steps(model, master, 3, seed=2)
    load(model, saved)
    with pytest.warns(UserWarning, match="MasterWeights.load_state_dict"):
        if then == "step":
            for g in master.optimizer.param_groups:
                g["lr"] = 0.0
            model(torch.ones(5, 4)).float().pow(2).mean().backward()
            master.step()
        elif then == "copy_master_to_model":
            master.copy_master_to_model()
        else:
            state = copy.deepcopy(master.state_dict())
    if then == "state_dict":
        master.load_state_dict(state)                  # a resume from the checkpoint taken after the load
    oracle_model = fp16_model(seed=3)
    oracle_model.load_state_dict(saved)
    oracle = MasterWeights(oracle_model, torch.optim.SGD, lr=0.0)
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    for a, b in zip(master.master_params, oracle.master_params):
        assert torch.equal(a, b)


def test_a_load_that_replaces_the_parameters_is_refused_naming_the_load_that_works():
    """``load_state_dict(sd, assign=True)`` puts new tensors in the model in place of its parameters: MasterWeights
    would go on stepping the old ones, and the loaded model would never train (before the fix: no error, the step
    left the loaded weights where they were and updated parameters no module held any more). Refused at the next
    MasterWeights call, naming the load that copies; built over a list of parameters with ``model=`` the same."""
    model = fp16_model()
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    train_steps(model, master, 1)
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    model(torch.ones(5, 4)).float().pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"assign=True.*model\.load_state_dict\(state\) without assign") as err:
        master.step()
    assert "\n" not in str(err.value)
    other = fp16_model()
    listed = MasterWeights(list(other.parameters()), torch.optim.SGD, lr=0.1, model=other)
    other.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    with pytest.raises(RuntimeError, match="replaced"):
        listed.state_dict()


def test_a_recipe_refuses_a_load_that_replaces_its_parameters(corpus):
    from recipe_loop import make_recipe
    r = make_recipe("fp16-master", corpus, SMALL)
    _steps(r, corpus, torch.Generator().manual_seed(0), 1, 0)
    r.model.load_state_dict(copy.deepcopy(r.model.state_dict()), assign=True)
    with pytest.raises(RuntimeError, match="assign=True"):
        _steps(r, corpus, torch.Generator().manual_seed(1), 1, 1)


def test_no_warning_and_no_refresh_in_a_normal_run(recwarn):
    model = fp16_model()
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    with torch.no_grad():
        master.master_params[0].add_(2.0 ** -20)  # low bits the fp16 model cannot hold must survive
    kept = master.master_params[0].clone()
    model(torch.ones(1, 4)).float().sum().backward()
    master.copy_grads_to_master()
    assert torch.equal(master.master_params[0], kept)
    assert not [w for w in recwarn if "MasterWeights" in str(w.message)]


def test_master_load_state_dict_checks_before_changing_anything():
    model = fp16_model()
    master = MasterWeights(model, torch.optim.Adam, lr=0.1)
    train_steps(model, master, 1)
    good = copy.deepcopy(master.state_dict())
    before = [m.clone() for m in master.master_params]
    bad_shape = copy.deepcopy(good)
    bad_shape["optimizer"]["state"][0]["exp_avg"] = torch.zeros(1)  # would broadcast into (3, 4)
    bad_master = copy.deepcopy(good)
    bad_master["master_params"][1] = torch.zeros(4)
    for bad, msg in [(bad_shape, "exp_avg.*shape"), (bad_master, "master param 1"),
                     ({**good, "extra": 1}, "keys"), ({"optimizer": good["optimizer"]}, "keys")]:
        with pytest.raises(CheckpointError, match=msg):
            master.load_state_dict(bad)
        assert all(torch.equal(a, b) for a, b in zip(master.master_params, before))
    master.load_state_dict(good)  # the valid one still loads


def test_torch_optimizer_accepts_a_wrong_shape_and_ours_refuses():
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(4)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = torch.full((1,), 5.0)
    oracle = torch.optim.Adam([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    oracle.load_state_dict(sd)  # torch: no complaint
    with pytest.raises(CheckpointError, match="'exp_avg' of parameter 0 has shape \\(1,\\)"):
        check_optimizer_state_dict(opt, sd)
    other = torch.optim.Adam([w, torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(CheckpointError, match="parameters per group"):
        check_optimizer_state_dict(other, opt.state_dict())
    with pytest.raises(CheckpointError, match="not an optimizer state_dict"):
        check_optimizer_state_dict(opt, {"state": {}})
    check_optimizer_state_dict(opt, opt.state_dict())


# -- BF16Optimizer -----------------------------------------------------------------------------------------
def kahan_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), rounding="nearest", kahan=True)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("corrupt, msg", [
    (lambda sd: sd["compensation"].__setitem__(0, torch.ones(1, dtype=torch.bfloat16)), "compensation buffer 0"),
    (lambda sd: sd["compensation"].__setitem__(1, torch.ones(3)), "compensation buffer 1"),   # fp32, not bf16
    (lambda sd: sd["compensation"].pop(), "expected 2 buffers"),
    (lambda sd: sd["optimizer"]["state"][0].__setitem__("exp_avg_sq", torch.ones(4, 3)), "exp_avg_sq"),
    (lambda sd: sd.__setitem__("kahan", False), "kahan=False"),
    (lambda sd: sd.pop("generator"), "keys"),
    (lambda sd: sd.__setitem__("generator", torch.zeros(3)), "generator"),
])
def test_bf16_optimizer_load_state_dict_checks_shapes_and_keys(corrupt, msg):
    _, opt = kahan_optimizer()
    sd = copy.deepcopy(opt.state_dict())
    corrupt(sd)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(CheckpointError, match=msg):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(after["compensation"], before["compensation"]))
    assert torch.equal(after["optimizer"]["state"][0]["exp_avg"], before["optimizer"]["state"][0]["exp_avg"])


def test_bf16_optimizer_valid_round_trip_still_loads():
    _, opt = kahan_optimizer()
    sd = copy.deepcopy(opt.state_dict())
    _, fresh = kahan_optimizer()
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.comp, sd["compensation"]))


# -- recipes and the Trainer -------------------------------------------------------------------------------
SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def cfg(steps=4):
    return TrainConfig(steps=steps, batch_size=4, eval_interval=2, eval_batches=1, model=SMALL)


@pytest.mark.parametrize("recipe", ["fp32", "fp16-dynamic", "bf16-pure-kahan"])
def test_recipe_load_state_dict_checks_keys_and_shapes_first(recipe, corpus):
    t = Trainer(recipe, corpus, cfg(1)).run()
    sd = copy.deepcopy(t.recipe.state_dict())
    before = [p.detach().clone() for p in t.recipe.model.parameters()]
    missing = dict(sd)
    missing.pop(sorted(sd)[-1])
    with pytest.raises(CheckpointError, match="expected the keys"):
        t.recipe.load_state_dict(missing)
    opt_sd = sd["master"]["optimizer"] if "master" in sd else sd["optimizer"]
    opt_sd = opt_sd.get("optimizer", opt_sd)  # BF16Optimizer wraps the torch optimizer's state_dict
    opt_sd["state"][0]["exp_avg"] = opt_sd["state"][0]["exp_avg"][:1].clone()
    with pytest.raises(CheckpointError, match="exp_avg"):
        t.recipe.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(t.recipe.model.parameters(), before))


def test_trainer_file_round_trip_and_corruption_is_detected(corpus, tmp_path):
    path = tmp_path / "run.ckpt"
    first = Trainer("fp16-dynamic", corpus, cfg()).run(2)
    digest = first.save(path)
    raw = path.read_bytes()
    header, payload = raw.split(b"\n", 1)
    assert digest == hashlib.sha256(payload).hexdigest() and header.split()[2] == b"sha256=" + digest.encode()
    resumed = Trainer("fp16-dynamic", corpus, cfg()).load(path).run()
    straight = Trainer("fp16-dynamic", corpus, cfg()).run()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]

    flipped = bytearray(raw)
    flipped[len(header) + 1 + len(payload) // 2] ^= 0x01  # one bit in the middle of the payload
    (tmp_path / "flipped.ckpt").write_bytes(bytes(flipped))
    (tmp_path / "short.ckpt").write_bytes(raw[:-100])
    torch.save(first.state_dict(), tmp_path / "plain.pt")
    fresh = Trainer("fp16-dynamic", corpus, cfg())
    for name, msg in [("flipped.ckpt", "corrupted: SHA-256"), ("short.ckpt", "truncated"),
                      ("plain.pt", "not a checkpoint written by save_checkpoint")]:
        with pytest.raises(CheckpointError, match=msg):
            fresh.load(tmp_path / name)
        assert fresh.step == 0 and fresh.history == []  # nothing was touched


def test_save_checkpoint_is_atomic_and_plain_objects_round_trip(tmp_path):
    obj = {"a": torch.arange(3), "b": [1.5, None, "x"]}
    save_checkpoint(obj, tmp_path / "c")
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary left behind
    out = load_checkpoint(tmp_path / "c")
    assert torch.equal(out["a"], obj["a"]) and out["b"] == obj["b"]
    with pytest.raises(CheckpointError, match="not a Trainer checkpoint"):
        Trainer("fp32", load_corpus(), cfg(1)).load_state_dict({"recipe_name": "fp32"})
    assert get_recipe("fp32")  # the registry is untouched by failed loads


def test_a_checkpoint_of_another_corpus_is_refused_naming_data(corpus, tmp_path):
    """The same text with its characters kept (same vocabulary, same shapes) but reordered: the weights would
    load and the run would go on silently on other data. The corpus's SHA-256 in the checkpoint refuses it."""
    path = tmp_path / "run.ckpt"
    Trainer("fp32", corpus, cfg()).run(1).save(path)
    other_file = tmp_path / "other.txt"
    other_file.write_text(corpus.text[len(corpus.text) // 2:] + corpus.text[:len(corpus.text) // 2])
    other = load_corpus(other_file)
    assert other.chars == corpus.chars                       # the model's shapes alone cannot tell
    with pytest.raises(CheckpointError, match=r"corpus mismatch: .* resume with the same --data"):
        Trainer("fp32", other, cfg()).load(path)
    Trainer("fp32", load_corpus(), cfg()).load(path)         # the same corpus loads
    old = {k: v for k, v in load_checkpoint(path).items() if k != "corpus"}   # a checkpoint from before the field
    Trainer("fp32", other, cfg()).load_state_dict(old)


# -- a model-only load is the model that trains, for every recipe that keeps a master ----------------------------
MASTER_RECIPES = ["fp8-delayed-fp8-weights", "fp16-master", "bf16-master", "fp16-dynamic"]


def _floats(state):
    """A model state_dict's floating tensors as raw bits (FP8 weights and their scales included), by key."""
    return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith("_extra_state")}


def _steps(recipe, corpus, gen, n, start, lr=None):
    from dataclasses import replace

    from recipe_loop import run_steps
    if lr is not None:
        recipe.optim = replace(recipe.optim, lr=lr)
    return [loss for loss, _ in run_steps(recipe, corpus, gen, n, block_size=SMALL.block_size, batch_size=4,
                                          start=start)]


@pytest.mark.parametrize("recipe", MASTER_RECIPES)
def test_a_model_only_load_is_the_model_that_trains(recipe, corpus, recwarn):
    """Weights loaded with ``model.load_state_dict`` into a run whose master has moved on: one step at learning
    rate 0 must leave them as loaded, bit for bit (the stale master must not be written back over them). The
    saved weights come right after a step at learning rate 0, so that the FP8 weights' delayed scale is the one
    they were cast with (a max over an amax history that the constant master does not change). Before the fix,
    fp8-delayed-fp8-weights cast its stale FP32 masters over both loaded weights of each block."""
    from recipe_loop import make_recipe
    r, gen = make_recipe(recipe, corpus, SMALL), torch.Generator().manual_seed(0)
    lr = r.optim.lr
    _steps(r, corpus, gen, 3, 0)
    _steps(r, corpus, gen, 1, 3, lr=0.0)
    saved = copy.deepcopy(r.model.state_dict())
    _steps(r, corpus, gen, 3, 4, lr=lr)                          # the masters move on: stale for `saved`
    assert _floats(r.model.state_dict()).keys() == _floats(saved).keys()
    assert any(not torch.equal(a, _floats(saved)[k]) for k, a in _floats(r.model.state_dict()).items())
    r.model.load_state_dict(saved)
    _steps(r, corpus, gen, 1, 7, lr=0.0)
    now, want = _floats(r.model.state_dict()), _floats(saved)
    assert [k for k in want if not torch.equal(now[k], want[k])] == []


@pytest.mark.parametrize("recipe", MASTER_RECIPES)
def test_a_resume_from_a_checkpoint_file_gives_the_uninterrupted_losses(recipe, corpus, tmp_path):
    """Trainer.save after 3 steps, a fresh Trainer (fresh recipe, fresh masters) loads it and trains on: the
    losses of the steps after the resume are the uninterrupted run's, bit for bit, and so are the weights."""
    path = tmp_path / "run.ckpt"
    Trainer(recipe, corpus, cfg(6)).run(3).save(path)
    resumed = Trainer(recipe, corpus, cfg(6)).load(path).run()
    straight = Trainer(recipe, corpus, cfg(6)).run()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    a, b = _floats(resumed.recipe.model.state_dict()), _floats(straight.recipe.model.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


LOW_STATE = ("fp8-moments", "int8-moments", "bf16-master-bf16-moments", "bf16-master-bf16-moments-sr")


def _bits(obj):
    """A recipe state_dict's tensors as raw bits (floats bit for bit, -0.0 != 0.0), other values as they are."""
    if isinstance(obj, dict):
        return {k: _bits(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bits(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), obj.detach().reshape(-1).view(torch.uint8).tolist() if obj.is_floating_point()
                else obj.tolist())
    return obj


@pytest.mark.parametrize("recipe", LOW_STATE)
def test_low_precision_optimizer_state_resumes_bit_for_bit(recipe, corpus, tmp_path):
    """Every recipe whose optimizer state is stored in low precision (quantized FP8/8-bit moments, BF16 moments, BF16
    moments rounded stochastically): saved after 2 steps, loaded in a fresh Trainer, the 3 steps after give the
    uninterrupted run's losses and its whole state, bit for bit (the generators of the stochastic rounding too).
    The control: the same resume with the generators reset to their seed ends elsewhere."""
    path = tmp_path / "run.ckpt"
    Trainer(recipe, corpus, cfg(5)).run(2).save(path)
    straight = Trainer(recipe, corpus, cfg(5)).run()
    resumed = Trainer(recipe, corpus, cfg(5)).load(path).run()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    assert _bits(resumed.recipe.state_dict()) == _bits(straight.recipe.state_dict())
    if recipe.endswith("-sr"):
        planted = Trainer(recipe, corpus, cfg(5)).load(path)
        planted.recipe.master.optimizer.load_rng_state({})          # fresh generators, seeded again
        assert _bits(planted.run().recipe.state_dict()) != _bits(straight.recipe.state_dict())
