"""Blockwise-quantized AdamW (``fp8-moments``, ``int8-moments``) on FSDP2 shards over 2 and 3 gloo ranks.

The oracle is the same optimizer in this process on the whole tensors. Under FSDP2 a parameter is a DTensor split
by rows as ``torch.chunk`` splits it, so a rank's rows need not start or end on a block of 256: 144 x 48 on 2
ranks (13.5 blocks each, ``n_embd=48``'s attention weight), 64 x 64 on 3 ranks (22, 22 and 20 rows: 5.5, 5.5 and 5
blocks; ``n_embd=64``'s attention projection), 2 x 2048 on 3 ranks (one rank holds no row). The optimizer keeps
the whole tensor's blocks (``mpcourse.core.optim.shards``: block amaxes all-reduced with MAX), so given the same
gradients each rank's rows of the weights, the codes and the dequantized moments are the one-process ones bit for
bit, and every rank holds the one-process scales. Before, the step raised DTensor's own errors ("Sharding
propagation failed for aten.view.default", "Cannot unflatten unevenly sharded tensor").

Whole runs (``DataParallelTrainer``, FSDP2) cannot be compared bit for bit with one process: the gradients are
reduce-scattered, the same numbers added in another order (tests/experiment/parallel/test_distributed.py). They
are compared with ``fp32``'s FSDP2 tolerance (rtol 1e-5; measured here about 1e-7), every rank reporting the same
losses. ``mpcourse compare --parallel fsdp --nproc 3 --batch-size 12 --recipes fp8-moments`` runs end to end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mpcourse
from mpcourse.core.optim.blockwise import BlockQuantizedAdamW
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.parallel.distributed import DataParallelTrainer, ranks, rendezvous, spawn
from mpcourse.experiment.training.train import TrainConfig, Trainer

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
              pytest.mark.slow]

#: (rows, cols): quantized and cut mid-block (144 x 48 on 2 ranks; 64 x 64 on 3), quantized and cut on block
#: boundaries (64 x 128), one empty shard on 3 ranks (2 x 2048), a 1-D one, and two that keep FP32 moments (under
#: 4096 elements; not a multiple of 256)
SHAPES = [(144, 48), (64, 64), (64, 128), (2, 2048), (4096,), (48,), (100, 48)]
RULES = [("fp8", "sqrt-nonzero"), ("int8", "sqrt-nonzero"), ("fp8", "torchao"), ("int8", "torchao")]
STEPS = 5
#: the whole runs: n_embd 48 on 2 ranks (its 144-row attention weight splits a block), 64 on 3 ranks (64-row
#: weights: 22 + 22 + 20 rows)
RUNS = {2: TrainConfig(steps=3, batch_size=8, eval_interval=1000, eval_batches=1,
                       model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=48)),
        3: TrainConfig(steps=3, batch_size=12, eval_interval=1000, eval_batches=1,
                       model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64))}
RECIPES = ("fp8-moments", "int8-moments")


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    # loud, then quieter: the moments cross many binades, blocks of very different amax side by side
    grads = [[torch.randn(s, generator=gen) * 10.0 ** (-(t + i) % 5) for i, s in enumerate(SHAPES)]
             for t in range(STEPS)]
    return params, grads


def _optimizer(params, fmt, rule):
    return BlockQuantizedAdamW(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, fmt=fmt, state_rule=rule)


def _sharded_steps(world):
    """Every rule's optimizer over DTensor shards of ``SHAPES`` (the same gradients on every rank): this rank's
    weights, moments and stored tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for fmt, rule in RULES:
        full, grads = _tensors(0)
        params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in full]
        opt = _optimizer(params, fmt, rule)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = distribute_tensor(gi, mesh, [Shard(0)])
            opt.step()
        out[(fmt, rule)] = {
            "params": [p.to_local().detach().clone() for p in params],
            "moments": [[m.clone() for m in opt.moments(p)] for p in params],
            "stored": [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in opt.state[p].items()}
                       for p in params]}
    return out


