"""Lesson 09's mutants: learner-plausible wrong versions of the exercise's functions.

``block_quantize``: no power of two, the power of two from ``log2`` in FP32 (wrong one ulp below a power of two),
rounded to nearest or up, no cap where 448 / amax overflows, an inf / NaN / zero amax not taken as scale 1,
torchao's amax clamp at 1e-12, results of the wrong dtype, the scale for its inverse.
``columnwise_quantize``: the rowwise copy transposed, re-quantized from the dequantized rowwise copy, not transposed,
scales untransposed, the wrong tile. ``mx_shared_exponent``: floor(log2) in FP32 or FP64, frexp, the RCEIL rule,
no clamp, inf clamped, int32 or float results, emax off by one. ``mx_quantize``: the OCP divisor 2^-127 (the
library's default, not the rule graded), NaN blocks, the wrong rule, blocks along columns, dtypes,
double rounding through BF16. ``nvfp4_scales``: another FP32 order (amax_b / (6 t), (amax_b / t) / 6,
amax_b * (1 / t) / 6, amax / 448 / 6), FP64, a Python float, no floor on t or the former 2^-121 one, no 2^-6
clamp, no flush of the blocks a tiny tensor's scales cannot reach (or a flush in every tensor), BF16/FP16 detours,
the wrong dtype.

(No mutant omits the clamp to +-448 before the E4M3 cast: torch 2.13's CPU cast saturates by itself, so that
version is not wrong here.)
"""

_BQ_HEAD = '''def block_quantize(x, block):
    M, K = x.shape
    r, c = block
    v = x.reshape(M // r, r, K // c, c)
    amax = v.abs().amax(dim=(1, 3))
'''
_BQ_SCALE = '''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
'''
_BQ_POW2 = '''    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
'''
_BQ_TAIL = '''    data = (v * scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M, K)
    return data, scale.reciprocal()
'''


def _bq(scale=_BQ_SCALE, pow2=_BQ_POW2, tail=_BQ_TAIL):
    return _BQ_HEAD + scale + pow2 + tail


_BLOCK = [
    ("exact 448 / amax, no power of two", _bq(pow2="")),
    ("power of two from log2 in FP32", _bq(pow2="    scale = torch.exp2(torch.floor(torch.log2(scale)))\n")),
    ("power of two rounded to nearest", _bq(pow2="    scale = torch.exp2(torch.round(torch.log2(scale.double()))).float()\n")),
    ("power of two rounded up", _bq(pow2="    scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()\n")),
    ("no cap where 448 / amax overflows", _bq(scale='''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
''')),
    ("inf amax kept (scale 0), as amax > 0 only", _bq(scale='''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
''')),
    ("only amax == 0 takes 1 (NaN and inf pass through)", _bq(scale='''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
''')),
    ("torchao's amax clamp at 1e-12", _bq(scale='''    a = amax.clamp(min=1e-12)
    scale = torch.full_like(amax, E4M3_MAX) / a
    scale = torch.where(torch.isfinite(amax), scale, torch.ones_like(scale))
''')),
    ("zero block takes the FP32 max scale", _bq(scale='''    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = scale.nan_to_num(nan=1.0, posinf=torch.finfo(torch.float32).max)
    scale = torch.where(torch.isinf(amax), torch.ones_like(scale), scale)
''')),
    ("scale returned instead of scale_inv", _bq(tail='''    data = (v * scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M, K)
    return data, scale
''')),
    ("scale_inv in float64", _bq(tail='''    data = (v * scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M, K)
    return data, scale.double().reciprocal()
''')),
    ("data returned as float32 (not cast)", _bq(tail='''    data = (v * scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M, K)
    return data.float(), scale.reciprocal()
''')),
    ("divides by 448 / amax rounded, multiplies scale_inv", _bq(tail='''    inv = scale.reciprocal()
    data = (v / inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(M, K)
    return data, amax / E4M3_MAX
''')),
    ("block rows and columns swapped", '''def block_quantize(x, block):
    M, K = x.shape
    c, r = block
    v = x.reshape(M // r, r, K // c, c)
    amax = v.abs().amax(dim=(1, 3))
''' + _BQ_SCALE + _BQ_POW2 + _BQ_TAIL),
]

