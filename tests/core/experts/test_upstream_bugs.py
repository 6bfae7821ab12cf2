"""Bug classes reported upstream in MoE grouped GEMMs, each a test run on the course's ``grouped_mm`` (every format) and
on a small faithful copy of the upstream behaviour, which it must reject (``xfail(strict=True)``: the test can fail).

* pytorch/pytorch#154557 (#193633): ``torch._grouped_mm`` leaves rows past the last group uninitialised, in y and
  in autograd's dx; a later backward turns NaN (0 x NaN = NaN, so a zero routing weight does not protect).
* pytorch/pytorch#172439 (also meta-pytorch/MSLK#158): an expert without tokens gets a non-zero (garbage) weight
  gradient: its slice of an ``empty`` output is never written.
* flashinfer-ai/flashinfer#3103: a NaN scale of one expert leaks into another expert's rows of a shared tile.
* NVIDIA/TransformerEngine#2966: MXFP8 ``GroupedLinear`` fails when a split is not a multiple of 32.
* deepseek-ai/DeepGEMM#365: the weight gradient of an expert with exactly 128 tokens and an all-zero channel came out
  wrong; its reproducer has to special-case that channel's scale (amax 0 gives amax / 448 = 0, whose inverse is inf).
"""
import pytest
import torch

from mpcourse.core.experts import GROUPED_FORMATS, grouped_mm, pad_groups, token_groups, unpad_groups
from rule_quantize import quantize
from mpcourse.core.quant.rules.mx import quantize_mx

K, N = 128, 256
FORMATS = list(GROUPED_FORMATS)
QUANTIZED = [f for f, g in GROUPED_FORMATS.items() if g.quantized]


def course(x, w, g, fmt):
    return grouped_mm(x, w, g, fmt)


def run(impl, fmt, x, w, g, dy):
    """(y, dx, dw) of ``impl`` with gradients ``dy`` (the high-precision formats cast dy to the output dtype)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = impl(x, w, g, fmt)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


def data(counts, fmt="fp32", extra_rows=0, seed=0):
    """(x, w, g, dy): tokens grouped in ``fmt``'s padded layout with ``extra_rows`` of padding past the last group."""
    gen = torch.Generator().manual_seed(seed)
    align = GROUPED_FORMATS[fmt].alignment
    g = token_groups(torch.tensor(counts), align, token_groups(torch.tensor(counts), align).rows + extra_rows)
    x = pad_groups(torch.randn(sum(counts), K, generator=gen), g)
    w = torch.randn(len(counts), N, K, generator=gen) * 0.05
    dy = pad_groups(torch.randn(sum(counts), N, generator=gen), g)
    return x, w, g, dy


# ------------------------------------------------------------------------------ pytorch#154557: padding rows
class UninitialisedTail(torch.autograd.Function):
    """``torch._grouped_mm`` as pytorch#154557 reports it: rows past ``offs[-1]`` are never written, in y and in
    autograd's dx (NaN stands in for whatever the memory held); every row inside a group is read and written."""

    @staticmethod
    def forward(ctx, x, w, offs):
        end = int(offs[-1])
        y = torch.full((x.shape[0], w.shape[1]), float("nan"))
        y[:end] = torch._grouped_mm(x[:end], w.transpose(-2, -1), offs=offs)
        ctx.save_for_backward(x, w, offs)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        end = int(offs[-1])
        dx = torch.full_like(x, float("nan"))
        dx[:end] = torch._grouped_mm(dy[:end].contiguous(), w, offs=offs)
        dw = torch._grouped_mm(dy[:end].t(), x[:end], offs=offs)
        return dx, dw, None


def upstream_154557(x, w, g, fmt):
    return UninitialisedTail.apply(x, w, g.padded_offs)


@pytest.mark.parametrize("impl, fmt", [(course, f) for f in FORMATS] + [
    pytest.param(upstream_154557, "fp32", marks=pytest.mark.xfail(strict=True, reason="pytorch#154557"))])
