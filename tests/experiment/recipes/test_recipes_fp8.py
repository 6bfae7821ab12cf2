"""The FP8 recipes (fp8-current, fp8-delayed): registry, where FP8 is and is not, the FP8 GEMMs of a training
step, the delayed-scaling state against TE's rule, memory, closeness to FP32, and resume bit for bit."""
import copy
import math

import pytest
import torch
import torch.nn as nn

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.core.quant import CurrentScaling, Float8Linear, Format
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import RECIPES, get_recipe
from recipe_loop import make_recipe, run_steps
from mpcourse.experiment.recipes.fp8 import AMAX_HISTORY_LEN
from mpcourse.experiment.training.train import TrainConfig, evaluate, train

SMALL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
FP8_RECIPES = ["fp8-current", "fp8-delayed"]
FP8_LINEARS = {f"blocks.{i}.{name}" for i in range(SMALL.n_layer)
               for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
B = 4
E4M3_MAX, E5M2_MAX = 448.0, 57344.0                                    # torch.finfo of the two FP8 dtypes


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def make(name, corpus, seed=0):
    return make_recipe(name, corpus, SMALL, seed)


def run(recipe, corpus, gen, steps, start=0):
    """The training loop of mpcourse.experiment.training.train, step by step; returns the losses."""
    return [loss for loss, _ in run_steps(recipe, corpus, gen, steps, block_size=SMALL.block_size,
                                          batch_size=B, start=start)]


def fp8_states(recipe):
    """{(layer, role): (scale, amax_history)} copies of every delayed-scaling state."""
    return {(n, role): (s.scale.clone(), s.amax_history.clone())
            for n, m in recipe.model.named_modules() if isinstance(m, Float8Linear)
            for role, s in m.scaling_state.items()}


def bits(t):
    return t.detach().contiguous().view(-1).view(torch.int32)


def test_registered_with_te_defaults():
    names = list(RECIPES)
    i = names.index("fp8-current")
    assert names[i:i + 2] == FP8_RECIPES and names.index("fp32") < i
    for n in FP8_RECIPES:
        assert get_recipe(n).description and "\n" not in get_recipe(n).description
    cur, dly = get_recipe("fp8-current").fp8_recipe, get_recipe("fp8-delayed").fp8_recipe
    assert cur == CurrentScaling(fp8_format=Format.HYBRID)
    # TE DelayedScaling defaults (common/recipe/__init__.py) except the history length (TE's quickstart value)
    assert (dly.margin, dly.fp8_format, dly.amax_compute_algo, dly.scaling_factor_compute_algo) == \
        (0, Format.HYBRID, "max", None)
    assert dly.amax_history_len == AMAX_HISTORY_LEN == 16


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_fp8_exactly_on_the_block_linears(name, corpus):
    """Float8Linear on the four linears of every block; head, embeddings and norms untouched; the head still tied
    to tok_emb; every parameter FP32 and stepped by the optimizer directly (the FP32 weights are the master); the
    rest of the model computes in FP32 (no autocast), so the logits are FP32."""
    r = make(name, corpus)
    m = r.model
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, Float8Linear)}
    assert fp8 == FP8_LINEARS
    assert type(m.head) is nn.Linear and m.head.weight is m.tok_emb.weight
    assert type(m.tok_emb) is nn.Embedding and type(m.pos_emb) is nn.Embedding
    assert all(type(mod) is nn.LayerNorm for n, mod in m.named_modules() if "ln" in n.split(".")[-1])
    plain = {n for n, mod in m.named_modules() if type(mod) is nn.Linear}
    assert plain == {"head"}
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert [id(p) for g in r.optimizer.param_groups for p in g["params"]] == [id(p) for p in m.parameters()]
    assert all(mod.recipe == r.fp8_recipe for n, mod in m.named_modules() if n in fp8)
    x, _ = corpus.batch("train", B, SMALL.block_size, torch.Generator().manual_seed(0))
    with torch.no_grad(), r.forward_context():
        logits, _ = m(x)
    assert logits.dtype == torch.float32                                 # the non-FP8 compute stays FP32


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_a_training_step_runs_three_fp8_gemms_per_layer(name, corpus, monkeypatch):
    """Forward, input-gradient and weight-gradient GEMM of each FP8 layer take FP8 operands (E4M3 forward; an E5M2
    gradient operand in the backward, HYBRID) through torch._scaled_mm (on a CPU its bit-exact equivalent, the
    step ``scaled_mm`` of the layers' backend: ``tensor.scaled_mm`` or its kernel; the CPU backward upcasts dy, W and x
    once each for both GEMMs, the same bits); the head does not. Evaluation runs the forward GEMMs only."""
    import dataclasses
    from mpcourse.core.quant import backend
    calls, upcasts = [], []

    def spy_upcast(real):
        def spy(data, *args, **kwargs):
            upcasts.append(data.dtype)
            return real(data, *args, **kwargs)
        return spy

    def spying(real):
        def spy(a, b, *args, **kwargs):
            calls.append((a.dtype, b.dtype))
            return real(a, b, *args, **kwargs)
        return spy

    monkeypatch.setattr(torch, "_scaled_mm", spying(torch._scaled_mm))
    # both backends, rules and kernels alike: the layers built below take the spies
    for name_ in ("RULES", "KERNELS"):
        b = getattr(backend, name_)
        monkeypatch.setattr(backend, name_, dataclasses.replace(b, scaled_mm=spying(b.scaled_mm),
                                                                fp8_to_float32=spy_upcast(b.fp8_to_float32)))
    r = make(name, corpus)
    run(r, corpus, torch.Generator().manual_seed(0), 1)
    n = len(FP8_LINEARS)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert calls.count((e4, e4)) == n                                    # forward: x and W in E4M3
    backward_gemms = calls.count((e5, e4))     # dx = dy @ W and dW = dy^T @ x: dy in E5M2 first, E4M3 second
    if backward_gemms == 0:   # the CPU route: W and x upcast once, dy and its transposed codes (tests/core/quant/kernels/test_quant_fastpath.py)
        assert sorted(map(str, upcasts)) == sorted(map(str, [e5, e5, e4, e4] * n))
    else:
        assert backward_gemms == 2 * n and not upcasts
    assert len(calls) == n + backward_gemms
    calls.clear()
    evaluate(r, corpus, TrainConfig(batch_size=B, eval_batches=1, model=SMALL))
    assert len(calls) == 2 * n and set(calls) == {(e4, e4)}              # one batch per split, forward only


