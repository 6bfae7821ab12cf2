"""Grader for lesson 10 (beyond one machine): the distributed skip decision of a dynamic loss scaler.

Both checks spawn four gloo ranks in two process groups, {0, 1} and {2, 3} (two data-parallel replicas, say,
each sharded over two ranks), and give every rank its own group: a function that reduces over every rank, or
ignores ``group``, makes one group's overflow skip the other group's step, and fails.

``check_all_reduce_found_inf(fn)``: ``fn(found_inf, group=None)`` makes every rank's inf/NaN flag (FP32, shape
(), 0.0 or 1.0) the MAX over the ranks of ``group``, in place, and returns it; in a single process
(torch.distributed not initialized) it changes nothing. Oracle: ``mpcourse.core.distributed.all_reduce_max_``
run beside it on the same flags, over a group of the same ranks of its own (so a function whose collectives do
not pair up across the ranks cannot pair with the oracle's). The returned flag must be an FP32 tensor of shape
() holding the reduced value (not an int, a bool or a Python float).

``check_distributed_skip_step(fn)``: ``fn(optimizer, scale, growth_tracker, group=None, growth_factor=2.0,
backoff_factor=0.5, growth_interval=2000)`` is one iteration of ``unscale_`` + ``step`` + ``update`` of FSDP's
``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py; the same rules as torch.amp.GradScaler
plus the all-reduce of the flag over its ``process_group``). Oracle: a ``ShardedGradScaler`` over a group of
the same ranks as ``group`` on every rank, run side by side on a copy of the same parameters and gradients
(two of them, in two param groups of the optimizer), over steps with injected inf, -inf or NaN on one rank,
on two ranks of a group, on a rank of the other group, a NaN alone on one rank (a check that tests ``isinf``
only misses it), an overflow in the second param group and away from element 0, a scale that is not a power
of two (so ``g / S`` and ``g * fp32(1/S)`` differ) and a scale below 1 (a finite ``g`` whose ``g / S``
overflows: torch's check reads ``g`` as backward left it). After every step the gradients (unscaled, still in
place), the parameters, the scale, the tracker and the returned flag must be the oracle's bit for bit, and the
flag an FP32 tensor of shape (). torch's scaler all-reduces the flag with SUM and then asks only "nonzero?";
the contract here returns the flag itself, so it must be 0.0 or 1.0 (MAX, or a clamped SUM).

Several functions in one job (the tests' planted bugs): ``grade_all_reduce_found_inf(fns)`` and
``grade_distributed_skip_step(fns)`` return one verdict per function, ``None`` (it passes) or the
``GradingError`` that ``check_*`` would raise; ``check_*(fn)`` is the one-function case plus the PASS line.
Each function first runs in this process (one that fails there never reaches the ranks); the others run on the
same four ranks one after the other, each in fresh process groups, with an all-gather over every rank between
two functions (the fence: no rank starts the next function before all have finished this one). A rank that
raises is the function's fault (the verdict names the earliest error on any rank); its partners' collective fails after
``GROUP_TIMEOUT_S``, well inside the default group's ``WORLD_TIMEOUT_S`` that bounds the fence. A job that
fails as a whole (a rank that dies, a fence broken by a function's unmatched collective on the default group)
is graded again function by function, each in its own job, so each gets its own verdict.

The learner's functions travel to the ranks as source text (a function defined in a notebook cannot be imported
by a spawned process): the graded function and every function of its own module it calls by name (its
``all_reduce_found_inf_``), exec'd in a namespace of its own with ``torch`` and ``dist`` = ``torch.distributed``.
"""
from __future__ import annotations

import datetime
import inspect
import os
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from mpcourse.core.distributed import all_reduce_max_

from . import GradingError, call, verdict

