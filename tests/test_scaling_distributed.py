"""The loss scalers over two gloo ranks on the CPU: one rank alone overflows, both ranks skip together.

Oracle: FSDP's ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py), which all-reduces the
inf/NaN flag with MAX before the skip decision, run side by side on the same gradients in the same processes.
Without the all-reduce the overflowing rank would skip and back off while the other steps and keeps its scale,
and the ranks' weights and scales would drift apart.
"""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mpcourse.experiment.distributed import free_port
from mpcourse.core import distributed
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

INF = float("inf")
# True gradients per step; rank 1 alone overflows at step 1 (inf) and at step 3 (NaN).
GRADS = {0: [[1.0, -2.0], [0.5, 0.25], [1.0, 1.0], [-0.5, 2.0], [3.0, 1.0]],
         1: [[2.0, 1.0], [INF, 0.5], [1.0, -1.0], [float("nan"), 0.0], [1.0, 1.0]]}


def _run(scaler, rank, steps=None):
    """SGD on one parameter with the given per-rank gradients; returns per-step (skipped, scale after, weight)."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    out = []
    for g in GRADS[rank][:steps]:
        opt.zero_grad()
        w.grad = scaler.scale(torch.tensor(g))  # the grad of scale * <w, g>
        before = w.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((bool(torch.equal(before, w.detach())), scaler.get_scale(), w.detach().clone()))
    return out


def _no_grad_rank(rank):
    """Rank 0 has no gradient at all this iteration (an empty shard); rank 1 overflows. Both must skip."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s = DynamicLossScaler(init_scale=8.0)
    s.scale(torch.ones(()))
    if rank == 1:
        w.grad = torch.tensor([INF, 0.0])
    s.step(opt)
    s.update()
    return s.get_scale(), s.last_step_skipped


def _worker(rank, world_size, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))  # a missed collective fails, never hangs
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        flag = torch.tensor([float(rank), 5.0 - rank])
        res = {
            "world_size": distributed.world_size(),
            "max": distributed.all_reduce_max_(flag).tolist(),
            "ours": _run(DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2), rank),
            "oracle": _run(ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2), rank),
            "static": _run(StaticLossScaler(4.0), rank, steps=2),
            "no_grad": _no_grad_rank(rank),
        }
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_single_process_helpers_are_no_ops():
    t = torch.tensor([1.0, -3.0])
    assert not distributed.is_initialized()
    assert distributed.world_size() == 1
    assert distributed.all_reduce_max_(t) is t and t.tolist() == [1.0, -3.0]


@pytest.mark.slow
def test_one_rank_overflows_both_skip_with_the_same_scale():
    with tempfile.TemporaryDirectory() as d:  # one spawn for all cases: starting ranks is the slow part
        mp.spawn(_worker, args=(2, free_port(), d), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(2)]
    assert [r["world_size"] for r in res] == [2, 2]
    assert [r["max"] for r in res] == [[1.0, 5.0]] * 2
    for r in res:
        skipped = [s for s, _, _ in r["ours"]]
        assert skipped == [s for s, _, _ in r["oracle"]] == [False, True, False, True, False]
        assert [sc for _, sc, _ in r["ours"]] == [sc for _, sc, _ in r["oracle"]]
        for (_, _, w), (_, _, w_ref) in zip(r["ours"], r["oracle"]):
            assert torch.equal(w, w_ref)
        assert [s for s, _, _ in r["static"]] == [False, True]
    # the same scale trajectory on both ranks: 1024, backoff at step 1 -> 512, grow after 2 clean -> ...
    assert [sc for _, sc, _ in res[0]["ours"]] == [sc for _, sc, _ in res[1]["ours"]] == [
        1024.0, 512.0, 512.0, 256.0, 256.0]
    assert res[0]["no_grad"] == res[1]["no_grad"] == (4.0, True)