def test_padding_rows_are_exactly_zero_in_every_output_and_gradient(impl, fmt):
    """A buffer with 24 rows past the last group and padding inside the groups. Rows without a token are exactly 0 in
    y and dx, even where dy holds NaN there (an upstream op's own uninitialised rows); then a combine that weights
    the padding with 0 stays finite, and so do the tokens' gradients."""
    x, w, g, dy = data([40, 0, 130, 7], fmt, extra_rows=24)
    dy[~g.real_rows] = float("nan")
    xx = unpad_groups(x, g).requires_grad_(True)                     # the tokens, before padding
    xp, ww = pad_groups(xx, g), w.clone().requires_grad_(True)
    y = impl(xp, ww, g, fmt)
    y.retain_grad()
    routing = g.real_rows.to(y.dtype)[:, None]                       # 1 on the tokens, 0 on the padding
    (y * routing * dy.nan_to_num(0.0).to(y.dtype)).sum().backward()
    assert not y.detach()[~g.real_rows].any()
    assert torch.isfinite(xx.grad).all() and torch.isfinite(ww.grad).all()
    _, dx, dw = run(impl, fmt, xp.detach(), w, g, dy)                 # dy's padding rows are NaN
    assert not dx[~g.real_rows].any() and torch.isfinite(dx).all() and torch.isfinite(dw).all()


