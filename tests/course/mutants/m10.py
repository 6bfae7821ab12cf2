"""Lesson 10's mutants: learner-plausible wrong versions of ``all_reduce_found_inf_`` and ``distributed_skip_step_``.

The check cells of ``solutions/10_beyond_one_machine.ipynb`` spawn four gloo ranks per check, so running the
mutants one by one would spawn two jobs each. ``graded_together`` (called by ``tests/course/test_mutation.py``) instead
runs the notebook once per mutant with the graders only *recording* what they were asked to grade, grades every
recorded function of a check in one job (``grading.distributed._grade``, the graders' own batch path: each
function in fresh process groups, one after the other), and then lets the check cells read those verdicts.
A check cell still raises exactly the ``GradingError`` the grader gives that function.
"""
from __future__ import annotations

import contextlib

_SOLUTION_FLAG = '''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
'''


def _flag(body: str) -> str:
    return "def all_reduce_found_inf_(found_inf, group=None):\n" + body


FLAG_MUTANTS = [
    ("no all-reduce: each rank keeps its own flag", _flag("    return found_inf\n")),
    ("SUM instead of MAX", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, group=group)
    return found_inf
''')),
    ("ignores group: reduces over every rank", _flag('''\
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return found_inf
''')),
    ("collective without the single-process guard", _flag('''\
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
''')),
    ("guard without is_initialized", _flag('''\
    if dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
''')),
    ("reduces in place, returns nothing", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
''')),
    ("reduces a copy: the caller's flag unchanged", _flag('''\
    flag = found_inf.clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag
''')),
    ("returns a Python float", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf.item()
''')),
    ("reduces and returns an int flag", _flag('''\
    flag = found_inf.to(torch.int32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    found_inf.copy_(flag)
    return flag
''')),
    ("returns a bool flag", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf > 0
''')),
    ("MIN instead of MAX", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MIN, group=group)
    return found_inf
''')),
    ("mean of the flags (SUM / ranks)", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, group=group)
        found_inf /= dist.get_world_size(group)
    return found_inf
''')),
    ("broadcast from the group's first rank", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(found_inf, src=dist.get_global_rank(group, 0), group=group)
    return found_inf
''')),
    ("collective only where the flag is set", _flag('''\
    if dist.is_initialized() and dist.get_world_size(group) > 1 and found_inf.item() > 0:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
''')),
]

_SIG = ("def distributed_skip_step_(optimizer, scale: torch.Tensor, growth_tracker: torch.Tensor, group=None,\n"
        "                           growth_factor: float = 2.0, backoff_factor: float = 0.5,\n"
        "                           growth_interval: int = 2000) -> torch.Tensor:\n")

#: the solution's body, in parts a mutant replaces one at a time
_GRADS = '''\
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
'''
_FLAG = '''\
    found_inf = torch.zeros((), dtype=torch.float32)
'''
_CHECK = '''\
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
'''
_UNSCALE = '''\
    inv_scale = scale.double().reciprocal().float()
    for g in grads:
        g.mul_(inv_scale)
'''
_REDUCE = '''\
    all_reduce_found_inf_(found_inf, group)
'''
_DECIDE = '''\
    if found_inf.item() == 0:
        optimizer.step()
        growth_tracker.add_(1)
        if growth_tracker.item() == growth_interval:
            scale.mul_(growth_factor)
            growth_tracker.zero_()
    else:
        scale.mul_(backoff_factor)
        growth_tracker.zero_()
    return found_inf
'''


def _step(grads=_GRADS, flag=_FLAG, check=_CHECK, unscale=_UNSCALE, reduce=_REDUCE, decide=_DECIDE,
          order=("grads", "flag", "check", "unscale", "reduce", "decide")) -> str:
    parts = dict(grads=grads, flag=flag, check=check, unscale=unscale, reduce=reduce, decide=decide)
    return _SIG + "".join(parts[k] for k in order)


STEP_MUTANTS = [
    ("checks isinf only: a NaN alone goes unseen", _step(check='''\
    for g in grads:
        if torch.isinf(g).any():
            found_inf.fill_(1.0)
''')),
    ("no all-reduce: each rank decides alone", _step(reduce="")),
    ("SUM all-reduce: returns 2.0 when two ranks overflow", _step(reduce='''\
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, group=group)
''')),
    ("reduces over every rank, not group", _step(reduce='''\
    all_reduce_found_inf_(found_inf)
''')),
    ("int flag", _step(flag='''\
    found_inf = torch.zeros((), dtype=torch.int32)
''')),
    ("flag of shape (1,)", _step(flag='''\
    found_inf = torch.zeros(1)
''')),
    ("decides on the local flag (steps on one rank, skips on another)", _step(decide='''\
    if local == 0:
        optimizer.step()
        growth_tracker.add_(1)
        if growth_tracker.item() == growth_interval:
            scale.mul_(growth_factor)
            growth_tracker.zero_()
    else:
        scale.mul_(backoff_factor)
        growth_tracker.zero_()
    return found_inf
''', reduce='''\
    local = found_inf.item()
    all_reduce_found_inf_(found_inf, group)
