"""Lesson 05's graders (mpcourse.course.grading.autocast): they pass on correct implementations (a reference
``cast_args`` over the library's table, ``mpcourse.core.autocast`` itself as the mode) and reject planted,
plausible wrong ones with a message that names the first wrong case and the fix."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import mpcourse.core.autocast as mpa
from mpcourse.core.autocast.mode import _eligible
from mpcourse.core.autocast.policy import FP32, LOWER_PRECISION_FP, PROMOTE, policy_for
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.autocast import check_autocast_mode, check_cast_args


def _map(fn, a):
    """Apply ``fn`` to a tensor argument, or to each tensor of a list/tuple argument."""
    if isinstance(a, (list, tuple)):
        return type(a)(fn(b) for b in a)
    return fn(a)


def reference_cast_args(op_name, args, device_type, dtype, *, table_device=None, promote=True,
                        skip_float64=True, check_device=True):
    """The reference, over the library's table (mpcourse.core.autocast.policy); the keyword switches plant bugs."""
    policy = policy_for(table_device or device_type, op_name)

    def eligible(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False
        if skip_float64 and t.dtype is torch.float64:
            return False
        return not check_device or t.device.type == device_type

    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if eligible(t)]
    if policy == LOWER_PRECISION_FP:
        to = dtype
    elif policy in (FP32, "fp32_set_opt_dtype"):          # the CUDA-only policy treated as fp32: a planted bug
        to = torch.float32
    elif policy == PROMOTE and promote:
        to = torch.float32 if any(t.dtype is torch.float32 for t in flat) else dtype
    else:
        return args
    return tuple(_map(lambda t: t.to(to) if eligible(t) else t, a) for a in args)


class ReferenceMode(TorchFunctionMode):
    """A minimal autocast mode for the CPU list, over ``reference_cast_args``."""

    def __init__(self, dtype, table_device="cpu"):
        super().__init__()
        self.dtype = dtype
        self.table_device = table_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        name = {"__matmul__": "matmul", "__rmatmul__": "matmul"}.get(name, name)
        if name is not None:
            args = reference_cast_args(name, args, "cpu", self.dtype, table_device=self.table_device)
        return func(*args, **(kwargs or {}))


def test_reference_cast_args_agrees_with_the_library_eligibility():
    """The reference's eligibility is the library's ``is_eligible`` on the cases it sees."""
    for t in (torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64),
              torch.ones(2, dtype=torch.bfloat16)):
        assert _eligible(t, "cpu") == (t.is_floating_point() and t.dtype is not torch.float64)
        assert not _eligible(t, "cuda")


def test_cast_args_grader_passes_the_reference(capsys):
    check_cast_args(reference_cast_args)
    out = capsys.readouterr().out
    assert out.startswith("PASS cast_args: 64 op calls") and "fake CUDA tensors" in out


@pytest.mark.parametrize("planted,match", [
    (dict(skip_float64=False), r"mm\(float64, float64\).*aten\.mm\.default\(float64, float64\).*"
                               r"aten\.mm\.default\(bfloat16, bfloat16\).*float64 tensors are never eligible"),
    (dict(table_device="cuda"), r"softmax\(low, dim=-1\).*_softmax\.default\(bfloat16\).*"
                                r"_softmax\.default\(float32\).*on no CPU list"),
    (dict(promote=False), r"cat\(\[low, fp32\]\).*aten\.cat\.default\(float32, float32\).*"
                          r"aten\.cat\.default\(bfloat16, float32\).*promotes on CPU"),
    (dict(check_device=False), r"mm\(fp32, fp32\) in a 'cuda' region, CPU tensors.*torch\.autocast\('cuda'.*"
                               r"a 'cuda' region leaves CPU tensors alone"),
    (dict(table_device="cpu"), r"exp\(low\), CUDA tensors` in torch\.autocast\('cuda'.*aten\.exp\.default\(float32\).*"
                               r"aten\.exp\.default\(bfloat16\).*on the FP32 list of CUDA"),
], ids=["casts float64", "softmax forced to fp32 on CPU", "no promotion for cat", "ignores the device type",
        "CPU table in a CUDA region"])
def test_cast_args_grader_rejects_planted_bugs(planted, match):
    def wrong(op, args, device_type, dtype):
        return reference_cast_args(op, args, device_type, dtype, **planted)
    with pytest.raises(GradingError, match=f"(?s)^FAIL cast_args: case `{match}"):
        check_cast_args(wrong)


