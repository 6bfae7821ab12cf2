"""The inspector over every format (mpcourse.core.inspect_quant): planted tensors with known fractions under each
recipe's quantizer, the overflow point against the non-saturating cast, and a real layer's tensors: the
inspector's statistics equal a direct computation on the copies the layer's own quantizers made in training."""
import math

import pytest
import torch
import torch.nn as nn

from mpcourse.core.formats import round_to
from mpcourse.core.inspect import Inspector
from mpcourse.core.inspect_quant import (WHAT_IFS, WhatIfQuantizers, overflow_point, quantize_as_training,
                                         quantized_stats)
from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling,
                                 NVFP4BlockScaling, autocast, convert_to_float8_training)
from mpcourse.core.quant.engine import quantizer

TINY = 2.0 ** -20


def planted() -> torch.Tensor:
    """(2, 64): row 0 = [1, 31 x 2^-20 | 32 x 2^-20], row 1 = ones. 128 nonzero elements."""
    x = torch.full((2, 64), TINY)
    x[0, 0] = 1.0
    x[1] = 1.0
    return x


def stats(name: str, x: torch.Tensor, role: str = "input") -> dict:
    return quantized_stats(x, quantize_as_training(quantizer(WHAT_IFS[name].recipe, role), x))


def test_planted_underflow_under_each_granularity():
    """Which 2^-20 values flush depends on the block they share (E4M3 flushes below half its 2^-9 floor):
    per tensor (scale 448 / 1): 2^-20 * 448 = 2^-11.2 < 2^-10, all 63 flush. MX (RCEIL): the block holding 1 gets
    2^ceil(log2(1/448)) = 2^-8, 2^-20 / 2^-8 = 2^-12 flushes (31); the block of 2^-20 alone is scaled on its own
    (none). NVFP4: t = 1 / 2688; a block of 16 holding 1 flushes its 15 (2^-20 * 2688 / s, s = 1/6 / t ... far
    below E2M1's 0.25); a block of 2^-20 alone asks for s = 2^-20 * 448 < 2^-6, clamped to 2^-6 (E4M3's smallest
    normal), so 2^-20 * 2688 / 2^-6 = 0.164 < 0.25 flushes too: 15 + 48 = 63."""
    x = planted()
    assert stats("fp8-current", x)["underflow"] == 63 / 128
    assert stats("mxfp8", x)["underflow"] == 31 / 128
    assert stats("nvfp4", x)["underflow"] == 63 / 128
    # 1x128 tiles do not divide K = 64; rowwise (one scale per row) is per tensor along each row here
    assert stats("fp8-rowwise", x)["underflow"] == 63 / 128


def test_planted_saturation_and_the_band_below_the_overflow_point():
    """Floor MX: a block max of 1000 gets 2^(floor(log2 1000) - 8) = 2, 1000 / 2 = 500 > 464 (E4M3's overflow
    point): saturated. A max of 460 gets 2^0 and lands in (448, 464], rounding to 448 anyway: not counted
    (TE's overflows% would count it). RCEIL rounds the exponent up: nothing saturates."""
    x = torch.ones(2, 32)
    x[0, 0], x[1, 0] = 1000.0, 460.0
    floor = stats("mxfp8-floor", x)
    assert floor["saturation"] == 1 / 64 and floor["underflow"] == 0.0
    assert stats("mxfp8", x)["saturation"] == 0.0
    # the dequantized value of the clipped element is 448 * 2 = 896: its error is in mse / rel_error
    err = (1000 - 896) ** 2 + (460 - 448) ** 2
    assert floor["mse"] == pytest.approx(err / 64, rel=1e-6)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_overflow_point_is_where_the_non_saturating_cast_overflows(fmt):
    """Oracle: ``formats.round_to(saturate=False)`` (OCP non-saturating cast) gives inf/NaN exactly past it."""
    mid, tie_up = overflow_point(fmt)
    x = torch.tensor([mid * (1 - 2 ** -20), mid, mid * (1 + 2 ** -20)])
    over = ~torch.isfinite(round_to(x, fmt, saturate=False))
    assert over.tolist() == [False, tie_up, True]


def test_overflow_point_of_e2m1():
    """E2M1 has no inf to check against: max 6 = 1.1b x 2^2, the next step 8, the midpoint 7, and 6's odd mantissa
    sends the tie up (to 8, were there an 8)."""
    assert overflow_point("e2m1") == (7.0, True)


def test_block_dynamic_range_and_scales():
    x = planted()
    s = stats("mxfp8", x)
    assert s["block_dynamic_range"] == pytest.approx(20.0)             # 1 over 2^-20 in the first block
    assert s["scale_inv_min"] == 2.0 ** -28 and s["scale_inv_max"] == 2.0 ** -8   # 2^ceil(log2(2^-20 / 448))
    assert stats("fp8-current", x)["block_dynamic_range"] == pytest.approx(20.0)


def test_what_if_skips_a_block_that_does_not_divide():
    w = WhatIfQuantizers()
    out, skipped = w.stats(torch.randn(103, 128), "weight")            # a head's weight: 103 rows
    assert "fp8-block" in skipped and "128x128" in skipped["fp8-block"]
    assert "nvfp4" in skipped and "mxfp8" in out                        # 1x32 along K = 128 divides
    out, skipped = w.stats(torch.randn(64, 64), "input")                # K = 64: no 1x128 tile
    assert set(skipped) == {"fp8-block"}
    assert "mxfp8-e5m2" not in out                                      # E5M2 MX is a gradient format only
    with pytest.raises(ValueError, match="unknown what-if"):
        WhatIfQuantizers(("mxfp9",))


