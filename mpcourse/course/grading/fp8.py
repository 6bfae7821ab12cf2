"""Graders for lessons 07 (FP8 formats and per-tensor scaling) and 08 (delayed scaling).

Oracles, none of them ``mpcourse.core.quant``:

* ``check_compute_scale``: Transformer Engine's rule (``common/recipe/recipe_common.cuh``
  ``compute_scale_from_amax``; ``pytorch/quantization.py`` ``_default_sf_compute``) transcribed here in
  NumPy FP32: ``scale = (fp8_max / amax) / 2**margin``; amax 0, inf or NaN gives 1.0; a scale that
  overflows FP32 becomes the largest FP32. TE's two implementations round the division differently: the
  CUDA kernel divides once (``__fdiv_rn``, correctly rounded), the PyTorch path evaluates
  ``fp8_max / amax_tensor`` as ``reciprocal(amax) * fp8_max`` (two roundings, 1 ulp off in about a quarter
  of the cases). Both are accepted, bit for bit.
* ``check_quantize``: ``ml_dtypes`` (``float8_e4m3fn``, ``float8_e5m2``; round to nearest even) applied to
  the FP32 product ``x * scale`` clipped to ``[-fp8_max, fp8_max]`` (saturation, as TE and torchao cast).
* ``check_delayed_update``: TE's delayed-scaling update (``_default_get_amax_and_update_history`` and
  ``_default_sf_compute``; ``common/recipe/__init__.py``) transcribed in plain Python over FP32 values: record
  the amax into slot 0 (max with what is there: micro-batches of one step share the slot), take the amax
  from the whole window (``max``) or slot 0 (``most_recent``) *before* rolling, roll by -1, zero slot 0,
  then a new scale only where that amax is > 0 and finite. Cases: TE's worked example (E4M3, margin 0,
  L = 4, [5, 1, 2, 3] -> 89.6 and [0, 2, 3, 5]; margin 1 -> 44.8), the overflow/saturation regression values (448, the 464 tie,
  465, 57344, the 61440 tie), and a
  seeded random sequence with spikes, zeros and infinities.

Sources: Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv 2209.05433), section 3; NVIDIA
TransformerEngine at the files named above.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from ...core.formats import FORMATS
from . import GradingError, call, verdict

E4M3_MAX, E5M2_MAX = FORMATS["e4m3"].max, FORMATS["e5m2"].max  # 448.0, 57344.0 (checked against ml_dtypes)
FP32_MAX = FORMATS["fp32"].max  # 3.4028234663852886e38
_ML = {E4M3_MAX: ml_dtypes.float8_e4m3fn, E5M2_MAX: ml_dtypes.float8_e5m2}
_TORCH = {E4M3_MAX: torch.float8_e4m3fn, E5M2_MAX: torch.float8_e5m2}
_NAME = {E4M3_MAX: "E4M3", E5M2_MAX: "E5M2"}


def _f32(v) -> np.float32:
    return np.float32(v)


def _bits32(v: float) -> int:
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def _same32(a: float, b: float) -> bool:
    """Same FP32 value, bit for bit (so +0 differs from -0); any NaN equals any NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return _bits32(a) == _bits32(b)


# ----------------------------------------------------------------------------------------------------------
# Lesson 07: compute_scale
# ----------------------------------------------------------------------------------------------------------
def te_scales(amax: float, fp8_max: float, margin: int = 0) -> set[float]:
    """Oracle: the scales TE's rule allows for ``amax`` (one value, or two where TE's two divisions differ)."""
    a = _f32(amax)
    if not np.isfinite(a) or a == 0:
        return {1.0}
    with np.errstate(over="ignore", divide="ignore"):
        once = _f32(fp8_max) / a                                   # correctly rounded FP32 division
        twice = (_f32(1) / a) * _f32(fp8_max)                      # reciprocal, then multiply
    out = set()
    for s in (once, twice):
        s = _f32(s / _f32(2.0 ** margin))                          # exact: a power of two, result normal
        out.add(FP32_MAX if np.isinf(s) else float(s))
    return out


