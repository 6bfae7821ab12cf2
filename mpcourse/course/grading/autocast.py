"""Graders for lesson 05 (autocast): the cast policy of one op call, and a minimal autocast mode.

Oracle: ``torch.autocast`` itself, run side by side on the same inputs (never ``mpcourse.core.autocast``).
The library's table (``mpcourse.core.autocast.policy``) is only used to word the hints.

* ``check_cast_args(cast_args)``: ``cast_args(op_name, args, device_type, dtype) -> args`` must cast an
  op's arguments as ``torch.autocast(device_type, dtype=dtype)`` does. For each fixed case the op is
  run twice under a dispatch trace: once inside ``torch.autocast`` on the original arguments, once
  outside any region on the learner's arguments. Graded: the dtypes of the tensors every aten op
  received (casts excluded), then the output's dtype and bits. So a cast that changes no value
  (``cat`` of BF16 with FP32 type-promotes to FP32 anyway) is still seen.
* ``check_autocast_mode(make_mode)``: ``make_mode(dtype)`` returns a context manager (the learner's
  TorchFunctionMode); a fixed program of calls runs inside it and inside ``torch.autocast("cpu")``;
  every step's output dtype and bits, then the dtypes its aten ops received, must agree.

Both run every case for ``torch.bfloat16`` and ``torch.float16`` regions on CPU tensors (the CPU list),
plus a "cuda" region given CPU tensors (none are eligible there: nothing is cast); ``check_cast_args`` also
runs the CUDA list on fake CUDA tensors (``FakeTensorMode``: no GPU needed, torch's dispatcher casts them as
real ones), so a wrong CUDA policy fails on a CPU-only machine. They raise
``GradingError`` at the first case that differs, with the expected and obtained dtypes and a hint.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import GradingError, call, same_bits, verdict

f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
LOW_DTYPES = (bf16, f16)
_CASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy"}

HINTS = {
    "lower": "'{op}' is on the lower-precision list of {dev}: cast every eligible tensor (floating point, on the "
             "region's device type, not float64) to the region's dtype.",
    "fp32": "'{op}' is on the FP32 list of {dev}: cast every eligible tensor to torch.float32.",
    "promote": "'{op}' promotes on {dev}: cast every eligible tensor to the widest floating dtype among the "
               "eligible inputs (float32 if any is float32, else the region's dtype); look inside list "
               "arguments too (cat and stack take a list of tensors).",
    "unlisted": "'{op}' is on no {dev} list: leave its arguments unchanged. (On CUDA softmax, layer_norm, exp, "
                "log and sum are forced to FP32; the CPU list leaves them alone: look the policy up in the "
                "table of the region's device_type.)",
    "float64": "float64 tensors are never eligible: autocast leaves them (and integer tensors) alone.",
    "integer": "only floating-point tensors are eligible: integer tensors are left alone.",
    "device": "only tensors on the region's device type are eligible: a 'cuda' region leaves CPU tensors alone, "
              "a 'cpu' region leaves CUDA tensors alone.",
}


def _r(shape, seed: int, dtype=f32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _idx() -> torch.Tensor:
    return torch.tensor([2, 0])


def _targets() -> torch.Tensor:
    return torch.tensor([1, 0, 4])


# (label, op name as in the tables, device_type of the region, fn, args(low dtype) -> tuple, hint key)
CASES = [
    ("mm(fp32, fp32)", "mm", "cpu", torch.mm, lambda low: (_r((3, 4), 1), _r((4, 5), 2)), "lower"),
    ("matmul(fp32, bf16)", "matmul", "cpu", torch.matmul, lambda low: (_r((2, 3, 4), 3), _r((4, 5), 4, bf16)), "lower"),
    ("linear(x, weight, bias)", "linear", "cpu", F.linear, lambda low: (_r((3, 4), 5), _r((6, 4), 6), _r((6,), 7)),
     "lower"),
    ("addmm(bias, a, b)", "addmm", "cpu", torch.addmm, lambda low: (_r((3, 5), 8), _r((3, 4), 9), _r((4, 5), 10)),
     "lower"),
    ("mm(float64, float64)", "mm", "cpu", torch.mm, lambda low: (_r((3, 4), 11, f64), _r((4, 2), 12, f64)), "float64"),
    ("matmul(int64, int64)", "matmul", "cpu", torch.matmul,
     lambda low: (torch.arange(12).view(3, 4), torch.arange(8).view(4, 2)), "integer"),
    ("softmax(low, dim=-1)", "softmax", "cpu", torch.softmax, lambda low: (_r((3, 5), 13, low), -1), "unlisted"),
    ("softmax(fp32, dim=-1)", "softmax", "cpu", torch.softmax, lambda low: (_r((3, 5), 14), -1), "unlisted"),
    ("layer_norm(low, [5])", "layer_norm", "cpu", torch.layer_norm, lambda low: (_r((3, 5), 15, low), [5]), "unlisted"),
    ("exp(low)", "exp", "cpu", torch.exp, lambda low: (_r((4,), 16, low),), "unlisted"),
    ("gelu(fp32)", "gelu", "cpu", F.gelu, lambda low: (_r((3, 5), 17),), "unlisted"),
    ("prod(low)", "prod", "cpu", torch.prod, lambda low: (_r((3, 4), 18, low),), "fp32"),
    ("mse_loss(low, fp32)", "mse_loss", "cpu", F.mse_loss, lambda low: (_r((3, 4), 19, low), _r((3, 4), 20)), "fp32"),
    ("cross_entropy_loss(low logits, int64 targets)", "cross_entropy_loss", "cpu", F.cross_entropy,
     lambda low: (_r((3, 5), 21, low), _targets()), "fp32"),
    ("cat([low, fp32])", "cat", "cpu", torch.cat, lambda low: ([_r((2, 3), 22, low), _r((1, 3), 23)],), "promote"),
    ("cat([low, low])", "cat", "cpu", torch.cat, lambda low: ([_r((2, 3), 24, low), _r((1, 3), 25, low)],), "promote"),
    ("stack([fp32, low])", "stack", "cpu", torch.stack, lambda low: ([_r((2, 3), 26), _r((2, 3), 27, low)],),
     "promote"),
    ("index_copy(low, 0, index, fp32)", "index_copy", "cpu", torch.index_copy,
     lambda low: (_r((4, 3), 28, low), 0, _idx(), _r((2, 3), 29)), "promote"),
    ("cat([float64, fp32])", "cat", "cpu", torch.cat, lambda low: ([_r((2, 3), 30, f64), _r((1, 3), 31)],), "float64"),
    ("mm(fp32, fp32) in a 'cuda' region, CPU tensors", "mm", "cuda", torch.mm,
     lambda low: (_r((3, 4), 32), _r((4, 5), 33)), "device"),
    ("softmax(low) in a 'cuda' region, CPU tensors", "softmax", "cuda", torch.softmax,
     lambda low: (_r((3, 5), 34, low), -1), "device"),
]

# The CUDA table, graded on any machine: the same kind of cases on *fake* CUDA tensors
# (torch._subclasses.FakeTensorMode: tensors with device "cuda", shapes and dtypes, no storage). torch's own
# Autocast dispatch key casts them as it casts real CUDA tensors, so the oracle is still torch.autocast; outputs
# are compared by dtype and shape (a fake tensor has no values).
CUDA_CASES = [
    ("mm(fp32, fp32), CUDA tensors", "mm", "cuda", torch.mm, lambda low: (_r((3, 4), 50), _r((4, 5), 51)), "lower"),
    ("linear(x, weight, bias), CUDA tensors", "linear", "cuda", F.linear,
     lambda low: (_r((3, 4), 52), _r((6, 4), 53), _r((6,), 54)), "lower"),
    ("exp(low), CUDA tensors", "exp", "cuda", torch.exp, lambda low: (_r((4,), 55, low),), "fp32"),
    ("layer_norm(low, [5]), CUDA tensors", "layer_norm", "cuda", torch.layer_norm,
     lambda low: (_r((3, 5), 56, low), [5]), "fp32"),
    ("pow(low, 2.0), CUDA tensors", "pow", "cuda", torch.pow, lambda low: (_r((4,), 57, low), 2.0), "fp32"),
    ("mse_loss(low, fp32), CUDA tensors", "mse_loss", "cuda", F.mse_loss,
     lambda low: (_r((3, 4), 58, low), _r((3, 4), 59)), "fp32"),
    ("cat([low, fp32]), CUDA tensors", "cat", "cuda", torch.cat, lambda low: ([_r((2, 3), 60, low), _r((1, 3), 61)],),
     "unlisted"),
    ("dot(low, fp32), CUDA tensors", "dot", "cuda", torch.dot, lambda low: (_r((4,), 62, low), _r((4,), 63)),
     "promote"),
    ("mm(float64, float64), CUDA tensors", "mm", "cuda", torch.mm,
     lambda low: (_r((3, 4), 64, f64), _r((4, 2), 65, f64)), "float64"),
    ("mm(fp32, fp32) in a 'cpu' region, CUDA tensors", "mm", "cpu", torch.mm,
     lambda low: (_r((3, 4), 66), _r((4, 5), 67)), "device"),
    ("exp(low) in a 'cpu' region, CUDA tensors", "exp", "cpu", torch.exp, lambda low: (_r((4,), 68, low),), "device"),
]


class _Trace(TorchDispatchMode):
    """Logs each aten op (casts excluded) with the dtypes of the tensors it received."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) not in _CASTS and not str(func).startswith("prim."):   # prim.device: autocast's device query
            dts = []
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    dts.append(_name(a.dtype))
                elif isinstance(a, (list, tuple)):
                    dts.extend(_name(b.dtype) for b in a if isinstance(b, torch.Tensor))
            self.log.append((str(func), tuple(dts)))
        return func(*args, **kwargs)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _region(device_type: str, dtype):
    with warnings.catch_warnings():                      # "CUDA is not available": the region is disabled
        warnings.simplefilter("ignore")
        return torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def _fake_cuda():
    """A FakeTensorMode: tensors made with device="cuda" inside it are fake CUDA tensors, on any machine."""
    with FakeTensorMode() as mode:
        yield mode


