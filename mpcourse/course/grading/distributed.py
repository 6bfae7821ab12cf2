"""Grader for lesson 10 (beyond one machine): the all-reduce step of a distributed dynamic loss scaler.

``check_all_reduce_found_inf(fn)``: ``fn(found_inf, group=None)`` makes every rank's inf/NaN flag (an FP32
tensor of shape (), 0.0 or 1.0 here; any value > 0 means "overflow") the MAX over the ranks, in place, and
returns it; in a single process (torch.distributed not initialized) it changes nothing and does not fail.
Semantics: FSDP's ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py, the flag all-reduced
before the skip decision) and ``mpcourse.core.distributed.all_reduce_max_``.

Oracle: the rule itself on two gloo ranks spawned here: for every pattern of flags, both ranks must hold
``max(flags)`` (a SUM would give 2 where both overflow; a rank that keeps its own flag disagrees with the
other). The learner's function travels to the ranks as its source text (a function defined in a notebook
cannot be imported by a spawned process), so it must be self-contained (``torch`` and ``dist`` =
``torch.distributed`` are provided).
"""
from __future__ import annotations

import inspect
import os
import tempfile
import textwrap

import torch
import torch.distributed as dist

from . import GradingError, call, verdict

PATTERNS = [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)]


def _rank(rank, init_method, source, name, out_dir):
    from mpcourse.experiment.distributed import close_ranks, init_ranks

    init_ranks(rank, 2, init_method, timeout_s=60, threads=1)   # a learner's unmatched collective fails in 60 s
    out = []
    ns = {"torch": torch, "dist": dist}
    try:
        exec(source, ns)
        fn = ns[name]
        for flags in PATTERNS:
            t = torch.tensor(flags[rank], dtype=torch.float32)
            r = fn(t)
            out.append({"in_place": float(t), "returned": None if r is None else float(r)})
    except Exception as e:  # the learner's error, reported by the grader (not a crash of the job)
        out = f"{type(e).__name__}: {e}"
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    close_ranks()


def check_all_reduce_found_inf(fn) -> None:
    name = "all_reduce_found_inf_"
    t = torch.tensor(1.0)
    try:
        r = call(name, fn, t)                                   # single process: a no-op
    except GradingError:
        raise
    except Exception as e:
        raise GradingError(f"FAIL {name}: in a single process (torch.distributed not initialized) it raised "
                           f"{type(e).__name__}: {e}. Return the flag unchanged when "
                           "dist.is_initialized() is False or the group has one rank.") from None
    if float(t) != 1.0 or r is None or float(r) != 1.0:
        raise GradingError(f"FAIL {name}: in a single process the flag must stay 1.0 and be returned; got "
                           f"{float(t)} in place and {r!r} returned")
    from mpcourse.experiment.distributed import rendezvous, spawn

    source = textwrap.dedent(inspect.getsource(fn))
    with tempfile.TemporaryDirectory() as d:
        spawn(_rank, 2, (rendezvous(d), source, fn.__name__, d))
        got = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]
    for rank, g in enumerate(got):
        if isinstance(g, str):
            raise GradingError(f"FAIL {name}: on rank {rank} of 2 it raised {g}")
    for i, flags in enumerate(PATTERNS):
        want = max(flags)
        held = [got[r][i]["in_place"] for r in range(2)]
        if held != [want, want]:
            hint = ("a SUM counts the overflowing ranks; use op=dist.ReduceOp.MAX" if held == [sum(flags)] * 2
                    else "each rank kept its own flag: all-reduce it" if held == list(flags)
                    else "every rank must end with the MAX of the flags")
            raise GradingError(f"FAIL {name}: ranks' flags {flags} became {held} on ranks (0, 1), expected "
                               f"[{want}, {want}] on both: {hint}")
        returned = [got[r][i]["returned"] for r in range(2)]
        if returned != [want, want]:
            raise GradingError(f"FAIL {name}: flags {flags}: returned {returned}, expected the reduced flag "
                               "(return the tensor you reduced in place)")
    verdict(name, f"{len(PATTERNS)} flag patterns on 2 gloo ranks agree on MAX; no-op in one process")
