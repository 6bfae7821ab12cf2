"""Distributed checkpoints (torch.distributed.checkpoint) resume bit for bit, on two gloo ranks.

The oracle is the run that was never interrupted: job 1 trains ``K`` steps, saves, and goes on to ``STEPS``;
job 2, in fresh processes, builds the trainer again, loads the checkpoint and trains the remaining steps. Both
record each rank's losses and its whole final state (its shards of the weights, the optimizer state, the FP8
scales and amax histories, the loss scaler); they must be equal, bit for bit (the same ops in the same order on
the same inputs: no tolerance is needed). The cases cover what a resume can lose: the FP32 master and the
scaler of ``fp16-dynamic``, the FP8 delayed-scaling state of ``fp8-delayed``, torch's ``ShardedGradScaler``,
the stochastic-rounding generator of ``bf16-pure-sr``, the sharded Kahan compensation of ``bf16-pure-kahan``
under FSDP2; under DDP (replicated) and FSDP2 (sharded). A planted
bug (the FP8 state reset after the load) shows the comparison can fail.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from mpcourse.experiment.parallel.distributed import init_ranks, ranks, rendezvous
from mpcourse.core.checkpoint import CheckpointError
from mpcourse.core.quant import Float8Linear
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.parallel.distributed import DataParallelTrainer, spawn
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.parallel.data_parallel import local
from mpcourse.experiment.training.train import TrainConfig

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

K, STEPS = 2, 4
CFG = TrainConfig(steps=STEPS, batch_size=8, eval_interval=1000, eval_batches=1,
                  model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
CASES = [("ddp", "fp16-dynamic"), ("ddp", "fp8-delayed"), ("ddp", "bf16-pure-sr"),
         ("fsdp", "fp16-dynamic"), ("fsdp", "fp8-delayed"), ("fsdp", "torch-amp-fp16"), ("fsdp", "bf16-pure-sr"),
         ("fsdp", "bf16-pure-kahan")]
#: the low-precision optimizer states: quantized moments (their fmt, state_rule and block size travel in the param
#: groups), BF16 moments, and BF16 moments rounded stochastically (each rank's generators)
LOW_STATE = ("fp8-moments", "int8-moments", "bf16-master-bf16-moments", "bf16-master-bf16-moments-sr")
CASES += [(parallel, name) for name in LOW_STATE for parallel in ("ddp", "fsdp")]


def _localize(obj):
    """A recipe state_dict with every DTensor replaced by this rank's shard (plain tensors, picklable)."""
    if isinstance(obj, dict):
        return {k: _localize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_localize(v) for v in obj]
    return local(obj).clone() if isinstance(obj, torch.Tensor) else obj


def _record(t):
    return {"losses": [h["loss"] for h in t.history], "state": _localize(t.recipe.state_dict()),
            "step": t.step}


def _uninterrupted(rank, init_method, d):
    """Job 1: K steps, save, then on to STEPS (the run that was never interrupted)."""
    with ranks(rank, 2, init_method, threads=1):
        corpus, res = load_corpus(None), {}
        for parallel, name in CASES:
            t = DataParallelTrainer(name, corpus, CFG, parallel).run(steps=K)
            t.save(os.path.join(d, f"{parallel}-{name}"))
            res[(parallel, name)] = _record(t.run())
        torch.save(res, os.path.join(d, f"full{rank}.pt"))


def _resumed(rank, init_method, d):
    """Job 2, fresh processes: load each checkpoint and train to STEPS; plus the planted bug."""
    with ranks(rank, 2, init_method, threads=1):
        corpus, res = load_corpus(None), {}
        for parallel, name in CASES:
            t = DataParallelTrainer(name, corpus, CFG, parallel).load(os.path.join(d, f"{parallel}-{name}"))
            res[(parallel, name, "at")] = t.step
            res[(parallel, name)] = _record(t.run())
        t = DataParallelTrainer("fp8-delayed", corpus, CFG, "fsdp").load(os.path.join(d, "fsdp-fp8-delayed"))
        for m in t.recipe.model.modules():
            if isinstance(m, Float8Linear):
                m._reset_scaling_state()                       # planted: scales 1, amax histories 0
        res["planted"] = _record(t.run())
        res["other rule"] = _other_rule(corpus, os.path.join(d, "fsdp-fp8-moments"))
        torch.save(res, os.path.join(d, f"resumed{rank}.pt"))


def _other_rule(corpus, path):
    """An fp8-moments checkpoint (state_rule 'sqrt-nonzero') loaded by a trainer whose optimizer stores torchao's
    rule: the error, and whether the trainer's weights stayed as built."""
    from mpcourse.core.optim.blockwise import BlockQuantizedAdamW

    t = DataParallelTrainer("fp8-moments", corpus, CFG, "fsdp")
    o = t.recipe.optim
    t.recipe.optimizer = BlockQuantizedAdamW(list(t.recipe.model.parameters()), lr=o.lr, betas=o.betas, eps=o.eps,
                                             weight_decay=o.weight_decay, fmt="fp8", state_rule="torchao")
    before = [local(p).detach().clone() for p in t.recipe.model.parameters()]
    try:
        t.load(path)
        error = None
    except CheckpointError as e:
        error = str(e)
    after = [local(p) for p in t.recipe.model.parameters()]
    return {"error": error, "untouched": all(torch.equal(a, b) for a, b in zip(before, after))}


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as d:
        spawn(_uninterrupted, 2, (rendezvous(d), d))
        spawn(_resumed, 2, (rendezvous(d), d))
        load = lambda f: torch.load(os.path.join(d, f), weights_only=False)  # noqa: E731
        yield {"full": [load(f"full{r}.pt") for r in range(2)],
               "resumed": [load(f"resumed{r}.pt") for r in range(2)], "dir": d}