def _to_fake_cuda(a):
    """Inside a FakeTensorMode: a fake CUDA tensor of ``a``'s shape and dtype (lists: element by element)."""
    if isinstance(a, torch.Tensor):
        return torch.empty(a.shape, dtype=a.dtype, device="cuda")
    if isinstance(a, (list, tuple)):
        return type(a)(_to_fake_cuda(b) for b in a)
    return a


@contextlib.contextmanager
def _torch_region(device_type, dtype):
    """torch's autocast state switched on for ``device_type`` directly (``torch.autocast("cuda")`` disables
    itself on a machine without CUDA; the dispatcher's Autocast key does not need a GPU to cast fake CUDA
    tensors)."""
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])
        torch.clear_autocast_cache()


def _oracle(fn, args, device_type, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _region(device_type, dtype), _Trace() as tr:
            out = fn(*args)
    return _first_tensor(out), tr.log


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(same_bits(a, b).all())
    return torch.equal(a, b)


def _ops(log) -> str:
    return "; ".join(f"{op}({', '.join(dts)})" for op, dts in log) or "(no op)"


def _fail(name, label, dtype, device_type, op, hint_key, lines):
    where = f"case `{label}` in torch.autocast({device_type!r}, dtype={dtype})"
    hint = HINTS[hint_key].format(op=op, dev=device_type.upper() if device_type == "cpu" else "CUDA")
    raise GradingError(f"FAIL {name}: {where}\n  " + "\n  ".join(lines) + f"\n  hint: {hint}")


def check_cast_args(cast_args) -> None:
    """Grade ``cast_args(op_name, args, device_type, dtype) -> args`` against torch.autocast.

    Args:
        cast_args: the learner's function. Given an aten op name (``"mm"``, ``"softmax"``, ``"cat"``),
            the call's positional arguments (a tuple: tensors, lists of tensors, ints...), the region's
            device type and dtype, it returns the arguments (a tuple or list of the same length) with
            the casts torch.autocast would make.

    Raises:
        GradingError: at the first case (over bf16 then fp16 regions) where the ops run, or the
            output's dtype or bits, differ from torch.autocast's.
    """
    name = "cast_args"
    n = 0
    for dtype in LOW_DTYPES:
        for case in CASES:
            _grade_cast_case(name, cast_args, dtype, *case)
            n += 1
    for dtype in LOW_DTYPES:
        for case in CUDA_CASES:
            _grade_cast_case(name, cast_args, dtype, *case, fake_cuda=True)
            n += 1
    verdict(name, f"{n} op calls (bf16 and fp16 regions; CPU tensors, and fake CUDA tensors for the CUDA table) "
                  "cast exactly as torch.autocast casts them")


def _grade_cast_case(name, cast_args, dtype, label, op, device_type, fn, make, hint_key, fake_cuda=False):
    with contextlib.ExitStack() as stack:
        if fake_cuda:
            real = make(dtype)
            stack.enter_context(_fake_cuda())
            args_ref, args = _to_fake_cuda(real), _to_fake_cuda(real)
            with _torch_region(device_type, dtype), _Trace() as tr:
                expected = _first_tensor(fn(*args_ref))
            ref_log = tr.log
        else:
            expected, ref_log = _oracle(fn, make(dtype), device_type, dtype)
            args = make(dtype)
        got_args = call(name, cast_args, op, args, device_type, dtype)
        if not isinstance(got_args, (tuple, list)) or len(got_args) != len(args):
            raise GradingError(f"FAIL {name}: case `{label}`: return the arguments as a tuple of the same "
                               f"length ({len(args)}), got {type(got_args).__name__}"
                               f"{'' if not isinstance(got_args, (tuple, list)) else f' of length {len(got_args)}'}.")
        error = None
        try:
            with _Trace() as tr:
                got = _first_tensor(fn(*got_args))
        except Exception as e:                          # noqa: BLE001 - reported to the learner
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        if error is not None:
            _fail(name, label, dtype, device_type, op, hint_key,
                  [f"running {op} on your arguments raised {error}", f"torch.autocast ran: {_ops(ref_log)}"])
        if tr.log != ref_log:
            _fail(name, label, dtype, device_type, op, hint_key,
                  [f"torch.autocast ran:  {_ops(ref_log)}", f"your arguments ran: {_ops(tr.log)}"])
        same = (got.dtype == expected.dtype and got.shape == expected.shape) if fake_cuda else _same(got, expected)
        if not same:
            _fail(name, label, dtype, device_type, op, hint_key,
                  [f"expected a {_name(expected.dtype)} result equal to torch.autocast's, got "
                   f"{_name(got.dtype)}{'' if got.dtype != expected.dtype else ' with different values'}"])


# ----------------------------------------------------------------------------- the mode exercise
def _program():
    """(label, fn(env) -> tensor) steps; ``env`` holds the inputs and every earlier result."""
    return [
        ("h = torch.mm(x, w)", lambda e: torch.mm(e["x"], e["w"])),
        ("x @ w", lambda e: e["x"] @ e["w"]),
        ("F.linear(x, w, b)", lambda e: F.linear(e["x"], e["w"], e["b"])),
        ("F.softmax(h, dim=-1)", lambda e: F.softmax(e["h"], dim=-1)),
        ("F.layer_norm(h, (8,))", lambda e: F.layer_norm(e["h"], (8,))),
        ("F.gelu(h)", lambda e: F.gelu(e["h"])),
        ("torch.cat([h, x])", lambda e: torch.cat([e["h"], e["x"]])),
        ("torch.prod(h, 1)", lambda e: torch.prod(e["h"], 1)),
        ("F.mse_loss(h, x)", lambda e: F.mse_loss(e["h"], e["x"])),
        ("torch.mm(x64, w64)", lambda e: torch.mm(e["x64"], e["w64"])),
        ("h + x", lambda e: e["h"] + e["x"]),
    ]


def _run_program(ctx):
    env = {"x": _r((4, 8), 40), "w": _r((8, 8), 41), "b": _r((8,), 42),
           "x64": _r((2, 3), 43, f64), "w64": _r((3, 2), 44, f64)}
    outs, logs = [], []
    with ctx:
        for i, (label, fn) in enumerate(_program()):
            with _Trace() as tr:
                out = fn(env)
            if i == 0:
                env["h"] = out
            outs.append(out)
            logs.append(tr.log)
    return outs, logs


def check_autocast_mode(make_mode) -> None:
    """Grade a minimal autocast mode for the CPU list against ``torch.autocast("cpu")``.

    Args:
        make_mode: ``make_mode(dtype)`` returns a context manager (e.g. a TorchFunctionMode subclass
            taking the dtype) inside which the calls of a fixed program (mm, ``@``, F.linear, F.softmax,
            F.layer_norm, F.gelu, cat, prod, F.mse_loss, a float64 mm, an add) are cast as in torch.autocast.

    Raises:
        GradingError: at the first step whose output dtype or bits, or whose aten ops' input dtypes
            (casts excluded), differ from torch.autocast's, or if the mode is still
            active after its region (a plain FP32 mm must stay FP32 afterwards).
    """
    name = "autocast mode"
    steps = _program()
    for dtype in LOW_DTYPES:
        expected, ref_logs = _run_program(torch.autocast("cpu", dtype=dtype))
        ctx = call(name, make_mode, dtype)
        try:
            got, logs = _run_program(ctx)
        except NotImplementedError as e:
            raise GradingError(f"FAIL {name}: `__torch_function__` of your mode (or a function it calls, such as "
                               f"cast_args) is not implemented yet ({e or 'NotImplementedError'}). Fill in the "
                               "cell marked YOUR CODE HERE, run it, then run this check again.") from None
        except Exception as e:                              # noqa: BLE001 - reported to the learner
            raise GradingError(f"FAIL {name}: running the program inside your mode (dtype={dtype}) raised "
                               f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None
        hint = ("  hint: look the op name up in the CPU table (func.__name__; map __matmul__, which `x @ w` may "
                "arrive as, to 'matmul'), apply cast_args to the arguments, then call func with them.")
        for (label, _), e, g, ref_log, log in zip(steps, expected, got, ref_logs, logs):
            if not isinstance(g, torch.Tensor) or not _same(g, e):
                what = _name(g.dtype) if isinstance(g, torch.Tensor) else type(g).__name__
                raise GradingError(
                    f"FAIL {name}: step `{label}` inside your mode (dtype={dtype}): torch.autocast gave "
                    f"{_name(e.dtype)}, your mode gave {what}"
                    f"{' with different values' if isinstance(g, torch.Tensor) and g.dtype == e.dtype else ''}.\n"
                    + hint)
            if log != ref_log:
                raise GradingError(
                    f"FAIL {name}: step `{label}` inside your mode (dtype={dtype}) ran different ops.\n"
                    f"  torch.autocast ran: {_ops(ref_log)}\n  your mode ran:      {_ops(log)}\n" + hint)
        after = torch.mm(_r((2, 3), 45), _r((3, 2), 46))
        if after.dtype != f32:
            raise GradingError(f"FAIL {name}: after the region a FP32 mm gave {_name(after.dtype)}: the mode must "
                               "stop casting when its `with` block exits.")
    verdict(name, f"{len(steps)} program steps in bf16 and fp16 regions agree bit for bit with torch.autocast('cpu')")