def test_delayed_state_follows_te_rule_and_eval_does_not_touch_it(corpus):
    """After one step every state has rolled once: amax_history = [0, ..., 0, amax of step 0] and
    scale = fp8_max / amax (TE's rule; scale 1.0 was used during step 0). The weight's amax is the FP32 weight's
    before the optimizer step; input and weight use E4M3's 448, the output gradient E5M2's 57344."""
    r = make("fp8-delayed", corpus)
    layers = {n: mod for n, mod in r.model.named_modules() if isinstance(mod, Float8Linear)}
    w_amax = {n: mod.weight.detach().abs().max() for n, mod in layers.items()}
    assert all(float(s.scale) == 1.0 for mod in layers.values() for s in mod.scaling_state.values())
    run(r, corpus, torch.Generator().manual_seed(0), 1)
    for n, mod in layers.items():
        for role, fp8_max in (("input", E4M3_MAX), ("weight", E4M3_MAX), ("grad_output", E5M2_MAX)):
            s = mod.scaling_state[role]
            h = s.amax_history
            assert h.shape == (AMAX_HISTORY_LEN,) and h.dtype == torch.float32
            assert torch.count_nonzero(h[:-1]) == 0 and h[-1] > 0, (n, role, h)
            assert torch.equal(s.scale, torch.tensor(fp8_max) / h[-1]), (n, role)
        assert torch.equal(mod.scaling_state["weight"].amax_history[-1], w_amax[n])
    before = fp8_states(r)
    evaluate(r, corpus, TrainConfig(batch_size=B, eval_batches=2, model=SMALL))
    after = fp8_states(r)
    assert all(torch.equal(before[k][0], after[k][0]) and torch.equal(before[k][1], after[k][1]) for k in before)


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_bytes_per_param(name, corpus):
    """FP32 weights (4 B), FP32 grads (4 B), no master copy, AdamW moments (8 B); extra = the FP8 scaling state:
    per FP8 layer 3 states x (scale + amax_history_len entries) x 4 B for delayed scaling, nothing for current."""
    r = make(name, corpus)
    n_params = sum(p.numel() for p in r.model.parameters())
    extra = len(FP8_LINEARS) * 3 * (1 + AMAX_HISTORY_LEN) * 4 if name == "fp8-delayed" else 0
    assert r.memory()["extra"] == extra
    res = train(name, corpus, TrainConfig(steps=1, batch_size=B, eval_batches=1, model=SMALL), progress=False)
    assert res.bytes_per_param == pytest.approx(
        {"weights": 4, "grads": 4, "master": 0, "optimizer": 8, "extra": extra / n_params})