def _whole_runs(world):
    corpus = load_corpus(None)
    out = {}
    for name in RECIPES:
        t = DataParallelTrainer(name, corpus, RUNS[world], "fsdp").run()
        codes = {str(st["exp_avg"].to_local().dtype) for st in t.recipe.optimizer.state.values()
                 if "exp_avg_scale" in st}                            # the quantized moments' codes
        out[name] = {"losses": [h["loss"] for h in t.history], "codes": codes}
    return out


def _worker(rank, world, init_method, out_dir):
    with ranks(rank, world, init_method, threads=1):
        res = {"steps": _sharded_steps(world), "runs": _whole_runs(world)}
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def sharded(request):
    world = request.param
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, (world, rendezvous(d), d))
        return world, [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def _rows(n, world, rank):
    """The rows of ``n`` that ``rank`` holds: ``torch.chunk``'s split, as DTensor's ``Shard(0)`` and FSDP2 make it."""
    chunks = torch.arange(n).chunk(world)
    return chunks[rank] if rank < len(chunks) else torch.arange(0)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("fmt,rule", RULES)
def test_sharded_step_gives_the_one_process_bits(sharded, fmt, rule):
    world, got = sharded
    full, grads = _tensors(0)
    params = [torch.nn.Parameter(p.clone()) for p in full]
    opt = _optimizer(params, fmt, rule)
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
    for rank, res in enumerate(got):
        mine = res["steps"][(fmt, rule)]
        for i, p in enumerate(params):
            rows = _rows(p.shape[0], world, rank)
            where = f"rank {rank} of {world}, {fmt}/{rule}, {tuple(p.shape)}"
            assert torch.equal(_bits(mine["params"][i]), _bits(p.detach()[rows])), where
            for a, b in zip(mine["moments"][i], opt.moments(p)):
                assert torch.equal(_bits(a), _bits(b[rows])), where
            st, one = mine["stored"][i], opt.state[p]
            assert set(st) == set(one), where                  # quantized exactly where one process quantizes
            for k, v in one.items():
                want = v if k.endswith("_scale") or k == "step" else v[rows]   # every block's scale on every rank
                assert st[k].dtype == v.dtype and torch.equal(_bits(st[k]) if v.dim() else st[k],
                                                              _bits(want) if v.dim() else want), (where, k)


def test_the_cut_blocks_are_there(sharded):
    """The case the test is about occurs: a shard boundary inside a block of a quantized tensor, and an empty
    shard (3 ranks)."""
    world, got = sharded
    rows = {2: (144, 48), 3: (64, 64)}[world]
    boundaries = [len(torch.cat([_rows(rows[0], world, r) for r in range(k)])) * rows[1] for k in range(1, world)]
    assert any(b % 256 for b in boundaries) and rows[0] * rows[1] % 256 == 0   # quantized, a block cut in two
    if world == 3:
        empty = got[2]["steps"][("fp8", "sqrt-nonzero")]["params"][SHAPES.index((2, 2048))]
        assert empty.numel() == 0


@pytest.mark.parametrize("name", RECIPES)
def test_fsdp_runs_follow_one_process(sharded, name):
    world, got = sharded
    losses = [res["runs"][name]["losses"] for res in got]
    assert all(x == losses[0] for x in losses)                      # every rank the same losses
    assert got[0]["runs"][name]["codes"] == {"torch.float8_e4m3fn" if name == "fp8-moments" else "torch.uint8"}
    one = Trainer(name, load_corpus(None), RUNS[world]).run()
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor([h["loss"] for h in one.history]),
                               rtol=1e-5, atol=0)


def test_the_cli_runs_fp8_moments_on_three_uneven_ranks():
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "mpcourse", "compare", "--parallel", "fsdp", "--nproc", "3", "--batch-size", "12",
               "--recipes", "fp8-moments", "--steps", "2", "--no-progress", "--out", out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(Path(mpcourse.__file__).parents[1])})
        assert run.returncode == 0, run.stderr[-2000:]
        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)["results"]
        assert [r["recipe"] for r in results] == ["fp8-moments"] and len(results[0]["history"]) == 2