def test_nonfinite_inputs_never_give_nan_statistics():
    x = torch.randn(32, 32)
    x[0, 0] = float("inf")
    x[1, 1] = float("nan")
    out, _ = WhatIfQuantizers().stats(x, "input")
    for name, s in out.items():
        assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), name
    assert out["nvfp4"]["nonfinite_out"] > 0                              # NVFP4 turns the tensor into NaNs


# ------------------------------------------------------------------------------------------------------------
# A real layer: what the inspector reports equals a direct computation on the copies training made
# ------------------------------------------------------------------------------------------------------------
class Spy:
    """Stands for one of a layer's quantizers, keeping the first tensor it quantized (along K, the copy the role's
    first GEMM reads) and what it returned; every attribute is the quantizer's."""

    def __init__(self, q):
        self.q, self.seen = q, None

    def __getattr__(self, name):
        return getattr(self.q, name)

    def __call__(self, x, *args, **kwargs):
        out = self.q(x, *args, **kwargs)
        if self.seen is None and (self.q.per_tensor or args[0] == 1):
            self.seen = (x.detach().clone(), out)
        return out


RECIPES = {"fp8-current": CurrentScaling(), "fp8-delayed": DelayedScaling(amax_history_len=4),
           "fp8-block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling()}
ROLE_PAIRS = (("activation", "input"), ("weight", "weight"), ("output_grad", "grad_output"))


@pytest.mark.parametrize("name", list(RECIPES))
def test_run_statistics_equal_those_of_the_copies_training_made(name):
    """Two steps of a two-layer model; on the second (delayed scaling now has a history) the inspector's "run" of
    each role equals ``quantized_stats`` of the tensor the layer quantized and the copy its quantizer returned in
    training (NVFP4's stochastically rounded gradient included: the inspector draws from a fork of the same
    stream, just before the layer's backward). Where the run's recipe is a what-if too, the two agree."""
    recipe = RECIPES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
    convert_to_float8_training(model, recipe=recipe)
    ins = Inspector(model, every=1)
    x = torch.randn(4, 32, 128)
    for step in range(2):
        ins.set_step(step)
        if step == 1:
            spies = {qrole: Spy(model[2].quantizers[qrole]) for _, qrole in ROLE_PAIRS}
            model[2].quantizers.update(spies)
        with autocast(enabled=True, recipe=recipe):
            y = model(x)
        y.pow(2).mean().backward()
        model.zero_grad()
    recs = {r["role"]: r for r in ins.records if r["step"] == 1 and r["layer"] == "2"}
    for irole, qrole in ROLE_PAIRS:
        assert recs[irole]["recipes"]["run"] == quantized_stats(*spies[qrole].seen), (name, irole)
        if name in ("fp8-block", "mxfp8", "nvfp4"):
            assert recs[irole]["recipes"][name] == recs[irole]["recipes"]["run"], (name, irole)
    ins.remove()


def test_delayed_run_reads_the_scale_of_earlier_steps():
    """An input 256 times larger than on the step before: delayed scaling casts it with the old scale and clips
    it; the inspector's "run" sees the clipping, the current-scaling what-if of the same tensor does not."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=1)
    layer = convert_to_float8_training(nn.Linear(64, 64), recipe=recipe)
    ins = Inspector(layer, every=1)
    x = torch.randn(32, 64)
    for step, mult in enumerate((1.0, 256.0)):
        ins.set_step(step)
        with autocast(enabled=True, recipe=recipe):
            layer(x * mult).sum().backward()
    act = next(r for r in ins.records if r["step"] == 1 and r["role"] == "activation")["recipes"]
    assert act["run"]["saturation"] > 0.5 and act["fp8-current"]["saturation"] == 0.0
    ins.remove()


def test_inspecting_moves_no_bit_of_an_nvfp4_run():
    """The inspector quantizes every tensor again, NVFP4's gradients stochastically: inside a fork of the random
    stream, so the run with it trains bit for bit as the run without it."""
    def run(inspect: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
        recipe = NVFP4BlockScaling()
        convert_to_float8_training(model, recipe=recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ins = Inspector(model, every=1) if inspect else None
        x = torch.randn(2, 64, 128)
        for step in range(3):
            if ins:
                ins.set_step(step)
            with autocast(enabled=True, recipe=recipe):
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], ins

    plain, _ = run(False)
    seen, ins = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, seen))
    assert {r["step"] for r in ins.records} == {0, 1, 2} and "run" in ins.records[0]["recipes"]


def test_observe_records_a_tensor_that_is_no_linear_layers():
    """The extension point (e.g. FP8 attention): any tensor, the quantizer role its what-ifs take, and the
    quantizer that cast it in training as "run"."""
    ins = Inspector(nn.Linear(4, 4), every=1)
    p = torch.softmax(torch.randn(2, 4, 32, 32), dim=-1)          # (B, H, T, T): read as (-1, 32)
    own = quantizer(MXFP8BlockScaling(), "input")
    rec = ins.observe("blocks.0.attn", "P", p, as_role="input", own=own)
    assert rec["recipes"]["run"] == rec["recipes"]["mxfp8"] and rec["skipped"] == {"fp8-block": rec["skipped"]["fp8-block"]}
    assert ins.observe("blocks.0.attn", "S", p)["recipes"] == {}     # no quantizer role: element formats only
    assert rec["role"] == "P" and ins.records[-1]["formats"]["e4m3"]["underflow"] >= 0
    ins.remove()
