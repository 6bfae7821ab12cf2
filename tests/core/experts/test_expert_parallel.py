"""Expert parallelism over 2 and 4 gloo ranks (loopback) against one process running the same dispatch rule.

One job of W spawned ranks per world size runs every case and saves what each rank saw; the tests compare it with
``MoEFeedForward`` in this process on the union of the ranks' tokens, with ``dispatch`` set to the same mode (the
dispatch's encode and decode at the same points, forward and backward: ``core.experts.dispatch.RoundTrip``).

What is compared bit for bit, and why it can be: the router here has one power-of-two weight per row in its own
column (``_router``), so every logit is one exact product and the routing is the same whatever rows a GEMM sees
(a CPU's FP32 GEMM may round a row differently with another number of rows: on AVX2 it does); each expert's GEMMs see
the same rows, in the same order, in one process and under expert parallelism (``expert_parallel``'s docstring), and
the combine adds each token's k outputs in the same order. So the layer's output, the gradient of its input and
each expert's weight gradient are equal bit for bit. The router's weight gradient is a sum over tokens that the
ranks split (each sums its own, the test adds the W sums): equal up to that order (rtol 1e-5 and, for elements
where the sum cancels, atol 1e-6; measured at most 2e-7 on elements of order 1e-2).

The forced cases bias the router (``_force``) so that an expert, or every expert of one rank, gets no token, each
rank in turn; the group's collectives run with a 20 s timeout, so a rank left waiting fails the job instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from mpcourse.core.experts.dispatch import bytes_per_row, dispatch_mode, round_trip
from mpcourse.core.experts.expert_parallel import DispatchLog, ExpertParallelMoE, expert_range
from mpcourse.core.experts.layer import MoEFeedForward
from mpcourse.experiment.parallel.distributed import ranks as gloo_ranks, rendezvous, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

C, H, E, K, S = 64, 128, 8, 2, 24          # width, expert hidden, experts, top-k, tokens per rank
CASES = [("fp32", None, None), ("bf16", None, None), ("fp8", None, None), ("fp8", "fp8-rowwise", None)]


def _layer(fmt=None) -> MoEFeedForward:
    torch.manual_seed(3)
    m = MoEFeedForward(C, H, E, top_k=K, expert_format=fmt)
    with torch.no_grad():
        m.router.copy_(_router())
    return m


def _router() -> torch.Tensor:
    """(E, C): expert e reads column e of the token, times 2**(e % 3) (exact logits, see the module docstring)."""
    r = torch.zeros(E, C)
    r[torch.arange(E), torch.arange(E)] = 2.0 ** (torch.arange(E) % 3).float()
    return r


def _tokens(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens (S, C) and the weights (S, C) of the loss sum(out * w), from one seed."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(world * S, C, generator=g), torch.randn(world * S, C, generator=g)
    return x[rank * S:(rank + 1) * S], w[rank * S:(rank + 1) * S]


def _force(x: torch.Tensor, empty: list[int]) -> torch.Tensor:
    """x with column e of every token set to -50: expert e's logit is -50 * 2**(e % 3), never in the top-k."""
    x = x.clone()
    x[:, empty] = -50.0
    return x


