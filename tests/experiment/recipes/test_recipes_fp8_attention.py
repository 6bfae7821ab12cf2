"""The FP8 attention recipes (fp8-attention, fp8-attention-current): registered outside the default run, FP8
attention in every block under the linears' recipe, the rule's products in a training step, state in checkpoints
(resume bit for bit), the state counted in memory, and losses near fp8-delayed's."""
import copy
import math

import pytest
import torch

from mpcourse.core.attention import layer as attention_layer
from mpcourse.core.attention.fp8_attention import ROLES
from mpcourse.core.attention.layer import FP8DotProductAttention
from mpcourse.core.quant import Float8Linear
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import NOT_IN_DEFAULT_RUN, RECIPES, get_recipe
from recipe_loop import make_recipe, run_steps

SMALL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
NAMES = ["fp8-attention", "fp8-attention-current"]
B = 4


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def make(name, corpus, seed=0):
    return make_recipe(name, corpus, SMALL, seed)


def run(recipe, corpus, gen, steps, start=0):
    return [loss for loss, _ in run_steps(recipe, corpus, gen, steps, block_size=SMALL.block_size, batch_size=B,
                                          start=start)]


def states(recipe):
    """{(layer, role): (scale, history)} of every FP8 state: the linears' and the attention modules'."""
    out = {(n, r): (s.scale.clone(), s.amax_history.clone()) for n, m in recipe.attention_layers().items()
           for r, s in m.scaling_state.items()}
    out.update({(n, r): (s.scale.clone(), s.amax_history.clone()) for n, m in recipe.fp8_layers().items()
                for r, s in m.scaling_state.items()})
    return out


def test_registered_beside_their_linear_recipes_and_not_in_the_default_run():
    names = list(RECIPES)
    assert names.index("fp8-attention") == names.index("fp8-delayed-fp8-weights") + 1
    assert names.index("fp8-attention-current") == names.index("fp8-attention") + 1
    assert set(NAMES) <= set(NOT_IN_DEFAULT_RUN)
    assert get_recipe("fp8-attention").fp8_recipe == get_recipe("fp8-delayed").fp8_recipe
    assert get_recipe("fp8-attention-current").fp8_recipe == get_recipe("fp8-current").fp8_recipe


@pytest.mark.parametrize("name", NAMES)
def test_every_block_attends_in_fp8_under_the_linears_recipe(name, corpus, monkeypatch):
    r = make(name, corpus)
    layers = r.attention_layers()
    assert set(layers) == {f"blocks.{i}.attn.core_attention" for i in range(SMALL.n_layer)}
    assert all(m.recipe is r.fp8_recipe and m.roles == ROLES for m in layers.values())
    want = set(ROLES) if name == "fp8-attention" else {"s", "dp"}
    assert all(set(m.scaling_state) == want for m in layers.values())
    calls = []
    real = attention_layer.attention_backward
    monkeypatch.setattr(attention_layer, "attention_backward",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    losses = run(r, corpus, torch.Generator().manual_seed(0), 2)
    assert len(calls) == 2 * SMALL.n_layer and all(math.isfinite(x) for x in losses)
    for m in layers.values():                     # every attention tensor's amax was recorded and used
        assert all(float(s.scale) != 1.0 for s in m.scaling_state.values())
    extra = r.memory()["extra"]
    linear_bytes = sum(4 * (1 + s.amax_history.numel()) for m in r.fp8_layers().values()
                       for s in m.scaling_state.values())
    attention_bytes = sum(4 * (1 + s.amax_history.numel()) for m in layers.values() for s in m.scaling_state.values())
    assert extra == linear_bytes + attention_bytes and attention_bytes > 0


@pytest.mark.parametrize("name", NAMES)
def test_resume_is_bit_for_bit(name, corpus):
    """4 steps, checkpoint, resume into a recipe from another init, 4 more: equal to 8 steps in every loss, weight
    and FP8 state, the attention's included; resuming without the attention's state gives other losses."""
    full = make(name, corpus)
    ref = run(full, corpus, torch.Generator().manual_seed(0), 8)
    first = make(name, corpus)
    gen = torch.Generator().manual_seed(0)
    a = run(first, corpus, gen, 4)
    ckpt = copy.deepcopy({"recipe": first.state_dict(), "gen": gen.get_state()})
    assert all(f"blocks.{i}.attn.core_attention._extra_state" in ckpt["recipe"]["model"]
               for i in range(SMALL.n_layer))

    def resume(drop_attention_state=False):
        r = make(name, corpus, seed=1)
        r.load_state_dict(ckpt["recipe"])
        if drop_attention_state:
            for m in r.attention_layers().values():
                m._reset_scaling_state()
        g = torch.Generator()
        g.set_state(ckpt["gen"])
        return r, run(r, corpus, g, 4, start=4)

    resumed, b = resume()
    assert a + b == ref
    for p, q in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(p, q)
    sa, sb = states(resumed), states(full)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k][0], sb[k][0]) and torch.equal(sa[k][1], sb[k][1]) for k in sa)
    _, b_fresh = resume(drop_attention_state=True)
    assert b_fresh != b


def test_losses_near_fp8_delayed(corpus):
    """Ten steps: FP8 attention changes the losses (it is on) by little (|gap| < 1% of the loss)."""
    losses = {n: run(make(n, corpus), corpus, torch.Generator().manual_seed(0), 10)
              for n in ("fp8-delayed", "fp8-attention")}
    assert losses["fp8-delayed"] != losses["fp8-attention"]
    assert abs(losses["fp8-attention"][-1] - losses["fp8-delayed"][-1]) < 0.01 * losses["fp8-delayed"][-1]


def test_dropout_refused(corpus):
    from mpcourse.experiment.gpt.model import GPT
    from mpcourse.experiment.recipes import OptimConfig

    model = GPT(GPTConfig(**{**SMALL.__dict__, "vocab_size": corpus.vocab_size, "dropout": 0.1}))
    with pytest.raises(ValueError, match="dropout"):
        get_recipe("fp8-attention")(model, OptimConfig())
    assert not any(isinstance(m, (FP8DotProductAttention, Float8Linear)) for m in model.modules())   # untouched
