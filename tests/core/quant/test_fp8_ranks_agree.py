"""Every rank takes part in every collective of the FP8 and loss-scaling paths, and agrees on what a NaN means:
2 and 3 gloo ranks on the CPU, against one process run on the union of the ranks' data (the oracle).

1. A rank with nothing to do still takes part. Under delayed scaling a ``Float8Linear`` whose input on one rank is
   empty (an expert that received no token, an empty micro-batch) must still record (amax 0: nothing) and enter
   the amax all-reduces, forward and backward, that the other ranks enter (torchtitan#1166, pytorch/ao#1938: the
   ranks hung until the timeout). The FP8 state after each step equals one process's on the union of the rows,
   with each rank empty in turn, every rank empty, and the backward outside or inside the FP8 region. So does the
   loss scaler's found-inf decision when a rank has no gradient at all.
2. A NaN amax means the same on every rank. gloo's MAX keeps or drops a NaN depending on which rank holds it
   (NVIDIA/TransformerEngine#3550). The reduction (``mpcourse.core.distributed.all_reduce_max_``), the delayed
   scaling state it feeds, FSDP2's FP8 all-gather scale and the loss scaler's skip must equal one process's,
   whichever rank holds the NaN or inf (each rank in turn).

The groups' timeout is short (``TIMEOUT_S``): a rank that skips a collective fails the test in seconds, never
hangs it. The ranks first wait for each other through files (``_start_together``), so a loaded machine that starts
them seconds apart does not trip that timeout at the rendezvous.

Exactness: the inputs are small integers, the weights multiples of 1/4 and the planted amaxes powers of two times
1.75, so the first layer's sums are exact; no optimizer steps. The second layer's input scale is not a power of two,
and an FP32 GEMM's row may round differently with another number of rows (MKL's AVX2 kernels do), so the oracle
computes each rank's outputs with a GEMM of that rank's rows, under the one-process scales. Bit for bit; a NaN
equals a NaN.
"""
from __future__ import annotations

import copy
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from mpcourse.core import distributed
from mpcourse.core.quant import DelayedScaling, CurrentScaling, Float8Linear, fp8_autocast
from mpcourse.core.quant.layers.fsdp_fp8 import FP8AllGatherWeight, quantize_shard_for_all_gather
from mpcourse.core.scaling import DynamicLossScaler
from mpcourse.experiment.parallel.distributed import ranks, rendezvous, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

TIMEOUT_S = 20                      # a missed collective fails a rank after this many seconds
RECIPE = DelayedScaling(amax_history_len=4)
K, H, N = 16, 16, 8                 # Sequential(Float8Linear(K, H), Float8Linear(H, N))
NAN, INF = float("nan"), float("inf")


def _start_together(rank: int, world: int, directory: str, deadline_s: float = 300.0) -> None:
    """Return once every rank has reached this point (each touches a file, then waits for the others')."""
    open(os.path.join(directory, f"started-{rank}"), "w").close()
    t0 = time.monotonic()
    while not all(os.path.exists(os.path.join(directory, f"started-{r}")) for r in range(world)):
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError("the other ranks did not start")
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ the model and data
def _model() -> torch.nn.Sequential:
    """The same two FP8 layers on every rank and in the oracle: weights in multiples of 1/4, |w| <= 1.75."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(Float8Linear(K, H, bias=True, recipe=RECIPE), Float8Linear(H, N, bias=False,
                                                                                          recipe=RECIPE))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-7, 8, p.shape, generator=g) / 4)
    return model


def _rows(step: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank (x (r + 1, K), dy (r + 1, N)) of one step: small integers, the step's amaxes 1.75 * 2**k."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for r in range(world):
        x = torch.randint(-3, 4, (r + 1, K), generator=g).float()
        dy = torch.randint(-1, 2, (r + 1, N), generator=g).float()
        out.append((x, dy))
    out[0][0][0, 0], out[-1][1][-1, 0] = 3.5, 1.75          # the input and gradient amaxes: power-of-two scales
    return out


def _step(model, x, dy, backward_in_region: bool) -> torch.Tensor:
    """One forward and backward (no optimizer); returns y."""
    x = x.clone().requires_grad_(True)
    with fp8_autocast(fp8_recipe=RECIPE):
        y = model(x)
        if backward_in_region:
            y.backward(dy)
    if not backward_in_region:
        y.backward(dy)
    return y.detach()


def _state(model) -> list[torch.Tensor]:
    """Every layer's (3, 1 + L) [scale, *amax_history] per role."""
    return [m.get_extra_state().clone() for m in model]


