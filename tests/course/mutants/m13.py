"""Lesson 13's mutants: learner-plausible wrong versions of the exercise's functions.

``pad_token_groups``: the round-up off by one (a whole extra block for an aligned or empty group), rounded down,
padding rows of ones or NaN (memory left as it was), tokens at the end of their slot, int64 or unpadded ends,
group starts for ends, the tokens upcast to FP32, the gradient cut (detach), a loop over experts that forgets the
last group, a loop over tokens. ``unpad_token_groups``: the first rows, padding read, the rows at the unpadded
positions, an off-by-one round-up, FP32 results, rows told apart by their values, the last group forgotten.
``group_scales``: one scale for the whole tensor (spanning experts), the amax over the wrong axis, the signed max,
no power of two, rounded up or to nearest, floor(log2) in FP32, no guard for an empty group, for a zero, inf or NaN
amax, no cap where 448 / amax overflows, E5M2's max, the inverse scale, the wrong dtype, rows past the last group
counted, the last group forgotten, group boundaries off by one.
"""

# -- pad_token_groups ---------------------------------------------------------------------------------------

_PAD_SIZES = "    sizes = (counts + alignment - 1) // alignment * alignment\n"
_PAD = '''def pad_token_groups(x, counts, alignment):
    counts = counts.long()
{sizes}    padded_offs = torch.cumsum(sizes, 0)
    shift = (padded_offs - sizes) - (torch.cumsum(counts, 0) - counts)
    rows = torch.arange(x.shape[0]) + torch.repeat_interleave(shift, counts)
    total = int(padded_offs[-1]) if counts.numel() else 0
    out = {alloc}
    return {ret}
'''


def _pad(sizes=_PAD_SIZES, alloc="x.new_zeros(total, *x.shape[1:])", ret="out.index_copy(0, rows, x), padded_offs.int()"):
    return _PAD.format(sizes=sizes, alloc=alloc, ret=ret)


_PAD_LOOP_EXPERTS = '''def pad_token_groups(x, counts, alignment):
    sizes = (counts + alignment - 1) // alignment * alignment
    ends = torch.cumsum(sizes, 0)
    out = x.new_zeros(int(ends[-1]) if len(counts) else 0, *x.shape[1:])
    src = 0
    for e in range(len(counts) - 1):
        n = int(counts[e])
        start = int(ends[e] - sizes[e])
        out[start:start + n] = x[src:src + n]
        src += n
    return out, ends.int()
'''

_PAD_LOOP_TOKENS = '''def pad_token_groups(x, counts, alignment):
    sizes = (counts + alignment - 1) // alignment * alignment
    ends = torch.cumsum(sizes, 0)
    out = x.new_zeros(int(ends[-1]) if len(counts) else 0, *x.shape[1:])
    i = 0
    for e in range(len(counts)):
        start = int(ends[e] - sizes[e])
        for j in range(int(counts[e])):
            out[start + j] = x[i]
            i += 1
    return out, ends.int()
'''

_PAD_MUTANTS = [
    ("round-up off by one: (c + a) // a * a", _pad(sizes="    sizes = (counts + alignment) // alignment * alignment\n")),
    ("rounded down: c // a * a", _pad(sizes="    sizes = counts // alignment * alignment\n")),
    ("an empty group padded to one block", _pad(sizes="    sizes = torch.clamp((counts + alignment - 1) // alignment, "
                                                      "min=1) * alignment\n")),
    ("padding rows of ones", _pad(alloc="x.new_ones(total, *x.shape[1:])")),
    ("padding rows left as memory held them (NaN)", _pad(alloc="x.new_full((total, *x.shape[1:]), float('nan'))")),
    ("tokens at the end of their slot", _pad().replace(
        "shift = (padded_offs - sizes) - (torch.cumsum(counts, 0) - counts)",
        "shift = padded_offs - torch.cumsum(counts, 0)")),
    ("int64 group ends", _pad(ret="out.index_copy(0, rows, x), padded_offs")),
    ("the unpadded ends", _pad(ret="out.index_copy(0, rows, x), torch.cumsum(counts, 0).int()")),
    ("group starts for ends", _pad(ret="out.index_copy(0, rows, x), (padded_offs - sizes).int()")),
    ("tokens upcast to FP32", _pad(alloc="x.new_zeros(total, *x.shape[1:], dtype=torch.float32)",
                                   ret="out.index_copy(0, rows, x.float()), padded_offs.int()")),
    ("gradient cut (detach)", _pad(ret="out.index_copy(0, rows, x.detach()), padded_offs.int()")),
    ("loop over experts forgets the last group", _PAD_LOOP_EXPERTS),
    ("loop over tokens", _PAD_LOOP_TOKENS),
]

# -- unpad_token_groups -------------------------------------------------------------------------------------

_UNPAD = '''def unpad_token_groups(y, counts, alignment):
    counts = counts.long()
{sizes}    shift = (torch.cumsum(sizes, 0) - sizes) - (torch.cumsum(counts, 0) - counts)
    rows = torch.arange(int(counts.sum())) + torch.repeat_interleave(shift, counts)
    return {ret}
'''


def _unpad(sizes=_PAD_SIZES, ret="y.index_select(0, rows)"):
    return _UNPAD.format(sizes=sizes, ret=ret)