''')),
    ("unscales twice", _step(unscale=_UNSCALE + '''\
    for g in grads:
        g.mul_(inv_scale)
''')),
    ("unscales only when it steps", _step(unscale="", decide=_DECIDE.replace('''\
        optimizer.step()
''', '''\
        inv_scale = scale.double().reciprocal().float()
        for g in grads:
            g.mul_(inv_scale)
        optimizer.step()
'''))),
    ("divides by S instead of multiplying by fp32(1/S)", _step(unscale='''\
    for g in grads:
        g.div_(scale)
''')),
    ("unscales in FP64", _step(unscale='''\
    for g in grads:
        g.copy_((g.double() / scale.double()).float())
''')),
    ("checks after unscaling", _step(order=("grads", "flag", "unscale", "check", "reduce", "decide"))),
    ("steps anyway", _step(decide=_DECIDE.replace("    if found_inf.item() == 0:\n        optimizer.step()\n",
                                                  "    optimizer.step()\n    if found_inf.item() == 0:\n"))),
    ("no back-off", _step(decide=_DECIDE.replace("        scale.mul_(backoff_factor)\n", ""))),
    ("backs off by dividing", _step(decide=_DECIDE.replace("scale.mul_(backoff_factor)",
                                                           "scale.div_(backoff_factor)"))),
    ("tracker not reset after an overflow", _step(decide=_DECIDE.replace('''\
        scale.mul_(backoff_factor)
        growth_tracker.zero_()
''', '''\
        scale.mul_(backoff_factor)
'''))),
    ("grows one clean step late", _step(decide='''\
    if found_inf.item() == 0:
        optimizer.step()
        if growth_tracker.item() == growth_interval:
            scale.mul_(growth_factor)
            growth_tracker.zero_()
        else:
            growth_tracker.add_(1)
    else:
        scale.mul_(backoff_factor)
        growth_tracker.zero_()
    return found_inf
''')),
    ("grows without resetting the tracker", _step(decide=_DECIDE.replace('''\
            scale.mul_(growth_factor)
            growth_tracker.zero_()
''', '''\
            scale.mul_(growth_factor)
'''))),
    ("scale rebound, not updated in place", _step(decide=_DECIDE.replace("scale.mul_(backoff_factor)",
                                                                        "scale = scale * backoff_factor"))),
    ("first param group only", _step(grads='''\
    grads = [p.grad for p in optimizer.param_groups[0]["params"] if p.grad is not None]
''')),
    ("zeroes the gradients after the step", _step(decide=_DECIDE.replace(
        "        optimizer.step()\n", "        optimizer.step()\n        optimizer.zero_grad()\n"))),
    ("returns a Python bool", _step(decide=_DECIDE.replace("    return found_inf\n",
                                                           "    return bool(found_inf.item())\n"))),
    ("all-reduce only where the local flag is set", _step(reduce='''\
    if found_inf.item() > 0:
        all_reduce_found_inf_(found_inf, group)
''')),
]

MUTANTS = {"all_reduce_found_inf_": FLAG_MUTANTS, "distributed_skip_step_": STEP_MUTANTS}


@contextlib.contextmanager
def graded_together(notebook: str, mutants: dict):
    """Inside: the check cells of ``notebook`` read verdicts computed beforehand, every function a check is asked
    to grade (over the solution and all ``mutants``) graded in one job per check; a function not graded
    beforehand is graded as usual."""
    from mutation import run_mutant

    from mpcourse.course.grading import distributed as grader

    real_check = grader._check
    runs: list[list] = []                    # per run of the notebook: (check, fn, sources) in the cells' order

    def record(check, fn):                   # the sources now: the next mutant reuses the linecache entry
        runs[-1].append((check, fn, grader._sources(fn)))

    grader._check = record
    try:
        for name, source in [("", None)] + [(n, s) for n, versions in mutants.items() for _, s in versions]:
            runs.append([])
            run_mutant(notebook, name, source)
    finally:
        grader._check = real_check

    verdicts: dict = {}                      # (check name, sources) -> GradingError | None
    real_sources = grader._sources
    for position in range(max(map(len, runs))):
        # a check cell runs only if the ones before it passed
        todo = {}
        for run in runs:
            if position < len(run) and all(verdicts[(c.name, s)] is None for c, _, s in run[:position]):
                check, fn, sources = run[position]
                todo.setdefault(check, {}).setdefault(sources, fn)
        for check, by_source in todo.items():
            by_source = {s: fn for s, fn in by_source.items() if (check.name, s) not in verdicts}
            fns = list(by_source.values())
            known = {id(fn): s for s, fn in by_source.items()}
            grader._sources = lambda fn: known.get(id(fn)) or real_sources(fn)
            try:
                for (s, _), v in zip(by_source.items(), grader._grade(check, fns)):
                    verdicts[(check.name, s)] = v
            finally:
                grader._sources = real_sources

    missing = object()

    def replay(check, fn):
        v = verdicts.get((check.name, grader._sources(fn)), missing)
        if v is missing:
            return real_check(check, fn)
        if v is not None:
            raise v
        grader.verdict(check.name, check.passed)

    grader._check = replay
    try:
        yield
    finally:
        grader._check = real_check