def test_short_run_is_finite_and_close_to_fp32(corpus):
    """40 steps: every FP8 loss finite, the mean training loss of the last 10 steps and the final validation loss
    within 2% of FP32's (single steps may differ more: the batches are small)."""
    cfg = TrainConfig(steps=40, batch_size=8, eval_interval=40, eval_batches=4, model=SMALL)
    ref = train("fp32", corpus, cfg, progress=False)
    ref_losses = [h["loss"] for h in ref.history]
    assert ref_losses[-1] < ref_losses[0] - 0.5                          # it learns something
    for name in FP8_RECIPES:
        res = train(name, corpus, cfg, progress=False)
        losses = [h["loss"] for h in res.history]
        assert res.diverged_at is None and len(losses) == cfg.steps and all(map(math.isfinite, losses))
        assert abs(sum(losses[-10:]) - sum(ref_losses[-10:])) / sum(ref_losses[-10:]) < 0.02, name
        assert abs(res.final_val_loss - ref.final_val_loss) / ref.final_val_loss < 0.02, name
        assert losses != ref_losses                                      # FP8 really changed the numbers


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_resume_is_bit_for_bit(name, corpus):
    """Train 4 steps, checkpoint (recipe state + batch RNG), resume into a recipe built from another init, 4 more
    steps: equal to 8 uninterrupted steps in every loss, weight, AdamW moment and FP8 scale / amax history. For
    delayed scaling, resuming without the FP8 state (fresh scales of 1.0) is shown to give other losses."""
    full = make(name, corpus)
    ref = run(full, corpus, torch.Generator().manual_seed(0), 8)

    first = make(name, corpus)
    gen = torch.Generator().manual_seed(0)
    a = run(first, corpus, gen, 4)
    ckpt = copy.deepcopy({"recipe": first.state_dict(), "gen": gen.get_state()})
    del first

    def resume(load_fp8_state=True):
        r = make(name, corpus, seed=1)                                   # another init: loading must replace it
        r.load_state_dict(ckpt["recipe"])
        if not load_fp8_state:
            for mod in r.fp8_layers().values():
                mod._reset_scaling_state()
        g = torch.Generator()
        g.set_state(ckpt["gen"])
        return r, run(r, corpus, g, 4, start=4)

    resumed, b = resume()
    assert a + b == ref
    for p, q in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(bits(p), bits(q))
    sa, sb = resumed.optimizer.state_dict()["state"], full.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for n in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(bits(sa[k][n]), bits(sb[k][n]))
    fa, fb = fp8_states(resumed), fp8_states(full)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert torch.equal(bits(fa[k][0]), bits(fb[k][0])) and torch.equal(bits(fa[k][1]), bits(fb[k][1])), k
    if name == "fp8-delayed":
        assert len(fa) == 3 * len(FP8_LINEARS) and all(float(s) != 1.0 for s, _ in fa.values())
        _, b_fresh = resume(load_fp8_state=False)
        assert b_fresh != b                                              # the FP8 state is part of the run
    else:
        assert fa == {}