_UNPAD_MUTANTS = [
    ("the first sum(counts) rows", _unpad(ret="y[:int(counts.sum())]")),
    ("the rows at their unpadded positions", _unpad(ret="y.index_select(0, torch.arange(int(counts.sum())))")),
    ("round-up off by one", _unpad(sizes="    sizes = (counts + alignment) // alignment * alignment\n")),
    ("FP32 results", _unpad(ret="y.index_select(0, rows).float()")),
    ("rows told apart by their values (zero and NaN rows dropped)",
     _unpad(ret="y[(y.float().nan_to_num(0.0) != 0).any(dim=1)]")),
    ("the padded tensor unchanged", _unpad(ret="y")),
    ("the last group forgotten", '''def unpad_token_groups(y, counts, alignment):
    sizes = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(sizes, 0) - sizes
    parts = [y[int(starts[e]):int(starts[e]) + int(counts[e])] for e in range(len(counts) - 1)]
    return torch.cat(parts) if parts else y[:0]
'''),
]

# -- group_scales -------------------------------------------------------------------------------------------

_AMAX = '''    ends = offs.long().tolist()
    amax = torch.zeros(len(ends), t.shape[1])
    for e, (start, end) in enumerate(zip([0] + ends, ends)):
        if end > start:
            amax[e] = t[start:end].float().abs().amax(0)
'''
_SCALE = '''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where((amax > 0) & amax.isfinite(), scale, torch.ones_like(scale))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
'''
_POW2 = '''    _, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)
'''


def _gs(amax=_AMAX, scale=_SCALE, pow2=_POW2):
    return "def group_scales(t, offs):\n" + amax + scale + pow2


def _sub(block: str, old: str, new: str) -> str:
    assert old in block, old
    return block.replace(old, new)


_GS_MUTANTS = [
    ("one scale for the whole tensor (spans experts)", _gs(amax=_sub(
        _AMAX, "amax[e] = t[start:end].float().abs().amax(0)", "amax[e] = t[:ends[-1]].float().abs().amax(0)"))),
    ("one scale per column over every row", _gs(amax=_sub(
        _AMAX, "amax[e] = t[start:end].float().abs().amax(0)", "amax[e] = t.float().abs().amax(0)"))),
    ("amax over the wrong axis (per token, then per group)", _gs(amax=_sub(
        _AMAX, "amax[e] = t[start:end].float().abs().amax(0)",
        "amax[e] = t[start:end].float().abs().amax(1).max()"))),
    ("signed max instead of max |t|", _gs(amax=_sub(_AMAX, ".float().abs().amax(0)", ".float().amax(0)"))),
    ("rows past the last group counted", _gs(amax=_sub(
        _AMAX, "for e, (start, end) in enumerate(zip([0] + ends, ends)):",
        "for e, (start, end) in enumerate(zip([0] + ends, ends[:-1] + [t.shape[0]])):"))),
    ("group boundaries off by one (start at offs[e-1] + 1)", _gs(amax=_sub(
        _AMAX, "zip([0] + ends, ends)", "zip([0] + [x + 1 for x in ends], ends)"))),
    ("the last group forgotten", _gs(amax=_sub(
        _AMAX, "enumerate(zip([0] + ends, ends))", "enumerate(zip([0] + ends[:-2], ends[:-1]))"))),
    ("no guard for an empty group", _gs(amax=_sub(
        _AMAX, "        if end > start:\n            amax[e]", "        if True:\n            amax[e]"))),
    ("not a power of two", _gs(pow2="    return scale\n")),
    ("rounded up: 2**ceil(log2)", _gs(pow2="    return torch.exp2(torch.ceil(torch.log2(scale)))\n")),
    ("rounded to nearest: 2**round(log2)", _gs(pow2="    return torch.exp2(torch.round(torch.log2(scale)))\n")),
    ("floor(log2) in FP32", _gs(pow2="    return torch.exp2(torch.floor(torch.log2(scale)))\n")),
    ("a zero amax divides by zero (inf capped: 2**127)", _gs(scale=_sub(
        _SCALE, "(amax > 0) & amax.isfinite()", "amax.isfinite()"))),
    ("an inf amax gives scale 0 -> 1 / 0", _gs(scale=_sub(
        _SCALE, "(amax > 0) & amax.isfinite()", "(amax > 0) & ~amax.isnan()"))),
    ("a NaN amax gives a NaN scale", _gs(scale=_sub(
        _SCALE, "(amax > 0) & amax.isfinite()", "(amax > 0) | amax.isnan()"))),
    ("no cap where 448 / amax overflows", _gs(scale=_sub(
        _SCALE, "    scale = scale.clamp(max=torch.finfo(torch.float32).max)\n", ""))),
    ("E5M2's max 57344", _gs(scale=_sub(_SCALE, "E4M3_MAX", "57344.0"))),
    ("the inverse scale amax / 448", _gs(scale=_sub(
        _SCALE, "torch.full_like(amax, E4M3_MAX) / amax", "amax / E4M3_MAX"))),
    ("float64 scales", _gs(pow2=_POW2.replace("exponent - 1)", "exponent - 1).double()"))),
    ("amax in the input's dtype (BF16 scales)", _gs(amax=_sub(
        _AMAX, "amax = torch.zeros(len(ends), t.shape[1])", "amax = torch.zeros(len(ends), t.shape[1], dtype=t.dtype)")
        .replace(".float().abs()", ".abs()"))),
]

MUTANTS = {"pad_token_groups": _PAD_MUTANTS, "unpad_token_groups": _UNPAD_MUTANTS, "group_scales": _GS_MUTANTS}