WORLD, GROUPS = 4, ([0, 1], [2, 3])
#: seconds: the default group (and the fence between two functions) waits for a missing rank this long; a
#: learner's unmatched collective on the default group (one that ignores ``group``) fails after it
WORLD_TIMEOUT_S = 60.0
#: seconds: a collective in a function's own group that a rank never makes fails after this (< WORLD_TIMEOUT_S)
GROUP_TIMEOUT_S = 30.0
#: flags of ranks 0..3, per pattern
PATTERNS = [(0.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (1.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0),
            (1.0, 0.0, 0.0, 1.0)]
_INF, _NAN = float("inf"), float("nan")
#: per step: {rank: (parameter, element, value)}: ``value`` is written into that element of the rank's scaled
#: gradient (parameter 0 is in the optimizer's first param group, parameter 1 in its second)
STEPS = [{}, {1: (0, 0, _INF)}, {0: (1, 2, _NAN), 1: (0, 0, _INF)}, {}, {3: (1, 1, _INF)}, {}, {2: (0, 4, _NAN)},
         {}, {2: (1, 0, -_INF)}, {0: (0, 3, _NAN)}, {}]
#: the scale of the main run starts at 3 * 2**9: not a power of two, so 1/S is inexact and g / S differs from
#: torch's g * fp32(1/S) for some g (it stays so: the scale only doubles and halves)
INIT_SCALE, GROWTH_INTERVAL = 1536.0, 2
#: a second run with the scale below 1: a finite gradient whose unscaled value overflows FP32
LOW_SCALE, LOW_STEPS = 0.5, [{2: (0, 0, 3e38)}, {}]


class Raised(NamedTuple):
    """What a rank records when the learner's function raised there: when (``time.monotonic``, one clock for
    every process of the machine) and ``Type: message``."""

    at: float
    message: str


# ---- on the ranks -------------------------------------------------------------------------------------------

def _sources(fn) -> tuple[str, str]:
    """The source of ``fn`` and of the functions of its module it calls by name (recursively); its name."""
    seen, parts, todo = set(), [], [fn]
    while todo:
        f = todo.pop()
        if f.__name__ in seen:
            continue
        seen.add(f.__name__)
        parts.append(textwrap.dedent(inspect.getsource(f)))
        for n in f.__code__.co_names:
            g = f.__globals__.get(n)
            if inspect.isfunction(g) and g.__module__ == f.__module__:
                todo.append(g)
    return "\n\n".join(reversed(parts)), fn.__name__


def _load(source, name):
    ns = {"torch": torch, "dist": dist}
    exec(source, ns)
    return ns[name]


def _my_groups(rank, timeout_s):
    """Fresh groups {0, 1} and {2, 3} (every rank creates every group, in the same order), twice: this rank's
    group for the learner's function and one of the same ranks for the oracle. Apart, so a function whose
    collectives do not match across its ranks (one made only where a flag is set) cannot pair with the
    oracle's and spoil the expected values."""
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [dist.new_group(g, timeout=timeout) for _ in range(2) for g in GROUPS]
    mine = [g for g, members in zip(groups, GROUPS * 2) if rank in members]
    return mine[0], mine[1]


def _describe(r) -> str:
    """What a function returned, for a verdict: a tensor's dtype and shape, else the Python type."""
    if isinstance(r, torch.Tensor):
        return f"a {str(r.dtype).replace('torch.', '')} tensor of shape {tuple(r.shape)}"
    return "None" if r is None else f"a Python {type(r).__name__}"


def _is_flag(r) -> bool:
    """A float32 tensor of shape (), as the contract's flag."""
    return isinstance(r, torch.Tensor) and r.dtype == torch.float32 and r.shape == ()


def _flags_rank(rank, fn, group, oracle_group) -> list:
    """``fn`` beside ``all_reduce_max_`` (over ``oracle_group``, the same ranks) on every flag pattern; one record
    per pattern."""
    out = []
    for flags in PATTERNS:
        t, want = torch.tensor(flags[rank]), all_reduce_max_(torch.tensor(flags[rank]), oracle_group)
        r = fn(t, group)
        out.append({"in_place": float(t), "returned": float(r) if _is_flag(r) else None, "kind": _describe(r),
                    "want": float(want)})
    return out


def _params(rank):
    g = torch.Generator().manual_seed(rank)
    return [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _optimizer(params):
    """SGD with each parameter in its own param group (a check of the first group only misses the second)."""
    return torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}], lr=0.1)


def _same(a, b) -> bool:
    """Equal values, NaN equal to NaN (a skipped step's gradients hold NaN where backward put one)."""
    return a is not None and b is not None and torch.equal(a.isnan(), b.isnan()) \
        and torch.equal(torch.where(a.isnan(), 0.0, a), torch.where(b.isnan(), 0.0, b))


