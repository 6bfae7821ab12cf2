"""Lesson 02's graders: pass on the library's MasterWeights, reject planted mistakes (stepping the FP16 weights,
forgetting to unscale, unscaling in FP16, truncating instead of rounding, rebinding instead of copying)."""
import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.master import check_make_master, check_master_step
from mpcourse.core.master import MasterWeights


def lib_make_master(params):
    return MasterWeights(params, torch.optim.SGD, lr=0.0).master_params


def lib_master_step(params, masters, optimizer, loss_scale):
    mw = MasterWeights(params, torch.optim.SGD, lr=0.0)
    mw.master_params, mw.optimizer = list(masters), optimizer          # public attributes: step the grader's master
    mw.copy_grads_to_master(inv_scale=1.0 / loss_scale)                # exact: the scales are powers of two
    optimizer.step()
    mw.copy_master_to_model()


def test_library_passes(capsys):
    check_make_master(lib_make_master)
    check_master_step(lib_master_step)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS make_master:") and out[1].startswith("PASS master_step: 11 steps")


def _step(grad_fn, copy_fn):
    def step(params, masters, optimizer, loss_scale):
        for p, m in zip(params, masters):
            m.grad = grad_fn(p.grad, loss_scale)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                copy_fn(p, m)
    return step


GOOD_GRAD = lambda g, s: g.float() / s                                # noqa: E731
GOOD_COPY = lambda p, m: p.copy_(m)                                   # noqa: E731


def _truncate(p, m):
    r = m.half()
    p.copy_(torch.where(r.float().abs() > m.abs(), torch.nextafter(r, torch.zeros_like(r)), r))


def _update_fp16_directly(params, masters, optimizer, loss_scale):
    lr = optimizer.param_groups[0]["lr"]
    with torch.no_grad():
        for p in params:
            p.sub_(lr * p.grad / loss_scale)


def _rebind(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / loss_scale
    optimizer.step()
    for p, m in zip(params, masters):
        p = m.half()                                                   # noqa: F841  (changes nothing)


@pytest.mark.parametrize("fn,expect", [
    (_update_fp16_directly, "you stepped the FP16 weights"),
    (_step(lambda g, s: g.float(), GOOD_COPY), "not unscaled"),
    (_step(lambda g, s: (g / s).float(), GOOD_COPY), "unscaled in FP16"),
    (_step(GOOD_GRAD, _truncate), "truncated"),
    (_rebind, "model was not updated"),
    (_step(GOOD_GRAD, lambda p, m: None), "model was not updated"),
])
def test_master_step_rejects_planted_mistakes(fn, expect):
    with pytest.raises(GradingError, match=expect):
        check_master_step(fn)


def test_unscaling_in_fp16_is_caught_even_without_the_sgd_scenario():
    """The AdamW scenario alone (scale 2**16, gradients subnormal or 0 in FP16 once unscaled) exposes it."""
    import mpcourse.course.grading.master as gm
    saved = gm.SCENARIOS
    try:
        gm.SCENARIOS = [s for s in saved if s[1] is torch.optim.AdamW]
        with pytest.raises(GradingError, match="AdamW"):
            check_master_step(_step(lambda g, s: (g / s).float(), GOOD_COPY))
    finally:
        gm.SCENARIOS = saved


def _same_objects(ps):                    # makes the model params FP32 and returns them: no separate master
    for p in ps:
        p.data = p.data.float()
    return list(ps)


@pytest.mark.parametrize("fn,expect", [
    (_same_objects, "changing the master changed the model"),
    (lambda ps: [p.detach().float() for p in ps], "leaf that requires grad"),
    (lambda ps: [torch.nn.Parameter(p.detach()) for p in ps], "float32"),
    (lambda ps: [torch.nn.Parameter(p.detach().float()) for p in ps[:-1]], "one master tensor per"),
    (lambda ps: [torch.nn.Parameter(p.detach().float().bfloat16().float()) for p in ps], "exactly the model's"),
])
def test_make_master_rejects_planted_mistakes(fn, expect):
    with pytest.raises(GradingError, match=expect):
        check_make_master(fn)