def _run(rank, world, empty, plant=None, backward_in_region=False, steps=2):
    """``steps`` steps on this rank's rows (none where ``empty(rank)``; ``rank=None``: the oracle, every rank's rows
    at once); ``plant(step, rank, x, dy)`` may write a NaN or inf in place. Returns (the states, the outputs); the
    oracle's outputs are per rank (``[rank][step]``): each rank's rows through a copy of the one-process model as it
    stood before the step, a GEMM of that rank's shape (an FP32 GEMM's row may round differently with another
    number of rows, as MKL's AVX2 kernels do), the scales the union's."""
    model, ys = _model(), []
    for step in range(steps):
        rows = _rows(step, world)
        for r, (x, dy) in enumerate(rows):
            if plant is not None:
                plant(step, r, x, dy)
            if empty(r):
                rows[r] = (x[:0], dy[:0])
        if rank is None:
            ys.append([_forward(copy.deepcopy(model), x) for x, _ in rows])
        x, dy = rows[rank] if rank is not None else [torch.cat(t) for t in zip(*rows)]
        y = _step(model, x, dy, backward_in_region)
        if rank is not None:
            ys.append(y)
    return _state(model), ys if rank is not None else [list(per_rank) for per_rank in zip(*ys)]


def _forward(model, x) -> torch.Tensor:
    """The forward alone, under the region, with the model's current scales (delayed scaling: the step's own amax
    does not enter its output)."""
    with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE):
        return model(x)


# ------------------------------------------------------------------------------------------------ 1. empty ranks
def _empty_cases(world: int) -> list:
    """(name, empty(r), backward_in_region): each rank empty in turn, every rank empty."""
    cases = [(f"rank {e} empty", (lambda r, e=e: r == e), False) for e in range(world)]
    cases += [(f"rank {e} empty, backward in the region", (lambda r, e=e: r == e), True) for e in range(world)]
    return cases + [("every rank empty", lambda r: True, False)]


def _scaler_step(rank, world, no_grad_rank, bad_rank, bad):
    """One DynamicLossScaler step: ``no_grad_rank`` has no gradient at all, ``bad_rank`` plants ``bad``
    (``rank=None``: the oracle, one parameter holding every rank's gradients). Returns (skipped, scale after)."""
    grads = [torch.full((2,), 1.0 + r) for r in range(world)]
    if bad_rank is not None:
        grads[bad_rank][1] = bad
    grads = [g for r, g in enumerate(grads) if r != no_grad_rank]
    w = torch.nn.Parameter(torch.zeros(2 if rank is not None else 2 * len(grads)))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(torch.ones(()))
    if rank is None:
        w.grad = scaler.scale(torch.cat(grads))
    elif rank != no_grad_rank:
        w.grad = scaler.scale(grads[rank - (no_grad_rank is not None and rank > no_grad_rank)])
    scaler.step(opt)
    scaler.update()
    return scaler.last_step_skipped, scaler.get_scale()


def _scaler_cases(world: int) -> list:
    """(no_grad_rank, bad_rank, bad): each rank without gradients in turn, with no, a NaN or an inf elsewhere."""
    return [(e, b, v) for e in range(world) for b in [None, *[r for r in range(world) if r != e]]
            for v in ([0.0] if b is None else [NAN, INF])]


def _empty_job(rank: int, world: int) -> dict:
    out = {"layers": {}, "scaler": {}}
    for name, empty, in_region in _empty_cases(world):
        out["layers"][name] = _run(rank, world, empty, backward_in_region=in_region)
    for e, b, v in _scaler_cases(world):
        out["scaler"][(e, b, str(v))] = _scaler_step(rank, world, e, b, v)
    return out


# ------------------------------------------------------------------------------------------------ 2. NaN and inf
def _max_inputs(world: int, holder: int, bad: float) -> list[torch.Tensor]:
    """Per rank: [1 + r, 3.33 on the holder's neighbour else 0.5, -(1 + r), 2 ** -r]; the holder's first two and
    last entries are ``bad`` (a non-finite value beside finite ones and beside larger ones)."""
    out = []
    for r in range(world):
        t = torch.tensor([1.0 + r, 3.33 if r == (holder + 1) % world else 0.5, -(1.0 + r), 2.0 ** -r])
        if r == holder:
            t[[0, 1, 3]] = bad
        out.append(t)
    return out


