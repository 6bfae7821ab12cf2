"""The loss scalers over two gloo ranks on the CPU: one rank alone overflows, both ranks skip together.

Oracle: FSDP's ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py), which all-reduces the
inf/NaN flag with MAX before the skip decision, run side by side on the same gradients in the same processes.
Without the all-reduce the overflowing rank would skip and back off while the other steps and keeps its scale,
and the ranks' weights and scales would drift apart.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from mpcourse.experiment.parallel.distributed import ranks, rendezvous, spawn
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


def _disagreeing_scalers(rank):
    """The ranks' scalers checked against each other: what each case raised (None: it stepped)."""
    def one(make, change=None, steps=2):
        w = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([w], lr=0.1)
        s = make()
        try:
            for i in range(steps):
                if change is not None and i == 1:
                    change(s)
                w.grad = s.scale(torch.tensor([1.0, 2.0]))
                s.step(opt)
                s.update()
        except RuntimeError as e:
            return (i, str(e))
        return None

    dyn = lambda: DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)  # noqa: E731
    sd = dyn().state_dict()
    return {
        "agree": one(dyn),
        "init": one(lambda: DynamicLossScaler(init_scale=2.0 ** (10 + rank))),            # hand-set per rank
        "resume one rank": one(dyn, (lambda s: s.load_state_dict({**sd, "scale": 2.0 ** 4})) if rank == 1 else None),
        "tracker": one(dyn, (lambda s: s.load_state_dict({**sd, "_growth_tracker": 2})) if rank == 0 else None),
        "resume all": one(dyn, lambda s: s.load_state_dict({**sd, "scale": 2.0 ** 4})),
        "new_scale one rank": one(dyn, (lambda s: s.update(new_scale=8.0)) if rank == 1 else None, steps=3),
        "static": one(lambda: StaticLossScaler(4.0 * (rank + 1))),
    }


def _worker(rank, world_size, init_method, out_dir):
    with ranks(rank, world_size, init_method, threads=1):  # a missed collective fails after the timeout, never hangs
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        flag = torch.tensor([float(rank), 5.0 - rank])
        res = {
            "world_size": distributed.world_size(),
            "max": distributed.all_reduce_max_(flag).tolist(),
            "ours": _run(DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2), rank),
            "oracle": _run(ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2), rank),
            "static": _run(StaticLossScaler(4.0), rank, steps=2),
            "no_grad": _no_grad_rank(rank),
            "disagree": _disagreeing_scalers(rank),
        }
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


def test_single_process_helpers_are_no_ops():
    t = torch.tensor([1.0, -3.0])
    assert not distributed.is_initialized()
    assert distributed.world_size() == 1
    assert distributed.all_reduce_max_(t) is t and t.tolist() == [1.0, -3.0]


@pytest.fixture(scope="module")
def ranks_results():
    with tempfile.TemporaryDirectory() as d:  # one spawn for all cases: starting ranks is the slow part
        spawn(_worker, 2, (2, rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(2)]


@pytest.mark.slow
def test_one_rank_overflows_both_skip_with_the_same_scale(ranks_results):
    res = ranks_results
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


@pytest.mark.slow
def test_ranks_whose_loss_scales_differ_are_refused(ranks_results):
    """A scaler state that differs between ranks (a scale set per rank, a resume that restored one rank's
    scaler) is refused on every rank at the first step, or the first one after the load; equal states step."""
    res = [r["disagree"] for r in ranks_results]
    assert res[0] == res[1]                                   # every rank raises the same error at the same step
    d = res[0]
    assert d["agree"] is None and d["resume all"] is None
    for case, step, what in [("init", 0, "scale from 1024 to 2048"), ("resume one rank", 1, "scale from 16 to 1024"),
                             ("tracker", 1, "growth_tracker from 1 to 2"), ("static", 0, "scale from 4 to 8")]:
        assert d[case][0] == step, case
        assert "loss scalers disagree" in d[case][1] and what in d[case][1], d[case]
        assert "load the same scaler state_dict on every rank" in d[case][1]
    # new_scale on rank 1 only, after step 0: the flag is re-armed and step 1 refuses
    assert d["new_scale one rank"][0] == 1 and "scale from 8 to 1024" in d["new_scale one rank"][1]


def _failing_worker(rank, init_method):
    with ranks(rank, 2, init_method, timeout_s=120):
        if rank == 1:
            raise ValueError("planted")
        dist.barrier()                        # rank 0 waits here for a rank that is gone


@pytest.mark.slow
def test_a_failing_rank_is_reported_at_once_not_after_the_timeout():
    """``ranks`` closes the group only on success: the failing rank exits at once (no barrier on its error
    path), and ``spawn`` ends the other rank and names the failure, long before the 120 s timeout."""
    import time
    from mpcourse.experiment.parallel.distributed import RankFailed

    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 failed: ValueError: planted"):
            spawn(_failing_worker, 2, (rendezvous(d),))
        assert time.monotonic() - t0 < 100


def test_ranks_meet_through_a_fresh_file_never_a_tcp_port():
    """Every place that starts gloo ranks (library, course demos, graders, tests, notebooks) uses
    ``rendezvous``: a port found free with ``free_port`` is released before rank 0 binds it, and another
    process can take it in between (the ranks then fail, or join another job's store)."""
    import json
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    a, b = rendezvous("/x"), rendezvous("/x")
    assert a.startswith("file:///x/rendezvous-") and a != b
    bad = []
    for path in [*root.glob("mpcourse/**/*.py"), *root.glob("tests/**/*.py"),
                 *root.glob("notebooks/*.ipynb"), *root.glob("solutions/*.ipynb")]:
        text = path.read_text()
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code")
        if path.name == pathlib.Path(__file__).name:
            text = text.split("def test_ranks_meet_through")[0]
        if path.name == "test_lab.py":                   # its free_port is a web server's, not a rendezvous
            continue
        for m in re.finditer(r"tcp://|(?<!def )free_port\(\)|init_process_group\(\s*\"gloo\"[^)]*\)", text):
            if not any(ok in m.group(0) for ok in ("init_method=init_method", "file://", "\"gloo\", ...)",
                                                   "seconds=job.timeout_s")):   # the last: torchrun's env://
                bad.append(f"{path.relative_to(root)}: {m.group(0)}")
    assert bad == []
