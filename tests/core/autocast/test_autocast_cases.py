"""Regression cases from public bug reports: what autocast does and does not protect.

Each test carries the right value (from exact arithmetic, float64, numpy's float16 or torch.autocast run
side by side) and cites the public report it comes from. The cases:

* masking with the FP16 minimum: ``-65504 - 16`` overflows to ``-inf``, a fully masked row's softmax is
  NaN; a mask added in FP32 keeps the row finite; the course's GPT masks with ``masked_fill(-inf)`` and
  never masks the diagonal, so no row can be NaN; softmax's dtype under autocast follows the device's list;
* LayerNorm of FP16 ``[300, -300, 300, -300]``: the statistics must be FP32 (``300**2`` overflows FP16);
* an FP16 activation of 70000 is inf, and the overflow detector flags it;
* min-max normalisation with ``+ 1e-8``: ``1e-8`` is 0 in FP16, so equal values give NaN, and autocast
  does not help (element-wise ops are on no list).

The CUDA half of a case runs against ``torch.autocast("cuda")`` on a GPU; without one, the CUDA table
is applied to CPU tensors (the ``cuda_policy`` fixture) and checked against the table's documented
policy (``mpcourse/core/autocast/policy.py``; ``aten/src/ATen/autocast_mode.h``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpcourse.core.autocast import autocast
from mpcourse.core.autocast import mode as mode_mod
from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.core.scaling import has_inf_or_nan

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
FP16_MIN = torch.finfo(f16).min                                      # -65504.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included)."""
    ints = {f32: torch.int32, f16: torch.int16, bf16: torch.int16}
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.detach().contiguous().view(ints[a.dtype]), b.detach().contiguous().view(ints[b.dtype])))


