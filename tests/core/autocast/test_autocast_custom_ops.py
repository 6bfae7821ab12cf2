"""Custom operators under the course's autocast follow their ``torch.library.register_autocast`` rule as
``torch.autocast`` does; an op without a rule has its body autocast as under ``torch.autocast``.

Oracle: the same call inside ``torch.autocast`` with the same dtype (outputs' dtypes and bits). The ops check
their own inputs as a compiled kernel would (one dtype for both operands), so a rule that cast one operand and
not the other, or none, shows as the error the op raises, not only as a different dtype.
"""
import pytest
import torch

from mpcourse.core.autocast import autocast

NS = "mpcourse_test_custom"


@torch.library.custom_op(f"{NS}::mm_same_dtype", mutates_args=())
def mm_same_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype != w.dtype:
        raise RuntimeError(f"mm_same_dtype: expected one dtype, got {x.dtype} and {w.dtype}")
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    torch.mm(x, w.t(), out=out)                      # out= : never cast by an autocast
    return out


@mm_same_dtype.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


torch.library.register_autocast(f"{NS}::mm_same_dtype", "cpu", torch.float16)   # its rule: FP16 on the CPU


@torch.library.custom_op(f"{NS}::no_rule", mutates_args=())
def no_rule(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.mm(w.t()), -1) + x.sum()   # body: mm (lower precision), softmax, sum


@no_rule.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g)


def _same(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("call", [lambda x, w: torch.ops.mpcourse_test_custom.mm_same_dtype(x, w),
                                  lambda x, w: torch.ops.mpcourse_test_custom.mm_same_dtype.default(x, w),
                                  mm_same_dtype])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_registered_autocast_rule_applies_as_under_torch_autocast(call, dtype):
    x, w = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        want = call(x, w)
    with autocast("cpu", dtype=dtype):
        got = call(x, w)
    assert want.dtype == torch.float16             # the op's rule, whatever the region's dtype
    _same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_without_a_rule_has_its_body_autocast_as_under_torch_autocast(dtype):
    x, w = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        want = no_rule(x, w)
    with autocast("cpu", dtype=dtype):
        got = no_rule(x, w)
    _same(got, want)
    _same(no_rule(x, w), no_rule(x, w))            # outside a region: FP32, as torch


def test_disabled_region_and_a_mixed_call_leave_the_op_alone():
    x, w = _inputs()
    with autocast("cpu", enabled=False):
        assert mm_same_dtype(x, w).dtype == torch.float32
    with autocast("cpu"):                          # the course's casts around the op still apply
        y = torch.nn.functional.linear(x, w)       # bf16 (the course's policy)
        z = mm_same_dtype(y, torch.ones(5, 3))     # the op's rule: both operands to fp16
    assert y.dtype == torch.bfloat16 and z.dtype == torch.float16
    assert not torch.is_autocast_enabled("cpu")    # torch's autocast was entered for the call only
