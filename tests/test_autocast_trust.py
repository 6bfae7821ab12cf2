"""mpcourse.core.autocast outside the happy path, against torch.autocast run side by side.

* the weight-cast cache never serves a stale cast (version counter), a documented difference from
  torch 2.13, whose cache is keyed by the tensor alone;
* the library's own modules (``Float8Linear``) see the course's autocast as they see torch's;
* the RNN family refuses with a clear error instead of differing silently;
* ``torch.utils.checkpoint`` (reentrant and not) recomputes under the course's autocast state;
* ``custom_fwd``/``custom_bwd`` across the two autocasts.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mpcourse.core.autocast as mpa
from mpcourse.core.autocast import autocast


def leaf(shape, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).requires_grad_(grad)


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())


# ------------------------------------------------------------------------ the weight-cast cache
UPDATES = {
    "no_grad add_": lambda w: w.add_(1.0),
    "no_grad copy_": lambda w: w.copy_(torch.full_like(w, 0.5)),
    "write through a view": lambda w: w[0].fill_(3.0),
    "optimizer.step": lambda w: (setattr(w, "grad", torch.ones_like(w)), torch.optim.SGD([w], lr=0.1).step()),
}


@pytest.mark.parametrize("name", list(UPDATES))
def test_cache_recasts_after_an_in_place_update_within_one_region(name):
    """After an in-place write the next use casts the new values (torch 2.13 reuses the old cast)."""
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    with autocast("cpu"):
        before = torch.mm(x, w)
        with torch.no_grad():
            UPDATES[name](w)
        after = torch.mm(x, w)
        assert mpa.cache_size() == 1                              # the entry was replaced, not added
    fresh = torch.mm(x.to(torch.bfloat16), w.detach().to(torch.bfloat16))   # the oracle: a fresh cast
    assert bits_equal(after, fresh) and not torch.equal(after, before)


def test_torch_autocast_serves_the_stale_cast_the_course_does_not():
    """Pins the documented policy difference: same program, torch's cache reuses the stale cast."""
    outs = {}
    for name, ctx in (("torch", lambda: torch.autocast("cpu")), ("course", lambda: autocast("cpu"))):
        x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
        with ctx():
            a = torch.mm(x, w)
            with torch.no_grad():
                w.mul_(2.0)
            outs[name] = (a, torch.mm(x, w))
    assert torch.equal(outs["torch"][0], outs["torch"][1])                   # stale in torch 2.13
    assert torch.equal(outs["course"][1], 2 * outs["course"][0])             # x2 is exact in bf16


def test_cache_still_reuses_an_unchanged_weight_and_gradients_match_torch():
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    wt = w.detach().clone().requires_grad_()
    with autocast("cpu"):
        a, b = torch.mm(x, w), torch.mm(x, w)
        assert mpa.cache_size() == 1
    with torch.autocast("cpu"):
        ra, rb = torch.mm(x, wt), torch.mm(x, wt)
    (a.float().sum() + b.float().sum()).backward()
    (ra.float().sum() + rb.float().sum()).backward()
    assert bits_equal(a, ra) and bits_equal(w.grad, wt.grad)


def test_a_write_through_data_is_not_seen_as_documented():
    """``w.data`` has its own version counter: the cache cannot see such a write (docstring of state.py)."""
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    with autocast("cpu"):
        a = torch.mm(x, w)
        w.data.mul_(2.0)
        assert torch.equal(torch.mm(x, w), a)
        mpa.clear_autocast_cache()                                # the documented way out
        assert torch.equal(torch.mm(x, w), 2 * a)


# ------------------------------------------------------- the library's modules see the course's autocast
def test_torch_is_autocast_enabled_stays_false_inside_the_course_autocast():
    """Why the library asks ``autocast_dtype_in_effect``: torch's flag would switch on torch's casts."""
    with autocast("cpu", dtype=torch.float16):
        assert not torch.is_autocast_enabled("cpu")
        assert mpa.autocast_dtype_in_effect("cpu") is torch.float16
    with torch.autocast("cpu"):
        assert mpa.autocast_dtype_in_effect("cpu") is torch.bfloat16
    assert mpa.autocast_dtype_in_effect("cpu") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float8_linear_gives_the_same_bits_under_both_autocasts(dtype):
    from mpcourse.core.quant import CurrentScaling, Float8Linear
    results = {}
    for name, ctx in (("torch", torch.autocast), ("course", autocast)):
        torch.manual_seed(0)
        layer = Float8Linear(32, 16, recipe=CurrentScaling())
        x = leaf((2, 8, 32), 3)
        with ctx("cpu", dtype=dtype):
            y = layer(x)
        y.float().square().sum().backward()
        results[name] = (y, x.grad, layer.weight.grad, layer.bias.grad)
    assert results["course"][0].dtype is dtype
    for got, ref in zip(results["course"], results["torch"]):
        assert bits_equal(got, ref)


def test_no_autocast_stops_both():
    x, w = leaf((2, 4), 1), leaf((4, 4), 2)
    for ctx in (torch.autocast, autocast):
        with ctx("cpu"), mpa.no_autocast("cpu"):
            assert torch.mm(x, w).dtype is torch.float32
