"""mpcourse.core.autocast against torch.autocast, run side by side (the oracle), on CPU; CUDA when present.

Every comparison is bit for bit: output dtypes and bits, gradients, and (for the GPT) the dtype and
shape of every aten op the forward and backward passes run. Table tests check the policy tables
against the kernels torch 2.13 registers for AutocastCPU / AutocastCUDA and against the CUDA macro
lists in the installed ATen/autocast_mode.h. Those table tests compare a transcription with the
installed torch, so they run only on the release the tables were transcribed from
(``policy.TORCH_VERSION``, pinned in CI) and are skipped, naming that release, on any other; the
behavioural oracle tests (torch.autocast run side by side) run on every version.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import mpcourse.core.autocast as mpa
from mpcourse.core.autocast import autocast, custom_bwd, custom_fwd, policy
from mpcourse.core.autocast import mode as mode_mod

LOW_DTYPES = [torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
        torch.float16: torch.int16}


# ----------------------------------------------------------------------------------------- helpers
def same(a, b) -> bool:
    """Same type, dtype, shape and bits (NaN-safe); recursive over tuples/lists."""
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in BITS:
        return torch.equal(a.detach().contiguous().view(BITS[a.dtype]), b.detach().contiguous().view(BITS[b.dtype]))
    return torch.equal(a.detach(), b.detach())


def leaf(shape, seed, dtype=torch.float32, device="cpu", grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)


def run_case(ctx, fn, make_inputs, device="cpu"):
    """Build fresh inputs, run ``fn`` inside ``ctx``, backward a fixed cotangent outside it.

    Returns (outputs, input gradients), or (("raised", ExceptionType), None).
    """
    inputs = make_inputs(device)
    torch.manual_seed(123)                                   # dropout draws the same mask in both runs
    try:
        with ctx:
            out = fn(*inputs)
    except Exception as e:                                   # both implementations must agree on errors
        return ("raised", type(e)), None
    outs = out if isinstance(out, tuple) else (out,)
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if diff:
        g = torch.Generator().manual_seed(7)
        cot = [torch.randn(o.shape, generator=g).to(device=device, dtype=o.dtype) for o in diff]
        torch.autograd.backward(diff, cot)
    grads = [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return outs, grads


class Trace(TorchDispatchMode):
    """Logs every aten op below autocast and autograd: (op, output dtypes and shapes)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.log.append((str(func), tuple((o.dtype, tuple(o.shape)) for o in outs if isinstance(o, torch.Tensor))))
        return out


def casts(log):
    """The dtype casts in a Trace log (``aten.to.dtype`` is not decomposed under inference_mode)."""
    return [entry for entry in log if entry[0] in ("aten._to_copy.default", "aten.to.dtype")]


# ----------------------------------------------------------------------------- per-op sample cases
# (id, the table entry it exercises or None for an unlisted op, fn, inputs(device)).
def _t(*specs):
    """specs: (shape, dtype) leaves, or ready tensors (ints) as callables of device."""
    def make(device):
        out = []
        for i, s in enumerate(specs):
            out.append(s(device) if callable(s) else leaf(s[0], 100 + i, s[1], device))
        return out
    return make


f32, bf16 = torch.float32, torch.bfloat16
IDX = lambda d: torch.tensor([1, 0, 3, 2], device=d)                       # noqa: E731
MASK = lambda d: torch.rand(4, 6, generator=torch.Generator().manual_seed(5)).to(d) > 0.5  # noqa: E731

