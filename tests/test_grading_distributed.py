"""The lesson-10 graders: the library's rules pass, planted wrong ones fail with a hint naming the fault.

Each check spawns four gloo ranks in two groups; the oracle is FSDP's ShardedGradScaler run beside the function.
"""
import pytest
import torch
import torch.distributed as dist

from mpcourse.core.distributed import all_reduce_max_
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.distributed import check_all_reduce_found_inf, check_distributed_skip_step

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


def _step(optimizer, scale, growth_tracker, group, growth_factor, backoff_factor, growth_interval, reduce,
          unscale_first=False, step_anyway=False, back_off=True):
    """The skip decision, with switches that plant one fault each."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    inv = scale.double().reciprocal().float()
    if unscale_first:
        torch._foreach_mul_(grads, inv)
    found_inf = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
    if not unscale_first:
        torch._foreach_mul_(grads, inv)
    reduce(found_inf, group)
    if found_inf.item() == 0 or step_anyway:
        optimizer.step()
    if found_inf.item() > 0:
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


def test_reference_passes(capsys):
    check_all_reduce_found_inf(reference)
    assert capsys.readouterr().out.startswith("PASS all_reduce_found_inf_")


def test_library_helper_agrees_with_the_grader_rule():
    t = torch.tensor(1.0)
    assert all_reduce_max_(t) is t and float(t) == 1.0          # one process: no-op


@pytest.mark.slow                                  # spawns four gloo ranks; test_reference_passes stays in the fast lane
@pytest.mark.parametrize("bad, message", [(summed, "SUM"), (kept, "kept its own flag"), (world, "not over `group`"),
                                          (unconditional, "single process")])
def test_planted_bugs_fail(bad, message):
    with pytest.raises(GradingError, match=message):
        check_all_reduce_found_inf(bad)


@pytest.mark.slow
def test_stub_fails():
    def stub(found_inf, group=None):
        raise NotImplementedError
    with pytest.raises(GradingError, match="not implemented"):
        check_all_reduce_found_inf(stub)


def test_skip_step_reference_passes(capsys):
    check_distributed_skip_step(step_reference)
    assert capsys.readouterr().out.startswith("PASS distributed_skip_step_")


@pytest.mark.slow
@pytest.mark.parametrize("bad, message", [
    (step_world, "the other group.*over `group`"),
    (step_summed, "a SUM counts them"),
    (step_unscale_first, "check the gradients as backward left them"),
    (step_anyway, "it stepped although"),
    (step_no_backoff, "back off"),
])
def test_skip_step_planted_bugs_fail(bad, message):
    with pytest.raises(GradingError, match=message):
        check_distributed_skip_step(bad)
