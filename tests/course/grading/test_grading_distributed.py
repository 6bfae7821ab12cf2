"""The lesson-10 graders: the library's rules pass, planted wrong ones fail with a hint naming the fault.

Each check spawns four gloo ranks in two groups; the oracle is FSDP's ShardedGradScaler run beside the function.
The planted bugs of a check are graded in one job (``grade_*``, a module-scoped fixture), then each test reads its
function's verdict; the reference's PASS line comes from ``check_*`` replaying its ranks' records of that job.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mpcourse.core.distributed import all_reduce_max_
from mpcourse.course.grading import GradingError
from mpcourse.course.grading import distributed
from mpcourse.course.grading.distributed import (check_all_reduce_found_inf, check_distributed_skip_step,
                                                 grade_all_reduce_found_inf, grade_distributed_skip_step)
from mpcourse.experiment.parallel.distributed import RankFailed

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def reference(found_inf, group=None):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def summed(found_inf, group=None):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, group=group)                # SUM: 2.0 when two ranks overflow
    return found_inf


def world(found_inf, group=None):
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)        # ignores group: every rank
    return found_inf


def unconditional(found_inf, group=None):
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)   # fails in one process
    return found_inf


def kept(found_inf, group=None):
    return found_inf


def raises_on_rank_1(found_inf, group=None):
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("planted: only rank 1 raises")        # rank 0 waits in the all-reduce until its timeout
    return reference(found_inf, group)


def stub(found_inf, group=None):
    raise NotImplementedError


def returns_int(found_inf, group=None):
    flag = found_inf.to(torch.int64)                            # int flag: right values, wrong dtype
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    found_inf.copy_(flag)
    return flag


def returns_python_float(found_inf, group=None):
    return float(reference(found_inf, group))                   # a Python float for the tensor


def not_in_place(found_inf, group=None):
    flag = found_inf.clone()                                    # reduces a copy: the caller's flag is unchanged
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reduce,
          unscale_first=False, step_anyway=False, back_off=True, bad=lambda g: ~torch.isfinite(g), first_group=False,
          flag_dtype=torch.float32, unscale=None, times=1, decide_local=False):
    """The skip decision, with switches that plant one fault each."""
    groups = optimizer.param_groups[:1] if first_group else optimizer.param_groups
    grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
    inv = scale.double().reciprocal().float()
    unscale = unscale or (lambda gs: torch._foreach_mul_(gs, inv))
    if unscale_first:
        unscale(grads)
    found_inf = torch.zeros((), dtype=flag_dtype)
    for g in grads:
        if bad(g).any():
            found_inf.fill_(1)
    if not unscale_first:
        for _ in range(times):
            unscale(grads)
    local = found_inf.item()
    reduce(found_inf, group)
    decided = local if decide_local else found_inf.item()
    if decided == 0 or step_anyway:
        optimizer.step()
    if decided > 0:
        if back_off:
            scale.mul_(backoff_factor)
        growth_tracker.zero_()
    else:
        growth_tracker.add_(1)
        if growth_tracker.item() == growth_interval:
            scale.mul_(growth_factor)
            growth_tracker.zero_()
    return found_inf


def step_reference(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                   growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference)


def step_world(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, world)


def step_summed(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, summed)


def step_unscale_first(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 unscale_first=True)


def step_anyway(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 step_anyway=True)


def step_no_backoff(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 back_off=False)


def step_isinf_only(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 bad=torch.isinf)


def step_first_group_only(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 first_group=True)


def step_int_flag(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 flag_dtype=torch.int32)


def step_divides(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 unscale=lambda gs: torch._foreach_div_(gs, scale))


def step_unscale_twice(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 times=2)


def step_decides_locally(optimizer, scale, growth_tracker, group=None, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=2000):
    return _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reference,
                 decide_local=True)


#: seconds: how long rank 0 waits for rank 1 in ``raises_on_rank_1`` (the grader's default is 30)
SHORT_GROUP_TIMEOUT_S = 5.0
#: graded in one job; ``raises_on_rank_1`` before the others shows a rank's error spoils only its own verdict
FLAG_FNS = [reference, raises_on_rank_1, summed, kept, world, unconditional, returns_int, returns_python_float,
            not_in_place]
STEP_FNS = [step_reference, step_world, step_summed, step_unscale_first, step_anyway, step_no_backoff,
            step_isinf_only, step_first_group_only, step_int_flag, step_divides, step_unscale_twice,
            step_decides_locally]


def _graded(grade, fns, **module_values):
    """``grade(fns)`` in one job; the verdicts per function and ``replay(fn)``: a ``_spawn`` that gives back
    ``fn``'s records of that job (to run ``check_*(fn)`` again without spawning)."""
    jobs = []

    def recording(on_rank, sources):
        got = real_spawn(on_rank, sources)
        jobs.append((sources, got))
        return got

    real_spawn = distributed._spawn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributed, "_spawn", recording)
        for name, value in module_values.items():
            mp.setattr(distributed, name, value)
        verdicts = dict(zip(fns, grade(fns)))
    assert len(jobs) == 1, "the batch was graded in more than one job (the fallback ran)"
    sources, got = jobs[0]

    def replay(fn):
        k = sources.index(distributed._sources(fn))
        return lambda on_rank, wanted: [[per_rank[k]] for per_rank in got]
    return SimpleNamespace(verdicts=verdicts, replay=replay)