def test_cast_args_grader_runs_the_cuda_table_on_fake_cuda_tensors():
    """No GPU needed: a cast_args that knows only CPU tensors, or only the CPU-style eligibility, fails on the
    CUDA cases; the old CPU-tensor cases alone would pass both."""
    def cpu_only(op, args, device_type, dtype):             # treats every non-CPU tensor as ineligible
        return reference_cast_args(op, args, "cpu", dtype) if device_type == "cpu" else args
    with pytest.raises(GradingError, match=r"(?s)case `mm\(fp32, fp32\), CUDA tensors` in torch\.autocast\('cuda'"):
        check_cast_args(cpu_only)

    def cast_everything_in_cuda_regions(op, args, device_type, dtype):
        return reference_cast_args(op, args, device_type, dtype, check_device=device_type != "cpu")
    with pytest.raises(GradingError, match=r"(?s)in a 'cpu' region, CUDA tensors.*a 'cpu' region leaves CUDA"):
        check_cast_args(cast_everything_in_cuda_regions)


def test_cast_args_grader_rejects_promote_as_lower_precision_and_bad_returns():
    def promote_low(op, args, device_type, dtype):
        if policy_for(device_type, op) == PROMOTE:
            return tuple(_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, a)
                         for a in args)
        return reference_cast_args(op, args, device_type, dtype)
    with pytest.raises(GradingError, match=r"(?s)cat\(\[low, fp32\]\).*aten\.cat\.default\(bfloat16, bfloat16\)"):
        check_cast_args(promote_low)
    with pytest.raises(GradingError, match="tuple of the same length"):
        check_cast_args(lambda op, args, d, t: None)
    with pytest.raises(GradingError, match="tuple of the same length.*length 1"):
        check_cast_args(lambda op, args, d, t: args[:1])


def test_cast_args_grader_reports_an_op_that_raises():
    """No promotion for index_copy: the op itself refuses mixed dtypes; the message says so."""
    def no_promote_index_copy(op, args, device_type, dtype):
        if op == "index_copy":
            return args
        return reference_cast_args(op, args, device_type, dtype)
    with pytest.raises(GradingError, match=r"(?s)index_copy.*raised RuntimeError.*promotes on CPU"):
        check_cast_args(no_promote_index_copy)


def test_stubs_fail_with_the_fill_in_message():
    def cast_args(op, args, device_type, dtype):
        raise NotImplementedError("exercise: replace this line with your code")

    class Stub(TorchFunctionMode):
        def __init__(self, dtype):
            super().__init__()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(GradingError, match="`cast_args` is not implemented yet.*YOUR CODE HERE"):
        check_cast_args(cast_args)
    with pytest.raises(GradingError, match="autocast mode: .*not implemented yet"):
        check_autocast_mode(Stub)


def test_mode_grader_passes_the_reference_and_the_library(capsys):
    check_autocast_mode(ReferenceMode)
    check_autocast_mode(lambda dtype: mpa.autocast("cpu", dtype=dtype))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.startswith("PASS autocast mode: 11 program steps") for line in out)


def test_mode_grader_rejects_planted_bugs():
    # The CUDA table applied to CPU tensors: softmax forced to FP32.
    with pytest.raises(GradingError, match=r"(?s)step `F.softmax\(h, dim=-1\)`.*torch.autocast gave bfloat16, "
                                           r"your mode gave float32.*hint: look the op name up"):
        check_autocast_mode(lambda dtype: ReferenceMode(dtype, table_device="cuda"))

    class MatmulOnly(TorchFunctionMode):                 # the lesson's toy: casts matmuls, nothing else
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) in ("mm", "matmul", "__matmul__", "linear"):
                args = tuple(a.to(self.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            return func(*args, **(kwargs or {}))
    with pytest.raises(GradingError, match=r"(?s)step `torch.cat\(\[h, x\]\)`.*ran different ops"):
        check_autocast_mode(MatmulOnly)                  # cat is not promoted (and prod not forced to FP32)

    class NoPromote(ReferenceMode):                      # cat without promotion: same values, other ops
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) == "cat":
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)
    with pytest.raises(GradingError, match=r"(?s)step `torch.cat\(\[h, x\]\)`.*ran different ops.*"
                                           r"aten.cat.default\(float32, float32\).*aten.cat.default\(bfloat16, float32\)"):
        check_autocast_mode(NoPromote)

    class NoFP32(ReferenceMode):                         # the FP32 list ignored: prod stays bf16
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if policy_for("cpu", getattr(func, "__name__", "") or "") == FP32:
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)
    with pytest.raises(GradingError, match=r"(?s)step `torch.prod\(h, 1\)`.*torch.autocast gave float32, "
                                           r"your mode gave bfloat16"):
        check_autocast_mode(NoFP32)


def test_mode_grader_rejects_a_mode_that_outlives_its_region():
    class Leaky:
        def __init__(self, dtype):
            self.mode = ReferenceMode(dtype)

        def __enter__(self):
            self.mode.__enter__()

        def __exit__(self, *exc):
            return False                                 # forgets to pop the mode

    try:
        with pytest.raises(GradingError, match="after the region a FP32 mm gave bfloat16"):
            check_autocast_mode(Leaky)
    finally:
        while torch.overrides._get_current_function_mode() is not None:
            torch._C._pop_torch_function_stack()
