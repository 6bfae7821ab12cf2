"""The FP16 recipes (fp16-master, fp16-static, fp16-dynamic): registry, memory, the step against an FP32 oracle,
resume bit for bit, and skip/back-off on an injected overflow."""
import copy
import math

import pytest
import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import RECIPES, OptimConfig, get_recipe
from recipe_loop import make_recipe, run_steps
from mpcourse.experiment.recipes.fp16 import STATIC_LOSS_SCALE
from mpcourse.core.scaling import DynamicLossScaler
from mpcourse.experiment.training.train import TrainConfig, lr_at, train

SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
FP16_RECIPES = ["fp16-master", "fp16-static", "fp16-dynamic"]
B = 4


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def make(name, corpus, seed=0, optim=None):
    return make_recipe(name, corpus, SMALL, seed, optim)


def run(recipe, corpus, gen, steps, start=0, inject=None):
    """The training loop of mpcourse.experiment.training.train, step by step; returns [(loss, StepResult)]."""
    return run_steps(recipe, corpus, gen, steps, block_size=SMALL.block_size, batch_size=B,
                     start=start, inject=inject)


def bits(t):
    return t.detach().contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same_tensors(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))


def test_registered_after_the_anchors_in_order():
    names = list(RECIPES)
    i = names.index("fp16-pure")
    assert names[i + 1:i + 4] == FP16_RECIPES
    for n in FP16_RECIPES:
        assert get_recipe(n).description and "\n" not in get_recipe(n).description


@pytest.mark.parametrize("name", FP16_RECIPES)
def test_where_each_dtype_lives_and_bytes_per_param(name, corpus):
    """Model params fp16 (2 B), model grads fp16 (2 B) + master grads fp32 (4 B) = 6 B, master fp32 (4 B),
    AdamW moments fp32 (8 B): 20 B per parameter. The ZeRO paper's 16 B leaves out the fp32 master grads, which
    DeepSpeed frees after each step; here both copies are alive between step() and zero_grad()."""
    r = make(name, corpus)
    run(r, corpus, torch.Generator().manual_seed(0), 1)
    assert all(p.dtype == torch.float16 for p in r.model.parameters())
    masters = [p for g in r.optimizer.param_groups for p in g["params"]]
    model_ids = {id(p) for p in r.model.parameters()}
    assert all(m.dtype == torch.float32 and id(m) not in model_ids for m in masters)
    assert len(masters) == len(list(r.model.parameters()))            # tied head counted once
    # Measure through the training loop (memory() is taken after the first step, before zero_grad).
    res = train(name, corpus, TrainConfig(steps=1, batch_size=B, eval_batches=1, model=SMALL), progress=False)
    assert res.bytes_per_param == {"weights": 2, "grads": 6, "master": 4, "optimizer": 8, "extra": 0}