@pytest.fixture
def cuda_policy(monkeypatch):
    """mpcourse.core.autocast("cuda") applied to CPU tensors: the CUDA table, without a GPU."""
    monkeypatch.setattr(mode_mod, "_device_type", lambda t: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------ masking with the FP16 minimum
def test_fp16_minimum_plus_sixteen_overflows():
    """huggingface/transformers#17306: ``torch.finfo(torch.float16).min + (-16.0)`` is ``-inf``.

    65504 + 15 = 65519 is below the halfway point 65520 between 65504 and 2**16 and rounds back to
    65504; 65504 + 16 = 65520 is exactly halfway, ties go to even (the 2**16 side), which is inf.
    Oracle: numpy's float16 arithmetic, besides torch's."""
    big = torch.tensor(65504.0, dtype=f16)
    assert float(big + torch.tensor(15.0, dtype=f16)) == 65504.0
    assert float(big + torch.tensor(16.0, dtype=f16)) == math.inf
    assert float(-big - torch.tensor(16.0, dtype=f16)) == -math.inf
    with np.errstate(over="ignore"):
        assert float(np.float16(65504) + np.float16(15)) == 65504.0
        assert float(np.float16(65504) + np.float16(16)) == math.inf


def test_fully_masked_row_with_fp16_minimum_is_nan_in_fp16_finite_in_fp32():
    """huggingface/transformers#17306 (a padded query row: every key masked with finfo(fp16).min).

    Scores [-20, -30] and [-20, -20] plus a mask of -65504 in FP16 become all -inf (-65524 and -65534
    are past the overflow threshold -65520), so softmax of the row is 0/0 = NaN. Added in FP32 the
    row stays finite, and since softmax is shift-invariant it gives softmax of the scores themselves:
    [1/(1+e^-10), e^-10/(1+e^-10)] = [0.9999546, 4.54e-5] and [0.5, 0.5]."""
    scores = torch.tensor([[-20.0, -30.0], [-20.0, -20.0]], dtype=f16)      # (rows, keys) fp16
    mask = torch.full((2, 2), FP16_MIN, dtype=f16)                         # every key masked
    masked16 = scores + mask
    assert torch.isneginf(masked16).all()
    assert F.softmax(masked16, dim=-1).isnan().all()
    assert F.softmax(masked16.float(), dim=-1).isnan().all()                 # upcasting afterwards is too late

    probs = F.softmax(scores.float() + mask.float(), dim=-1)               # mask added in fp32
    e = math.exp(-10.0)                                                    # exact, in float64
    right = torch.tensor([[1 / (1 + e), e / (1 + e)], [0.5, 0.5]], dtype=torch.float64)
    assert torch.allclose(probs.double(), right, rtol=1e-6, atol=0)
    assert abs(float(probs[0, 0]) - 0.9999546) < 1e-7 and abs(float(probs[0, 1]) - 4.54e-5) < 1e-7


@pytest.mark.parametrize("ctx", ["torch.autocast", "mpcourse.core.autocast"])
def test_autocast_does_not_save_an_fp16_additive_mask(ctx):
    """huggingface/transformers#17306: under FP16 autocast the masked add is an element-wise op (on no
    list), so it runs in FP16 and overflows whichever autocast runs; the two agree bit for bit."""
    q = torch.tensor([[-4.0, 5.0], [-4.0, 5.0]])                         # fp32 inputs
    k = torch.tensor([[1.0, -3.2], [5.0, 0.0]])
    make = torch.autocast if ctx == "torch.autocast" else autocast
    with make("cpu", dtype=f16):
        scores = q @ k.t()                                               # (2, 2) fp16: [[-20, -20], ...]
        out = F.softmax(scores + torch.full((2, 2), FP16_MIN, dtype=f16), dim=-1)
    with torch.autocast("cpu", dtype=f16):
        ref = F.softmax(q @ k.t() + torch.full((2, 2), FP16_MIN, dtype=f16), dim=-1)
    assert scores.dtype == f16 and out.dtype == f16 and out.isnan().all()
    assert same_bits(out, ref)


def test_fp16_mask_is_nan_even_with_cudas_fp32_softmax(cuda_policy):
    """The CUDA list forces softmax to FP32 (pytorch/pytorch#76661), but the overflow happened before,
    in the FP16 add: the FP32 softmax of -inf is still NaN (huggingface/transformers#17306)."""
    scores = torch.tensor([[-20.0, -30.0]], dtype=f16)
    with autocast("cuda"):
        out = F.softmax(scores + torch.full((1, 2), FP16_MIN, dtype=f16), dim=-1)
    assert out.dtype == f32 and out.isnan().all()


class SoftmaxRows(TorchDispatchMode):
    """Records every softmax output computed below autograd/autocast."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._softmax.default, torch.ops.aten.softmax.int):
            self.outputs.append((args[0].detach().float(), out.detach().float()))
        return out


@pytest.mark.parametrize("how", ["fp16 weights", "torch.autocast fp16", "mpcourse.core.autocast fp16",
                                 "mpcourse.core.autocast bf16"])
def test_course_gpt_never_produces_a_nan_attention_row(how):
    """The course's GPT masks with ``masked_fill(-inf)`` and never masks the diagonal, so every row has
    a finite score, the row max is finite and the softmax is finite and sums to 1, in any dtype; no
    additive constant can overflow (the failure of huggingface/transformers#17306). Checked on every
    attention row of every layer, with the query and key weights scaled x300 so scores reach the thousands."""
    cfg = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32)
    mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)
    assert not mask.diagonal().any()                                     # what the model registers
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * cfg.n_embd] *= 300.0             # q, k: large attention scores
            assert torch.equal(block.attn.mask, mask)
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    ctx = {"fp16 weights": None, "torch.autocast fp16": torch.autocast("cpu", dtype=f16),
           "mpcourse.core.autocast fp16": autocast("cpu", dtype=f16), "mpcourse.core.autocast bf16": autocast("cpu")}[how]
    if ctx is None:
        model = model.half()
    with tensor_cores(enabled=True), SoftmaxRows() as rec, torch.no_grad():   # emulated fp16 matmuls: fast
        if ctx is None:
            logits, _ = model(idx)
        else:
            with ctx:
                logits, _ = model(idx)
    assert len(rec.outputs) == cfg.n_layer
    assert max(float(scores[scores.isfinite()].abs().max()) for scores, _ in rec.outputs) > 1000.0
    for scores, att in rec.outputs:                                      # (B, H, T, T) each
        assert scores.isfinite().any(-1).all()                           # no row is all -inf
        assert not att.isnan().any()
        assert torch.allclose(att.sum(-1), torch.ones(att.shape[:-1]), atol=1e-2)
    assert logits.isfinite().all()


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=str)
def test_softmax_dtype_follows_the_cpu_list_like_torch_autocast(dtype):
    """pytorch/pytorch#76661: eager autocast upcasts softmax on the GPU only. On CPU softmax is on no
    list: the output keeps the input's dtype, with torch.autocast and with mpcourse.core.autocast, bit for
    bit; a matmul's low-precision scores stay low precision through the softmax."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    w = torch.randn(5, 5, generator=torch.Generator().manual_seed(1))
    for low in (bf16, f16):
        with torch.autocast("cpu", dtype=low):
            ref, ref_mm = F.softmax(x, -1), F.softmax(x.float() @ w, -1)
        with autocast("cpu", dtype=low):
            got, got_mm = F.softmax(x, -1), F.softmax(x.float() @ w, -1)
        assert ref.dtype == dtype and same_bits(got, ref)
        assert ref_mm.dtype == low and same_bits(got_mm, ref_mm)


def test_softmax_dtype_follows_the_cuda_list(cuda_policy):
    """The CUDA list's softmax is ``fp32_set_opt_dtype`` (autocast_mode.h): FP32 output for FP16 or
    BF16 input unless a dtype is given (pytorch/pytorch#76661)."""
    h = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(f16)
    with autocast("cuda"):
        assert F.softmax(h, -1).dtype == f32
        assert F.softmax(h.to(bf16), -1).dtype == f32
        assert F.softmax(h, -1, dtype=f16).dtype == f16
    assert torch.allclose(F.softmax(h.float(), -1), F.softmax(h, -1, dtype=f32))


@needs_gpu
@pytest.mark.gpu
def test_softmax_and_mask_on_cuda_match_torch_autocast():
    """On a GPU: softmax's dtype and bits, and the NaN of an FP16 additive mask, equal torch.autocast's."""
    h = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to("cuda", f16)
    m = torch.full((3, 5), FP16_MIN, dtype=f16, device="cuda")
    outs = []
    for ctx in (torch.autocast("cuda"), autocast("cuda")):
        with ctx:
            outs.append((F.softmax(h, -1), F.softmax(h - 40 + m, -1)))
    (ref, ref_nan), (got, got_nan) = outs
    assert ref.dtype == f32 and same_bits(got, ref)
    assert ref_nan.isnan().all() and same_bits(got_nan, ref_nan)


# --------------------------------------------------------------------------------------- LayerNorm
X300 = [300.0, -300.0, 300.0, -300.0]


def _layer_norm_right(x, eps=1e-5):
    """LayerNorm in float64 from the definition: (x - mean) / sqrt(var + eps), biased variance."""
    mean = sum(x) / len(x)
    var = sum((v - mean) ** 2 for v in x) / len(x)
    return torch.tensor([(v - mean) / math.sqrt(var + eps) for v in x], dtype=torch.float64)


def test_layer_norm_of_fp16_300s_uses_fp32_statistics():
    """pytorch/pytorch#66707 (layer_norm must be done in fp32 for fp16 inputs) and
    microsoft/onnxruntime#17692 (fp16 LayerNorm breaks when the variance, there 246419, is past 65504).

    FP16 [300, -300, 300, -300] normalises to [1, -1, 1, -1] within 1e-3: PyTorch's kernel accumulates
    mean and variance in FP32. A naive FP16 variance overflows (300**2 = 90000 > 65504), and the
    "normalised" values collapse to 0."""
    x = torch.tensor(X300, dtype=f16)
    right = _layer_norm_right(X300)
    assert torch.allclose(right, torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64), atol=1e-6)
    out = F.layer_norm(x, (4,))
    assert out.dtype == f16 and torch.allclose(out.double(), right, atol=1e-3)
    assert 300.0 ** 2 > torch.finfo(f16).max
    naive_var = ((x - x.mean()) ** 2).mean()                             # fp16 all the way
    assert naive_var.dtype == f16 and float(naive_var) == math.inf
    naive = (x - x.mean()) / torch.sqrt(naive_var + 1e-5)
    assert torch.equal(naive.float(), torch.zeros(4))                     # the signal is gone


@pytest.mark.parametrize("low", [f16, bf16], ids=str)
def test_layer_norm_under_cpu_autocast_matches_torch(low):
    """On CPU layer_norm is on no list: it runs in its input's dtype (FP32 statistics inside the
    kernel), with torch.autocast and mpcourse.core.autocast alike, bit for bit, within 1e-3 of the right value."""
    x = torch.tensor(X300, dtype=f16).to(low)
    with torch.autocast("cpu", dtype=low):
        ref = F.layer_norm(x, (4,))
    with autocast("cpu", dtype=low):
        got = F.layer_norm(x, (4,))
    assert ref.dtype == low and same_bits(got, ref)
    assert torch.allclose(got.double(), _layer_norm_right(X300), atol=1e-3)


def test_layer_norm_under_the_cuda_list_runs_in_fp32(cuda_policy):
    """The CUDA list forces layer_norm to FP32 (the fix pytorch/pytorch#66707 asks for, under autocast)."""
    x = torch.tensor(X300, dtype=f16)
    with autocast("cuda"):
        out = F.layer_norm(x, (4,))
    assert out.dtype == f32 and torch.allclose(out.double(), _layer_norm_right(X300), atol=1e-5)


# ------------------------------------------------------------------------------- FP16 overflow: 70000
def test_70000_in_fp16_is_inf_and_the_overflow_detector_flags_it():
    """huggingface/transformers#5651: a T5 feed-forward output of 66246.39 exceeded FP16's 65504, became
    inf and then a NaN loss. 70000 stored in FP16 is inf (BF16 keeps it, as 70144); the detector of
    mpcourse.core.scaling flags it, agreeing with torch.isinf, and leaves 65504 alone."""
    x = torch.tensor([1.0, 70000.0, -3.0]).to(f16)
    assert float(x[1]) == math.inf and torch.isinf(x).any()
    assert float(torch.tensor(70000.0).to(bf16)) == 70144.0
    assert bool(has_inf_or_nan(x)) is True
    assert bool(has_inf_or_nan([torch.zeros(3), x])) is True
    edge = torch.tensor([65504.0, -65504.0]).to(f16)
    assert bool(has_inf_or_nan(edge)) is False and not torch.isinf(edge).any()


@pytest.mark.parametrize("ctx", ["torch.autocast", "mpcourse.core.autocast"])
def test_fp16_matmul_output_past_65504_is_flagged(ctx):
    """The same overflow produced by a matmul under FP16 autocast (FP32 accumulation, rounded once to
    FP16): 4 * 150 * 120 = 72000 -> inf, flagged; both autocasts give the same bits."""
    a, b = torch.full((2, 4), 150.0), torch.full((4, 3), 120.0)
    make = torch.autocast if ctx == "torch.autocast" else autocast
    with make("cpu", dtype=f16):
        y = a @ b
    assert y.dtype == f16 and torch.isinf(y).all() and bool(has_inf_or_nan(y))


# ---------------------------------------------------------------- min-max normalisation with 1e-8
def _minmax(x):
    return (x - x.min()) / (x.max() - x.min() + 1e-8)


def test_minmax_epsilon_vanishes_in_fp16():
    """lightonai/pylate#239 (the 1e-8 guard of a min-max normalisation is 0 in float16; equal scores
    give NaN under fp16) and pytorch/pytorch#32137 (F.normalize's 1e-12 is 0 in half).

    1e-8 is below half FP16's smallest subnormal 2**-24 ~ 5.96e-8, so it rounds to 0; BF16 (8 exponent
    bits) keeps it. (x - min) / (max - min + 1e-8) on [2, 2, 2, 2]: 0/0 = NaN in FP16, 0 in BF16 and FP32."""
    assert float(torch.tensor(1e-8).to(f16)) == 0.0 and 1e-8 < 2.0 ** -25
    assert float(torch.tensor(1e-8).to(bf16)) > 0.0
    x = torch.full((4,), 2.0)
    assert _minmax(x.to(f16)).isnan().all()
    for dtype in (bf16, f32):
        out = _minmax(x.to(dtype))
        assert out.dtype == dtype and torch.equal(out.float(), torch.zeros(4))


@pytest.mark.parametrize("low", [f16, bf16], ids=str)
def test_autocast_does_not_change_minmax(low):
    """lightonai/pylate#239: scores from a matmul under autocast are low precision, and sub/min/max/add/div
    are on no autocast list, so the normalisation runs in that dtype: NaN for FP16, [0, 0, 0, 0] for
    BF16, with torch.autocast and mpcourse.core.autocast alike; FP32 inputs stay FP32 ([0, 0, 0, 0])."""
    q, d = torch.ones(1, 2), torch.ones(4, 2)                             # every score is exactly 2
    outs = {}
    for name, make in (("torch", torch.autocast), ("mpcourse", autocast)):
        with make("cpu", dtype=low):
            scores = (q @ d.t()).flatten()                               # (4,) low precision
            outs[name] = (scores, _minmax(scores), _minmax(torch.full((4,), 2.0)))
    (s_ref, ref, ref32), (s_got, got, got32) = outs["torch"], outs["mpcourse"]
    assert s_ref.dtype == low and torch.equal(s_ref.float(), torch.full((4,), 2.0))
    assert same_bits(got, ref) and same_bits(got32, ref32)
    assert ref.dtype == low and (ref.isnan().all() if low == f16 else torch.equal(ref.float(), torch.zeros(4)))
    assert ref32.dtype == f32 and torch.equal(ref32, torch.zeros(4))


def test_minmax_under_the_cuda_list_is_still_nan(cuda_policy):
    """The CUDA list has no element-wise arithmetic either: FP16 scores normalise to NaN there too."""
    scores = torch.full((4,), 2.0, dtype=f16)
    with autocast("cuda"):
        out = _minmax(scores)
    assert out.dtype == f16 and out.isnan().all()
