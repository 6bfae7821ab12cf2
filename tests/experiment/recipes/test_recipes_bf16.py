"""The BF16 recipes (bf16-autocast, bf16-master, bf16-pure, bf16-pure-sr, bf16-pure-kahan): registry, where each
dtype lives and the bytes per parameter, steps against oracles run side by side (torch.autocast's recipe, FP32
AdamW), and resume bit for bit (model, master copy, AdamW state, SR generator, Kahan buffers)."""
import copy

import pytest
import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import RECIPES, OptimConfig, get_recipe
from recipe_loop import make_recipe, run_steps
from mpcourse.experiment.training.train import TrainConfig, lr_at, train

SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
BF16_RECIPES = ["bf16-autocast", "bf16-master", "bf16-pure", "bf16-pure-sr", "bf16-pure-kahan"]
PURE = ["bf16-pure", "bf16-pure-sr", "bf16-pure-kahan"]
B = 4


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def make(name, corpus, seed=0, optim=None):
    return make_recipe(name, corpus, SMALL, seed, optim)


def run(recipe, corpus, gen, steps, start=0, inject=None):
    """The training loop of mpcourse.experiment.training.train, step by step; returns the losses."""
    hook = (lambda step, r: inject(r)) if inject is not None else None
    return [loss for loss, _ in run_steps(recipe, corpus, gen, steps, block_size=SMALL.block_size,
                                          batch_size=B, start=start, inject=hook)]


def bits(t):
    return t.detach().contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same_tensors(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))


def test_registered_in_order_with_one_line_descriptions():
    names = list(RECIPES)
    i = names.index("bf16-autocast")
    assert names[i:i + 5] == BF16_RECIPES
    for n in BF16_RECIPES:
        assert get_recipe(n).description and "\n" not in get_recipe(n).description


@pytest.mark.parametrize("name,want", [
    ("bf16-autocast", {"weights": 4, "grads": 4, "master": 0, "optimizer": 8, "extra": 0}),
    ("bf16-master", {"weights": 2, "grads": 6, "master": 4, "optimizer": 8, "extra": 0}),
    ("bf16-pure", {"weights": 2, "grads": 4, "master": 0, "optimizer": 4, "extra": 0}),
    ("bf16-pure-sr", {"weights": 2, "grads": 4, "master": 0, "optimizer": 4, "extra": 0}),
    ("bf16-pure-kahan", {"weights": 2, "grads": 4, "master": 0, "optimizer": 4, "extra": 2}),
])
def test_bytes_per_param(name, want, corpus):
    """Pure rows: bf16 weights (2), fp32 grad buffers (4; the bf16 grads are moved there and freed), bf16 Adam
    moments (4), and for Kahan a bf16 compensation buffer (2, listed by TrainingRecipe.memory_tensors)."""
    res = train(name, corpus, TrainConfig(steps=1, batch_size=B, eval_batches=1, model=SMALL), progress=False)
    assert res.bytes_per_param == want


@pytest.mark.parametrize("name", PURE)
def test_pure_recipes_keep_everything_in_bf16(name, corpus):
    r = make(name, corpus)
    run(r, corpus, torch.Generator().manual_seed(0), 2)
    assert all(p.dtype == torch.bfloat16 for p in r.model.parameters())
    for st in r.optimizer.state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    assert (r.optimizer.rounding, r.optimizer.kahan) == {"bf16-pure": ("nearest", False),
                                                         "bf16-pure-sr": ("stochastic", False),
                                                         "bf16-pure-kahan": ("nearest", True)}[name]


def test_bf16_autocast_equals_torch_autocast_recipe_bit_for_bit(corpus):
    """Oracle: the torch-amp-bf16 anchor (torch.autocast). Same losses and weights over 3 steps, every bit."""
    ours, ref = make("bf16-autocast", corpus), make("torch-amp-bf16", corpus)
    la = run(ours, corpus, torch.Generator().manual_seed(0), 3)
    lb = run(ref, corpus, torch.Generator().manual_seed(0), 3)
    assert la == lb
    assert_same_tensors(list(ours.model.parameters()), list(ref.model.parameters()))


