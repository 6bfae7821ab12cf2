"""Tensor-core emulation: exact against the upcast-accumulate-round reference, within one ULP of
torch's native CPU kernels, and switched by MPCOURSE_EMULATE / set_emulation."""
import pytest
import torch

from mpcourse.core import emulation
from mpcourse.core.emulation import TensorCoreEmulation, emulation_enabled, set_emulation, tensor_cores

LOW = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv("MPCOURSE_EMULATE", raising=False)
    set_emulation(None)
    yield
    set_emulation(None)


def ulp_distance(a, b):
    """Distance in units in the last place between two same-dtype low-precision tensors (finite)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)      # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


CASES = {
    "mm": (lambda a, b: torch.mm(a, b), [(24, 40), (40, 16)]),
    "matmul3d": (lambda a, b: a @ b, [(3, 24, 40), (40, 16)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(3, 24, 40), (3, 40, 16)]),
    "linear": (lambda x, w, b: torch.nn.functional.linear(x, w, b), [(2, 5, 40), (16, 40), (16,)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(24, 16), (24, 40), (40, 16)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b), [(3, 24, 16), (3, 24, 40), (3, 40, 16)]),
    "mv": (lambda a, v: torch.mv(a, v), [(24, 40), (40,)]),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", list(CASES))
def test_equals_upcast_accumulate_round_exactly(case, dtype):
    fn, shapes = CASES[case]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    with tensor_cores(True):
        got = fn(*xs)
    want = fn(*[x.float() for x in xs]).to(dtype)          # computed with emulation off: plain FP32
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", ["mm", "bmm", "linear", "addmm"])
def test_within_one_ulp_of_native_kernel(case, dtype):
    fn, shapes = CASES[case]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    with tensor_cores(True):
        emulated = fn(*xs)
    native = fn(*xs)                                        # torch's own CPU kernel (no mode)
    assert int(ulp_distance(emulated, native).max()) <= 1


def test_gradients_flow_through_emulated_ops_in_low_precision():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 40, generator=g).bfloat16().requires_grad_()
    x = torch.randn(8, 40, generator=g).bfloat16()
    with tensor_cores(True):
        y = torch.nn.functional.linear(x, w)
        y.float().sum().backward()
    # d/dw sum(x w^T) = ones^T x, computed as an emulated bf16 mm: upcast, FP32 sum, one rounding.
    want = (torch.ones(8, 16).t() @ x.float()).bfloat16()
    assert w.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad, want)


def test_serves_torch_autocast_regions():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(32, 48, generator=g), torch.randn(48, 16, generator=g)
    seen = []

    class Spy(TensorCoreEmulation):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                seen.append(args[0].dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    set_emulation(True)
    with Spy(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = a @ b
    assert seen == [torch.bfloat16]                          # autocast cast first, then the mode emulated
    assert torch.equal(out, (a.bfloat16().float() @ b.bfloat16().float()).bfloat16())


def test_fp32_and_fp8_and_mixed_ops_untouched():
    a = torch.randn(8, 8)
    with tensor_cores(True):
        assert torch.equal(a @ a, torch.mm(a, a))
    with pytest.raises(RuntimeError):                         # mixed dtypes stay an error, as natively
        with tensor_cores(True):
            torch.mm(a.bfloat16(), a)


def test_environment_variable_and_python_switch(monkeypatch):
    monkeypatch.setenv("MPCOURSE_EMULATE", "0")
    assert not emulation_enabled(torch.bfloat16)
    monkeypatch.setenv("MPCOURSE_EMULATE", "1")
    assert emulation_enabled(torch.float16)
    set_emulation(False)                                     # Python switch wins over the variable
    assert not emulation_enabled(torch.float16)
    set_emulation(None)
    monkeypatch.setenv("MPCOURSE_EMULATE", "yes")
    with pytest.raises(ValueError, match="MPCOURSE_EMULATE must be 0"):
        emulation_enabled(torch.bfloat16)
    with pytest.raises(TypeError):
        set_emulation("on")
    assert not emulation_enabled(torch.float32)


def test_auto_follows_cpu_flags(monkeypatch):
    for var in ("DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MPCOURSE_EMULATE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(emulation.policy, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert not emulation_enabled(torch.bfloat16)              # native bf16 units: leave it to torch
    assert emulation_enabled(torch.float16)                   # no fp16 units: emulate
    monkeypatch.setattr(emulation.policy, "_cpu_flags", lambda: frozenset({"avx2"}))
    assert emulation_enabled(torch.bfloat16)


@pytest.mark.parametrize("var, value", [("DNNL_MAX_CPU_ISA", "AVX2"), ("DNNL_MAX_CPU_ISA", "avx2_vnni"),
                                        ("ATEN_CPU_CAPABILITY", "avx2"), ("ATEN_CPU_CAPABILITY", "default")])
def test_the_forced_avx2_path_has_no_bf16_units(monkeypatch, var, value):
    """Forcing the AVX2 path on a CPU with BF16/FP16 units reproduces an AVX2 CPU: both dtypes emulated."""
    for v in ("DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MPCOURSE_EMULATE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(emulation.policy, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16",
                                                                          "avx512_fp16", "amx_fp16"}))
    assert not emulation_enabled(torch.bfloat16) and not emulation_enabled(torch.float16)
    monkeypatch.setenv(var, value)
    assert emulation_enabled(torch.bfloat16) and emulation_enabled(torch.float16)
    monkeypatch.delenv(var)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE_AMX")    # a cap at AVX-512 or above leaves the units on
    assert not emulation_enabled(torch.bfloat16)


def test_region_switch_is_restored():
    set_emulation(False)
    with tensor_cores(True):
        assert emulation_enabled(torch.bfloat16)
    assert not emulation_enabled(torch.bfloat16)
