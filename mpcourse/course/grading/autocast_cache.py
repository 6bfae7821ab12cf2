"""Grader for lesson 05's weight-cast cache: ``cached_cast(cache, t, to_type) -> tensor``.

Inside an autocast region every matmul casts its FP32 weight to BF16/FP16; the cache keeps the cast of a
weight so the next use in the same region (the same layer called again, a weight shared by two layers)
does not cast it again. The rule graded (``can_try_cache`` of ``cached_cast`` in
``aten/src/ATen/autocast_mode.cpp``, plus the invalidation the course adds):

* only an FP32 leaf tensor that requires grad and is not a view, outside ``torch.inference_mode``, is
  cached (a weight); anything else is cast every time;
* a cached cast is reused only for the same tensor, the same target dtype, and while the tensor is
  unchanged: its version counter ``t._version`` (bumped by every in-place write to ``t`` or to a view of
  it, ``optimizer.step()`` included) must be the one recorded at the cast; otherwise cast again and
  replace the entry;
* the cast is made with grad mode on (``torch.enable_grad()``), so a cast first made under ``no_grad``
  still carries autograd history when reused with grad (pytorch/pytorch#165068).

Two oracles, run on the same scenarios: ``mpcourse.core.autocast``'s own cache (``state.cached_cast``,
every scenario), and ``torch.autocast`` itself on the scenarios where torch 2.13 behaves the same: there
whether torch casts the tensor again is observed from the ``aten._to_copy`` calls a ``torch.mm`` makes on
it. Where torch differs (it keeps serving a cast after an in-place update of the weight, and keys its cache
on the tensor alone, not the dtype), the course's rule is graded and the scenario says so.

Each step is graded on: a new cast or a reuse (and of which earlier step's cast), the dtype, shape and
bits (``t.to(to_type)`` of the tensor's *current* value), and autograd history where grad mode is on. The
first step that differs raises a one-line ``GradingError``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import GradingError, call, same_bits, verdict

bf16, f16 = torch.bfloat16, torch.float16


def _w(seed: int, shape=(4, 3), dtype=torch.float32, requires_grad=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_(requires_grad)


# Each scenario: (label, torch agrees, build() -> env, steps). A step is ("use", name, dtype, grad mode
# "grad" | "no_grad" | "inference") or ("do", callable(env), what it does).
def _sgd_step(e):
    e["w"].grad = torch.ones_like(e["w"])
    torch.optim.SGD([e["w"]], lr=0.25).step()


def _view(e):
    with torch.no_grad():
        base = _w(9, (4, 4), requires_grad=False)
    return base[:, :3].requires_grad_()                       # a leaf that is a view


SCENARIOS = [
    ("one weight used three times", True, lambda: {"w": _w(1)},
     [("use", "w", bf16, "grad")] * 3),
    ("two weights, used in turn", True, lambda: {"w": _w(2), "v": _w(3)},
     [("use", "w", bf16, "grad"), ("use", "v", bf16, "grad"), ("use", "w", bf16, "grad"),
      ("use", "v", bf16, "grad")]),
    ("a tensor that does not require grad (an activation)", True, lambda: {"x": _w(4, requires_grad=False)},
     [("use", "x", bf16, "grad")] * 2),
    ("a non-leaf tensor (w * 2)", True, lambda: {"h": _w(5) * 2},
     [("use", "h", bf16, "grad")] * 2),
    ("a leaf that is a view (base[:, :3].requires_grad_())", True, lambda: {"u": _view(None)},
     [("use", "u", bf16, "grad")] * 2),
    ("an FP16 weight (not FP32) in an FP32 -> BF16 cast", True, lambda: {"w": _w(6, dtype=f16)},
     [("use", "w", bf16, "grad")] * 2),
    ("a cast first made under no_grad, then used with grad", True, lambda: {"w": _w(7)},
     [("use", "w", f16, "no_grad"), ("use", "w", f16, "grad")]),
    ("under torch.inference_mode, then with grad", True, lambda: {"w": _w(8)},
     [("use", "w", bf16, "inference"), ("use", "w", bf16, "inference"), ("use", "w", bf16, "grad")]),
    ("the same weight to BF16, then FP16, then BF16 (torch.autocast keys on the tensor alone)", False,
     lambda: {"w": _w(10)},
     [("use", "w", bf16, "grad"), ("use", "w", f16, "grad"), ("use", "w", bf16, "grad")]),
    ("an in-place update between uses, w.add_(0.5) (torch.autocast serves the old cast)", False,
     lambda: {"w": _w(11)},
     [("use", "w", bf16, "grad"), ("use", "w", bf16, "grad"),
      ("do", lambda e: e["w"].detach().add_(0.5), "w.detach().add_(0.5)"),
      ("use", "w", bf16, "grad"), ("use", "w", bf16, "grad")]),
    ("optimizer.step() between uses (torch.autocast serves the old cast)", False, lambda: {"w": _w(12)},
     [("use", "w", f16, "grad"), ("do", _sgd_step, "torch.optim.SGD([w]).step()"), ("use", "w", f16, "grad")]),
    ("a write through a view of the weight, w[0].zero_() (torch.autocast serves the old cast)", False,
     lambda: {"w": _w(13)},
     [("use", "w", bf16, "grad"), ("do", lambda e: e["w"].detach()[0].zero_(), "w.detach()[0].zero_()"),
      ("use", "w", bf16, "grad")]),
]


def _grad_mode(mode: str):
    return {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]()


def _run(scenario, cast) -> list:
    """Run one scenario with ``cast(t, dtype)``; per use step: (step, t, result, dtype, grad mode, the cast of
    t's value at that step) in order."""
    _, _, build, steps = scenario
    env = build()
    out = []
    for i, step in enumerate(steps):
        if step[0] == "do":
            with torch.no_grad():
                step[1](env)
            continue
        _, name, dtype, mode = step
        t = env[name]
        with _grad_mode(mode):
            r = cast(t, dtype)
        with torch.no_grad():
            now = t.detach().to(dtype)                        # the cast of the tensor's value at this step
        out.append((i, t, r, dtype, mode, now))
    return out


def _outcomes(records) -> list:
    """Per use: None for a new cast, else the index (in steps) of the use whose cast was returned again."""
    seen, res = [], []
    for i, _, r, *_ in records:
        k = next((j for j, o in seen if o is r), None)
        res.append(k)
        seen.append((i, r))
    return res


_CAST_OPS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


class _CastCount(TorchDispatchMode):
    """Counts the casts (``aten._to_copy``; ``aten.to.dtype`` under inference mode, where it is not decomposed)
    whose input is ``source``: torch.autocast's casts of it."""

    def __init__(self, source):
        super().__init__()
        self.source, self.n = source, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _CAST_OPS and args and args[0] is self.source:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _torch_cast_made(scenario) -> list[bool]:
    """torch.autocast's behaviour: per use, did ``torch.mm(x, t)`` in one region cast ``t`` again?"""
    _, _, build, steps = scenario
    env = build()
    dtype = next(s[2] for s in steps if s[0] == "use")
    made = []
    with torch.autocast("cpu", dtype=dtype):
        for step in steps:
            if step[0] == "do":
                with torch.no_grad():
                    step[1](env)
                continue
            t = env[step[1]]
            with _grad_mode(step[3]), _CastCount(t) as count:
                torch.mm(torch.ones(2, t.shape[0], dtype=torch.float32), t)
            made.append(count.n > 0)
    return made


def _library_cast(t, dtype):
    from mpcourse.core.autocast import autocast
    from mpcourse.core.autocast.state import cached_cast
    with autocast("cpu", dtype=dtype):
        return cached_cast(t, dtype, "cpu")


def _describe(step) -> str:
    _, name, dtype, mode = step
    where = {"grad": "", "no_grad": " under torch.no_grad()", "inference": " under torch.inference_mode()"}[mode]
    return f"cached_cast(cache, {name}, {str(dtype).replace('torch.', '')}){where}"


def check_cached_cast(fn) -> None:
    """Grade ``fn(cache: dict, t: Tensor, to_type: dtype) -> Tensor`` (see the module docstring); a fresh
    ``cache = {}`` per scenario (one autocast region)."""
    name = "cached_cast"
    uses = 0
    for scenario in SCENARIOS:
        label, torch_agrees, _, steps = scenario
        from mpcourse.core.autocast import autocast
        with autocast("cpu"):                                # one library region: its cache lives across steps
            want = _outcomes(_run(scenario, _library_cast))
        if torch_agrees:
            made = _torch_cast_made(scenario)
            if made != [k is None for k in want]:            # the two oracles must agree here
                raise RuntimeError(f"grader self-check: torch.autocast and the library disagree on '{label}'")
        cache: dict = {}
        records = _run(scenario, lambda t, dtype: call(name, fn, cache, t, dtype))
        got = _outcomes(records)
        oracle = "torch.autocast and the course's cache" if torch_agrees else "the course's cache"
        for (i, t, r, dtype, mode, now), w, g in zip(records, want, got):
            at = f"FAIL {name}: scenario '{label}', step {i} {_describe(steps[i])}"
            if not isinstance(r, torch.Tensor):
                raise GradingError(f"{at}: returned {type(r).__name__}; return the cast tensor.")
            if r.dtype != dtype or r.shape != t.shape:
                raise GradingError(f"{at}: returned {r.dtype} {tuple(r.shape)}; expected {dtype} {tuple(t.shape)} "
                                   f"(key the cache on the dtype too: a cast to one dtype never serves another).")
            if not bool(same_bits(r.detach(), now).all()):
                raise GradingError(f"{at}: returned a cast of an older value of the tensor (a stale cast); reuse a "
                                   "cached cast only while t._version is the one recorded when it was made.")
            if w is None and g is not None:
                why = ("cache only FP32 leaf tensors that require grad and are not views, outside "
                       "torch.inference_mode" if all(k is None for k in want) else
                       "the tensor changed in place since (t._version moved): cast again and replace the entry")
                raise GradingError(f"{at}: reused the cast of step {g}; {oracle} cast again here: {why}.")
            if w is not None and g != w:
                raise GradingError(f"{at}: made a new cast; {oracle} reuse the cast of step {w} (the same FP32 "
                                   "weight, same dtype, unchanged since): keep it in cache and return it.")
            if mode == "grad" and t.requires_grad and r.grad_fn is None:
                raise GradingError(f"{at}: the cast has no autograd history, so no gradient reaches the weight; "
                                   "make cacheable casts under torch.enable_grad() (a cast made under no_grad "
                                   "is reused with grad later).")
            uses += 1
    verdict(name, f"{len(SCENARIOS)} scenarios, {uses} casts: reused and recast exactly as the course's cache "
                  "(and as torch.autocast where torch keeps no stale cast)")
