"""The master copy is always FP32: a master-weights recipe given a model already in BF16/FP16 keeps FP32 master
weights and FP32 optimizer state, in one process (``MasterWeights``) and under FSDP2 (``ShardedMasterRecipe``,
where the sharded parameters are the master) - never a silent BF16/FP16 optimizer.

Oracle: the same recipe built over the FP32 model whose values are those of the low-precision one (an exact
upcast): the masters and, after a step, the optimizer state must be equal bit for bit. FSDP2 runs on a one-rank
gloo group in this process (file rendezvous, no port).
"""
import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.parallel.distributed import init_ranks, rendezvous
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.training.train import TrainConfig, Trainer

CASES = [("bf16-master", torch.bfloat16), ("fp16-master", torch.float16), ("fp16-dynamic", torch.float16),
         ("bf16-master-bf16-moments", torch.bfloat16)]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _models(corpus, dtype):
    torch.manual_seed(0)
    low = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_size=corpus.vocab_size)).to(dtype)
    return low, copy.deepcopy(low).float()                     # the same values, in FP32 (exact)


def _step_and_state(recipe, corpus):
    cfg = TrainConfig(steps=1, batch_size=2, eval_interval=100, eval_batches=1, model=GPTConfig(block_size=16))
    Trainer.wrap(recipe, corpus, cfg, evaluate=False).train_step()
    params = list(recipe.optimizer.param_groups[0]["params"])
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return ([local(p).detach().clone() for p in params],
            [{k: local(v).clone() for k, v in recipe.optimizer.state[p].items() if v.dim()} for p in params])


def _check(name, dtype, got, want):
    (gp, gs), (wp, ws) = got, want
    assert {p.dtype for p in gp} == {torch.float32}, name
    moments = torch.bfloat16 if name == "bf16-master-bf16-moments" else torch.float32
    assert {v.dtype for st in gs for v in st.values()} == {moments}, name
    assert all(torch.equal(a, b) for a, b in zip(gp, wp))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(gs, ws) for k in a)


@pytest.mark.parametrize("name,dtype", CASES)
def test_one_process_masters_and_state_are_fp32_for_a_low_precision_model(corpus, name, dtype):
    low, full = _models(corpus, dtype)
    cls = get_recipe(name)
    _check(name, dtype, _step_and_state(cls(low), corpus), _step_and_state(cls(full), corpus))


@pytest.fixture(scope="module")
def one_rank_group():
    with tempfile.TemporaryDirectory() as d:
        init_ranks(0, 1, rendezvous(d), timeout_s=60)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("name,dtype", CASES)
def test_fsdp2_masters_and_state_are_fp32_for_a_low_precision_model(corpus, one_rank_group, name, dtype):
    from mpcourse.experiment.parallel.data_parallel import shard_recipe

    low, full = _models(corpus, dtype)
    cls = get_recipe(name)
    got = _step_and_state(shard_recipe(cls, low, None), corpus)
    _check(name, dtype, got, _step_and_state(shard_recipe(cls, full, None), corpus))


def test_fsdp2_refuses_a_non_fp32_master_naming_the_fix(corpus, one_rank_group):
    from mpcourse.experiment.parallel.data_parallel import ShardedMasterRecipe

    low, _ = _models(corpus, torch.bfloat16)
    recipe = ShardedMasterRecipe(get_recipe("bf16-master"), low, None)
    with pytest.raises(ValueError, match=r"master copy must be FP32, got parameters in torch.bfloat16.*model.float\(\)"):
        recipe.make_optimizer([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
