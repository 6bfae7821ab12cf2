"""Graders for lesson 13 (experts in low precision): the padding of token groups and the per-group weight-gradient
scales of rowwise FP8.

The reference is the library's rule, bit for bit: ``mpcourse.core.experts.pad_token_groups`` /
``unpad_token_groups`` (``pad_groups`` / ``unpad_groups`` over ``token_groups(counts, alignment)``: torchtitan's and
torchao's padding, Transformer Engine's ``Fp8Padding``) and ``group_colwise_scales`` (torchao's rowwise weight
gradient: per group and column, power-of-two E4M3 scales; ``tests/core/experts`` holds it to the dense rule
``blockwise.quantize_fp32_scaled`` run on each group alone). Cases: the lesson's example, empty groups (first,
middle, last, all), groups already a multiple of the alignment, alignment 1 and 128, every float dtype, NaN/inf and
-0.0 tokens copied as they are, all-zero tokens, a gradient through the padding; for the scales, near-power-of-two
amaxes (``floor(log2)`` computed in FP32 rounds up there), amaxes whose ``448 / amax`` overflows FP32, an all-zero
and an empty group, inf and NaN in one group only, rows past the last group, BF16 input.
"""
from __future__ import annotations


import torch
from torch.overrides import TorchFunctionMode

from ...core.experts import group_colwise_scales, pad_token_groups, unpad_token_groups
from . import GradingError, call, verdict
from .blocks import near_pow2_amaxes

#: (what, counts, alignment, dtype, K) of the padding cases
PAD_CASES = (
    ("the lesson's example", (3, 0, 5, 2), 4, torch.float32, 3),
    ("empty first and last groups", (0, 7, 0), 16, torch.bfloat16, 5),
    ("groups already multiples of 16", (16, 32, 0, 48), 16, torch.float32, 4),
    ("alignment 1 (no padding)", (5, 0, 9), 1, torch.float16, 6),
    ("alignment 128 (1x128 tiles)", (1, 129, 0, 128), 128, torch.bfloat16, 2),
    ("MXFP8's 32, float64 tokens", (31, 33, 2), 32, torch.float64, 3),
    ("one expert", (10,), 8, torch.float32, 2),
    ("every group empty", (0, 0, 0), 16, torch.float32, 4),
)