def _assert_equal_bits(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_equal_bits(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_bits(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = lambda t: t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t  # noqa: E731
        assert torch.equal(bits(a), bits(b)), where                # -0.0 != 0.0, NaN payloads compared
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,name", CASES)
def test_resume_in_fresh_processes_is_bit_for_bit(runs, parallel, name):
    for rank in range(2):
        full, resumed = runs["full"][rank][(parallel, name)], runs["resumed"][rank][(parallel, name)]
        assert runs["resumed"][rank][(parallel, name, "at")] == K
        assert resumed["step"] == full["step"] == STEPS
        assert resumed["losses"] == full["losses"]            # the K saved ones and the STEPS - K after
        _assert_equal_bits(full["state"], resumed["state"], f"rank {rank} {parallel} {name}")


@pytest.mark.slow
def test_the_fp8_state_is_in_the_checkpoint_and_losing_it_shows(runs):
    """The FP8 scales moved off 1 during the K saved steps; a resume that drops them trains differently."""
    full = runs["full"][0][("fsdp", "fp8-delayed")]
    extra = [v for k, v in full["state"]["model"].items() if k.endswith("_extra_state")]
    assert extra and all((row[:, 0] != 1).any() for row in extra)   # [scale, *amax_history] per role
    planted = runs["resumed"][0]["planted"]
    assert planted["losses"][:K] == full["losses"][:K]
    assert planted["losses"][K:] != full["losses"][K:]


def _one_rank_group(directory):
    init_ranks(0, 1, rendezvous(directory), timeout_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,name,match", [
    ("ddp", "fp16-dynamic", r"world size mismatch: the checkpoint was saved by 2 ranks, this job has 1: resume "
                            r"with --nproc 2"),
    ("fsdp", "fp16-dynamic", r"parallel mismatch: the checkpoint was saved with --parallel ddp, this job uses fsdp"),
    ("ddp", "fp16-static", r"recipe mismatch: the checkpoint was saved with recipe fp16-dynamic"),
])
def test_a_mismatched_job_is_refused_by_name(runs, parallel, name, match):
    import json
    from mpcourse.experiment.parallel import dist_checkpoint

    path = os.path.join(runs["dir"], "ddp-fp16-dynamic")
    _one_rank_group(runs["dir"])
    try:
        t = DataParallelTrainer(name, load_corpus(None), CFG, parallel)
        meta = dist_checkpoint.read_meta(path)
        if parallel != "ddp" or name != "fp16-dynamic":
            meta = {**meta, "world_size": 1}               # so that the other mismatch is the first one found
        with pytest.raises(CheckpointError, match=match):
            dist_checkpoint.check_compatible(meta, t)
        if (parallel, name) == ("ddp", "fp16-dynamic"):
            with pytest.raises(CheckpointError, match=match):
                t.load(path)                                # the trainer's API checks first, reads nothing
            with pytest.raises(CheckpointError, match="not a distributed checkpoint"):
                t.load(os.path.join(runs["dir"], "nowhere"))
        assert json.loads(json.dumps(meta))["format"] == dist_checkpoint.FORMAT
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_quantized_state_of_another_rule_is_refused_before_anything_loads(runs):
    """The checkpoint's exp_avg_sq codes hold sqrt(v); an optimizer storing v would read them as v: refused, naming
    both rules and the one to build, before the trainer's weights are touched."""
    for rank in range(2):
        got = runs["resumed"][rank]["other rule"]
        assert got["error"] is not None and got["untouched"]
        assert ("stored with state_rule='sqrt-nonzero' and this optimizer uses state_rule='torchao': build "
                "BlockQuantizedAdamW(..., state_rule='sqrt-nonzero')") in got["error"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel,name,refused", [
    ("fsdp", "fp8-moments", r"how its quantized moments are stored \(fmt, state_rule, block_size\): its "
                            r"exp_avg_sq codes could be read as v where they hold sqrt\(v\)"),
    ("ddp", "int8-moments", "how its quantized moments are stored"),
    ("ddp", "bf16-master-bf16-moments-sr", "its stochastic-rounding generators: its draws would not continue"),
    ("ddp", "fp16-dynamic", None), ("fsdp", "bf16-master-bf16-moments", None),
])
def test_an_older_checkpoint_is_refused_where_it_lacks_what_the_optimizer_needs(runs, parallel, name, refused):
    """Format 1 (before the storage record and the generators were saved): refused, saying what it lacks and what
    to do, for the optimizers that need them; the others still resume from it."""
    from mpcourse.experiment.parallel import dist_checkpoint

    _one_rank_group(runs["dir"])
    try:
        t = DataParallelTrainer(name, load_corpus(None), CFG, parallel)
        meta = {**dist_checkpoint.read_meta(os.path.join(runs["dir"], f"{parallel}-{name}")), "format": 1,
                "world_size": 1}
        if refused is None:
            dist_checkpoint.check_compatible(meta, t)
        else:
            with pytest.raises(CheckpointError, match=rf"format 1\), which did not save, of recipe {name}'s "
                                                      rf"optimizer, {refused}.*\. Resume it with the mpcourse "
                                                      "version that wrote it, or start the run again"):
                dist_checkpoint.check_compatible(meta, t)
    finally:
        dist.destroy_process_group()