def compute_scale_cases(n_random: int = 120, seed: int = 0) -> list[tuple[float, float, int]]:
    """(amax, fp8_max, margin) cases: TE's worked example and the edges first, then seeded log-uniform amaxes."""
    edges = [(5.0, E4M3_MAX, 0), (5.0, E4M3_MAX, 1), (1.0, E4M3_MAX, 0), (1.0, E5M2_MAX, 0), (8.0, E4M3_MAX, 0),
             (8.0, E4M3_MAX, 1), (1000.0, E5M2_MAX, 0), (1000.0, E4M3_MAX, 0),
             (0.0, E4M3_MAX, 0), (-0.0, E5M2_MAX, 0), (math.inf, E4M3_MAX, 0), (math.nan, E4M3_MAX, 0),
             (math.nan, E5M2_MAX, 2), (math.inf, E5M2_MAX, 1), (0.0, E4M3_MAX, 3),
             (1e-40, E4M3_MAX, 0), (1e-40, E5M2_MAX, 2), (1e-38, E4M3_MAX, 0), (2.0 ** -126, E5M2_MAX, 0),
             (1.2e-36, E4M3_MAX, 0), (1e-30, E4M3_MAX, 0), (3e-3, E5M2_MAX, 0), (448.0, E4M3_MAX, 0),
             (57344.0, E5M2_MAX, 0), (1e30, E5M2_MAX, 0), (0.1, E4M3_MAX, 3)]
    g = torch.Generator().manual_seed(seed)
    exps = torch.rand(n_random, generator=g, dtype=torch.float64) * 100 - 50     # amax in [2**-50, 2**50]
    mant = torch.rand(n_random, generator=g, dtype=torch.float64) + 1
    fmts = torch.randint(0, 2, (n_random,), generator=g)
    margins = torch.randint(0, 4, (n_random,), generator=g)
    rand = [(float(_f32(m * 2.0 ** e)), (E4M3_MAX, E5M2_MAX)[int(f)], int(k))
            for m, e, f, k in zip(mant.tolist(), exps.tolist(), fmts, margins)]
    return edges + rand


def _compute_scale_hint(amax: float, fp8_max: float, margin: int, got: float) -> str:
    a = _f32(amax)
    if not np.isfinite(a) or a == 0:
        return ("an amax of 0, inf or NaN carries no information about the tensor: TE's current scaling returns "
                "1.0 for it (recipe_common.cuh), so an all-zero tensor quantizes to zeros, never to NaN.")
    if math.isinf(got) or (math.isnan(got)):
        return ("fp8_max / amax overflowed FP32 (a tiny amax): TE caps the scale at the largest FP32, "
                "torch.finfo(torch.float32).max = 3.4028235e38.")
    if fp8_max == E5M2_MAX and any(_same32(got, s) for s in te_scales(amax, E4M3_MAX, margin)):
        return "you used E4M3's 448 where the format is E5M2: use the fp8_max argument (57344 for E5M2)."
    for k in (-margin, 2 * margin, 0):
        if k != margin and any(_same32(got, s) for s in te_scales(amax, fp8_max, k)):
            return (f"your scale matches margin {k} instead of {margin}: the margin *divides* the scale by "
                    "2**margin (headroom below fp8_max).")
    return ("scale = (fp8_max / amax) / 2**margin, one FP32 division (divide two float32 tensors, e.g. "
            "torch.full_like(amax, fp8_max) / amax, or a float32 value by another).")


def check_compute_scale(fn) -> None:
    """Grade ``fn(amax: float32 tensor (), fp8_max: float, margin: int) -> float32 scale``: TE's per-tensor
    scale with its edge rules (amax 0 / inf / NaN -> 1.0; FP32 overflow -> FP32 max), bit for bit."""
    name = "compute_scale"
    cases = compute_scale_cases()
    for amax, fp8_max, margin in cases:
        got = call(name, fn, torch.tensor(amax, dtype=torch.float32), fp8_max, margin)
        if isinstance(got, torch.Tensor):
            if got.numel() != 1:
                raise GradingError(f"FAIL {name}: amax of shape () should give a scale of shape (), got shape "
                                   f"{tuple(got.shape)}.")
            got = float(got.detach().float())
        try:
            got = float(_f32(got))
        except (TypeError, ValueError):
            raise GradingError(f"FAIL {name}: return a float32 tensor (or a float), got {type(got).__name__}.") \
                from None
        want = te_scales(amax, fp8_max, margin)
        if not any(_same32(got, w) for w in want):
            w = min(want)
            raise GradingError(
                f"FAIL {name}: amax={amax!r} ({_NAME[fp8_max]}, fp8_max={fp8_max:g}), margin={margin}\n"
                f"  expected scale {w!r} [{_bits32(w):#010x}], got {got!r}"
                + (f" [{_bits32(got):#010x}]" if math.isfinite(got) else "")
                + f"\n  hint: {_compute_scale_hint(amax, fp8_max, margin, got)}")
    verdict(name, f"{len(cases)} cases (TE's worked example, amax 0/inf/NaN, tiny amax, E4M3 and E5M2, "
                  "margins 0-3) agree bit for bit with Transformer Engine's rule")