_COLUMNWISE = [
    ("the rowwise copy, transposed", '''def columnwise_quantize(x):
    d, s = block_quantize(x, (1, 128))
    return d.t().contiguous(), s.t().contiguous()
'''),
    ("re-quantized from the dequantized rowwise copy", '''def columnwise_quantize(x):
    M, K = x.shape
    d, s = block_quantize(x, (1, 128))
    dq = (d.float().reshape(M, K // 128, 128) * s[:, :, None]).reshape(M, K)
    return block_quantize(dq.t().contiguous(), (1, 128))
'''),
    ("128x1 blocks of x, not transposed", '''def columnwise_quantize(x):
    return block_quantize(x, (128, 1))
'''),
    ("data transposed, scales not", '''def columnwise_quantize(x):
    d, s = block_quantize(x, (128, 1))
    return d.t().contiguous(), s
'''),
    ("128x1 blocks of x^T", '''def columnwise_quantize(x):
    return block_quantize(x.t().contiguous(), (128, 1))
'''),
    ("128x128 blocks of x^T", '''def columnwise_quantize(x):
    d, s = block_quantize(x.t().contiguous(), (128, 128))
    return d, s.repeat_interleave(128, 0)
'''),
    ("tiles of 64", '''def columnwise_quantize(x):
    d, s = block_quantize(x.t().contiguous(), (1, 64))
    return d, s[:, ::2]
'''),
    ("scale for scale_inv", '''def columnwise_quantize(x):
    d, s = block_quantize(x.t().contiguous(), (1, 128))
    return d, s.reciprocal()
'''),
    ("exact scales, no power of two", '''def columnwise_quantize(x):
    xt = x.t().contiguous()
    K, M = xt.shape
    v = xt.reshape(K, M // 128, 128)
    amax = v.abs().amax(dim=2)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    data = (v * scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(K, M)
    return data, scale.reciprocal()
'''),
    ("dequantized values returned", '''def columnwise_quantize(x):
    d, s = block_quantize(x.t().contiguous(), (1, 128))
    K, M = d.shape
    return (d.float().reshape(K, M // 128, 128) * s[:, :, None]).reshape(K, M), s
'''),
]

_MXE_HEAD = '''def mx_shared_exponent(amax, elem):
    emax = {"e4m3": 8, "e5m2": 15, "e2m1": 2}[elem]
'''
_MX_EXP = [
    ("floor(log2) in FP32", _MXE_HEAD + '''    return (torch.floor(torch.log2(amax)).long() - emax).clamp(-127, 127)
'''),
    ("floor(log2) in FP64, log2(0) cast", _MXE_HEAD + '''    return (torch.floor(torch.log2(amax.double())).long() - emax).clamp(-127, 127)
'''),
    ("FP64 log2, zero handled, inf clamped to 127", _MXE_HEAD + '''    k = torch.floor(torch.log2(amax.double())).nan_to_num(posinf=127 + emax, neginf=-127 + emax).long() - emax
    return torch.where(amax == 0, -127, k).clamp(-127, 127)
'''),
    ("frexp exponent", _MXE_HEAD + '''    return (torch.frexp(amax).exponent.long() - 1 - emax).clamp(-127, 127)
'''),
    ("the RCEIL rule", _MXE_HEAD + '''    mx = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}[elem]
    k = torch.ceil(torch.log2(amax.double() / mx)).nan_to_num(neginf=-127)
    return k.clamp(-127, 127).long()
'''),
    ("no clamp at -127", _MXE_HEAD + '''    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 127
    return (e - emax).clamp(max=127)
'''),
    ("int32 result", _MXE_HEAD + '''    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    return (e - emax).clamp(-127, 127)
'''),
    ("float result (4.0 for 4)", _MXE_HEAD + '''    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 127
    return (e - emax).clamp(-127, 127).float()
'''),
    ("bias 126", _MXE_HEAD + '''    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 126
    return (e - emax).clamp(-127, 127)
'''),
    ("emax = ceil(log2(max))", '''def mx_shared_exponent(amax, elem):
    emax = {"e4m3": 9, "e5m2": 16, "e2m1": 3}[elem]
    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 127
    return (e - emax).clamp(-127, 127)
'''),
    ("a Python list", _MXE_HEAD + '''    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 127
    return (e - emax).clamp(-127, 127).tolist()
'''),
    ("log2 in FP64 truncated toward zero (.long())", _MXE_HEAD + '''    k = torch.log2(amax.double()).nan_to_num(posinf=128.0, neginf=-1000.0).long() - emax
    return k.clamp(-127, 127)
'''),
]