def _nonfinite_cases(world: int) -> list:
    return [(h, bad) for h in range(world) for bad in (NAN, INF)]


def _planter(holder: int, bad: float, where: str):
    """Plant ``bad`` at step 1 (of 0, 1, 2) in the holder's input (``where="x"``) or output gradient (``"dy"``)."""
    def plant(step, r, x, dy):
        if step == 1 and r == holder:
            (x if where == "x" else dy)[0, 1] = bad
    return plant


def _shard_case(rank: int, world: int, holder: int, bad: float):
    """This rank's rows of a (2 * world + 1, K) weight under FSDP2's chunking (the last rank shorter), the
    holder's with ``bad``; cast for the FP8 all-gather by the rule and by FSDP2's hook (``rank=None``: the whole
    weight in one process). Returns ((data bytes, scale_inv) of the rule, (data bytes, scale_inv) of the hook)."""
    rows = 2 * world + 1
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(rows, K, generator=g)
    chunks = list(torch.chunk(weight, world))
    chunks[holder][0, 2] = bad
    shard = torch.cat(chunks) if rank is None else chunks[rank]
    q = quantize_shard_for_all_gather(shard, "e4m3")
    layer = Float8Linear(K, rows, bias=False, recipe=CurrentScaling())

    class Mesh:                                    # what the hook asks of FSDP2's mesh
        def get_group(self):
            return None

        def size(self):
            return 1 if rank is None else world

    (data,), (scale_inv, _, _) = FP8AllGatherWeight(shard, layer).fsdp_pre_all_gather(Mesh(), (rows, K), None,
                                                                                          None, None)
    return (q.data.view(torch.uint8), q.scale_inv), (data[: shard.shape[0]], scale_inv)


def _nonfinite_job(rank: int, world: int) -> dict:
    out = {"max": {}, "layers": {}, "shard": {}, "scaler": {}}
    for h, bad in _nonfinite_cases(world):
        key = (h, str(bad))
        t = _max_inputs(world, h, bad)[rank]
        out["max"][key] = distributed.all_reduce_max_(t.clone()), distributed.all_reduce_max_(t[1].clone())
        for where in ("x", "dy"):
            out["layers"][key + (where,)] = _run(rank, world, lambda r: False, _planter(h, bad, where), steps=3)
        out["shard"][key] = _shard_case(rank, world, h, bad)
        out["scaler"][key] = _scaler_step(rank, world, None, h, bad)
    ints = torch.tensor([rank, -rank, 5 * (rank == world - 1)])
    out["ints"] = distributed.all_reduce_max_(ints)
    return out


# ------------------------------------------------------------------------------------------------ the job
JOBS = {"empty": _empty_job, "nonfinite": _nonfinite_job}


def _worker(rank: int, world: int, job: str, directory: str, init_method: str) -> None:
    torch.set_num_threads(1)
    _start_together(rank, world, directory)
    with ranks(rank, world, init_method, timeout_s=TIMEOUT_S, threads=1):
        torch.save(JOBS[job](rank, world), os.path.join(directory, f"{job}-{rank}.pt"))