# ----------------------------------------------------------------------------------------------------------
# Lesson 07: quantize (saturating)
# ----------------------------------------------------------------------------------------------------------
def ml_quantize(x: np.ndarray, scale: float, fp8_max: float) -> np.ndarray:
    """Oracle: ml_dtypes cast of clip(float32(x) * float32(scale), -fp8_max, fp8_max), as uint8 bit patterns."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.clip(x.astype(np.float32) * _f32(scale), -fp8_max, fp8_max)   # NaN passes through
    return y.astype(_ML[fp8_max]).view(np.uint8)


def quantize_cases(fp8_max: float, seed: int = 0) -> list[tuple[str, torch.Tensor, float]]:
    """(what, x (N,) float32, scale) groups for ``fp8_max`` (448 or 57344), deterministic."""
    dtype = _TORCH[fp8_max]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = every[every.isfinite()].unique()                                  # sorted FP8 values
    mids = ((finite[:-1].double() + finite[1:].double()) / 2).float()         # ties: exact in FP32
    top, step = float(finite[-1]), float(finite[-1] - finite[-2])
    up = lambda t: torch.nextafter(t, torch.full_like(t, math.inf))           # noqa: E731
    down = lambda t: torch.nextafter(t, torch.full_like(t, -math.inf))        # noqa: E731
    near = torch.cat([finite, mids, up(mids), down(mids)])
    over = torch.tensor([top + step / 2, top + step / 2 + 1, top * 1.01, 1000.0, 1e6, 1e30, math.inf])
    over = torch.cat([over, -over])
    special = torch.tensor([0.0, -0.0, math.nan, 1e-45, -1e-45, 1e-10, 2.0 ** -20])
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-12, 4, (2000,), generator=g).float())
    rand_scale = float(_f32(fp8_max) / _f32(float(rand.abs().max())))           # a current scale, not a power of 2
    if fp8_max == E4M3_MAX:
        regress = torch.tensor([448.0, 464.0, 465.0, 1000.0, -1000.0, math.nan])
    else:
        regress = torch.tensor([57344.0, 58000.0, 61439.0, 61440.0, -61440.0])
    return [("the saturation and tie regression values at scale 1", regress, 1.0),
            ("every FP8 value, the ties between neighbours and the FP32 values beside them, scale 2**-3",
             near * 8, 0.125),
            ("values past fp8_max and +-inf (saturate), scale 1", over, 1.0),
            ("zeros, NaN, values below the smallest subnormal, scale 1", special, 1.0),
            ("2,000 random values with their current scale fp8_max / amax", rand, rand_scale)]


def _quantize_hint(x: float, scale: float, fp8_max: float, want_val: float, got_val: float) -> str:
    y = float(_f32(x) * _f32(scale)) if math.isfinite(x) else x * scale
    if math.isnan(got_val) and not math.isnan(want_val):
        return (f"x * scale = {y!r} is beyond fp8_max: saturate, i.e. clamp to [-fp8_max, fp8_max] before the "
                "cast (E4M3 has no inf: an unclamped overflow is NaN).")
    if math.isinf(got_val):
        return (f"x * scale = {y!r}: clamp to [-fp8_max, fp8_max] before the cast, so overflow and +-inf become "
                "+-fp8_max (saturation); torch's cast does not saturate E5M2.")
    if fp8_max == E5M2_MAX and abs(got_val) == E4M3_MAX:
        return "you clamped to E4M3's 448 on the E5M2 branch: clamp to the fp8_max argument (57344 for E5M2)."
    if math.isnan(want_val):
        return "NaN must stay NaN (clamp lets it through): a NaN in a tensor has to show up, not be hidden."
    if want_val == 0 and got_val == 0:
        return "signed zero: -0.0 must stay -0.0 (x * scale, clamp and the cast all keep the sign)."
    return ("multiply in FP32 (x.float() * scale), clamp to [-fp8_max, fp8_max], then cast with round to "
            "nearest even (x.to(torch.float8_e4m3fn) / torch.float8_e5m2).")


def check_quantize(fn) -> None:
    """Grade ``fn(x: float32 (N,), scale: float32 (), fp8_max: float) -> (N,) torch.float8_e4m3fn (fp8_max 448)
    or torch.float8_e5m2 (57344)``: saturate(x * scale) rounded to nearest even, against ml_dtypes."""
    name = "quantize"
    total = 0
    for fp8_max in (E4M3_MAX, E5M2_MAX):
        want_dtype = _TORCH[fp8_max]
        for what, x, scale in quantize_cases(fp8_max):
            got = call(name, fn, x.clone(), torch.tensor(scale, dtype=torch.float32), fp8_max)
            if not isinstance(got, torch.Tensor) or got.dtype != want_dtype:
                got_type = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
                raise GradingError(
                    f"FAIL {name}: fp8_max={fp8_max:g} should give a {want_dtype} tensor, got {got_type}.\n"
                    f"  hint: fp8_max 448 is E4M3 (torch.float8_e4m3fn), 57344 is E5M2 (torch.float8_e5m2).")
            if got.shape != x.shape:
                raise GradingError(f"FAIL {name}: expected shape {tuple(x.shape)}, got {tuple(got.shape)}.")
            want_bits = torch.from_numpy(ml_quantize(x.numpy(), scale, fp8_max).copy())
            got_bits = got.contiguous().view(torch.uint8)
            want_v, got_v = want_bits.view(want_dtype).float(), got_bits.view(want_dtype).float()
            ok = (want_bits == got_bits) | (want_v.isnan() & got_v.isnan())
            if not bool(ok.all()):
                i = int((~ok).nonzero()[0])
                xi, w, gv = float(x[i]), float(want_v[i]), float(got_v[i])
                raise GradingError(
                    f"FAIL {name}: {int((~ok).sum())} of {x.numel()} cases differ from ml_dtypes "
                    f"({_NAME[fp8_max]}, case group: {what}).\n"
                    f"  first wrong case: x={xi!r}, scale={scale!r}: expected {w!r} [{int(want_bits[i]):#04x}], "
                    f"got {gv!r} [{int(got_bits[i]):#04x}]\n"
                    f"  hint: {_quantize_hint(xi, scale, fp8_max, w, gv)}")
            total += x.numel()
    verdict(name, f"{total:,} values in E4M3 and E5M2 (every FP8 value, every tie, overflow and +-inf saturated, "
                  "NaN, zeros, random) agree bit for bit with ml_dtypes")


# ----------------------------------------------------------------------------------------------------------
# Lesson 08: the delayed-scaling update
# ----------------------------------------------------------------------------------------------------------
def te_delayed_update(history: list[float], scale: float, amax: float, fp8_max: float, margin: int = 0,
                      algo: str = "max"):
    """Oracle: TE's delayed-scaling update in plain Python over FP32 values.

    Returns (new_history as a list of floats, set of allowed new scales: TE's two divisions, see module doc).
    """
    h = [float(_f32(v)) for v in history]
    a_new = float(_f32(amax))
    h[0] = math.nan if math.isnan(a_new) or math.isnan(h[0]) else max(h[0], a_new)   # as torch.maximum
    if algo == "max":
        a = math.nan if any(math.isnan(v) for v in h) else max(h)   # torch.max propagates NaN
    elif algo == "most_recent":
        a = h[0]
    else:
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    h = h[1:] + h[:1]                                            # roll by -1: slot 0 moves to the end
    h[0] = 0.0                                                   # the slot the next step records into
    if a > 0 and math.isfinite(a):
        scales = te_scales(a, fp8_max, margin)
    else:
        scales = {float(_f32(scale))}                            # no information: keep the previous scale
    return h, scales


def _fixed_update_cases():
    """(what, history, scale, amax, fp8_max, margin, algo): TE's worked example and regression cases."""
    return [
        ("TE's worked example: E4M3, margin 0, L = 4, history [5, 1, 2, 3]", [0.0, 1, 2, 3], 1.0, 5.0, E4M3_MAX, 0,
         "max"),
        ("TE's worked example with margin 1", [0.0, 1, 2, 3], 1.0, 5.0, E4M3_MAX, 1, "max"),
        ("the largest amax is two steps old", [0.0, 1, 9, 3], 1.0, 5.0, E4M3_MAX, 0, "max"),
        ("the oldest entry is the largest: it counts before it drops out", [0.0, 9, 2, 3], 1.0, 5.0, E4M3_MAX, 0,
         "max"),
        ("most_recent takes only this step's amax", [0.0, 9, 2, 3], 1.0, 5.0, E4M3_MAX, 0, "most_recent"),
        ("an amax of 8 every step", [0.0, 8, 8, 8], 56.0, 8.0, E4M3_MAX, 0, "max"),
        ("an amax of 8 every step, margin 1", [0.0, 8, 8, 8], 28.0, 8.0, E4M3_MAX, 1, "max"),
        ("E5M2 (gradients under HYBRID)", [0.0, 0.5, 0.25, 1], 1.0, 2.0, E5M2_MAX, 0, "max"),
        ("all-zero history and amax 0: keep the previous scale 2.0", [0.0, 0, 0, 0], 2.0, 0.0, E4M3_MAX, 0, "max"),
        ("amax 0 with most_recent: keep the previous scale", [0.0, 4, 4, 4], 112.0, 0.0, E4M3_MAX, 0,
         "most_recent"),
        ("an inf amax: keep the previous scale", [0.0, 1, 2, 3], 89.6, math.inf, E4M3_MAX, 0, "max"),
        ("an inf still in the window: keep the previous scale", [0.0, 1, math.inf, 3], 89.6, 2.0, E4M3_MAX, 0,
         "max"),
        ("a tiny amax: FP32 max, not inf", [0.0, 0, 0, 0], 1.0, 1e-40, E4M3_MAX, 0, "max"),
        ("two micro-batches of one step share slot 0 (max)", [7.0, 1, 2, 3], 1.0, 3.0, E4M3_MAX, 0, "max"),
        ("L = 1", [0.0], 3.0, 7.0, E5M2_MAX, 2, "max"),
        ("a NaN amax: recorded (torch.maximum propagates it), keep the previous scale", [0.0, 1, 2, 3], 89.6,
         math.nan, E4M3_MAX, 0, "max"),
        ("a NaN still in the window: keep the previous scale", [0.0, 1, math.nan, 3], 89.6, 2.0, E4M3_MAX, 0, "max"),
        ("a NaN amax with most_recent: keep the previous scale", [0.0, 4, 4, 4], 112.0, math.nan, E4M3_MAX, 0,
         "most_recent"),
        ("two micro-batches of one step under most_recent: slot 0 holds their max", [7.0, 1, 2, 3], 1.0, 3.0,
         E4M3_MAX, 0, "most_recent"),
    ]


def _random_update_cases(steps: int = 160, seed: int = 0):
    """Seeded sequences (L = 6): log-normal amaxes with spikes, zeros and infinities, per algo/format/margin.
    Yields (what, history, scale, amax, fp8_max, margin, algo) with the oracle's state before each step."""
    g = torch.Generator().manual_seed(seed)
    for algo, fp8_max, margin in (("max", E4M3_MAX, 0), ("most_recent", E5M2_MAX, 0), ("max", E5M2_MAX, 2),
                                  ("most_recent", E4M3_MAX, 1)):
        history, scale = [0.0] * 6, 1.0
        amaxes = torch.exp2(torch.randn(steps, generator=g) * 2)
        kind = torch.rand(steps, generator=g)
        for t in range(steps):
            amax = float(amaxes[t])
            if kind[t] < 0.05:
                amax *= 1000.0                                   # a spike
            elif kind[t] < 0.08:
                amax = 0.0
            elif kind[t] < 0.10:
                amax = math.inf
            yield (f"random sequence ({algo}, {_NAME[fp8_max]}, margin {margin}), step {t}", list(history), scale,
                   float(_f32(amax)), fp8_max, margin, algo)
            history, scales = te_delayed_update(history, scale, amax, fp8_max, margin, algo)
            scale = min(scales)


def _update_hint(history, scale, amax, fp8_max, margin, algo, want_h, got_h, got_s) -> str:
    same_h = len(got_h) == len(want_h) and all(_same32(a, b) for a, b in zip(got_h, want_h))
    if not same_h:
        overwrite, _ = te_delayed_update([0.0] + list(history[1:]), scale, amax, fp8_max, margin, algo)
        if history[0] > amax and len(got_h) == len(overwrite) and all(_same32(a, b) for a, b in zip(got_h, overwrite)):
            return ("slot 0 already held an amax of this step (another micro-batch): record with "
                    "max(history[0], amax), do not overwrite it.")
        if got_h and got_h[0] != 0:
            return "after rolling, zero slot 0: it is where the next step records its amax."
        return ("record amax into slot 0 (max with what is there), then roll by -1 (torch.roll(h, -1)): "
                "slot 0 moves to the end and the oldest entry (slot 1) becomes slot 0, which is zeroed.")
    rolled_first = list(history[1:]) + [max(history[0], amax)]
    rolled_first[0] = 0.0
    a_wrong = max(rolled_first) if algo == "max" else rolled_first[0]
    if (a_wrong > 0 and math.isfinite(a_wrong) and any(_same32(got_s, s) for s in te_scales(a_wrong, fp8_max, margin))) \
            or (algo == "most_recent" and _same32(got_s, scale) and amax > 0 and math.isfinite(amax)):
        return ("you rolled before taking the amax: compute it from the history *before* rolling (TE "
                "_default_get_amax_and_update_history), or the oldest entry is lost / slot 0 is already zero.")
    a = max(max(history[0], amax), *history) if algo == "max" else max(history[0], amax)
    if not (a > 0 and math.isfinite(a)):
        return ("this amax is 0, inf or NaN: it says nothing about the tensor, so keep the previous scale "
                "(never inf or 0).")
    if algo == "max" and any(_same32(got_s, s) for s in te_scales(max(history[0], amax), fp8_max, margin)):
        return "'max' takes the largest amax of the whole window, not only the newest."
    if algo == "most_recent" and any(_same32(got_s, s) for s in te_scales(a_wrong if a_wrong > 0 else -1,
                                                                          fp8_max, margin)):
        return "'most_recent' takes slot 0 (this step's amax) only."
    if math.isinf(got_s):
        return "the scale overflowed FP32: use the largest FP32 (3.4028235e38) instead, as TE does."
    return "new scale = (fp8_max / amax) / 2**margin, one FP32 division (as in compute_scale, lesson 07)."


def check_delayed_update(fn) -> None:
    """Grade ``fn(history (L,) fp32, scale () fp32, amax () fp32, fp8_max, margin, algo) -> (history, scale)``
    against TE's delayed-scaling update (see the module docstring), state by state."""
    name = "delayed_update"
    cases = _fixed_update_cases() + list(_random_update_cases())
    for what, history, scale, amax, fp8_max, margin, algo in cases:
        h_in = torch.tensor(history, dtype=torch.float32)
        out = call(name, fn, h_in, torch.tensor(scale, dtype=torch.float32), torch.tensor(amax, dtype=torch.float32),
                   fp8_max, margin, algo)
        try:
            got_h, got_s = out
            got_h = [float(v) for v in torch.as_tensor(got_h, dtype=torch.float32).reshape(-1)]
            got_s = float(torch.as_tensor(got_s, dtype=torch.float32).reshape(()))
        except (TypeError, ValueError, RuntimeError):
            raise GradingError(f"FAIL {name}: return (history, scale): a float32 tensor of shape (L,) and one of "
                               f"shape (), got {type(out).__name__}.") from None
        want_h, want_s = te_delayed_update(history, scale, amax, fp8_max, margin, algo)
        ok_h = len(got_h) == len(want_h) and all(_same32(a, b) for a, b in zip(got_h, want_h))
        ok_s = any(_same32(got_s, s) for s in want_s)
        if not (ok_h and ok_s):
            fmt = lambda v: "[" + ", ".join(f"{x:.6g}" for x in v) + "]"   # noqa: E731
            raise GradingError(
                f"FAIL {name}: {what}\n"
                f"  input: history {fmt(history)}, scale {scale!r}, amax {amax!r}, fp8_max {fp8_max:g}, "
                f"margin {margin}, algo {algo!r}\n"
                f"  expected: history {fmt(want_h)}, scale {min(want_s)!r}\n"
                f"  got:      history {fmt(got_h)}, scale {got_s!r}\n"
                f"  hint: {_update_hint(history, scale, amax, fp8_max, margin, algo, want_h, got_h, got_s)}")
    verdict(name, f"{len(cases)} updates (TE's worked example: 89.6 and [0, 2, 3, 5], margin 1: 44.8; zero, inf "
                  "and tiny amaxes; max and most_recent; a random sequence with spikes) agree with "
                  "Transformer Engine's rule")