_MXQ_HEAD = '''def mx_quantize(x):
    M, K = x.shape
    v = x.reshape(M, K // 32, 32)
    amax = v.abs().amax(dim=2)
    nan = torch.isnan(amax)
    k = mx_shared_exponent(torch.where(nan, 1.0, amax), "e4m3")
    scale = torch.exp2(k.double()).float()
'''
_MXQ_DIV = '''    divisor = torch.where(k == -127, 2.0 ** -126, scale)
'''
_MXQ_NAN = '''    scale = torch.where(nan, float("nan"), scale)
    divisor = torch.where(nan, float("nan"), divisor)
'''
_MXQ_TAIL = '''    y = (v / divisor[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return scale.to(torch.float8_e8m0fnu), y.reshape(M, K).to(torch.float8_e4m3fn)
'''


def _mxq(div=_MXQ_DIV, nan=_MXQ_NAN, tail=_MXQ_TAIL, head=_MXQ_HEAD):
    return head + div + nan + tail


_MX_Q = [
    ("the OCP divisor 2^-127 (the library's default edge)", _mxq(div="    divisor = scale\n")),
    ("divisor 1 at k = -127 (RCEIL's edge)", _mxq(div="    divisor = torch.where(k == -127, 1.0, scale)\n")),
    ("NaN block keeps a finite scale", _mxq(nan="    divisor = torch.where(nan, float('nan'), divisor)\n")),
    ("NaN block's other elements finite", _mxq(nan="    scale = torch.where(nan, float('nan'), scale)\n")),
    ("scale as float32", _mxq(tail='''    y = (v / divisor[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return scale, y.reshape(M, K).to(torch.float8_e4m3fn)
''')),
    ("scale as the uint8 byte k + 127", _mxq(tail='''    y = (v / divisor[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return torch.where(nan, 255, k + 127).to(torch.uint8), y.reshape(M, K).to(torch.float8_e4m3fn)
''')),
    ("elements through bfloat16 first (double rounding)", _mxq(tail='''    y = (v / divisor[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return scale.to(torch.float8_e8m0fnu), y.reshape(M, K).to(torch.bfloat16).to(torch.float8_e4m3fn)
''')),
    ("the RCEIL exponent", _mxq(head='''def mx_quantize(x):
    M, K = x.shape
    v = x.reshape(M, K // 32, 32)
    amax = v.abs().amax(dim=2)
    nan = torch.isnan(amax)
    k = torch.ceil(torch.log2(torch.where(nan, 1.0, amax).double() / 448)).nan_to_num(neginf=-127, posinf=127)
    k = k.clamp(-127, 127).long()
    scale = torch.exp2(k.double()).float()
''')),
    ("zero block takes scale 1", _mxq(head=_MXQ_HEAD + '''    k = torch.where(amax == 0, 0, k)
    scale = torch.where(amax == 0, 1.0, scale)
''')),
    ("blocks of 32 along columns", '''def mx_quantize(x):
    s, d = _mx_rows(x.t().contiguous())
    return s.t().contiguous()[: x.shape[0], : x.shape[1] // 32], d.t().contiguous()


''' + _mxq().replace("def mx_quantize(x):", "def _mx_rows(x):")),
    ("multiplies by 2^-k (inf where k = -127)", _mxq(tail='''    y = (v * torch.exp2(-k.double()).float()[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    y = torch.where(nan[:, :, None], float("nan"), y)
    return scale.to(torch.float8_e8m0fnu), y.reshape(M, K).to(torch.float8_e4m3fn)
''')),
]

