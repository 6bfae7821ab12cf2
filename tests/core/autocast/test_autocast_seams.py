"""The course autocast's seams (``autocast(cast_args=, cached_cast=)``, lesson 05's signatures): functions written
as a learner would give the library's forward, loss and gradients bit for bit on the course's GPT; what they
return is checked (``mpcourse.core.seams``) and a wrong value stops with one line naming the function."""
import weakref

import pytest
import torch

from mpcourse.core.autocast import autocast
from mpcourse.core.autocast.policy import FP32, LOWER_PRECISION_FP, PROMOTE, policy_for
from mpcourse.core.autocast.state import STATE
from mpcourse.core.seams import SeamError
from mpcourse.experiment.gpt.model import GPT, GPTConfig


def cast_args(op_name, args, device_type, dtype):
    def eligible(t):
        return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                and t.device.type == device_type)

    def flat(a):
        return list(a) if isinstance(a, (list, tuple)) else [a]
    policy = policy_for(device_type, op_name)
    if policy == LOWER_PRECISION_FP:
        to = dtype
    elif policy == FP32:
        to = torch.float32
    elif policy == PROMOTE:
        to = torch.float32 if any(t.dtype == torch.float32 for a in args for t in flat(a) if eligible(t)) else dtype
    else:
        return tuple(args)

    def cast(a):
        return type(a)(cast(b) for b in a) if isinstance(a, (list, tuple)) else a.to(to) if eligible(a) else a
    return tuple(cast(a) for a in args)


def cached_cast(cache, t, to_type):
    if not (t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
            and not torch.is_inference_mode_enabled()):
        return t.to(to_type)
    hit = cache.get((id(t), to_type))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    with torch.enable_grad():
        cast = t.to(to_type)
    cache[(id(t), to_type)] = (weakref.ref(t), t._version, cast)
    return cast


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)), torch.randint(0, 65, (2, 16))


def _forward_backward(gpt, **given):
    model, x = gpt
    model.zero_grad(set_to_none=True)
    with autocast("cpu", dtype=torch.bfloat16, **given):
        logits, loss = model(x, x)
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("given", [dict(cast_args=cast_args), dict(cached_cast=cached_cast),
                                   dict(cast_args=cast_args, cached_cast=cached_cast)],
                         ids=["cast_args", "cached_cast", "both"])
def test_given_functions_give_the_library_bits(gpt, given):
    calls = {name: 0 for name in given}

    def counted(name, fn):
        def f(*args):
            calls[name] += 1
            return fn(*args)
        return f
    want, got = _forward_backward(gpt), _forward_backward(gpt, **{n: counted(n, f) for n, f in given.items()})
    assert all(n > 0 for n in calls.values()), calls                        # the seams were used
    assert want[0].dtype == torch.bfloat16                                   # the region did cast
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2]))


def test_the_given_cache_serves_a_weight_used_twice_and_empties_at_the_outermost_exit():
    w = torch.randn(4, 3, requires_grad=True)
    calls = []

    def counting(cache, t, to_type):
        calls.append(len(cache))
        return cached_cast(cache, t, to_type)
    with autocast("cpu", cached_cast=counting):
        a = torch.mm(torch.ones(2, 4), w)
        with autocast("cpu"):                                                # inherits the given cache
            b = torch.mm(torch.ones(2, 4), w)
        assert len(STATE.given_cache) == 1
    assert STATE.given_cache == {} and STATE.cached_cast is None
    assert a.grad_fn.next_functions[1][0] is b.grad_fn.next_functions[1][0]   # one cast node for both uses
    assert len(calls) == 4                                                   # x and w, twice


@pytest.mark.parametrize("given,match", [
    (dict(cast_args=lambda op, args, d, t: args[:1]), "cast_args returned tuple of length 1, expected a tuple"),
    (dict(cast_args=lambda op, args, d, t: tuple(a * 2 if isinstance(a, torch.Tensor) else a for a in args)),
     "cast_args changed the values of argument 0"),
    (dict(cast_args=lambda op, args, d, t: tuple(a.half() if isinstance(a, torch.Tensor) else a for a in args)),
     "cast_args returned argument 0 of dtype torch.float16, expected"),
    (dict(cached_cast=lambda cache, t, to_type: t.detach().to(to_type)), "cached_cast returned a cast without "
                                                                          "autograd history"),
    (dict(cached_cast=lambda cache, t, to_type: t.to(torch.float16)), "cached_cast returned the cast of dtype "
                                                                       "torch.float16, expected torch.bfloat16"),
], ids=["cast_args: wrong length", "cast_args: other values", "cast_args: another dtype", "cached_cast: no history",
        "cached_cast: wrong dtype"])
def test_a_wrong_return_value_is_one_seam_error_naming_the_function(given, match):
    w = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(SeamError, match=match), autocast("cpu", **given):
        torch.mm(torch.ones(2, 4), w)


def test_a_stale_cache_is_refused():
    def never_invalidates(cache, t, to_type):
        if id(t) not in cache:
            cache[id(t)] = t.to(to_type)
        return cache[id(t)]
    w = torch.randn(4, 3, requires_grad=True)
    with autocast("cpu", cached_cast=never_invalidates):
        torch.mm(torch.ones(2, 4), w)
        with torch.no_grad():
            w.add_(1.0)                                                      # what optimizer.step() does
        with pytest.raises(SeamError, match="a stale cast"):
            torch.mm(torch.ones(2, 4), w)


def test_not_callable_is_refused():
    with pytest.raises(TypeError, match="cast_args must be a function"):
        autocast("cpu", cast_args=3)
