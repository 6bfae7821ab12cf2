"""The lesson-11 grader: the library's all-reduce passes, planted wrong ones fail (each spawns two gloo ranks)."""
import pytest
import torch.distributed as dist

from mpcourse.core.distributed import all_reduce_max_
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.distributed import check_all_reduce_found_inf

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def reference(found_inf, group=None):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def summed(found_inf, group=None):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, group=group)                # SUM: 2.0 when both overflow
    return found_inf


def unconditional(found_inf, group=None):
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)   # fails in one process
    return found_inf


def kept(found_inf, group=None):
    return found_inf


def test_reference_passes(capsys):
    check_all_reduce_found_inf(reference)
    assert capsys.readouterr().out.startswith("PASS all_reduce_found_inf_")


def test_library_helper_agrees_with_the_grader_rule():
    import torch
    t = torch.tensor(1.0)
    assert all_reduce_max_(t) is t and float(t) == 1.0          # one process: no-op


@pytest.mark.slow                                  # spawns two gloo ranks; test_reference_passes stays in the fast lane
@pytest.mark.parametrize("bad, message", [(summed, "SUM"), (kept, "kept its own flag"),
                                          (unconditional, "single process")])
def test_planted_bugs_fail(bad, message):
    with pytest.raises(GradingError, match=message):
        check_all_reduce_found_inf(bad)


@pytest.mark.slow                                  # spawns two gloo ranks; test_reference_passes stays in the fast lane
def test_stub_fails():
    def stub(found_inf, group=None):
        raise NotImplementedError
    with pytest.raises(GradingError, match="not implemented"):
        check_all_reduce_found_inf(stub)