CASES = [
    ("F.linear", "linear", lambda x, w, b: F.linear(x, w, b), _t(((4, 8), f32), ((6, 8), f32), ((6,), f32))),
    ("torch.matmul", "matmul", torch.matmul, _t(((2, 3, 8), f32), ((8, 5), f32))),
    ("a @ b", "matmul", lambda a, b: a @ b, _t(((2, 3, 8), f32), ((8, 5), f32))),
    ("Tensor.matmul", "matmul", lambda a, b: a.matmul(b), _t(((3, 8), f32), ((8, 5), f32))),
    ("__rmatmul__", "matmul", lambda a, b: b.__rmatmul__(a), _t(((3, 8), f32), ((8, 5), f32))),
    ("mm", "mm", torch.mm, _t(((4, 8), f32), ((8, 5), f32))),
    ("bmm", "bmm", torch.bmm, _t(((2, 3, 4), f32), ((2, 4, 5), f32))),
    ("baddbmm", "baddbmm", torch.baddbmm, _t(((2, 3, 5), f32), ((2, 3, 4), f32), ((2, 4, 5), f32))),
    ("addmm", "addmm", torch.addmm, _t(((4, 5), f32), ((4, 8), f32), ((8, 5), f32))),
    ("addbmm", "addbmm", torch.addbmm, _t(((3, 5), f32), ((2, 3, 4), f32), ((2, 4, 5), f32))),
    ("linalg.vecdot", "linalg_vecdot", torch.linalg.vecdot, _t(((3, 4), f32), ((3, 4), f32))),
    ("conv1d", "conv1d", F.conv1d, _t(((2, 3, 10), f32), ((4, 3, 3), f32), ((4,), f32))),
    ("conv2d", "conv2d", F.conv2d, _t(((1, 2, 5, 5), f32), ((3, 2, 3, 3), f32))),
    ("conv_transpose1d", "conv_transpose1d", F.conv_transpose1d, _t(((1, 2, 5), f32), ((2, 3, 3), f32))),
    ("prelu", "prelu", F.prelu, _t(((2, 3), f32), ((1,), f32))),
    ("sdpa", "scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     _t(((2, 3, 4), f32), ((2, 3, 4), f32), ((2, 3, 4), f32))),
    ("tensordot", "tensordot", lambda a, b: torch.tensordot(a, b, dims=([2], [1])),
     _t(((2, 3, 4), f32), ((2, 4, 5), f32))),
    ("multi_dot", "linalg_multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
     _t(((3, 4), f32), ((4, 4), f32), ((4, 2), f32))),
    # fp32 list (CPU): losses, reductions, linear algebra, FFT, 3-D pooling
    ("cross_entropy", "cross_entropy_loss", lambda x: F.cross_entropy(x, IDX(x.device)), _t(((4, 7), f32))),
    ("cross_entropy(bf16 logits, smoothing)", "cross_entropy_loss",
     lambda x: F.cross_entropy(x, IDX(x.device), label_smoothing=0.1), _t(((4, 7), bf16))),
    ("nll_loss", "nll_loss", lambda x: F.nll_loss(x, IDX(x.device)), _t(((4, 7), bf16))),
    ("mse_loss", "mse_loss", F.mse_loss, _t(((4, 5), bf16), ((4, 5), f32))),
    ("l1_loss", "l1_loss", F.l1_loss, _t(((4, 5), bf16), ((4, 5), bf16))),
    ("smooth_l1_loss", "smooth_l1_loss", F.smooth_l1_loss, _t(((4, 5), bf16), ((4, 5), f32))),
    ("kl_div", "kl_div", lambda a, b: F.kl_div(a, b, reduction="batchmean"), _t(((4, 5), bf16), ((4, 5), f32))),
    ("bce_with_logits", "binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits,
     _t(((4, 5), bf16), lambda d: torch.rand(4, 5, generator=torch.Generator().manual_seed(3)).to(d))),
    ("cdist", "cdist", torch.cdist, _t(((3, 4), bf16), ((5, 4), f32))),
    ("prod", "prod", lambda x: x.prod(-1), _t(((3, 4), bf16))),
    ("avg_pool3d", "avg_pool3d", lambda x: F.avg_pool3d(x, 2), _t(((1, 1, 4, 4, 4), bf16))),
    ("max_pool3d", "max_pool3d", lambda x: F.max_pool3d(x, 2), _t(((1, 1, 4, 4, 4), bf16))),
    ("fft.rfft", "fft_rfft", torch.fft.rfft, _t(((8,), bf16))),
    ("trace", "trace", torch.trace, _t(((4, 4), bf16))),
    ("linalg.inv", "linalg_inv", torch.linalg.inv,
     lambda d: [(torch.eye(3) * 2 + 0.1 * leaf((3, 3), 9, grad=False)).to(d, bf16).requires_grad_()]),
    ("quantile", "quantile", lambda x: torch.quantile(x, 0.3), _t(((9,), bf16))),
    # promote list (CPU): cat, stack, index_copy
    ("cat(bf16 matmul, fp32)", "cat", lambda a, b, c: torch.cat([a @ b, c]),
     _t(((3, 4), f32), ((4, 5), f32), ((2, 5), f32))),
    ("cat(low, low)", "cat", lambda a, b: torch.cat([a @ b, a @ b], dim=1), _t(((3, 4), f32), ((4, 5), f32))),
    ("stack", "stack", lambda a, b, c: torch.stack([a @ b, c]), _t(((3, 4), f32), ((4, 5), f32), ((3, 5), f32))),
    ("index_copy", "index_copy", lambda x, a, b: x.index_copy(0, IDX(x.device), a @ b),
     _t(((4, 5), f32), ((4, 3), f32), ((3, 5), f32))),
    # unlisted on CPU: run in the input dtype
    ("F.softmax", None, lambda a, b: F.softmax(a @ b, -1), _t(((3, 4), f32), ((4, 5), f32))),
    ("torch.softmax fp32", None, lambda x: torch.softmax(x, -1), _t(((3, 5), f32))),
    ("Tensor.softmax", None, lambda a, b: (a @ b).softmax(0), _t(((3, 4), f32), ((4, 5), f32))),
    ("log_softmax", None, lambda a, b: F.log_softmax(a @ b, -1), _t(((3, 4), f32), ((4, 5), f32))),
    ("layer_norm(low x, fp32 w)", None, lambda a, b, w, c: F.layer_norm(a @ b, (5,), w, c),
     _t(((3, 4), f32), ((4, 5), f32), ((5,), f32), ((5,), f32))),
    ("gelu", None, lambda a, b: F.gelu(a @ b), _t(((3, 4), f32), ((4, 5), f32))),
    ("embedding", None, lambda w: F.embedding(IDX(w.device), w), _t(((6, 5), f32))),
    ("masked_fill", None, lambda a, b: (a @ b).masked_fill(MASK(a.device), float("-inf")),
     _t(((4, 3), f32), ((3, 6), f32))),
    ("add/mul mixed", None, lambda a, b, c: (a @ b) * 0.5 + c, _t(((3, 4), f32), ((4, 5), f32), ((3, 5), f32))),
    ("view/transpose", None, lambda a, b: (a @ b).view(-1, 3).transpose(0, 1).contiguous(),
     _t(((3, 4), f32), ((4, 6), f32))),
    ("split", None, lambda a, b: (a @ b).split(2, dim=1), _t(((3, 4), f32), ((4, 6), f32))),
    ("sum/mean", None, lambda a, b: ((a @ b).sum(), (a @ b).mean(-1)), _t(((3, 4), f32), ((4, 5), f32))),
    ("exp/log", None, lambda a, b: ((a @ b).exp(), (a @ b).abs().log()), _t(((3, 4), f32), ((4, 5), f32))),
    ("pow", None, lambda a, b: ((a @ b) ** 2, 2 ** (a @ b)), _t(((3, 4), f32), ((4, 5), f32))),
    ("dropout", None, lambda a, b: F.dropout(a @ b, 0.5), _t(((3, 4), f32), ((4, 5), f32))),
    ("norm", None, lambda x: x.norm(), _t(((3, 4), bf16))),
    ("float64 stays", "mm", torch.mm, _t(((3, 4), torch.float64), ((4, 5), torch.float64))),
    ("int ignored", "matmul", lambda a: torch.matmul(a, torch.ones(4, 2, dtype=torch.int64, device=a.device)),
     lambda d: [torch.arange(12, device=d).view(3, 4)]),
    ("cat(f64, f32): f64 ignored", "cat", lambda a, b: torch.cat([a.double(), b]), _t(((3, 4), f32), ((2, 4), f32))),
]


@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_torch_autocast_cpu(case, low):
    """Outputs, dtypes and gradients equal torch.autocast('cpu', dtype=low) bit for bit."""
    _, op, fn, make = case
    assert op is None or policy.policy_for("cpu", op) is not None, f"{op} is not on the CPU list"
    ref_out, ref_grads = run_case(torch.autocast("cpu", dtype=low), fn, make)
    out, grads = run_case(autocast("cpu", dtype=low), fn, make)
    assert ref_out[0] != "raised", f"oracle raised {ref_out[1]}: fix the sample case"
    assert same(out, ref_out), "outputs differ from torch.autocast"
    assert same(grads, ref_grads), "gradients differ from torch.autocast"


# Direct calls of single ops, to check the CPU table against torch.autocast's observed dtypes. In a
# float16 region, fed bfloat16 inputs: a lower_precision_fp op returns float16, an fp32 op float32
# (complex64 for FFTs), an unlisted op bfloat16; promote ops are fed float16 (+ float32) inputs.
f16 = torch.float16
TABLE_SAMPLES = [
    ("linear", F.linear, _t(((4, 8), bf16), ((6, 8), bf16))),
    ("matmul", torch.matmul, _t(((3, 8), bf16), ((8, 5), bf16))),
    ("mm", torch.mm, _t(((3, 8), bf16), ((8, 5), f32))),
    ("bmm", torch.bmm, _t(((2, 3, 4), bf16), ((2, 4, 5), bf16))),
    ("baddbmm", torch.baddbmm, _t(((2, 3, 5), bf16), ((2, 3, 4), bf16), ((2, 4, 5), bf16))),
    ("addmm", torch.addmm, _t(((4, 5), bf16), ((4, 8), bf16), ((8, 5), bf16))),
    ("addbmm", torch.addbmm, _t(((3, 5), bf16), ((2, 3, 4), bf16), ((2, 4, 5), bf16))),
    ("linalg_vecdot", torch.linalg.vecdot, _t(((3, 4), bf16), ((3, 4), bf16))),
    ("conv1d", F.conv1d, _t(((2, 3, 10), bf16), ((4, 3, 3), bf16))),
    ("conv2d", F.conv2d, _t(((1, 2, 5, 5), bf16), ((3, 2, 3, 3), bf16))),
    ("conv_transpose1d", F.conv_transpose1d, _t(((1, 2, 5), bf16), ((2, 3, 3), bf16))),
    ("prelu", F.prelu, _t(((2, 3), bf16), ((1,), bf16))),
    ("scaled_dot_product_attention", F.scaled_dot_product_attention,
     _t(((2, 3, 4), bf16), ((2, 3, 4), bf16), ((2, 3, 4), bf16))),
    ("cross_entropy_loss", lambda x: F.cross_entropy(x, IDX(x.device)), _t(((4, 7), bf16))),
    ("nll_loss", lambda x: F.nll_loss(x, IDX(x.device)), _t(((4, 7), bf16))),
    ("mse_loss", F.mse_loss, _t(((4, 5), bf16), ((4, 5), bf16))),
    ("l1_loss", F.l1_loss, _t(((4, 5), bf16), ((4, 5), bf16))),
    ("huber_loss", F.huber_loss, _t(((4, 5), bf16), ((4, 5), bf16))),
    ("kl_div", lambda a, b: F.kl_div(a, b, reduction="batchmean"), _t(((4, 5), bf16), ((4, 5), bf16))),
    ("binary_cross_entropy", lambda x: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(x).detach()),
     _t(((4, 5), bf16))),
    ("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits, _t(((4, 5), bf16), ((4, 5), bf16))),
    ("cdist", torch.cdist, _t(((3, 4), bf16), ((5, 4), bf16))),
    ("prod", torch.prod, _t(((3, 4), bf16))),
    ("avg_pool3d", lambda x: F.avg_pool3d(x, 2), _t(((1, 1, 4, 4, 4), bf16))),
    ("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, 2), _t(((1, 1, 4, 4, 4), bf16))),
    ("reflection_pad1d", lambda x: F.pad(x, (1, 1), mode="reflect"), _t(((1, 2, 5), bf16))),
    ("fft_rfft", torch.fft.rfft, _t(((8,), bf16))),
    ("trace", torch.trace, _t(((4, 4), bf16))),
    ("linalg_svdvals", torch.linalg.svdvals, _t(((3, 3), bf16))),
    ("quantile", lambda x: torch.quantile(x, 0.3), _t(((9,), bf16))),
    ("cat", lambda a, b: torch.cat([a, b]), _t(((2, 3), f16), ((2, 3), f32))),
    ("cat", lambda a, b: torch.cat([a, b]), _t(((2, 3), f16), ((2, 3), f16))),
    ("stack", lambda a, b: torch.stack([a, b]), _t(((2, 3), f32), ((2, 3), f16))),
    ("index_copy", lambda x, s: x.index_copy(0, IDX(x.device)[:2], s), _t(((4, 3), f16), ((2, 3), f32))),
    ("softmax", lambda x: F.softmax(x, -1), _t(((3, 5), bf16))),
    ("log_softmax", lambda x: F.log_softmax(x, -1), _t(((3, 5), bf16))),
    ("layer_norm", lambda x: F.layer_norm(x, (5,)), _t(((3, 5), bf16))),
    ("exp", torch.exp, _t(((3, 5), bf16))),
    ("log", lambda x: x.abs().log(), _t(((3, 5), bf16))),
    ("sum", torch.sum, _t(((3, 5), bf16))),
    ("gelu", F.gelu, _t(((3, 5), bf16))),
    ("mv", torch.mv, _t(((3, 4), bf16), ((4,), bf16))),
]


@pytest.mark.parametrize("sample", TABLE_SAMPLES, ids=[f"{s[0]}-{i}" for i, s in enumerate(TABLE_SAMPLES)])
def test_cpu_table_predicts_torch_autocast_dtype(sample):
    """For each sampled op the CPU table's policy predicts the dtype torch.autocast('cpu') gives."""
    op, fn, make = sample
    inputs = make("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        out = fn(*inputs)
    pol = policy.policy_for("cpu", op)
    floating = [t.dtype for t in inputs if t.is_floating_point()]
    expected = {policy.LOWER_PRECISION_FP: {torch.float16}, policy.FP32: {torch.float32, torch.complex64},
                None: {torch.bfloat16},
                policy.PROMOTE: {torch.float32 if torch.float32 in floating else torch.float16}}[pol]
    assert out.dtype in expected, f"{op}: table says {pol}, torch.autocast gave {out.dtype}"


# ------------------------------------------------------------------------------------ table tests
def _torch_release(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"``; ``"2.11.0a0+git1234"`` -> ``"2.11"``."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return f"{m.group(1)}.{m.group(2)}" if m else str(version)


def require_transcribed_torch():
    """Skip a test that compares the transcribed tables with the installed torch's own lists, unless
    the installed torch is the release they were transcribed from (the lists change between releases;
    CI pins that release, where these tests are strict)."""
    if _torch_release(torch.__version__) != policy.TORCH_VERSION:
        pytest.skip(f"mpcourse.core.autocast.policy tables were transcribed from torch {policy.TORCH_VERSION}; "
                    f"this is torch {torch.__version__}, whose autocast op lists may differ. The exact table "
                    f"comparison runs on torch {policy.TORCH_VERSION}; the behavioural tests against "
                    "torch.autocast still run here.")


def test_torch_release_parsing():
    assert _torch_release("2.13.0+cpu") == "2.13" and _torch_release("2.11.0a0+git1a2b") == "2.11"
    assert _torch_release("2.4.1") == "2.4" and _torch_release(policy.TORCH_VERSION) == policy.TORCH_VERSION


def _registered(key):
    return {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def _entries(table):
    return [e for entries in table.values() for e in entries]


@pytest.mark.parametrize("device,key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_table_equals_registered_kernels(device, key):
    """Each table lists exactly the ops that have an autocast kernel for that device in this torch."""
    require_transcribed_torch()
    entries = _entries(policy.TABLES[device])
    assert len(entries) == len(set(entries)), "an op is listed twice"
    registered = _registered(key)
    assert set(entries) == registered, (
        f"tables transcribed from torch {policy.TORCH_VERSION}, this is torch {torch.__version__}: "
        f"missing {sorted(registered - set(entries))}, extra {sorted(set(entries) - registered)}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_entry_resolves_to_an_aten_op(device):
    require_transcribed_torch()
    for entry in _entries(policy.TABLES[device]):
        name, _, overload = entry.partition(".")
        packet = getattr(torch.ops.aten, name)
        assert isinstance(getattr(packet, overload or "default"), torch._ops.OpOverload), entry


def _header_lists():
    path = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")
    if not os.path.exists(path):
        pytest.skip("torch was installed without its C++ headers")
    text = open(path, encoding="utf-8").read()
    lists = {}
    for macro in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE"):
        body = re.search(rf"#define AT_FORALL_{macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        lists[macro] = {".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([^()]*)\)", body)}
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S).group(1)
    lists["APPEND"] = set(re.findall(r'"(norm\.[A-Za-z_]+)"', body))
    return lists


def test_cuda_table_policies_match_autocast_mode_h():
    """CUDA policies equal the macro lists of the installed ATen/autocast_mode.h (cudnn convs extra)."""
    require_transcribed_torch()
    h, cuda = _header_lists(), policy.TABLES["cuda"]
    assert set(cuda[policy.LOWER_PRECISION_FP]) == h["LOWER_PRECISION_FP"] | {"cudnn_convolution",
                                                                             "cudnn_convolution_transpose"}
    assert set(cuda[policy.FP32]) == h["FP32"]
    assert set(cuda[policy.FP32_SET_OPT_DTYPE]) == h["FP32_SET_OPT_DTYPE"]
    assert set(cuda[policy.FP32_APPEND_DTYPE]) == h["APPEND"]
    assert set(cuda[policy.PROMOTE]) == h["PROMOTE"]


def test_cpu_and_cuda_lists_differ_where_the_reference_says():
    p = policy.policy_for
    assert p("cpu", "softmax") is None and p("cuda", "softmax.int") == policy.FP32_SET_OPT_DTYPE
    assert p("cpu", "layer_norm") is None and p("cuda", "layer_norm") == policy.FP32
    assert p("cpu", "exp") is None and p("cuda", "exp") == policy.FP32
    assert p("cpu", "sum") is None and p("cuda", "sum") == policy.FP32_SET_OPT_DTYPE
    assert p("cpu", "einsum") is None and p("cuda", "einsum") == policy.LOWER_PRECISION_FP
    assert p("cpu", "mv") is None and p("cuda", "mv") == policy.LOWER_PRECISION_FP
    assert p("cpu", "cross_entropy_loss") == policy.FP32 and p("cpu", "prod") == policy.FP32
    assert {p("cpu", n) for n in ("cat", "stack", "index_copy")} == {policy.PROMOTE}
    assert p("cpu", "binary_cross_entropy") == policy.FP32 and p("cuda", "binary_cross_entropy") == policy.BANNED
    with pytest.raises(ValueError, match="device_type"):
        p("mps", "mm")


def test_composites_and_gaps_are_not_registered_ops():
    """COMPOSITES/KNOWN_GAPS name real ops that have no autocast kernel of their own on that device."""
    require_transcribed_torch()
    for device, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        registered = {policy.base_name(e) for e in _registered(key)}
        for name, inner in policy.COMPOSITES[device].items():
            assert name not in registered and hasattr(torch.ops.aten, name)
            assert policy.base_name(inner) in registered
        for name in policy.KNOWN_GAPS[device]:
            assert name not in registered and hasattr(torch.ops.aten, name)


def test_op_name_maps_python_callables():
    assert mpa.op_name(torch.matmul) == "matmul" and mpa.op_name(torch.Tensor.matmul) == "matmul"
    assert mpa.op_name(torch.Tensor.__matmul__) == "matmul"
    assert mpa.op_name(F.linear) == "linear" and mpa.op_name(torch.Tensor.softmax) == "softmax"
    assert mpa.op_name(torch._C._nn.cross_entropy_loss) == "cross_entropy_loss"
    assert mpa.op_name(torch.linalg.vector_norm) == "linalg_vector_norm"
    assert mpa.op_name(torch.fft.rfft) == "fft_rfft"
    assert mpa.op_name(F.softmax) is None and mpa.op_name(F.cross_entropy) is None   # Python: stepped into


def test_every_table_op_is_reachable_from_python():
    """Every table name is the __name__ of a C-bound torch callable, except internal-only ops."""
    require_transcribed_torch()
    names = set()
    for ns in (torch, torch._C._nn, torch._C._VariableFunctions, torch.linalg, torch.fft, torch.special,
               torch.Tensor):
        for attr in dir(ns):
            name = mpa.op_name(getattr(ns, attr, None))
            if name:
                names.add(name)
    internal = {"multilabel_margin_loss_forward", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"}
    for device in ("cpu", "cuda"):
        missing = {policy.base_name(e) for e in _entries(policy.TABLES[device])} - names
        assert missing <= internal, missing


# ------------------------------------------------------------------ grouped GEMMs (a course addition)
# torch._grouped_mm (F.grouped_mm is its Python wrapper) is in none of torch 2.13's autocast tables: under
# torch.autocast an FP32 activation meeting BF16 expert weights raises a dtype mismatch (an open PyTorch bug,
# "torch._grouped_mm is not autocast-compatible"). The course's tables give it bmm's policy (policy.ADDITIONS).
# On CPU, torch 2.13 runs it for float32, bfloat16 and float16 (its fallback loops over mm_out / calls
# bmm_out); a 2-D operand needs int32 offsets, two 3-D operands take none; strides must be multiples of 16 bytes.
GROUPED = {
    # (G, M, K) @ (G, K, N): a batched GEMM, no offsets
    "3d@3d": (lambda x, w: torch._grouped_mm(x, w), ((3, 8, 16), (3, 16, 24))),
    # the MoE forward: tokens (T, K) in groups ending at offs, expert weights (G, N, K) read as (G, K, N)
    "2d@3d offs": (lambda x, w: F.grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([3, 7, 12], dtype=torch.int32)),
                   ((12, 16), (3, 24, 16))),
}


def _grouped_inputs(shapes, device="cpu"):
    (xs, ws) = shapes
    return [leaf(xs, 11, torch.float32, device), leaf(ws, 12, torch.bfloat16, device)]   # FP32 input, BF16 weights


def _by_hand(fn, low):
    return lambda x, w: fn(x.to(low), w.to(low))


def _torch_lists_grouped_mm():
    return any(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", k)
               for k in ("AutocastCPU", "AutocastCUDA"))


def test_grouped_mm_has_the_policy_of_bmm():
    """The lookup, on every torch: _grouped_mm takes mm/bmm's lower_precision_fp on both device types as a course
    addition; torch's own tables (``course_additions=False``) leave it unlisted; F.grouped_mm is stepped into."""
    for dev in ("cpu", "cuda"):
        assert policy.policy_for(dev, "_grouped_mm") == policy.policy_for(dev, "bmm") == policy.LOWER_PRECISION_FP
        assert policy.policy_for(dev, "_grouped_mm", course_additions=False) is None
        assert policy.policy_for(dev, "bmm", course_additions=False) == policy.LOWER_PRECISION_FP
        assert "_grouped_mm" in policy.ops_with_policy(dev, policy.LOWER_PRECISION_FP)
        assert "_grouped_mm" not in policy.TABLES[dev][policy.LOWER_PRECISION_FP]      # the transcription stays torch's
    assert mpa.op_name(torch._grouped_mm) == "_grouped_mm" and mpa.op_name(F.grouped_mm) is None


def test_course_additions_are_not_in_torchs_tables():
    """Each addition fills a gap of the installed torch: when torch registers an autocast kernel for one, this fails
    and the addition goes (the transcribed table then lists the op)."""
    require_transcribed_torch()
    for dev, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        registered = {policy.base_name(e) for e in _registered(key)}
        for entries in policy.ADDITIONS[dev].values():
            for entry in entries:
                assert policy.base_name(entry) not in registered and hasattr(torch.ops.aten, entry)


@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(GROUPED), ids=list(GROUPED))
def test_grouped_mm_fp32_input_bf16_weights_cpu(case, low):
    """FP32 input, BF16 weights under the course's autocast('cpu'): output in the region's dtype, bits and
    gradients equal to the same call on inputs cast by hand; the forward equals torch.autocast's own bmm / per-group
    mm on the same inputs (the op's CPU fallback is those GEMMs). torch.autocast on the same _grouped_mm call
    raises while torch lists no autocast kernel for it: recorded here, the reason the course adds it."""
    fn, shapes = GROUPED[case]
    make = functools.partial(_grouped_inputs, shapes)
    out, grads = run_case(autocast("cpu", dtype=low), fn, make)
    assert out[0] != "raised", f"the course's autocast raised {out[1]}"
    assert out[0].dtype == low and [g.dtype for g in grads] == [torch.float32, torch.bfloat16]
    ref_out, ref_grads = run_case(contextlib.nullcontext(), _by_hand(fn, low), make)
    assert same(out, ref_out) and same(grads, ref_grads)
    # torch.autocast's own casts, through ops its table lists
    x, w = make("cpu")
    with torch.autocast("cpu", dtype=low):
        if case == "3d@3d":
            ops = torch.bmm(x, w)
        else:
            ends = [0, 3, 7, 12]
            ops = torch.cat([x[a:b] @ w[g].t() for g, (a, b) in enumerate(zip(ends, ends[1:]))])
    assert same(out[0], ops)
    torch_out, _ = run_case(torch.autocast("cpu", dtype=low), fn, make)
    if _torch_lists_grouped_mm():
        assert same(torch_out, out)               # torch fixed its gap: the course must then agree bit for bit
    else:
        assert torch_out == ("raised", RuntimeError), "torch.autocast ran _grouped_mm on mixed dtypes"


def test_course_additions_false_runs_torchs_tables():
    """``autocast(..., course_additions=False)``: torch's tables exactly. The mixed call raises as under
    torch.autocast; an all-FP32 call runs in FP32, bit for bit torch.autocast's, where the course's table casts it."""
    fn, shapes = GROUPED["3d@3d"]
    make = functools.partial(_grouped_inputs, shapes)
    assert run_case(autocast("cpu", course_additions=False), fn, make)[0] == ("raised", RuntimeError)
    fp32 = lambda d: [t.detach().float().requires_grad_() for t in make(d)]           # noqa: E731
    out, grads = run_case(autocast("cpu", course_additions=False), fn, fp32)
    ref_out, ref_grads = run_case(torch.autocast("cpu"), fn, fp32)
    assert out[0].dtype == torch.float32 and same(out, ref_out) and same(grads, ref_grads)
    assert run_case(autocast("cpu"), fn, fp32)[0][0].dtype == torch.bfloat16
    with autocast("cpu", course_additions=False):
        with autocast("cpu"):                     # None: an inner region keeps the enclosing setting
            assert run_case(contextlib.nullcontext(), fn, make)[0] == ("raised", RuntimeError)
        with autocast("cpu", course_additions=True):
            assert run_case(contextlib.nullcontext(), fn, make)[0][0].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="course_additions"):
        autocast("cpu", course_additions="no")


def test_grouped_mm_under_the_cuda_list(fake_cuda):
    """The CUDA table's addition, on CPU tensors counted as CUDA: FP32 x BF16 runs in the region's FP16."""
    fn, shapes = GROUPED["2d@3d offs"]
    make = functools.partial(_grouped_inputs, shapes)
    out, grads = run_case(autocast("cuda"), fn, make)
    ref_out, ref_grads = run_case(contextlib.nullcontext(), _by_hand(fn, torch.float16), make)
    assert out[0].dtype == torch.float16 and same(out, ref_out) and same(grads, ref_grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(GROUPED), ids=list(GROUPED))
def test_grouped_mm_fp32_input_bf16_weights_cuda(case, low):
    """On a GPU: the same call as inputs cast by hand, bit for bit (bf16 takes the grouped kernel on SM90+,
    fp16 the fallback), and torch.autocast('cuda') raising while torch lists no kernel for it."""
    fn, shapes = GROUPED[case]
    make = functools.partial(_grouped_inputs, shapes, device="cuda")
    out, grads = run_case(autocast("cuda", dtype=low), fn, make, "cuda")
    ref_out, ref_grads = run_case(contextlib.nullcontext(), _by_hand(fn, low), make, "cuda")
    assert out[0].dtype == low and same(out, ref_out) and same(grads, ref_grads)
    torch_out, _ = run_case(torch.autocast("cuda", dtype=low), fn, make, "cuda")
    assert same(torch_out, out) if _torch_lists_grouped_mm() else torch_out == ("raised", RuntimeError)


# ---------------------------------------------------------------------------- whole-model oracle
def _gpt_run(model, idx, targets, ctx):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)                                       # dropout masks
    with Trace() as tr:
        with ctx:
            logits, loss = model(idx, targets)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, loss, grads, tr.log


@pytest.mark.parametrize("emulate", [False, True], ids=["native kernels", "tensor-core emulation"])
@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
def test_gpt_matches_torch_autocast_bit_for_bit(low, emulate):
    """mpcourse.experiment.gpt.model.GPT: logits, loss, every parameter gradient and the dtype/shape of every aten op
    run in forward and backward equal torch.autocast's, on CPU, with dropout and tied weights.

    Both runs use the same matmul kernels: emulation off (``tensor_cores(enabled=False)``, the
    documented switch of mpcourse.core.emulation), and, as the training loop runs, emulation on for both."""
    model_mod = pytest.importorskip("mpcourse.experiment.gpt.model")
    emulation = pytest.importorskip("mpcourse.core.emulation")
    torch.manual_seed(0)
    cfg = model_mod.GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = model_mod.GPT(cfg)
    g = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(0, 37, (3, 16), generator=g), torch.randint(0, 37, (3, 16), generator=g)
    with emulation.tensor_cores(enabled=emulate):
        assert (_get_current_dispatch_mode() is not None) == emulate
        ref = _gpt_run(model, idx, targets, torch.autocast("cpu", dtype=low))
        got = _gpt_run(model, idx, targets, autocast("cpu", dtype=low))
    assert ref[0].dtype == low and ref[1].dtype == torch.float32
    assert same(got[0], ref[0]) and same(got[1], ref[1])
    assert ref[2].keys() == got[2].keys()
    for name in ref[2]:
        assert same(got[2][name], ref[2][name]), f"gradient of {name} differs"
    assert any(dt == low for _, outs in ref[3] for dt, _ in outs)
    assert got[3] == ref[3], "the aten ops run (or their dtypes) differ from torch.autocast's"


# ------------------------------------------------------------------------------ the weight cache
def _cache_scenario(ctx_factory, scenario):
    """Run ``scenario(ctx_factory)`` under a Trace; return the casts made and the scenario's outputs."""
    with Trace() as tr:
        outs = scenario(ctx_factory)
    return casts(tr.log), outs


def _two_uses(make_w, **region):
    def scenario(ctx):
        x = leaf((2, 4), 1, grad=False)
        w = make_w()
        with ctx(**region):
            return torch.mm(x, w), torch.mm(x, w)
    return scenario


SCENARIOS = {
    "leaf weight: cast once": _two_uses(lambda: leaf((4, 4), 2)),
    "non-leaf: cast each use": _two_uses(lambda: leaf((4, 4), 2) * 1),
    "no grad: cast each use": _two_uses(lambda: leaf((4, 4), 2, grad=False)),
    "view (non-leaf): cast each use": _two_uses(lambda: leaf((4, 4), 2)[:, :]),
    "leaf view: cast each use": _two_uses(lambda: leaf((4, 4), 2, grad=False)[:, :].requires_grad_()),
    "fp16 leaf: cast each use": _two_uses(lambda: leaf((4, 4), 2, torch.float16)),
    "cache_enabled=False": _two_uses(lambda: leaf((4, 4), 2), cache_enabled=False),
}


def _nested(ctx):
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    with ctx():
        a = torch.mm(x, w)
        with ctx(enabled=False):
            b = torch.mm(x, w)                                  # fp32, no cast
        with ctx():
            c = torch.mm(x, w)                                  # reuses the outer cast
        d = torch.mm(x, w)                                      # still cached after the inner exit
    with ctx():
        e = torch.mm(x, w)                                      # new outermost region: cast again
    return a, b, c, d, e


def _inference(ctx):
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    with ctx(), torch.inference_mode():
        return torch.mm(x, w) + 0, torch.mm(x, w) + 0


SCENARIOS.update({"nested regions": _nested, "inference_mode: no caching": _inference})


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cache_makes_the_same_casts_as_torch(name):
    """The same casts (count, order, dtypes) as torch.autocast's cache: it is reused only for FP32 leaf
    weights that require grad and are not views, within the outermost region, with cache_enabled."""
    ref_casts, ref_outs = _cache_scenario(lambda **kw: torch.autocast("cpu", **kw), SCENARIOS[name])
    got_casts, got_outs = _cache_scenario(lambda **kw: autocast("cpu", **kw), SCENARIOS[name])
    assert got_casts == ref_casts
    assert same(tuple(got_outs), tuple(ref_outs))


def test_cached_cast_is_the_same_tensor_and_cleared_at_outermost_exit():
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)
    seen = []

    class Args(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                seen.append(args[1].data_ptr())
            return func(*args, **(kwargs or {}))

    with Args():
        with autocast("cpu"):
            y1, y2 = torch.mm(x, w), torch.mm(x, w)
            assert mpa.cache_size() == 1
            with autocast("cpu"):
                pass
            assert mpa.cache_size() == 1                        # an inner exit keeps the cache
            assert y1.grad_fn.next_functions[1][0] is y2.grad_fn.next_functions[1][0]  # one ToCopyBackward0
        assert mpa.cache_size() == 0
    assert seen[0] == seen[1]                                   # the same bf16 storage both times


def test_no_caching_of_nonleaf_nograd_or_view_tensors():
    x = leaf((2, 4), 1, grad=False)
    w = leaf((4, 4), 2)
    with autocast("cpu"):
        leaf_view = leaf((4, 4), 3, grad=False).t().requires_grad_()
        assert leaf_view.is_leaf and leaf_view._is_view()
        for t in (w * 1, leaf((4, 4), 3, grad=False), w[:2], w.t(), leaf_view):
            torch.mm(x, t) if t.shape[0] == 4 else torch.mm(x[:, :2], t)
        assert mpa.cache_size() == 0
        torch.mm(x, w)
        assert mpa.cache_size() == 1


# ------------------------------------------------------------------ regressions from bug reports
def test_no_grad_forward_then_grad_forward_in_one_region():
    """pytorch/pytorch#112583 (and #65766, #158232; fixed by #165068): a forward under no_grad inside
    an autocast region cached a cast without history, so the next forward with grad lost the weight's
    gradient. Right value: the second output has a grad_fn and the weight gradient equals that of a
    fresh region (and torch.autocast's)."""
    def run(ctx, warm_up):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        x = leaf((2, 4), 1, grad=False)
        with ctx:
            if warm_up:
                with torch.no_grad():
                    lin(x)
            y = lin(x)
        assert y.grad_fn is not None
        y.float().pow(2).sum().backward()
        return lin.weight.grad, lin.bias.grad

    fresh = run(autocast("cpu"), warm_up=False)
    got = run(autocast("cpu"), warm_up=True)
    ref = run(torch.autocast("cpu"), warm_up=True)
    assert fresh[0] is not None and same(got, fresh) and same(got, ref)


def _mm_function(fwd_deco, bwd_deco, enabled_fn, record):
    class MyMM(torch.autograd.Function):
        @staticmethod
        @fwd_deco
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = a.mm(b)
            record["fwd"] = (out.dtype, enabled_fn("cpu"))
            return out

        @staticmethod
        @bwd_deco
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            ga, gb = grad.mm(b.t()), a.t().mm(grad)
            record["bwd"] = (ga.dtype, enabled_fn("cpu"))
            return ga, gb
    return MyMM


@pytest.mark.parametrize("where", ["in region", "cast_inputs=fp32", "outside region"])
def test_custom_function_backward_runs_like_forward(where):
    """A custom Function under BF16 autocast: backward runs in BF16 like forward (and with autocast
    off when it was off in forward; cast_inputs runs both with autocast off), as torch.amp's."""
    kw = {"cast_inputs": torch.float32} if where == "cast_inputs=fp32" else {}

    def run(fwd, bwd, ctx, enabled_fn):
        rec = {}
        fn = _mm_function(fwd(device_type="cpu", **kw), bwd(device_type="cpu"), enabled_fn, rec)
        a, b = leaf((3, 4), 1), leaf((4, 2), 2)
        with (ctx if where != "outside region" else contextlib.nullcontext()):
            out = fn.apply(a, b)
        out.float().sum().backward()
        return rec, out, a.grad, b.grad

    ref = run(torch.amp.custom_fwd, torch.amp.custom_bwd, torch.autocast("cpu"), torch.is_autocast_enabled)
    got = run(custom_fwd, custom_bwd, autocast("cpu"), mpa.is_autocast_enabled)
    assert got[0] == ref[0]
    assert same(got[1:], ref[1:])
    expected = torch.bfloat16 if where == "in region" else torch.float32
    assert got[0]["fwd"][0] == got[0]["bwd"][0] == expected


def test_custom_bwd_without_custom_fwd_names_the_fix():
    fn = _mm_function(lambda f: f, custom_bwd(device_type="cpu"), mpa.is_autocast_enabled, {})
    out = fn.apply(leaf((3, 4), 1), leaf((4, 2), 2))
    with pytest.raises(RuntimeError, match="custom_fwd"):
        out.sum().backward()
    with pytest.raises(ValueError, match="device_type"):
        custom_fwd(cast_inputs=torch.float32)


def test_softmax_dtype_follows_the_cpu_list():
    """Softmax under autocast on CPU keeps its input dtype (it is on no CPU list), as torch.autocast."""
    for x in (leaf((2, 5), 1), leaf((2, 5), 1, torch.bfloat16), leaf((2, 5), 1, torch.float16)):
        with torch.autocast("cpu"):
            ref = F.softmax(x, -1)
        with autocast("cpu"):
            got = F.softmax(x, -1)
        assert got.dtype == ref.dtype == x.dtype and same(got, ref)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Run the CUDA table on CPU tensors: CPU tensors count as 'cuda' and CUDA counts as available."""
    monkeypatch.setattr(mode_mod, "_device_type", lambda t: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_list_applied(fake_cuda):
    """The CUDA half of the softmax case, as a table-level test (no GPU here): under the CUDA list
    softmax, log_softmax, sum, layer_norm, exp and the losses give FP32 for FP16 inputs, matmuls FP16,
    promote ops the widest input, and binary_cross_entropy is refused (REFERENCE.md; autocast_mode.h)."""
    h, x16, w = leaf((3, 4), 1, torch.float16), leaf((3, 4), 1), leaf((4, 4), 2)
    with autocast("cuda"):                                      # default dtype on CUDA: fp16
        assert torch.mm(x16.float(), w).dtype == torch.float16
        assert F.softmax(h, -1).dtype == torch.float32
        assert F.softmax(h, -1, dtype=torch.float16).dtype == torch.float16   # an explicit dtype wins
        assert F.log_softmax(h, -1).dtype == torch.float32
        assert h.sum().dtype == torch.float32 and h.cumsum(0).dtype == torch.float32
        assert F.layer_norm(h, (4,)).dtype == torch.float32
        assert h.exp().dtype == torch.float32 and (h ** 2).dtype == torch.float32
        assert F.cross_entropy(h, torch.tensor([0, 1, 2])).dtype == torch.float32
        assert h.norm().dtype == torch.float32 and torch.norm(h, p=1, dim=0).dtype == torch.float32
        assert torch._VF.norm(h, 2).dtype == torch.float32        # norm.Scalar: fp32_append_dtype
        assert F.gelu(h).dtype == torch.float16                 # unlisted
        assert torch.cat([h, x16]).dtype == torch.float32       # promote
        assert torch.addcmul(h, h, h).dtype == torch.float16
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.sigmoid(h), torch.rand(3, 4, dtype=torch.float16))
        assert F.softmax(h, -1).float().sum(-1).sub(1).abs().max() < 1e-6


# ------------------------------------------------------------------- nesting, decorator, threads
def test_nesting_and_disabled_regions():
    x, w = leaf((2, 4), 1), leaf((4, 4), 2)
    assert not mpa.is_autocast_enabled("cpu") and mpa.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast("cpu"):
        assert mpa.is_autocast_enabled("cpu")
        with autocast("cpu", enabled=False):
            assert not mpa.is_autocast_enabled("cpu") and torch.mm(x, w).dtype == torch.float32
            with autocast("cpu", dtype=torch.float16):
                assert mpa.get_autocast_dtype("cpu") == torch.float16 and torch.mm(x, w).dtype == torch.float16
            assert mpa.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.mm(x, w).dtype == torch.bfloat16
        with autocast("cpu", dtype=torch.float16), autocast("cpu"):
            assert torch.mm(x, w).dtype == torch.float16        # dtype=None inherits the enclosing dtype
        # Policy (state.py): the cache is keyed by dtype too, so after fp16 regions the weight's bf16 cast
        # is used. (torch.autocast keys by tensor only and returns the fp16 cast here.)
        assert torch.mm(x, w).dtype == torch.bfloat16
    assert not mpa.is_autocast_enabled("cpu") and torch.mm(x, w).dtype == torch.float32
    assert _get_current_dispatch_mode() is None and torch.overrides._get_current_function_mode() is None


def test_decorator_and_reentrancy():
    x, w = leaf((2, 4), 1), leaf((4, 4), 2)

    @autocast("cpu")
    def step(depth):
        inner = step(depth - 1) if depth else None
        return torch.mm(x, w).dtype, mpa.is_autocast_enabled("cpu"), inner

    assert step(2) == (torch.bfloat16, True, (torch.bfloat16, True, (torch.bfloat16, True, None)))
    assert not mpa.is_autocast_enabled("cpu") and torch.mm(x, w).dtype == torch.float32

    @torch.autocast("cpu")
    def ref():
        return torch.mm(x, w)

    assert same(autocast("cpu")(lambda: torch.mm(x, w))(), ref())


def test_state_is_thread_local():
    """A thread started inside a region runs outside any region (as with torch.autocast); a thread's
    own region does not touch this thread's state or cache."""
    x, w = leaf((2, 4), 1, grad=False), leaf((4, 4), 2)

    def in_thread(ctx, enabled_fn, enter_own):
        res = {}

        def body():
            if enter_own:
                with ctx():
                    res["own"] = torch.mm(x, w).dtype
            res["dtype"], res["enabled"] = torch.mm(x, w).dtype, enabled_fn("cpu")
        th = threading.Thread(target=body)
        th.start()
        th.join()
        return res

    with torch.autocast("cpu"):
        ref = in_thread(lambda: torch.autocast("cpu"), torch.is_autocast_enabled, enter_own=True)
    with autocast("cpu"):
        torch.mm(x, w)
        got = in_thread(lambda: autocast("cpu"), mpa.is_autocast_enabled, enter_own=True)
        assert mpa.cache_size() == 1 and mpa.is_autocast_enabled("cpu")
        assert torch.mm(x, w).dtype == torch.bfloat16
    assert got == ref == {"own": torch.bfloat16, "dtype": torch.float32, "enabled": False}


# ------------------------------------------------------------------------------- errors and misc
def test_bad_arguments_and_mixing_with_torch_autocast():
    with pytest.raises(ValueError, match="device_type"):
        autocast("tpu")
    with pytest.raises(ValueError, match="str"):
        autocast(torch.device("cpu"))
    with pytest.raises(TypeError, match="torch.dtype"):
        autocast("cpu", dtype="bfloat16")
    with torch.autocast("cpu"), pytest.raises(RuntimeError, match="torch.autocast"):
        with autocast("cpu"):
            pass
    for ctx in (torch.autocast, autocast):                     # unsupported dtype: warn and disable
        with pytest.warns(UserWarning, match="not supported"):
            region = ctx("cpu", dtype=torch.float32)
        with region:
            assert torch.mm(leaf((2, 2), 1), leaf((2, 2), 2)).dtype == torch.float32
    a, b = leaf((2,), 1, torch.bfloat16), leaf((2,), 2, torch.float16)
    for ctx in (torch.autocast, autocast):                     # promote refuses bf16 with fp16
        with ctx("cpu"), pytest.raises(RuntimeError):
            torch.cat([a, b])


def test_cuda_region_without_cuda_warns_and_disables():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        region = autocast("cuda")
    with region:
        assert not mpa.is_autocast_enabled("cuda")


def test_out_and_inplace_variants_run_unchanged():
    a, b = leaf((3, 4), 1, grad=False), leaf((4, 5), 2, grad=False)
    for ctx in (torch.autocast("cpu"), autocast("cpu")):
        out = torch.empty(3, 5)
        with ctx:
            torch.mm(a, b, out=out)
            c = torch.zeros(3, 5).addmm_(a, b)
        assert out.dtype == c.dtype == torch.float32
        assert same(out, a @ b) and same(c, a @ b)


# ---------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_torch_autocast_cuda(case):
    """The CUDA table against torch.autocast('cuda') (fp16), per op, bit for bit."""
    _, _, fn, make = case
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # Deterministic kernels: cuDNN's weight-gradient and SDPA's fused backward may use atomics.
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH), \
            torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        warnings.simplefilter("ignore")
        ref_out, ref_grads = run_case(torch.autocast("cuda"), fn, make, "cuda")
        out, grads = run_case(autocast("cuda"), fn, make, "cuda")
    if ref_out[0] == "raised":
        assert out == ref_out
        return
    assert same(out, ref_out) and same(grads, ref_grads)