_NV_HEAD = '''def nvfp4_scales(x):
    M, K = x.shape
'''
_NV_T = '''    t = x.abs().amax() / (E4M3_MAX * E2M1_MAX)
    t = torch.where(t < 2.0 ** -126, torch.tensor(2.0 ** -126), t)
'''
_NV_B = '''    amax_b = x.reshape(M, K // 16, 16).abs().amax(dim=2)
'''
_NV_FLUSH = '''    s = torch.where((t < 2.0 ** -121) & (v < 2.0 ** -6), 0.0, s)
'''
_NV_S = '''    v = (amax_b / E2M1_MAX) / t
    s = v.clamp(2.0 ** -6, E4M3_MAX)
''' + _NV_FLUSH + '''    return t, s.to(torch.float8_e4m3fn)
'''


def _nv(t=_NV_T, s=_NV_S):
    return _NV_HEAD + t + _NV_B + s


_NVFP4 = [
    ("amax_b / (6 * t)", _nv(s='''    s = (amax_b / (E2M1_MAX * t)).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("(amax_b / t) / 6", _nv(s='''    s = ((amax_b / t) / E2M1_MAX).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("amax_b * (1 / t) / 6", _nv(s='''    s = (amax_b * (1 / t) / E2M1_MAX).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("amax_b * 448 / amax (t skipped)", _nv(s='''    s = (amax_b * E4M3_MAX / x.abs().amax()).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("block scales in FP64", _nv(s='''    s = ((amax_b.double() / E2M1_MAX) / t.double()).clamp(2.0 ** -6, E4M3_MAX).float().to(torch.float8_e4m3fn)
    return t, s
''')),
    ("t = amax / 448 / 6", _nv(t='''    t = x.abs().amax() / E4M3_MAX / E2M1_MAX
    t = torch.where(t < 2.0 ** -126, torch.tensor(2.0 ** -126), t)
''')),
    ("t as a Python float", _nv(t='''    t = max(float(x.abs().max()) / 2688.0, 2.0 ** -126)
''')),
    ("no floor on t (subnormal t)", _nv(t='''    t = x.abs().amax() / (E4M3_MAX * E2M1_MAX)
''')),
    ("the former 2^-121 floor on t", _nv(t='''    t = x.abs().amax() / (E4M3_MAX * E2M1_MAX)
    t = torch.where(t < 2.0 ** -121, torch.tensor(2.0 ** -121), t)
''')),
    ("no flush: the 2^-6 clamp in tiny tensors too", _nv(s=_NV_S.replace(_NV_FLUSH, ""))),
    ("the flush in every tensor", _nv(s=_NV_S.replace("(t < 2.0 ** -121) & ", ""))),
    ("the flush where t < 2^-126 only", _nv(s=_NV_S.replace("2.0 ** -121", "2.0 ** -126"))),
    ("no 2^-6 clamp (TE's cast)", _nv(s='''    s = ((amax_b / E2M1_MAX) / t).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("cast through bfloat16", _nv(s='''    s = ((amax_b / E2M1_MAX) / t).clamp(2.0 ** -6, E4M3_MAX).to(torch.bfloat16).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("cast through float16", _nv(s='''    s = ((amax_b / E2M1_MAX) / t).clamp(2.0 ** -6, E4M3_MAX).half().to(torch.float8_e4m3fn)
    return t, s
''')),
    ("block scales left in float32", _nv(s='''    s = ((amax_b / E2M1_MAX) / t).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return t, s
''')),
    ("t in float64", _nv(t='''    t = x.abs().amax().double() / (E4M3_MAX * E2M1_MAX)
    t = torch.where(t < 2.0 ** -126, torch.tensor(2.0 ** -126, dtype=torch.float64), t)
''', s='''    s = ((amax_b / E2M1_MAX) / t.float()).clamp(2.0 ** -6, E4M3_MAX).to(torch.float8_e4m3fn)
    return t, s
''')),
    ("blocks of 16 along columns", _NV_HEAD + _NV_T + '''    amax_b = x.reshape(M // 16, 16, K).abs().amax(dim=1).reshape(M, K // 16)
''' + _NV_S),
]

MUTANTS = {
    "block_quantize": _BLOCK,
    "columnwise_quantize": _COLUMNWISE,
    "mx_shared_exponent": _MX_EXP,
    "mx_quantize": _MX_Q,
    "nvfp4_scales": _NVFP4,
}