def _run(layer, x, w):
    """Forward, backward of sum(out * w): (out, dx, router grad, w_in grad, w_out grad, tokens per expert)."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * w).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "router": layer.router.grad.clone(), "w_in": layer.w_in.grad.clone(),
            "w_out": layer.w_out.grad.clone(), "counts": layer.tokens_per_expert.clone()}


def _ep_case(rank, world, group, mode, fmt, empty):
    x, w = _tokens(rank, world)
    log = DispatchLog()
    layer = ExpertParallelMoE(_layer(fmt), group, mode, log)
    res = _run(layer, _force(x, empty or []), w)
    res["bytes"] = log.per_step(1)
    return res


def _forced_cases(world):
    """(name, empty experts): one expert of each rank in turn, then every expert of each rank in turn."""
    out = []
    for r in range(world):
        first, end = expert_range(r, world, E)
        out += [(f"expert {first} empty", [first]), (f"rank {r} receives nothing", list(range(first, end)))]
    return out


def _worker(rank, world, init_method, out_dir):
    with gloo_ranks(rank, world, init_method, threads=1):
        group = dist.new_group(timeout=datetime.timedelta(seconds=20))     # a rank left waiting fails fast
        res = {(mode, fmt): _ep_case(rank, world, group, mode, fmt, None) for mode, fmt, _ in CASES}
        for name, empty in _forced_cases(world):
            res[name] = _ep_case(rank, world, group, "fp8", None, empty)
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
        del group


def _job(world):
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, (world, rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def job(request):
    return request.param, _job(request.param)


def _one_process(world, mode, fmt, empty=None):
    """The oracle on one thread, as each rank runs (with two, an AVX2 CPU's GEMM rounds some rows differently)."""
    xs, ws = zip(*(_tokens(r, world) for r in range(world)))
    layer = _layer(fmt)
    layer.dispatch = mode
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(layer, _force(torch.cat(xs), empty or []), torch.cat(ws))
    finally:
        torch.set_num_threads(threads)


def _check_equal(world, ranks, key, mode, fmt, empty=None):
    one = _one_process(world, mode, fmt, empty)
    for r, res in enumerate(ranks):
        got = res[key]
        first, end = expert_range(r, world, E)
        rows = slice(r * S, (r + 1) * S)
        assert torch.equal(got["out"], one["out"][rows]), (key, r)
        assert torch.equal(got["dx"], one["dx"][rows]), (key, r)
        assert torch.equal(got["w_in"], one["w_in"][first:end]) and torch.equal(got["w_out"], one["w_out"][first:end])
        assert torch.equal(got["counts"], one["counts"])               # every rank records the group's counts
    router = torch.stack([res[key]["router"] for res in ranks]).sum(0)
    torch.testing.assert_close(router, one["router"], rtol=1e-5, atol=1e-6)    # sums that cancel: atol
    return one


@pytest.mark.parametrize("mode,fmt", [(m, f) for m, f, _ in CASES])
def test_expert_parallel_equals_one_process_with_the_same_dispatch(job, mode, fmt):
    world, ranks = job
    _check_equal(world, ranks, (mode, fmt), mode, fmt)


def test_the_fp8_dispatch_changes_what_the_experts_see(job):
    """Not a vacuous comparison: the FP8 rows differ from the FP32 ones, and FP32 dispatch is one process's plain
    layer (no trip at all) bit for bit."""
    world, ranks = job
    assert not torch.equal(ranks[0][("fp8", None)]["out"], ranks[0][("fp32", None)]["out"])
    plain = _one_process(world, None, None)                     # dispatch None: no trip at all
    assert torch.equal(ranks[0][("fp32", None)]["out"], plain["out"][:S])


def test_a_rank_with_no_token_for_an_expert_or_none_at_all_takes_part(job):
    """Each rank in turn: one expert empty, then every expert of the rank empty. The job finished within the
    group's 20 s timeout (no hang), and every rank got one process's numbers."""
    world, ranks = job
    for name, empty in _forced_cases(world):
        one = _check_equal(world, ranks, name, "fp8", None, empty)
        assert (one["counts"][empty] == 0).all() and one["counts"].sum() == world * S * K, name
        if name.endswith("receives nothing"):
            r = int(name.split()[1])
            assert ranks[r][name]["bytes"]["by"].get("combine forward", 0) == 0      # it sent nothing back
            assert (ranks[r][name]["w_in"] == 0).all()                                # and its experts learn nothing


def _formula(world, counts_of_rank, rank, mode):
    """Bytes rank ``rank`` sends per step, by hand: counts to each other rank, then rows x the wire's bytes:
    its rows for other ranks' experts go out twice (dispatch, and the output gradient back to them) on the
    to-experts wire; the rows other ranks sent it go back twice (combine, input gradient) on the from-experts wire."""
    m = dispatch_mode(mode)
    first, end = expert_range(rank, world, E)
    out = sum(int(counts_of_rank[rank][e]) for e in range(E) if not first <= e < end)
    back = sum(int(counts_of_rank[s][e]) for s in range(world) if s != rank for e in range(first, end))
    return E * 8 * (world - 1) + 2 * out * bytes_per_row(C, m.to_experts) + 2 * back * bytes_per_row(C, m.from_experts)


def test_bytes_per_rank_are_the_formula_fp8_about_half_of_bf16(job):
    world, ranks = job
    counts = []
    for r in range(world):                     # each rank's own routing, as one process computes it on its tokens
        layer = _layer()
        layer(_tokens(r, world)[0])
        counts.append(layer.tokens_per_expert)
    for r, res in enumerate(ranks):
        fp8, bf16, fp32 = (res[(m, None)]["bytes"] for m in ("fp8", "bf16", "fp32"))
        assert fp8["sent"] == _formula(world, counts, r, "fp8") and bf16["sent"] == _formula(world, counts, r, "bf16")
        assert fp32["sent"] == _formula(world, counts, r, "fp32") == fp8["fp32"] == bf16["fp32"]
        assert bf16["sent"] == fp8["bf16"]            # the FP8 run's "as BF16" is the BF16 run, measured
        assert fp8["by"]["dispatch forward"] / bf16["by"]["dispatch forward"] == (C + 4) / (2 * C)
        assert fp8["by"]["combine forward"] == bf16["by"]["combine forward"]       # the combine stays BF16


def test_what_the_fp8_experts_see_is_the_dispatch_fp8():
    """The receiving FP8-rowwise expert re-quantizes the dispatched rows to the same E4M3 values (power-of-two
    scales on both sides): quantizing again changes nothing."""
    from rule_quantize import quantize
    from mpcourse.core.experts.formats import grouped_format

    x = torch.randn(256, C) * torch.logspace(-3, 3, 256)[:, None]
    seen = round_trip(x, "fp8")
    again = quantize(seen, grouped_format("fp8-rowwise"), "input", 1)
    assert torch.equal(again.dequantize(torch.float32), seen)
    assert not torch.equal(seen, x)