# ------------------------------------------------------------------------------ pytorch#172439: empty experts
class UnwrittenEmptyGroups(torch.autograd.Function):
    """A grouped weight-gradient kernel whose output is ``empty`` and which skips experts with no token
    (pytorch#172439; MSLK#158's diagnosis: ``at::empty``, and the empty groups' slices never written)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dw = torch.full_like(w, float("nan"))                      # what the allocator left there
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                dw[e] = dy[start:end].t() @ x[start:end]
            start = end
        return torch._grouped_mm(dy, w, offs=offs), dw, None


def upstream_172439(x, w, g, fmt):
    return UnwrittenEmptyGroups.apply(x, w, g.padded_offs)


@pytest.mark.parametrize("impl, fmt", [(course, f) for f in FORMATS] + [
    pytest.param(upstream_172439, "fp32", marks=pytest.mark.xfail(strict=True, reason="pytorch#172439"))])
def test_an_expert_without_tokens_gets_an_exactly_zero_weight_gradient(impl, fmt):
    x, w, g, dy = data([0, 40, 0, 130, 0], fmt)
    _, _, dw = run(impl, fmt, x, w, g, dy)
    for e in (0, 2, 4):
        assert not dw[e].any(), f"expert {e} has no token but a weight gradient"
    assert dw[1].any() and dw[3].any()


# ------------------------------------------------------------------------------ flashinfer#3103: isolation
def shared_tile(x, w, g, fmt):
    """MXFP8 with the tokens quantized in ONE call over the unpadded grouped tensor, so a 32-row block of the
    weight gradient spans two experts' tokens (flashinfer#3103's shared tile: a NaN scale reaches both)."""
    return SharedTileMX.apply(x, w, g)


class FP32Forward(torch.autograd.Function):
    """The upstream copies' forward: the FP32 grouped GEMM; each subclass's backward is the upstream behaviour."""

    @staticmethod
    def forward(ctx, x, w, g):
        ctx.save_for_backward(x, w)
        ctx.g = g
        return grouped_mm(x, w, g, "fp32")


class SharedTileMX(FP32Forward):
    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g, bare = ctx.g, token_groups(ctx.g.counts, 1)
        mx = lambda t: quantize_mx(unpad_groups(t, g), (32, 1), "e4m3", "rceil").dequantize(torch.float32)
        dw = torch._grouped_mm(mx(dy).t(), mx(x), offs=bare.offs)
        return torch.zeros_like(x), dw, None


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("impl, fmt", [(course, f) for f in FORMATS] + [
    pytest.param(shared_tile, "mxfp8", marks=pytest.mark.xfail(strict=True, reason="flashinfer#3103"))])
def test_a_nan_or_inf_in_one_expert_reaches_only_its_own_rows(impl, fmt, bad):
    """One non-finite value in expert 0's last token: experts 2 and 3 get the same y, dx and dW bits as without it
    (40 + 0 + 130 + 22 = 192 tokens: the shared-tile copy's 32-row blocks need a multiple of 32)."""
    x, w, g, dy = data([40, 0, 130, 22], fmt)
    clean = run(impl, fmt, x, w, g, dy)
    x[39, 5] = float(bad)
    dirty = run(impl, fmt, x, w, g, dy)
    rows = torch.zeros(g.rows, dtype=torch.bool)
    for s, n in g.spans()[2:]:
        rows[s:s + n] = True
    for a, b in zip(clean[:2], dirty[:2]):
        assert torch.equal(a[rows], b[rows])
    assert torch.equal(clean[2][2:], dirty[2][2:])


# ------------------------------------------------------------------------------ TransformerEngine#2966
def te_grouped_linear_mxfp8(x, w, g, fmt):
    """MXFP8 ``GroupedLinear`` as TransformerEngine#2966 reports it: a split that is not a multiple of 32 fails."""
    bad = [n for n in g.counts.tolist() if n % 32]
    if bad:
        raise RuntimeError(f"MXFP8 GroupedLinear: split sizes {bad} are not multiples of 32")
    return grouped_mm(x, w, g, fmt)


@pytest.mark.parametrize("impl, fmt", [(course, f) for f in FORMATS] + [
    pytest.param(te_grouped_linear_mxfp8, "mxfp8",
                 marks=pytest.mark.xfail(strict=True, raises=RuntimeError, reason="TransformerEngine#2966"))])
def test_group_sizes_off_the_alignment_are_padded_never_refused(impl, fmt):
    """Groups of 5, 37, 0 and 70 tokens with no padding at all (alignment 1) train, and give the same bits on
    their tokens as the format's padded layout."""
    counts = [5, 37, 0, 70]
    x, w, g, dy = data(counts, fmt)
    bare = token_groups(torch.tensor(counts), 1)
    xb, dyb = unpad_groups(x, g), unpad_groups(dy, g)
    yb, dxb, dwb = run(impl, fmt, xb, w, bare, dyb)
    y, dx, dw = run(course, fmt, x, w, g, dy)
    assert torch.equal(yb, unpad_groups(y, g)) and torch.equal(dxb, unpad_groups(dx, g)) and torch.equal(dwb, dw)


# ------------------------------------------------------------------------------ DeepGEMM#365
def unguarded_channel_scales(x, w, g, fmt):
    """The weight gradient's per-channel cast over 128 tokens without the guard DeepGEMM#365's reproducer needs:
    sf = amax / 448 (0 for an all-zero channel), data = x * (1 / sf) = 0 x inf = NaN."""
    return UnguardedWgrad.apply(x, w, g)


class UnguardedWgrad(FP32Forward):
    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors

        def cast(t):                                    # (M, C) in 128-token tiles per channel, dequantized
            v = t.reshape(-1, 128, t.shape[1])
            sf = v.abs().amax(dim=1, keepdim=True) / 448.0
            return ((v * (1.0 / sf)).to(torch.float8_e4m3fn).float() * sf).reshape(t.shape)
        return torch.zeros_like(x), torch._grouped_mm(cast(dy).t(), cast(x), offs=ctx.g.padded_offs), None


@pytest.mark.parametrize("impl, fmt", [(course, f) for f in QUANTIZED] + [
    pytest.param(unguarded_channel_scales, "fp8-block", marks=pytest.mark.xfail(strict=True, reason="DeepGEMM#365"))])
def test_an_all_zero_channel_of_an_expert_with_128_tokens_gets_a_correct_weight_gradient(impl, fmt):
    """Expert 1 holds exactly 128 tokens (one whole 1x128 tile along M) and channel 3 of its activations is 0: its
    dW is finite, exactly 0 in column 3, the same bits in two runs, and equals dequantize-then-GEMM elsewhere."""
    x, w, g, dy = data([128, 128, 256], fmt)
    s, n = g.spans()[1]
    x[s:s + n, 3] = 0.0
    _, _, dw = run(impl, fmt, x, w, g, dy)
    _, _, again = run(impl, fmt, x, w, g, dy)
    f = GROUPED_FORMATS[fmt]
    want = quantize(dy[s:s + n], f, "grad_output", 0).dequantize(torch.float32).t() @ \
        quantize(x[s:s + n], f, "input", 0).dequantize(torch.float32)
    assert torch.isfinite(dw[1]).all() and not dw[1][:, 3].any() and torch.equal(dw, again)
    assert torch.equal(dw[1], want)