def test_bf16_master_step_equals_fp32_adamw_on_bf16_grads(corpus):
    """Oracle: torch.optim.AdamW + clip_grad_norm_ on an FP32 copy fed the model's bf16 grads; model = cast."""
    optim = OptimConfig(grad_clip=0.05)
    r = make("bf16-master", corpus, optim=optim)
    ref = [p.detach().float().clone().requires_grad_(True) for p in r.model.parameters()]
    opt = torch.optim.AdamW(ref, lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    captured = []
    run(r, corpus, torch.Generator().manual_seed(0), 1,
        inject=lambda rec: captured.extend(p.grad.clone() for p in rec.model.parameters()))
    assert all(g.dtype == torch.bfloat16 for g in captured)
    for p, g in zip(ref, captured):
        p.grad = g.float()
    assert float(torch.nn.utils.clip_grad_norm_(ref, optim.grad_clip)) > optim.grad_clip
    opt.step()
    assert_same_tensors(r.master.master_params, [p.detach() for p in ref])
    assert_same_tensors(list(r.model.parameters()), [p.detach().bfloat16() for p in ref])


def test_bf16_pure_step_equals_fp32_adamw_then_rounding(corpus):
    """Oracle: the first step of torch.optim.AdamW (+ clip_grad_norm_) in FP32 on the bf16 grads, then torch's
    cast to bf16; -sr lands on one of the two bf16 neighbours of that FP32 result; -kahan holds the rest."""
    optim = OptimConfig(grad_clip=0.05)
    results = {}
    for name in PURE:
        r = make(name, corpus, optim=optim)
        ref = [p.detach().float().clone().requires_grad_(True) for p in r.model.parameters()]
        opt = torch.optim.AdamW(ref, lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps,
                                weight_decay=optim.weight_decay)
        captured = []
        run(r, corpus, torch.Generator().manual_seed(0), 1,
            inject=lambda rec: captured.extend(p.grad.clone() for p in rec.model.parameters()))
        for p, g in zip(ref, captured):
            p.grad = g.float()
        torch.nn.utils.clip_grad_norm_(ref, optim.grad_clip)
        opt.step()
        results[name] = (r, [p.detach() for p in ref])
    r, ref = results["bf16-pure"]
    assert_same_tensors(list(r.model.parameters()), [p.bfloat16() for p in ref])
    r, ref = results["bf16-pure-sr"]
    for p, q in zip(r.model.parameters(), ref):
        rn = q.bfloat16()
        up = torch.nextafter(rn, torch.full_like(rn, float("inf")))
        down = torch.nextafter(rn, torch.full_like(rn, -float("inf")))
        assert bool(((p == rn) | (p == up) | (p == down)).all())
        w = p.detach().float()
        assert bool(((w - q).abs() < (up.float() - down.float())).all())  # never past a neighbour
    r, ref = results["bf16-pure-kahan"]
    for p, c, q in zip(r.model.parameters(), r.optimizer.comp, ref):
        err = (p.detach().double() + c.double() - q.double()).abs()
        # comp is bf16: its rounding error is <= 2**-9 |comp| <= 2**-17 |w|, plus the fp32 rounding of the update
        assert bool((err <= p.detach().abs().double() * 2**-16 + 2**-30).all())


@pytest.mark.parametrize("name", BF16_RECIPES)
def test_resume_is_bit_for_bit(name, corpus):
    """Train 3 steps, checkpoint (recipe state + batch RNG), resume into a recipe built from another init, 3 more
    steps: equal to 6 uninterrupted steps in every bit of model, master, optimizer state, SR generator, Kahan."""
    full = make(name, corpus)
    ref = run(full, corpus, torch.Generator().manual_seed(0), 6)

    first = make(name, corpus)
    gen = torch.Generator().manual_seed(0)
    a = run(first, corpus, gen, 3)
    ckpt = copy.deepcopy({"recipe": first.state_dict(), "gen": gen.get_state()})
    del first

    resumed = make(name, corpus, seed=1)
    if name == "bf16-pure-sr":
        resumed.optimizer.generator.manual_seed(123)                  # loading must restore it
    resumed.load_state_dict(ckpt["recipe"])
    gen = torch.Generator()
    gen.set_state(ckpt["gen"])
    b = run(resumed, corpus, gen, 3, start=3)

    assert a + b == ref
    assert_same_tensors(list(resumed.model.parameters()), list(full.model.parameters()))
    inner = lambda r: getattr(r.optimizer, "optimizer", r.optimizer)  # the torch optimizer (pure: wrapped)
    sa, sb = inner(resumed).state_dict()["state"], inner(full).state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert_same_tensors([sa[k][n] for n in sorted(sa[k])], [sb[k][n] for n in sorted(sb[k])])
    if name == "bf16-master":
        assert_same_tensors(resumed.master.master_params, full.master.master_params)
    if name == "bf16-pure-sr":
        assert torch.equal(resumed.optimizer.generator.get_state(), full.optimizer.generator.get_state())
    if name == "bf16-pure-kahan":
        assert any(bool(c.any()) for c in full.optimizer.comp)         # the buffers really hold something
        assert_same_tensors(resumed.optimizer.comp, full.optimizer.comp)