def _spawn(job: str, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, (world, job, d, rendezvous(d)))
        return [torch.load(os.path.join(d, f"{job}-{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def world(request):
    return request.param


def _same(a, b) -> bool:
    """Equal tensors (or nested lists/tuples of them, or numbers), a NaN equal to a NaN."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and not a.is_floating_point():
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)))
    return a == b


_RESULTS: dict = {}


def _results(job: str, world: int) -> list[dict]:
    """What each rank of one spawned ``job`` over ``world`` ranks returned (spawned once per module)."""
    if (job, world) not in _RESULTS:
        _RESULTS[job, world] = _spawn(job, world)
    return _RESULTS[job, world]


def _my_rows(ys: list, rank: int, sizes: list[int]) -> list:
    """Rank ``rank``'s rows of each of the oracle's outputs, where rank r contributed ``sizes[r]`` rows."""
    start = sum(sizes[:rank])
    return [y[start:start + sizes[rank]] for y in ys]


@pytest.mark.slow
def test_an_empty_rank_takes_part_and_the_fp8_state_is_one_process_on_the_union(world):
    """Forward (input, weight) and backward (output-gradient) amaxes of both layers, 2 steps: every rank's scales
    and histories are the one process's on the union of the rows, whichever rank (or every rank) is empty."""
    res = _results("empty", world)
    for name, empty, in_region in _empty_cases(world):
        want_state, want_ys = _run(None, world, empty, backward_in_region=in_region)
        assert all(bool(s[:, 1:].any()) for s in want_state), name      # amaxes were recorded: not a blank state
        for r in range(world):
            state, ys = res[r]["layers"][name]
            assert _same(state, want_state), (name, r, state, want_state)
            assert _same(ys, want_ys[r]), (name, r)


@pytest.mark.slow
def test_a_rank_without_gradients_takes_part_in_the_loss_scalers_skip(world):
    """The found-inf all-reduce: a rank that holds no gradient at all still enters it, and every rank skips (or
    steps) and backs off as one process holding every rank's gradients does."""
    res = _results("empty", world)
    for e, b, v in _scaler_cases(world):
        want = _scaler_step(None, world, e, b, v)
        assert want == ((False, 8.0) if b is None else (True, 4.0))
        assert [r["scaler"][(e, b, str(v))] for r in res] == [want] * world, (e, b, v)


@pytest.mark.slow
def test_the_max_all_reduce_propagates_a_nan_from_any_rank(world):
    """``all_reduce_max_`` equals ``torch.amax`` over the stacked ranks' tensors (NaN wins, inf kept, negative
    values kept), for a NaN or an inf on each rank in turn; a 0-dim tensor alike; integers as MAX."""
    res = _results("nonfinite", world)
    for h, bad in _nonfinite_cases(world):
        want = torch.stack(_max_inputs(world, h, bad)).amax(0)
        for r in range(world):
            got, got0 = res[r]["max"][(h, str(bad))]
            assert _same(got, want) and _same(got0, want[1]), (h, bad, r, got, want)
    want = torch.stack([torch.tensor([r, -r, 5 * (r == world - 1)]) for r in range(world)]).amax(0)
    assert all(torch.equal(r["ints"], want) for r in res)


@pytest.mark.slow
def test_delayed_scaling_with_a_nan_or_inf_on_any_rank_is_one_process(world):
    """Three steps, a NaN or inf planted at step 1 in one rank's input (forward amaxes) or output gradient
    (backward amaxes): every rank's histories hold it and keep the scale, as one process on the union does."""
    res = _results("nonfinite", world)
    for h, bad in _nonfinite_cases(world):
        for where in ("x", "dy"):
            want_state, want_ys = _run(None, world, lambda r: False, _planter(h, bad, where), steps=3)
            assert not all(bool(torch.isfinite(s).all()) for s in want_state)    # it reached the oracle's history
            for r in range(world):
                state, ys = res[r]["layers"][(h, str(bad), where)]
                assert _same(state, want_state), (h, bad, where, r, state, want_state)
                assert _same(ys, want_ys[r]), (h, bad, where, r)


@pytest.mark.slow
def test_the_fp8_all_gather_scale_with_a_nan_or_inf_shard_is_one_process(world):
    """FSDP2's FP8 all-gather (the rule and the hook): each rank's E4M3 bytes and scale are the one-process cast
    of the whole weight's, whichever rank's shard holds the NaN or inf (scale 1: current scaling's rule)."""
    res = _results("nonfinite", world)
    sizes = [c.shape[0] for c in torch.chunk(torch.empty(2 * world + 1), world)]
    for h, bad in _nonfinite_cases(world):
        want = _shard_case(None, world, h, bad)
        assert all(float(s) == 1.0 for _, s in want)
        for r in range(world):
            for (data, scale_inv), (want_data, want_scale_inv) in zip(res[r]["shard"][(h, str(bad))], want):
                assert _same(scale_inv, want_scale_inv), (h, bad, r)
                assert _same(data, _my_rows([want_data], r, sizes)[0]), (h, bad, r)


@pytest.mark.slow
def test_the_loss_scaler_skips_on_every_rank_whichever_rank_holds_the_nan(world):
    res = _results("nonfinite", world)
    for h, bad in _nonfinite_cases(world):
        want = _scaler_step(None, world, None, h, bad)
        assert want == (True, 4.0)
        assert [r["scaler"][(h, str(bad))] for r in res] == [want] * world, (h, bad)