@pytest.fixture(scope="module")
def flag_job():
    return _graded(grade_all_reduce_found_inf, FLAG_FNS, GROUP_TIMEOUT_S=SHORT_GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def step_job():
    return _graded(grade_distributed_skip_step, STEP_FNS)


@pytest.mark.slow                                  # the fixture spawns four gloo ranks
def test_reference_passes(flag_job, monkeypatch, capsys):
    assert flag_job.verdicts[reference] is None
    monkeypatch.setattr(distributed, "_spawn", flag_job.replay(reference))
    check_all_reduce_found_inf(reference)
    assert capsys.readouterr().out.startswith("PASS all_reduce_found_inf_")


def test_library_helper_agrees_with_the_grader_rule():
    t = torch.tensor(1.0)
    assert all_reduce_max_(t) is t and float(t) == 1.0          # one process: no-op


@pytest.mark.slow
@pytest.mark.parametrize("bad, message", [(summed, "SUM"), (kept, "kept its own flag"), (world, "not over `group`"),
                                          (unconditional, "single process"),
                                          (returns_int, "must stay 1.0 and be returned.*int64 tensor"),
                                          (returns_python_float, "must stay 1.0 and be returned.*Python float"),
                                          (not_in_place, "in place")])
def test_planted_bugs_fail(flag_job, bad, message):
    error = flag_job.verdicts[bad]
    assert isinstance(error, GradingError) and error.args[0].startswith("FAIL all_reduce_found_inf_")
    with pytest.raises(GradingError, match=message):
        raise error


@pytest.mark.slow
def test_a_rank_that_raises_fails_its_function_only(flag_job):
    """rank 1 raises, rank 0 waits in the all-reduce until its group's timeout: the verdict names rank 1's error
    (the first), and the functions graded after it on the same ranks get their own verdicts (the tests above)."""
    error = flag_job.verdicts[raises_on_rank_1]
    assert isinstance(error, GradingError)
    assert "on rank 1 of 4 it raised ValueError: planted: only rank 1 raises" in str(error)


def test_stub_fails():                             # fails in one process: spawns nothing
    with pytest.raises(GradingError, match="not implemented"):
        check_all_reduce_found_inf(stub)


def test_a_failed_job_is_graded_again_function_by_function(monkeypatch):
    """A job that fails as a whole (a rank dies) is graded again one job per function: each its own verdict; a
    function that fails in one process never reaches the ranks. A fake ``_spawn``: each function's records are
    made up (a rank holding its own flag, or the group's MAX), a function named ``dies`` kills rank 2."""
    def good(found_inf, group=None):
        return found_inf

    def bad(found_inf, group=None):
        return found_inf

    def dies(found_inf, group=None):
        return found_inf

    def records(name, rank):
        """Per pattern: the group's MAX (``good``) or the rank's own flag (``bad``), in place and returned."""
        out = []
        for flags in distributed.PATTERNS:
            want = max(flags[m] for m in next(g for g in distributed.GROUPS if rank in g))
            held = want if name == "good" else flags[rank]
            out.append({"in_place": held, "returned": held, "want": want})
        return out

    jobs = []

    def fake_spawn(on_rank, sources):
        names = [name for _, name in sources]
        jobs.append(names)
        if "dies" in names:
            raise RankFailed(2, "exited with code 3")
        return [[records(name, rank) for name in names] for rank in range(distributed.WORLD)]

    monkeypatch.setattr(distributed, "_spawn", fake_spawn)
    verdicts = grade_all_reduce_found_inf([good, stub, dies, bad])
    assert jobs == [["good", "dies", "bad"], ["good"], ["dies"], ["bad"]]
    assert verdicts[0] is None
    assert "not implemented" in str(verdicts[1])
    assert "rank 2 of 4 failed (exited with code 3)" in str(verdicts[2])
    assert "each rank kept its own flag" in str(verdicts[3])


@pytest.mark.slow
def test_skip_step_reference_passes(step_job, monkeypatch, capsys):
    assert step_job.verdicts[step_reference] is None
    monkeypatch.setattr(distributed, "_spawn", step_job.replay(step_reference))
    check_distributed_skip_step(step_reference)
    assert capsys.readouterr().out.startswith("PASS distributed_skip_step_")


@pytest.mark.slow
@pytest.mark.parametrize("bad, message", [
    (step_world, "the other group.*over `group`"),
    (step_summed, "a SUM counts them"),
    (step_unscale_first, "check the gradients as backward left them"),
    (step_anyway, "it stepped although"),
    (step_no_backoff, "back off"),
    (step_isinf_only, "NaN"),
    (step_first_group_only, "second param group"),
    (step_int_flag, "FP32 tensor of shape \\(\\)"),
    (step_divides, "not g / S"),
    (step_unscale_twice, "exactly once"),
    (step_decides_locally, "decide on the reduced flag"),
])
def test_skip_step_planted_bugs_fail(step_job, bad, message):
    error = step_job.verdicts[bad]
    assert isinstance(error, GradingError) and error.args[0].startswith("FAIL distributed_skip_step_")
    with pytest.raises(GradingError, match=message):
        raise error
