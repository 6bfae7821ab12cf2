"""The fast path of ``tensor_cores(fast=True)`` (a kernel on the matmul ops only) against the rule it replaces (the
``TensorCoreEmulation`` dispatch mode), side by side and bit for bit: single ops, their gradients, torch.autocast
regions, modes pushed inside the region, inference mode, other threads, and whole training steps of the
emulated recipes (losses, parameters and the first step's memory count)."""
import contextlib
import threading

import pytest
import torch

from mpcourse.core import emulation
from mpcourse.core.emulation import TensorCoreEmulation, emulated_calls, set_emulation, tensor_cores
from torch.utils._python_dispatch import TorchDispatchMode

# tests/ is on sys.path under pytest (no package): the mode's cases, dtypes and its autouse reset fixture
from test_emulation import CASES as MODE_CASES, LOW, _reset  # noqa: F401

aten = torch.ops.aten


def bits(t):
    return t.view(torch.int16) if t.dtype in LOW else t.view(torch.int32)


def run(fast: bool, fn, *xs):
    """fn(*xs) and the gradients of its inputs, under tensor_cores(True) by the fast path or by the mode."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    with tensor_cores(True, fast=fast):
        out = fn(*xs)
        out.float().square().sum().backward()
    return [out.detach()] + [x.grad for x in xs if x.requires_grad]


CASES = {**MODE_CASES,   # the mode's own cases (tests/core/emulation/test_emulation.py), and the other matmul-family ops
         "addbmm": (lambda c, a, b: torch.addbmm(c, a, b), [(24, 16), (3, 24, 40), (3, 40, 16)]),
         "addmv": (lambda c, a, v: torch.addmv(c, a, v), [(24,), (24, 40), (40,)]),
         "dot": (lambda a, b: torch.dot(a, b), [(40,), (40,)])}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_equals_the_mode_forward_and_backward(case, dtype):
    fn, shapes = CASES[case]
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    before = emulated_calls()
    fast = run(True, fn, *xs)
    n_fast = emulated_calls() - before
    mode = run(False, fn, *xs)
    assert n_fast == emulated_calls() - before - n_fast > 0          # the same matmuls emulated, forward and backward
    for f, m in zip(fast, mode, strict=True):
        assert f.dtype == m.dtype and f.shape == m.shape
        assert torch.equal(bits(f), bits(m))
    after = emulated_calls()
    fn(*xs)                                                          # outside the region: torch's own kernel
    assert emulation._registry["lib"] is None and emulated_calls() == after


def test_fast_path_serves_torch_autocast_regions():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 48, generator=g), torch.randn(48, 16, generator=g)
    outs = []
    for fast in (True, False):
        with tensor_cores(True, fast=fast), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(a @ b)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], (a.bfloat16().float() @ b.bfloat16().float()).bfloat16())


class Spy(TorchDispatchMode):
    """Records every aten op it sees (a mode pushed inside the region, as the memory tracker is)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inside", ["spy", "spy in spy"])
def test_a_mode_pushed_inside_the_region_sees_what_it_saw_with_the_mode(inside):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 40, generator=g).bfloat16()
    x = torch.randn(8, 40, generator=g).bfloat16()
    got = {}
    for fast in (True, False):
        ww = w.clone().requires_grad_()
        spies = [Spy() for _ in range(1 if inside == "spy" else 2)]
        with tensor_cores(True, fast=fast), contextlib.ExitStack() as stack:
            for s in spies:
                stack.enter_context(s)
            y = torch.nn.functional.linear(x, ww)
            y.float().sum().backward()
        got[fast] = (y, ww.grad, [s.seen for s in spies])
    (y1, g1, s1), (y0, g0, s0) = got[True], got[False]
    assert torch.equal(y1, y0) and torch.equal(g1, g0)
    assert s1 == s0                                                  # the same ops, in the same dtypes
    assert (aten.mm.default, (torch.bfloat16, torch.bfloat16)) in s1[0]
    assert not any(f is aten.mm.default and d == (torch.float32, torch.float32) for f, d in s1[0])  # emulation unseen
    assert torch._C._len_torch_dispatch_stack() == 0


def test_region_entered_under_inference_mode_is_emulated():
    g = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        a, b = torch.randn(24, 40, generator=g).bfloat16(), torch.randn(40, 16, generator=g).bfloat16()
        with tensor_cores(True, fast=True):
            got = a @ b
    assert torch.equal(got, (a.float() @ b.float()).bfloat16())


def test_only_the_thread_inside_the_region_is_emulated():
    a = torch.randn(64, 64).bfloat16()
    inside, go, other = threading.Event(), threading.Event(), {}

    def worker():
        with tensor_cores(True, fast=True):
            inside.set()
            go.wait(10)
            before = emulated_calls()
            torch.mm(a, a)
            other["calls"] = emulated_calls() - before

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    assert emulation._registry["users"] == 1                        # the kernels are registered now
    before = emulated_calls()
    torch.mm(a, a)                                                  # this thread is in no region: native
    assert emulated_calls() == before
    go.set()
    t.join()
    assert other["calls"] == 1
    assert emulation._registry["users"] == 0 and emulation._registry["lib"] is None


def test_nested_regions_and_an_error_leave_nothing_registered():
    a = torch.randn(8, 8).bfloat16()
    with pytest.raises(ZeroDivisionError):
        with tensor_cores(True, fast=True):
            with tensor_cores(True, fast=True):
                a @ a
            a @ a
            1 / 0
    assert emulation._registry["users"] == 0 and emulation._registry["lib"] is None
    assert emulation._depth() == 0


@pytest.fixture(scope="module")
def corpus():
    from mpcourse.experiment.gpt.data import load_corpus

    return load_corpus()


@pytest.mark.parametrize("recipe", ["bf16-pure", "torch-amp-fp16", "bf16-autocast"])
def test_training_steps_equal_the_mode_bit_for_bit(recipe, corpus):
    """Three steps (the first one counts memory under the peak tracker, a mode pushed inside the region) and
    the final evaluation, once by each path: losses, parameters and the memory count are identical."""
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.training.train import TrainConfig, Trainer

    set_emulation(True)                       # emulated on every machine
    out = {}
    for fast in (True, False):
        t = Trainer(recipe, corpus, TrainConfig(steps=3, batch_size=4, eval_interval=2, eval_batches=1,
                                                     model=GPTConfig(block_size=32, n_layer=2, n_embd=64)))
        t.fast_emulation = fast                   # how its steps and evaluations enter tensor_cores()
        before = emulated_calls()
        res = t.run().result()
        out[fast] = (res.history, res.final_val_loss, res.memory,
                     [p.detach().clone() for p in t.recipe.model.parameters()], emulated_calls() - before)
    (h1, v1, m1, p1, n1), (h0, v0, m0, p0, n0) = out[True], out[False]
    assert h1 == h0 and v1 == v0 and m1 == m0 and n1 == n0 > 0
    assert all(torch.equal(a, b) for a, b in zip(p1, p0, strict=True))
