"""mpcourse.core.autocast outside the happy path, against torch.autocast run side by side.

* the weight-cast cache never serves a stale cast (version counter), a documented difference from
  torch 2.13, whose cache is keyed by the tensor alone;
* the library's own modules (``Float8Linear``) see the course's autocast as they see torch's;
* the RNN family refuses with a clear error instead of differing silently;
* ``torch.utils.checkpoint`` (reentrant and not) recomputes under the course's autocast state (its
  ``course_additions`` setting included);
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
            with autocast("cpu"):                      # a region opened inside casts again, as torch's would
                assert torch.mm(x, w).dtype is torch.bfloat16


# ------------------------------------------------------------------------------------- RNN family
RNNS = {"LSTM": lambda: torch.nn.LSTM(4, 5), "GRU": lambda: torch.nn.GRU(4, 5), "RNN": lambda: torch.nn.RNN(4, 5),
        "RNN relu": lambda: torch.nn.RNN(4, 5, nonlinearity="relu"), "LSTMCell": lambda: torch.nn.LSTMCell(4, 5),
        "GRUCell": lambda: torch.nn.GRUCell(4, 5), "RNNCell": lambda: torch.nn.RNNCell(4, 5)}


@pytest.mark.parametrize("name", list(RNNS))
def test_rnn_family_raises_naming_the_gap_where_torch_autocast_would_differ(name):
    torch.manual_seed(0)
    m, x = RNNS[name](), leaf((3, 4), 1)
    first = lambda out: (out[0] if isinstance(out, tuple) else out).detach()   # noqa: E731
    plain = first(m(x))
    try:                                   # the oracle: torch.autocast does not give the FP32 result
        with torch.autocast("cpu"):
            assert not bits_equal(first(m(x)), plain)
    except RuntimeError as e:              # oneDNN's bf16 LSTM is not available on every CPU
        assert "LSTM" in str(e)
    with pytest.raises(NotImplementedError, match=r"torch\.autocast\('cpu'\).*enabled=False"):
        with autocast("cpu"):
            m(x)
    with autocast("cpu"), autocast("cpu", enabled=False):       # the named way out runs FP32
        assert bits_equal(first(m(x)), plain)


# ------------------------------------------------------------------------- activation checkpointing
def _block(w1, w2):
    def f(x):
        h = F.gelu(torch.mm(x, w1))                       # bf16 under autocast
        h = F.layer_norm(h, h.shape[-1:])
        return torch.mm(h, w2)
    return f


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_checkpoint_recomputes_under_the_same_state_bit_identical(reentrant, dtype, backward_inside):
    grads = {}
    for ckpt in (False, True):
        x, w1, w2 = leaf((4, 8), 1), leaf((8, 8), 2), leaf((8, 3), 3)
        f = _block(w1, w2)
        with autocast("cpu", dtype=dtype):
            y = checkpoint(f, x, use_reentrant=reentrant) if ckpt else f(x)
            loss = y.float().square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        assert y.dtype is dtype
        grads[ckpt] = (y, x.grad, w1.grad, w2.grad)
    for a, b in zip(grads[True], grads[False]):
        assert bits_equal(a, b)


def test_checkpoint_in_a_disabled_inner_region_recomputes_in_fp32():
    x, w1, w2 = leaf((4, 8), 1), leaf((8, 8), 2), leaf((8, 3), 3)
    f = _block(w1, w2)
    with autocast("cpu"):
        with autocast("cpu", enabled=False):
            y = checkpoint(f, x, use_reentrant=True)
        y.sum().backward()                       # inside an enabled region: the recompute must stay FP32
    x2, v1, v2 = leaf((4, 8), 1), leaf((8, 8), 2), leaf((8, 3), 3)
    _block(v1, v2)(x2).sum().backward()
    assert y.dtype is torch.float32 and bits_equal(w1.grad, v1.grad) and bits_equal(x.grad, x2.grad)


def test_checkpoint_matches_torch_autocast_with_its_checkpoint():
    out = {}
    for name, ctx in (("torch", torch.autocast), ("course", autocast)):
        x, w1, w2 = leaf((4, 8), 1), leaf((8, 8), 2), leaf((8, 3), 3)
        with ctx("cpu"):
            y = checkpoint(_block(w1, w2), x, use_reentrant=False)
        y.float().sum().backward()
        out[name] = (y, x.grad, w1.grad, w2.grad)
    for a, b in zip(out["course"], out["torch"]):
        assert bits_equal(a, b)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputes_with_torchs_tables_when_asked(reentrant):
    # course_additions=False: the grouped GEMM of FP32 inputs runs in FP32 (torch's tables); the recompute, run
    # after the region exited, must too (with the course's table it would run in BF16)
    out = {}
    for ckpt in (False, True):
        x, w = leaf((2, 4, 8), 1), leaf((2, 8, 8), 2)
        f = lambda x: F.gelu(torch._grouped_mm(x, w))          # noqa: E731
        with autocast("cpu", course_additions=False):
            y = checkpoint(f, x, use_reentrant=reentrant) if ckpt else f(x)
        y.square().sum().backward()
        out[ckpt] = (y, x.grad, w.grad)
    assert out[True][0].dtype is torch.float32
    for a, b in zip(out[True], out[False]):
        assert bits_equal(a, b)


# ------------------------------------------------------------------------ custom_fwd / custom_bwd
def _mm_function(fwd_deco, bwd_deco, seen):
    class MM(torch.autograd.Function):
        @staticmethod
        @fwd_deco
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            seen["inputs"] = (a.dtype, b.dtype)
            return a.mm(b)

        @staticmethod
        @bwd_deco
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            ga, gb = g.mm(b.t()), a.t().mm(g)
            seen["backward"] = ga.dtype
            return ga, gb
    return MM


def _run_mm(ctx, fwd_deco, bwd_deco):
    seen = {}
    a, b = leaf((3, 4), 1), leaf((4, 2), 2)
    with ctx:
        y = _mm_function(fwd_deco, bwd_deco, seen).apply(a, b)
    y.float().square().sum().backward()
    return seen, (y, a.grad, b.grad)


@pytest.mark.parametrize("cast_inputs", [None, torch.float16, torch.float32])
def test_course_custom_fwd_bwd_inside_torch_autocast_behave_as_torch_amps(cast_inputs):
    ref = _run_mm(torch.autocast("cpu"), torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
                  torch.amp.custom_bwd(device_type="cpu"))
    got = _run_mm(torch.autocast("cpu"), mpa.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
                  mpa.custom_bwd(device_type="cpu"))
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        assert bits_equal(a, b)


@pytest.mark.parametrize("cast_inputs", [None, torch.float16])
def test_course_custom_fwd_bwd_inside_the_course_autocast_behave_as_torch_amps_in_torch_autocast(cast_inputs):
    ref = _run_mm(torch.autocast("cpu"), torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
                  torch.amp.custom_bwd(device_type="cpu"))
    got = _run_mm(autocast("cpu"), mpa.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
                  mpa.custom_bwd(device_type="cpu"))
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        assert bits_equal(a, b)


def test_torch_custom_fwd_bwd_inside_the_course_autocast_is_pinned_as_documented():
    """torch's decorators cannot see this autocast (custom.py): cast_inputs ignored, FP32 backward."""
    seen = {}
    a, b = leaf((3, 4), 1), leaf((4, 2), 2)
    fn = _mm_function(torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float16),
                      torch.amp.custom_bwd(device_type="cpu"), seen)
    with autocast("cpu"):
        y = fn.apply(a, b)
    assert seen == {"inputs": (torch.float32, torch.float32)}   # cast_inputs=float16 was not applied
    assert y.dtype is torch.bfloat16                             # a.mm(b) was cast by the course's mode
    with pytest.raises(RuntimeError, match="same dtype"):         # BF16 grad x FP32 saved input, no autocast
        y.float().sum().backward()