def _tokens(counts, dtype, k, seed) -> torch.Tensor:
    """(sum(counts), k) tokens: random values, a NaN, an inf, a -0.0 and an all-zero row where there is room."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g) * 3
    if x.shape[0] >= 4:
        x[0, 0], x[1, -1], x[2, 0] = float("nan"), float("-inf"), -0.0
        x[3] = 0.0
    return x.to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (-0.0 is not 0.0, NaN equals NaN); both of one dtype."""
    a, b = a.detach(), b.detach()
    if a.dtype == torch.float64:
        return bool(((a.view(torch.int64) == b.view(torch.int64)) | (a.isnan() & b.isnan())).all())
    return bool(((a.float().view(torch.int32) == b.float().view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _first_bad_row(got: torch.Tensor, want: torch.Tensor) -> int:
    same = (got.float().view(torch.int32) == want.float().view(torch.int32)) | (got.float().isnan() & want.float().isnan())
    return int((~same.all(dim=1)).nonzero()[0])


def _padded_pair(out, name: str):
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
        raise GradingError(f"FAIL {name}: return a tuple (padded, padded_offs) of two tensors, got {type(out).__name__}")
    return out


def _check_pad_case(fn, what, counts, alignment, dtype, k, seed) -> None:
    x, c = _tokens(counts, dtype, k, seed), torch.tensor(counts)
    padded, offs = _padded_pair(call("pad_token_groups", fn, x.clone(), c.clone(), alignment), "pad_token_groups")
    want, want_offs = pad_token_groups(x, c, alignment)
    where = f"pad_token_groups on {what} (counts {list(counts)}, alignment {alignment}, {dtype})"
    if offs.dtype != torch.int32:
        raise GradingError(f"FAIL {where}: padded_offs must be int32 (torch._grouped_mm's offs), got {offs.dtype}")
    if not torch.equal(offs, want_offs):
        raise GradingError(f"FAIL {where}: padded_offs {offs.tolist()}, expected {want_offs.tolist()}: round each "
                           "count UP to a multiple of the alignment (0 stays 0), then take the running sum (the ends)")
    if padded.dtype != x.dtype:
        raise GradingError(f"FAIL {where}: the padded tokens must keep x's dtype {x.dtype}, got {padded.dtype}")
    if tuple(padded.shape) != tuple(want.shape):
        raise GradingError(f"FAIL {where}: padded shape {tuple(padded.shape)}, expected {tuple(want.shape)} "
                           "(padded_offs[-1] rows)")
    if not _bits_equal(padded, want):
        r = _first_bad_row(padded, want)
        kind = "a token's row" if r in _real_rows(c, alignment) else "a padding row"
        raise GradingError(f"FAIL {where}: row {r} ({kind}) is {padded[r].float().tolist()}, expected "
                           f"{want[r].float().tolist()}: each group starts at its padded start, tokens copied as they "
                           "are (NaN, inf, -0.0 too), every padding row exactly zero")


def _real_rows(counts: torch.Tensor, alignment: int) -> set[int]:
    padded = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(padded, 0) - padded
    return {int(s) + i for s, n in zip(starts, counts) for i in range(int(n))}


def check_pad_token_groups(fn) -> None:
    """Grade ``fn(x (num_tokens, K), counts (E,) int64, alignment int) -> (padded (rows, K) x's dtype, padded_offs (E,)
    int32)`` bit for bit against the library's ``pad_token_groups``; its gradient; no loop over tokens."""
    for seed, case in enumerate(PAD_CASES):
        _check_pad_case(fn, *case, seed)
    x = torch.randn(10, 3, requires_grad=True)
    padded, _ = _padded_pair(call("pad_token_groups", fn, x, torch.tensor([3, 0, 7]), 4), "pad_token_groups")
    weights = torch.arange(float(padded.numel())).reshape(padded.shape)
    if not padded.requires_grad:
        raise GradingError("FAIL pad_token_groups: the padded tokens carry no gradient back to x (training needs it): "
                           "build them with autograd-visible ops (new_zeros + index_copy / indexing), no .detach()")
    (grad,) = torch.autograd.grad((padded * weights).sum(), x)
    want = weights[sorted(_real_rows(torch.tensor([3, 0, 7]), 4))]                 # (10, 3): the token rows
    if not torch.equal(grad, want):
        raise GradingError("FAIL pad_token_groups: the gradient reaching x is not the padded gradient's token rows")
    _check_no_token_loop(fn)
    verdict("pad_token_groups", f"{len(PAD_CASES)} cases (empty groups, exact multiples, alignment 1 to 128, 4 "
            "dtypes, NaN/inf/-0.0 tokens) agree bit for bit with the library; the gradient flows to x")


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside it (``__torch_function__``)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


#: torch calls a padding of ``_LOOP_CASE`` may make: a vectorized one makes tens, a loop over the groups tens per
#: group, a loop over tokens at least one per token (20,000)
MAX_TORCH_CALLS = 2_000


def _check_no_token_loop(fn) -> None:
    """20,000 tokens in 4 groups, the torch calls counted (whatever the machine's speed): a loop over tokens makes
    one or more per token, a vectorized padding a few dozen."""
    x, counts = torch.zeros(20_000, 1), torch.tensor([5_000, 7_001, 0, 7_999])
    with _TorchCalls() as calls:
        call("pad_token_groups", fn, x, counts, 16)
    if calls.calls > MAX_TORCH_CALLS:
        raise GradingError(f"FAIL pad_token_groups: 20,000 tokens took {calls.calls:,} torch calls (a loop over "
                           "tokens): move the tokens with one index_copy (or indexing) over a row map built with "
                           "repeat_interleave")


def check_unpad_token_groups(fn) -> None:
    """Grade ``fn(y (rows, N), counts (E,), alignment) -> (num_tokens, N)`` in y's dtype, bit for bit against the
    library's ``unpad_token_groups``; the padding rows hold NaN here, so reading one shows."""
    for seed, (what, counts, alignment, dtype, k) in enumerate(PAD_CASES):
        c = torch.tensor(counts)
        y, _ = pad_token_groups(_tokens(counts, dtype, k, seed + 50), c, alignment)
        real = torch.zeros(y.shape[0], dtype=torch.bool)
        real[sorted(_real_rows(c, alignment))] = True
        y = torch.where(real[:, None], y, torch.full_like(y, float("nan")))         # padding rows: NaN
        got = call("unpad_token_groups", fn, y.clone(), c.clone(), alignment)
        want = unpad_token_groups(y, c, alignment)
        where = f"unpad_token_groups on {what} (counts {list(counts)}, alignment {alignment}, {dtype})"
        if not isinstance(got, torch.Tensor):
            raise GradingError(f"FAIL {where}: return a tensor, got {type(got).__name__}")
        if got.dtype != y.dtype:
            raise GradingError(f"FAIL {where}: keep y's dtype {y.dtype}, got {got.dtype}")
        if tuple(got.shape) != tuple(want.shape):
            raise GradingError(f"FAIL {where}: shape {tuple(got.shape)}, expected {tuple(want.shape)} (one row per "
                               "token: sum(counts) rows)")
        if not _bits_equal(got, want):
            r = _first_bad_row(got, want)
            raise GradingError(f"FAIL {where}: token row {r} is {got[r].float().tolist()}, expected "
                               f"{want[r].float().tolist()}: read each group's first counts[e] rows from its padded "
                               "start (padding rows here hold NaN; a real row may be all zero)")
    verdict("unpad_token_groups", f"{len(PAD_CASES)} cases agree bit for bit with the library (padding never read)")


def _scale_cases() -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(40, 8, generator=g) * torch.logspace(-6, 6, 8)
    wide[:, 3] = -wide[:, 3].abs()                                   # a column of negative values only
    near = torch.tensor(near_pow2_amaxes())                          # 13 amaxes, 448 / amax one ulp below 2^n
    edges = torch.rand(60, 13, generator=g) * 1e-3
    edges[:13] = torch.diag(near) + torch.rand(13, 13, generator=g) * 1e-6   # group 0: the near-pow2 amaxes
    edges[13:20] = (torch.rand(7, 13, generator=g) - 0.5) * 2e-40            # group 1: 448 / amax overflows FP32
    edges[20:30] = 0.0                                                        # group 2: all zero
    edges[30, 2], edges[35, 5], edges[40, 7] = float("nan"), float("inf"), -float("inf")   # group 3 (30..45)
    edges[45:50] = 1e4                                                        # group 5, after an empty group 4
    edges[50:] = 1e5                                                          # past the last group: ignored
    return [("values over 12 binades, counts (3, 0, 17, 20)", wide, (3, 0, 17, 20)),
            ("constructed edges", edges, (13, 7, 10, 15, 0, 5)),
            ("BF16 tokens", wide.to(torch.bfloat16), (40,)),
            ("only empty groups", wide[:0], (0, 0))]


def check_group_scales(fn) -> None:
    """Grade ``fn(t (M, C), offs (E,) int32) -> (E, C) float32`` bit for bit against the library's
    ``group_colwise_scales`` (rowwise FP8's weight-gradient scales, per expert group and column)."""
    n = 0
    for what, t, counts in _scale_cases():
        offs = torch.cumsum(torch.tensor(counts), 0).int()
        got = call("group_scales", fn, t.clone(), offs.clone())
        want = group_colwise_scales(t, offs)
        where = f"group_scales on {what}"
        if not isinstance(got, torch.Tensor):
            raise GradingError(f"FAIL {where}: return a tensor, got {type(got).__name__}")
        if got.dtype != torch.float32 or tuple(got.shape) != tuple(want.shape):
            raise GradingError(f"FAIL {where}: return float32 of shape (E, C) = {tuple(want.shape)}, got "
                               f"{got.dtype} {tuple(got.shape)}")
        same = (got == want) | (got.isnan() & want.isnan())
        if not bool(same.all()):
            e, c = (~same).nonzero()[0].tolist()
            rows = t[(offs[e - 1] if e else 0):offs[e], c].float()
            amax = float(rows.abs().max()) if rows.numel() else 0.0
            raise GradingError(f"FAIL {where}: group {e} (rows {int(offs[e - 1]) if e else 0}..{int(offs[e])}), "
                               f"column {c}: scale {float(got[e, c])!r}, expected {float(want[e, c])!r}; "
                               + _scale_hint(rows, amax, float(got[e, c]), float(want[e, c])))
        n += want.numel()
    verdict("group_scales", f"{n} scales (near-power-of-two, overflowing, zero, empty, inf and NaN groups) agree "
            "bit for bit with the library")


def _scale_hint(rows: torch.Tensor, amax: float, got: float, want: float) -> str:
    if rows.numel() == 0:
        return "an empty group has amax 0: its scale is 1 (no NaN, no inf, no error; its gradient is zero anyway)"
    if amax != amax or amax in (0.0, float("inf")):
        return f"this group's column has amax {amax}: its scale is 1, and no other group's scale changes"
    if 448.0 / amax == float("inf") or torch.tensor(448.0) / torch.tensor(amax) == float("inf"):
        return "448 / amax overflows FP32 here: cap it at FP32's max before rounding down (2^127)"
    if got == 2 * want:
        return ("448 / amax is one FP32 ulp below a power of two, and floor(log2) in FP32 rounds up there: round down "
                "exactly (keep the FP32 exponent bits, or torch.frexp)")
    if got * want > 0 and abs(torch.tensor(got).log2().item()) % 1:
        return "the scale must be a power of two: 448 / amax rounded DOWN"
    return ("amax = max |t| over the group's rows of this column only (offs are the group ENDS), scale = 448 / amax "
            "in FP32 rounded down to a power of two")
