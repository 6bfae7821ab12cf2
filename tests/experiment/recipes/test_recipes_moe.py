"""The mixture-of-experts rows (mpcourse.experiment.recipes.moe): the MoE twin of the run's model, the experts'
format each row's region gives, the routing statistics each step records, and the BF16-router ablation."""
import pytest
import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPT, GPTConfig, to_moe
from mpcourse.experiment.recipes import MOE_RECIPES, NOT_IN_DEFAULT_RUN, RECIPES, TABLE_ORDER, get_recipe

from recipe_loop import make_recipe, run_steps

SMALL = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=128)
FORMAT = {"moe-fp32": "fp32", "moe-bf16": "bf16", "moe-fp8-rowwise": "fp8-rowwise", "moe-fp8-block": "fp8-block",
          "moe-mxfp8": "mxfp8", "moe-bf16-router": "fp32"}


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_the_rows_are_registered_last_and_named_apart_from_the_default_run():
    assert list(RECIPES)[-6:] == list(MOE_RECIPES) == list(TABLE_ORDER[-6:]) == list(FORMAT)
    assert set(MOE_RECIPES) <= set(NOT_IN_DEFAULT_RUN)


def test_the_moe_twin_shares_every_dense_weight_and_leaves_the_rng_alone(corpus):
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**{**SMALL.__dict__, "vocab_size": corpus.vocab_size}))
    state = torch.get_rng_state()
    twin = to_moe(dense, n_experts=4, top_k=2)
    assert torch.equal(torch.get_rng_state(), state)
    twin_state = twin.state_dict()
    for k, v in dense.state_dict().items():
        assert (".mlp." in k) != (k in twin_state and torch.equal(twin_state[k], v)), k
    again = to_moe(dense, n_experts=4, top_k=2)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="n_experts > 0"):
        to_moe(dense, n_experts=0)


@pytest.mark.parametrize("name", list(MOE_RECIPES))
def test_each_row_trains_its_experts_in_its_format_and_records_the_routing(name, corpus):
    recipe = make_recipe(name, corpus, SMALL)
    fp32 = make_recipe("moe-fp32", corpus, SMALL)
    start = fp32.model.state_dict()
    for k, a in recipe.model.state_dict().items():
        if k in start:
            assert torch.equal(a.float(), start[k].float()), k                  # every row starts from one model
    with recipe.forward_context():
        assert recipe.model.blocks[0].mlp.format_in_effect(torch.zeros(1, 128)).name == FORMAT[name]
    out = run_steps(recipe, corpus, torch.Generator().manual_seed(0), 2, block_size=32, batch_size=8)
    for loss, result in out:
        assert torch.isfinite(torch.tensor(loss))
        counts = result.stats["tokens_per_expert"]
        assert len(counts) == 1 and len(counts[0]) == 4 and sum(counts[0]) == 8 * 32 * 2
        assert ("routing_flipped" in result.stats) == (name == "moe-bf16-router")
    if name == "moe-bf16-router":
        assert all(0.0 <= f <= 1.0 for _, r in out for f in r.stats["routing_flipped"])
        assert recipe.model.blocks[0].mlp.router_dtype == torch.bfloat16


def test_the_rows_take_no_learner_function_the_experts_would_ignore():
    """Only lesson 13's functions, which the MoE layer and its grouped GEMM call (the FP8 rows; group_scales is
    rowwise's own); no quantizer or cast rule that would reach the attention's linears and not the experts."""
    padding = ("pad_token_groups", "unpad_token_groups")
    want = {"moe-fp8-rowwise": padding + ("group_scales",), "moe-fp8-block": padding, "moe-mxfp8": padding}
    for name in MOE_RECIPES:
        assert get_recipe(name).OVERRIDABLE == want.get(name, ()), name