def test_one_step_equals_fp32_adamw_on_unscaled_clipped_grads(corpus):
    """Oracle: torch.optim.AdamW + clip_grad_norm_ on an fp32 copy fed (fp16 grad of S*loss) / S."""
    optim = OptimConfig(grad_clip=0.05)                                # small enough that clipping acts
    r = make("fp16-static", corpus, optim=optim)
    ref = [p.detach().float().clone().requires_grad_(True) for p in r.model.parameters()]
    opt = torch.optim.AdamW(ref, lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    captured = []
    run(r, corpus, torch.Generator().manual_seed(0), 1,
        inject=lambda step, rec: captured.extend(p.grad.clone() for p in rec.model.parameters()))
    assert all(g.dtype == torch.float16 for g in captured)
    for p, g in zip(ref, captured):
        p.grad = g.float() / STATIC_LOSS_SCALE                        # exact: power-of-two scale
    norm = torch.nn.utils.clip_grad_norm_(ref, optim.grad_clip)
    assert float(norm) > optim.grad_clip
    opt.step()
    masters = [p for g in r.optimizer.param_groups for p in g["params"]]
    assert_same_tensors(masters, [p.detach() for p in ref])
    # and the fp16 model holds the master rounded to nearest even (torch's cast is the oracle)
    assert_same_tensors(list(r.model.parameters()), [p.detach().half() for p in ref])


@pytest.mark.parametrize("name", FP16_RECIPES)
def test_resume_is_bit_for_bit(name, corpus):
    """Train 4 steps, checkpoint (recipe state + batch RNG + torch RNG), resume into a recipe built from a
    *different* init, 4 more steps: equal to 8 uninterrupted steps in every bit of model, master, AdamW state and
    scaler state. For fp16-dynamic the scaler starts at 2**17 with growth_interval 2, so the run grows, skips
    and backs off on both sides of the checkpoint, and the resumed default-constructed scaler must take its config
    from the checkpoint."""
    def build(seed):
        r = make(name, corpus, seed=seed)
        if name == "fp16-dynamic" and seed == 0:
            r.scaler = DynamicLossScaler(init_scale=2.0**17, growth_interval=2)
        return r

    full = build(0)
    gen = torch.Generator().manual_seed(0)
    ref = run(full, corpus, gen, 8)

    first = build(0)
    gen = torch.Generator().manual_seed(0)
    a = run(first, corpus, gen, 4)
    ckpt = copy.deepcopy({"recipe": first.state_dict(), "gen": gen.get_state(), "rng": torch.get_rng_state()})
    del first

    resumed = build(1)                                                 # another init: loading must replace it
    resumed.load_state_dict(ckpt["recipe"])
    torch.set_rng_state(ckpt["rng"])
    gen = torch.Generator()
    gen.set_state(ckpt["gen"])
    b = run(resumed, corpus, gen, 4, start=4)

    assert [loss for loss, _ in a + b] == [loss for loss, _ in ref]
    assert [(s.skipped, s.loss_scale) for _, s in a + b] == [(s.skipped, s.loss_scale) for _, s in ref]
    assert_same_tensors(list(resumed.model.parameters()), list(full.model.parameters()))
    assert_same_tensors(resumed.master.master_params, full.master.master_params)
    sa, sb = resumed.optimizer.state_dict()["state"], full.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert_same_tensors([sa[k][n] for n in sorted(sa[k])], [sb[k][n] for n in sorted(sb[k])])
    if name != "fp16-master":
        assert resumed.scaler.state_dict() == full.scaler.state_dict()
    if name == "fp16-dynamic":                                         # the scaler really did things
        assert any(s.skipped for _, s in ref[:4]) and any(s.skipped for _, s in ref[4:])
        assert resumed.scaler.state_dict()["growth_interval"] == 2
        scales = [s.loss_scale for _, s in ref]
        assert any(b2 > b1 for b1, b2 in zip(scales, scales[1:]))     # grew at least once


def _inject_inf_at(k):
    def inject(step, recipe):
        if step == k:
            next(recipe.model.parameters()).grad[0, 0] = float("inf")   # an overflowed fp16 gradient
    return inject


def test_dynamic_skips_and_backs_off_on_injected_overflow(corpus):
    r = make("fp16-dynamic", corpus)
    gen = torch.Generator().manual_seed(0)
    run(r, corpus, gen, 3)
    before_model = [p.detach().clone() for p in r.model.parameters()]
    before_master = [m.detach().clone() for m in r.master.master_params]
    steps_before = [int(s["step"]) for s in r.optimizer.state.values()]
    scale_before = r.scaler.get_scale()
    (loss, res), = run(r, corpus, gen, 1, start=3, inject=_inject_inf_at(3))
    assert res.skipped and res.loss_scale == scale_before
    assert r.scaler.get_scale() == scale_before * 0.5
    assert r.scaler.skipped_steps == 1
    assert_same_tensors(list(r.model.parameters()), before_model)     # nothing moved
    assert_same_tensors(r.master.master_params, before_master)
    assert [int(s["step"]) for s in r.optimizer.state.values()] == steps_before   # Adam's count unchanged
    assert all(torch.isfinite(m).all() for m in r.master.master_params)
    (loss, res), = run(r, corpus, gen, 1, start=4)                    # next step is clean and steps
    assert not res.skipped and res.loss_scale == scale_before * 0.5
    assert not any(torch.equal(bits(a), bits(b)) for a, b in zip(r.model.parameters(), before_model))


def test_dynamic_trajectory_equals_gradscaler_fed_the_same_overflows(corpus):
    """The loss scale the recipe reports, step by step, equals torch.amp.GradScaler's (the oracle) given the same
    inf pattern (injected at steps 2, 3 and 9), with the recipe's growth_interval."""
    r = make("fp16-dynamic", corpus)
    r.scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)   # low: no natural overflow
    ovf = {2, 3, 9}

    def inject(step, recipe):
        if step in ovf:
            _inject_inf_at(step)(step, recipe)

    results = [s for _, s in run(r, corpus, torch.Generator().manual_seed(0), 12, inject=inject)]
    assert [s.skipped for s in results] == [step in ovf for step in range(12)]
    got = [s.loss_scale for s in results]
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    want = []
    for step in range(12):
        gs.scale(p.sum()).backward()
        if step in ovf:
            p.grad.fill_(float("inf"))
        want.append(gs.get_scale())
        gs.step(opt)
        gs.update()
        opt.zero_grad()
    assert got == want


def test_static_skips_but_keeps_its_scale(corpus):
    r = make("fp16-static", corpus)
    results = run(r, corpus, torch.Generator().manual_seed(0), 3, inject=_inject_inf_at(1))
    assert [s.skipped for _, s in results] == [False, True, False]
    assert {s.loss_scale for _, s in results} == {STATIC_LOSS_SCALE}
    assert r.scaler.skipped_steps == 1


def test_master_keeps_the_updates_pure_fp16_loses(corpus):
    """After a few steps fp16-pure has diverged (AdamW eps 1e-8 is 0 in FP16) while fp16-master has not, and the
    model holds its fp32 master rounded to fp16 bit for bit (oracle: torch's cast)."""
    cfg = TrainConfig(steps=6, batch_size=B, eval_interval=3, eval_batches=2, model=SMALL)
    pure = train("fp16-pure", corpus, cfg, progress=False)
    master = train("fp16-master", corpus, cfg, progress=False)
    assert pure.diverged_at is not None and master.diverged_at is None and math.isfinite(master.final_val_loss)
    r = make("fp16-master", corpus)
    run(r, corpus, torch.Generator().manual_seed(0), 3)
    assert_same_tensors(list(r.model.parameters()), [m.detach().half() for m in r.master.master_params])