def _run_steps(rank, fn, group, oracle_group, init_scale, steps):
    """Run ``steps`` with the learner's ``fn`` and with ShardedGradScaler side by side; one record per step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mine, theirs = _params(rank), _params(rank)
    opt_mine, opt_theirs = _optimizer(mine), _optimizer(theirs)
    oracle = ShardedGradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL,
                               process_group=oracle_group)
    oracle.scale(torch.ones(()))                                  # creates its scale tensor (as the first loss would)
    scale = torch.tensor(init_scale)                              # fp32 ()
    tracker = torch.tensor(0, dtype=torch.int32)                  # int32 ()
    g = torch.Generator().manual_seed(10 + rank)
    records = []
    for i, inject in enumerate(steps):
        grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in mine]   # this step's unscaled grads, fp32
        for p, q, gr in zip(mine, theirs, grads):
            p.grad = gr * scale                                   # the scaled gradient backward leaves
            q.grad = gr * scale
        if rank in inject:
            k, e, v = inject[rank]
            mine[k].grad[e] = theirs[k].grad[e] = v               # this rank's scaled gradient overflowed
        before = [p.detach().clone() for p in mine]
        given = [p.grad.clone() for p in mine]
        flag = fn(opt_mine, scale, tracker, group, growth_interval=GROWTH_INTERVAL)
        oracle.unscale_(opt_theirs)
        found = float(sum(v.sum() for v in oracle._per_optimizer_states[id(opt_theirs)]["found_inf_per_device"]
                          .values()))
        oracle.step(opt_theirs)
        oracle.update()
        records.append({
            "step": i, "inject": inject,
            "flag": float(flag) if _is_flag(flag) else None, "flag_kind": _describe(flag),
            "want_flag": float(found > 0),
            "skipped_want": found > 0, "summed": found,
            "grads": all(_same(p.grad, q.grad) for p, q in zip(mine, theirs)),
            "grads_gone": any(p.grad is None for p in mine),
            "grads_left_scaled": [not _same(p.grad, q.grad) and _same(p.grad, g0)
                                  for p, q, g0 in zip(mine, theirs, given)],
            "params": all(_same(p.detach(), q.detach()) for p, q in zip(mine, theirs)),
            "params_moved": [not _same(p.detach(), b) for p, b in zip(mine, before)],
            "scale": float(scale), "want_scale": oracle.get_scale(),
            "tracker": int(tracker), "want_tracker": int(oracle._growth_tracker)})
        with torch.no_grad():
            for p, q in zip(mine, theirs):                        # the caller zeroes the grads, skipped or not
                p.grad = q.grad = None
                p.copy_(q)                                        # start the next step from the oracle's state
        scale.fill_(oracle.get_scale())
        tracker.fill_(int(oracle._growth_tracker))
    return records


def _step_rank(rank, fn, group, oracle_group) -> dict:
    """``fn`` beside ShardedGradScaler: the run from INIT_SCALE and the run from LOW_SCALE."""
    return {"main": _run_steps(rank, fn, group, oracle_group, INIT_SCALE, STEPS),
            "low": _run_steps(rank, fn, group, oracle_group, LOW_SCALE, LOW_STEPS)}


def _fence(k: int) -> None:
    """Wait until every rank has finished function ``k``: an all-gather of ``k`` on the default group (the one a
    function that ignores ``group`` uses). A function that left that group out of step (a collective one rank
    did not make) makes it fail or gather something else: RuntimeError, and the rank fails."""
    got = [torch.full((2,), -1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(got, torch.tensor([WORLD, k]))
    if any(g.tolist() != [WORLD, k] for g in got):
        raise RuntimeError(f"the ranks are out of step after function {k}: a collective on the default group "
                           "was not made by every rank")


def _spawned(rank, init_method, on_rank, sources, out_dir, group_timeout_s):
    """One rank: every function of ``sources`` in turn, ``on_rank(rank, fn, group, oracle_group)`` in fresh groups,
    then the fence; writes ``<rank>.pt``: per function its records or ``Raised``."""
    from mpcourse.experiment.parallel.distributed import close_ranks, init_ranks

    init_ranks(rank, WORLD, init_method, timeout_s=WORLD_TIMEOUT_S, threads=1)
    out = []
    for k, source in enumerate(sources):
        group, oracle_group = _my_groups(rank, group_timeout_s)
        try:
            out.append(on_rank(rank, _load(*source), group, oracle_group))
        except Exception as e:  # the learner's error, judged by the parent (not a failure of the job)
            out.append(Raised(time.monotonic(), f"{type(e).__name__}: {e}"))
        _fence(k)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    close_ranks()


def _spawn(on_rank, sources) -> list[list]:
    """Run the functions of ``sources`` (``_sources``' pairs) in one job of WORLD ranks; per rank, per function,
    what ``_spawned`` recorded. Raises RankFailed when a rank fails."""
    from mpcourse.experiment.parallel.distributed import rendezvous, spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(_spawned, WORLD, (rendezvous(d), on_rank, sources, d, GROUP_TIMEOUT_S))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(WORLD)]


# ---- in the grader's process ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Check:
    """One grader: ``one_process(fn)`` and ``judge(got)`` (``got``: per rank, ``on_rank``'s records) raise
    GradingError; ``on_rank(rank, fn, group, oracle_group)`` runs on the ranks; ``passed`` is the PASS line's detail."""

    name: str
    one_process: Callable
    on_rank: Callable
    judge: Callable
    passed: str


def _error(check_fn, *args) -> GradingError | None:
    """``check_fn(*args)``'s GradingError, or None when it returns."""
    try:
        check_fn(*args)
    except GradingError as e:
        return e
    return None


def _judge(check: _Check, got: list) -> None:
    """The first error raised on a rank (the earliest: its partners then fail waiting), else ``check.judge``."""
    raised = sorted((g.at, rank, g.message) for rank, g in enumerate(got) if isinstance(g, Raised))
    if raised:
        _, rank, message = raised[0]
        raise GradingError(f"FAIL {check.name}: on rank {rank} of {WORLD} it raised {message}")
    check.judge(got)


def _on_ranks(check: _Check, fns: list) -> list[GradingError | None]:
    """Verdicts of ``fns`` graded on the ranks in one job; if the job fails, each in its own job."""
    from mpcourse.experiment.parallel.distributed import RankFailed

    if not fns:
        return []
    try:
        got = _spawn(check.on_rank, [_sources(fn) for fn in fns])
    except RankFailed as e:
        if len(fns) > 1:
            return [v for fn in fns for v in _on_ranks(check, [fn])]
        return [GradingError(f"FAIL {check.name}: rank {e.rank} of {WORLD} failed ({e.message}); a collective every "
                             "rank of the group does not make in the same order waits until the timeout")]
    return [_error(_judge, check, [per_rank[k] for per_rank in got]) for k in range(len(fns))]


def _grade(check: _Check, fns) -> list[GradingError | None]:
    """One verdict per function: the one-process check, then those that pass it on the ranks, in one job."""
    fns = list(fns)
    verdicts = [_error(check.one_process, fn) for fn in fns]
    todo = [i for i, v in enumerate(verdicts) if v is None]
    for i, v in zip(todo, _on_ranks(check, [fns[i] for i in todo])):
        verdicts[i] = v
    return verdicts


def _check(check: _Check, fn) -> None:
    error = _grade(check, [fn])[0]
    if error is not None:
        raise error
    verdict(check.name, check.passed)


def _single_process(name, fn, *args):
    try:
        return call(name, fn, *args)
    except GradingError:
        raise
    except Exception as e:
        raise GradingError(f"FAIL {name}: in a single process (torch.distributed not initialized) it raised "
                           f"{type(e).__name__}: {e}. Skip the collective when dist.is_initialized() is False "
                           "or the group has one rank.") from None


# ---- all_reduce_found_inf_ ------------------------------------------------------------------------------------

def _flags_one_process(fn) -> None:
    name = FLAGS.name
    for value in (1.0, 0.0):
        t = torch.tensor(value)
        r = _single_process(name, fn, t)
        if float(t) != value or not _is_flag(r) or float(r) != value:
            raise GradingError(f"FAIL {name}: in a single process the flag {value} must stay {value} and be returned "
                               f"(an FP32 tensor of shape ()); got {float(t)} in place and {_describe(r)}"
                               + (f" holding {float(r)}" if isinstance(r, torch.Tensor) and r.numel() == 1 else "")
                               + " returned")


def _judge_flags(got) -> None:
    name = FLAGS.name
    for i, flags in enumerate(PATTERNS):
        held, want = [got[r][i]["in_place"] for r in range(WORLD)], [got[r][i]["want"] for r in range(WORLD)]
        if held != want:
            sums = [sum(flags[m] for m in members) for members in GROUPS for _ in members]
            hint = ("a SUM counts the overflowing ranks; use op=dist.ReduceOp.MAX" if held == sums
                    else f"every rank now holds {max(flags)}: you reduced over every rank, not over `group`"
                    if held == [max(flags)] * WORLD
                    else "each rank's found_inf kept its own flag although the returned one is reduced: reduce "
                         "found_inf itself, in place (the caller reads it)"
                    if held == list(flags) and [got[r][i]["returned"] for r in range(WORLD)] == want
                    else "each rank kept its own flag: all-reduce it" if held == list(flags)
                    else "every rank must end with the MAX of its group's flags, in place")
            raise GradingError(f"FAIL {name}: ranks' flags {flags} (groups {GROUPS[0]} and {GROUPS[1]}) became "
                               f"{held}, expected {want}: {hint}")
        returned = [got[r][i]["returned"] for r in range(WORLD)]
        if returned != want:
            kinds = sorted({got[r][i]["kind"] for r in range(WORLD)})
            raise GradingError(f"FAIL {name}: flags {flags}: returned {returned} ({', '.join(kinds)}), expected "
                               f"{want}: return found_inf, the FP32 tensor of shape () you reduced in place")


FLAGS = _Check("all_reduce_found_inf_", _flags_one_process, _flags_rank, _judge_flags,
               f"{len(PATTERNS)} flag patterns on 4 gloo ranks in 2 groups agree with MAX over the group; "
               "no-op in one process")


def grade_all_reduce_found_inf(fns) -> list[GradingError | None]:
    """``check_all_reduce_found_inf``'s verdict for each of ``fns`` (None: passes), the ranks' part in one job."""
    return _grade(FLAGS, fns)


def check_all_reduce_found_inf(fn) -> None:
    _check(FLAGS, fn)


# ---- distributed_skip_step_ -----------------------------------------------------------------------------------

def _step_one_process(fn) -> None:
    name = SKIP_STEP.name
    for bad in (float("inf"), float("nan")):
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.tensor([4.0, bad])
        scale, tracker = torch.tensor(4.0), torch.tensor(0, dtype=torch.int32)
        flag = _single_process(name, fn, torch.optim.SGD([p], lr=1.0), scale, tracker)
        what = (f"in one process, a gradient [4, {bad}] at scale 4 (got flag {_describe(flag)}"
                + (f" holding {float(flag)}" if isinstance(flag, torch.Tensor) and flag.numel() == 1 else "")
                + f", weights {p.detach().tolist()}, scale {float(scale)}, tracker {int(tracker)})")
        if not torch.equal(p.detach(), torch.ones(2)):
            raise GradingError(f"FAIL {name}: {what}: it stepped although a rank of the group found inf/NaN: skip "
                               "optimizer.step() when the flag is set" + (" (a NaN counts: torch.isfinite is False "
                                                                          "for inf and NaN)" if bad != bad else ""))
        if float(scale) != 2.0 or int(tracker) != 0:
            raise GradingError(f"FAIL {name}: {what}: after an overflow the scale must back off to S * "
                               "backoff_factor = 2 and the tracker reset to 0, in place")
        if not (_is_flag(flag) and float(flag) == 1.0):
            raise GradingError(f"FAIL {name}: {what}: return the flag, an FP32 tensor of shape () holding 1.0 after "
                               "an overflow")


def _step_hint(rec, rank) -> str:
    inject = rec["inject"]
    mine = [r for r in inject if (r < 2) == (rank < 2)]               # the overflows in this rank's group
    other = [r for r in inject if (r < 2) != (rank < 2)]
    if rec["skipped_want"] is False and not rec["params"] and other and not any(rec["params_moved"]):
        return (f"rank {rank} skipped because rank {other[0]} (the other group) overflowed: reduce the flag over "
                "`group`, not over every rank")
    if rec["skipped_want"] is False and not rec["params"] and not any(rec["params_moved"]):
        return ("it skipped a step torch takes: check the gradients as backward left them (the scaled values), "
                "then unscale; with a scale below 1 a finite g can overflow once divided, which torch's check "
                "does not see")
    if rec["skipped_want"] and not rec["params"]:
        values = [inject[r][2] for r in mine]
        where = {inject[r][0] for r in mine}
        more = (" (a NaN counts as an overflow: torch.isfinite is False for inf, -inf and NaN; isinf misses NaN)"
                if values and all(v != v for v in values) else
                " (check every gradient of every param group of the optimizer: the overflow is in the second)"
                if where == {1} else
                " (the flag must be the group's: all-reduce it before the decision, and decide on the reduced flag)"
                if rank not in inject else "")
        return ("it stepped although a rank of the group found inf/NaN: skip optimizer.step() when the flag is set"
                + more)
    if rec["grads_gone"]:
        return ("a gradient is gone after the call: leave every .grad in place, unscaled (the caller zeroes the "
                "gradients, as after torch's scaler.step)")
    if not rec["grads"] and rec["grads_left_scaled"] == [False, True]:
        return ("the gradient of the optimizer's second param group is still scaled: unscale (and check) every "
                "gradient of every param group")
    if not rec["grads"]:
        return ("the gradients must end unscaled, g * fp32(1/S) with 1/S computed in FP64 and rounded once to FP32 "
                "(not g / S: with S not a power of two they differ), exactly once, on every step, skipped or not, "
                "as torch's unscale_")
    if rec["flag"] != rec["want_flag"]:
        if rec["flag"] is None:
            return f"return the flag as an FP32 tensor of shape (), not {rec['flag_kind']}"
        return (f"the returned flag is {rec['flag']} where {rec['summed']:g} ranks of the group overflowed: a SUM "
                "counts them; use MAX (or clamp) so the flag is 0.0 or 1.0"
                if rec["flag"] == rec["summed"] else "return the reduced flag, 0.0 or 1.0, the same on every rank")
    if rec["skipped_want"] and rec["scale"] != rec["want_scale"]:
        return (f"after an overflow the scale must back off to S * backoff_factor = {rec['want_scale']:g} "
                f"(and the tracker reset to 0); it is {rec['scale']:g}")
    return (f"scale {rec['scale']:g}, tracker {rec['tracker']} where torch has {rec['want_scale']:g}, "
            f"{rec['want_tracker']}: grow by growth_factor after growth_interval clean steps in a row, then reset; "
            "after an overflow back off and reset the tracker to 0")


def _judge_steps(got) -> None:
    for run in ("main", "low"):
        for i in range(len(got[0][run])):
            for rank in range(WORLD):
                rec = got[rank][run][i]
                ok = (rec["grads"] and rec["params"] and rec["flag"] == rec["want_flag"]
                      and rec["scale"] == rec["want_scale"] and rec["tracker"] == rec["want_tracker"])
                if not ok:
                    inj = ", ".join(f"rank {r}: {v:g} in parameter {k}'s element {e}"
                                    for r, (k, e, v) in rec["inject"].items()) or "none"
                    raise GradingError(
                        f"FAIL {SKIP_STEP.name}: step {i} (counted from 0) of the run from scale "
                        f"{INIT_SCALE if run == 'main' else LOW_SCALE:g} (injected: {inj}; groups {GROUPS[0]} and "
                        f"{GROUPS[1]}), on rank {rank}: " + _step_hint(rec, rank))


SKIP_STEP = _Check("distributed_skip_step_", _step_one_process, _step_rank, _judge_steps,
                   f"{len(STEPS) + len(LOW_STEPS)} steps on 4 gloo ranks in 2 groups (inf, -inf or NaN on one rank "
                   "or two, in either param group; a scale not a power of two, one below 1): gradients, weights, "
                   "flag, scale and tracker equal ShardedGradScaler's")


def grade_distributed_skip_step(fns) -> list[GradingError | None]:
    """``check_distributed_skip_step``'s verdict for each of ``fns`` (None: passes), the ranks' part in one job."""
    return _grade(SKIP_STEP, fns)


def check_distributed_skip_step(fn) -> None:
    _check(SKIP_STEP, fn)
