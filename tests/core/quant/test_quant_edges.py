"""Edge cases of the quantizers: shapes a block-scaled layer cannot finish, empty tensors, the E8M0 scale at every
binade boundary (against torchao's ``to_mx``), and settings that must be refused rather than silently accepted.

* A block-scaled ``Float8Linear`` whose token count the backward's blocks do not divide is refused in the forward,
  naming the shape, the block and the valid values; ``mpcourse compare`` refuses such a ``--batch-size`` up front.
  Without gradients the forward takes any token count (rows are independent: the oracle is a padded input).
* Every quantizer takes (0, K) and (K, 0) tensors as the per-tensor path does: no error, empty data of the input's
  shape, one scale per block (a whole-dimension block counts one), each the scale of an all-zero block.
"""
from __future__ import annotations

import math

import pytest
import torch

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling, Format,
                                 MXFP8BlockScaling, NVFP4BlockScaling, engine)
from mpcourse.core.quant.rules import blockwise, hadamard, mx, nvfp4, tensor
from mpcourse.core.quant.block_recipes import block_for
from mpcourse.core.quant.layers.linear import Float8Linear

BLOCK_RECIPES = {"fp8-block": (Float8BlockScaling(), 128), "mxfp8": (MXFP8BlockScaling(), 32),
                 "nvfp4": (NVFP4BlockScaling(), 16)}


# ------------------------------------------------------------------------------------ shapes a layer cannot finish
@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_scaled_layer_refuses_a_token_count_in_the_forward(name):
    recipe, block = BLOCK_RECIPES[name]
    torch.manual_seed(0)
    layer = Float8Linear.from_float(torch.nn.Linear(256, 128), recipe=recipe)
    x = torch.randn(3, 5, 256)                    # 15 tokens: no block divides them
    with pytest.raises(ValueError) as err:
        layer(x)                                  # the forward, not the backward
    msg = str(err.value)
    assert "M = 15" in msg and f"blocks of {block}" in msg and f"multiple of {block}" in msg, msg
    assert "Hadamard" not in msg and "\n" not in msg
    # a token count the block divides trains, forward and backward
    layer(torch.randn(2, block, 256)).sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_scaled_layer_without_gradients_takes_any_token_count(name):
    recipe, block = BLOCK_RECIPES[name]
    torch.manual_seed(0)
    layer = Float8Linear.from_float(torch.nn.Linear(256, 128), recipe=recipe)
    x = torch.randn(15, 256)
    padded = torch.cat([x, torch.zeros(block - 15 % block, 256)])   # zeros: the tensor amax (NVFP4) stays
    with torch.no_grad():   # the same quantized operands; the FP32 GEMM's order may follow M on some BLAS paths
        torch.testing.assert_close(layer(x), layer(padded)[:15], rtol=1e-5, atol=1e-5)


def test_compare_refuses_a_batch_size_the_blocks_do_not_divide(capsys, tmp_path):
    from mpcourse.cli import main
    assert main(["compare", "--recipes", "fp32,fp8-block", "--batch-size", "1", "--out", str(tmp_path),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--batch-size 1" in err and "multiple of 2" in err, err
    assert not (tmp_path / "results.json").exists()


# ------------------------------------------------------------------------------------------------- empty tensors
QUANTIZER_RECIPES = {"current": CurrentScaling(), "delayed": DelayedScaling(), "rowwise": Float8RowwiseScaling(),
                     "fp8-block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(),
                     "mxfp8-floor": MXFP8BlockScaling(scale_rule="floor"), "nvfp4": NVFP4BlockScaling()}


def _quantize(q, x, axis):
    return q(x, True) if q.per_tensor else q(x, axis)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("name", QUANTIZER_RECIPES)
@pytest.mark.parametrize("shape", [(0, 256), (256, 0)])
def test_every_quantizer_takes_empty_tensors(kernels, name, shape):
    recipe = QUANTIZER_RECIPES[name]
    for role in ("input", "weight", "grad_output"):
        for axis in (0, 1):
            q = engine.quantizers(recipe, kernels=kernels)[role]
            assert q.backend.kernels is kernels
            x = torch.zeros(shape)
            out = _quantize(q, x, axis)
            ref = _quantize(engine.quantizers(recipe, kernels=kernels)[role], torch.zeros(256, 256), axis)  # zeros
            assert out.data.shape == shape and out.data.dtype == ref.data.dtype
            assert out.dequantize().shape == shape
            if q.per_tensor:                      # one scale, that of amax 0, as compute_amax(empty) == 0
                assert torch.equal(out.scale_inv, ref.scale_inv)
                continue
            b = block_for(recipe, role, axis)
            grid = tuple(1 if k == -1 else n // k for n, k in zip(shape, b))   # a whole-dimension block: one
            assert tuple(out.scale_inv.shape) == grid, (role, axis, b)
            assert out.scale_inv.dtype == ref.scale_inv.dtype
            if out.scale_inv.numel():
                assert (out.scale_inv.float() == ref.scale_inv.float().flatten()[0]).all()
            if ref.tensor_scale_inv is not None:
                assert torch.equal(out.tensor_scale_inv, ref.tensor_scale_inv)


@pytest.mark.parametrize("shape", [(0, 256), (256, 0)])
def test_the_rules_take_empty_tensors_as_the_per_tensor_path(shape):
    x = torch.zeros(shape)
    per_tensor = tensor.quantize_current(x, "e4m3")
    assert torch.equal(tensor.compute_amax(x), torch.tensor(0.0))
    whole = blockwise.quantize_fp32_scaled(x, (-1, -1))
    assert whole.scale_inv.shape == (1, 1) and torch.equal(whole.scale_inv.reshape(()), per_tensor.scale_inv)
    assert mx.quantize_mx(x, (1, 32) if shape[1] else (32, 1), "e4m3", "rceil").data.shape == shape
    t, s = nvfp4.two_level_scales(x, (16, 16))
    assert t.item() == 0.0 and s.numel() == 0
    assert hadamard.rht(x).shape == shape


# ------------------------------------------------------------------------------- the E8M0 scale at every boundary
def _boundary_amaxes(top: float) -> torch.Tensor:
    """Every power of two 2^e of FP32 (subnormals included) and 2^e * top (the RCEIL thresholds), each with its FP32
    neighbours one ulp below and above; plus 0, the smallest subnormal, FP32 max, inf and NaN."""
    out = []
    for e in range(-149, 128):
        for base in (torch.tensor(2.0 ** e), torch.tensor(2.0 ** e) * top):
            if torch.isfinite(base) and base > 0:
                out += [torch.nextafter(base, torch.tensor(0.0)), base, torch.nextafter(base, torch.tensor(float("inf")))]
    t = torch.stack(out)
    t = t[torch.isfinite(t) & (t > 0)]
    return torch.cat([t, torch.tensor([0.0, 2.0 ** -149, 3.4028234663852886e38, float("inf"), float("nan")])]).unique()


def _boundary_blocks(amax: torch.Tensor) -> torch.Tensor:
    """One 32-element block per amax: the amax itself and 31 smaller values of both signs (an inf block: one inf)."""
    frac = torch.tensor([1.0, -0.3, 0.75, 1 / 7, -0.5, 0.999, 0.001, -1.0] * 4)
    x = amax[:, None] * frac[None, :]
    x[torch.isinf(amax), 1:] = 1.0
    return x.contiguous()


def _exact_ceil_log2(v: float) -> int:
    """ceil(log2 v) of a positive finite float, exactly (v = m 2^e, m in [0.5, 1): e - 1 if m is 0.5, else e)."""
    if not (v > 0 and math.isfinite(v)):
        return 0
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


@pytest.mark.parametrize("rule,mode", [("rceil", "RCEIL"), ("floor", "FLOOR")])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_mx_scale_matches_torchao_to_mx_at_every_e8m0_boundary(elem, rule, mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from mpcourse.core.formats import FORMATS
    from mpcourse.core.quant.kernels import blocks
    top = FORMATS[elem].max
    amax = _boundary_amaxes(top)
    x = _boundary_blocks(amax)
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem]
    scale, data = mx_tensor.to_mx(x, dtype, 32, getattr(mx_tensor.ScaleCalculationMode, mode))
    want_s, want_d = scale.view(torch.uint8).flatten().clone(), data.view(torch.uint8).clone()
    if rule == "rceil":
        # torchao's eager RCEIL takes ceil of an FP32 log2(amax / top), which rounds a d just above a power of two
        # down onto it (d = 2^k (1 + 2^-23): log2 d = k in FP32); the rule is the exact ceil (cuBLAS' and TE's
        # round-up conversion, which torchao's compiled Blackwell path uses): 2^(k+1), nothing saturates.
        d = amax / top
        finite = (d > 0) & torch.isfinite(d)
        exact = torch.tensor([_exact_ceil_log2(v) for v in d.tolist()])
        eager = torch.ceil(torch.log2(d))
        coarse = finite & (eager != exact) & (exact > -127)           # torchao clamps below 2^-127 (as the rule)
        assert (eager[coarse] == exact[coarse] - 1).all()             # its log2 rounded down onto a power of two
        assert ((d[coarse] / torch.exp2(eager[coarse]) - 1) < 2.0 ** -18).all()   # within a few ulps above it
        assert coarse.sum() < len(amax) // 4
        want_s[coarse] += 1
        want_d[coarse] = (x[coarse] / torch.exp2(exact[coarse].float())[:, None]).to(dtype).view(torch.uint8)
    for quantize in (mx.quantize_mx, blocks.quantize_mx):   # torchao's divisor where k = -127: edges="torchao"
        q = quantize(x, (1, 32), elem, rule, edges="torchao")
        got_s = q.scale_inv.view(torch.uint8).flatten()
        bad = (got_s != want_s).nonzero().flatten()
        assert len(bad) == 0, [(amax[i].item(), got_s[i].item(), want_s[i].item()) for i in bad[:5]]
        assert torch.equal(q.data.view(torch.uint8), want_d), quantize
    if rule == "rceil":          # the RCEIL promise: the block max never exceeds the element max (scale <= 2^127)
        ok = finite & (exact <= 127) & (d >= 2.0 ** -126)   # a subnormal d is itself rounded (as in torchao)
        assert (x[ok].abs() / q.scale_inv.float().flatten()[ok, None] <= top).all()


# ------------------------------------------------------------------------------ settings that must not pass silently
@pytest.mark.parametrize("make,words", [
    (lambda: NVFP4BlockScaling(fp4_format="e3m2"), "fp4_format must be 'e2m1'"),
    (lambda: NVFP4BlockScaling(fp8_format=Format.HYBRID), "fp8_format must be Format.E4M3"),
    (lambda: MXFP8BlockScaling(block_len=16), "block_len must be 32"),
    (lambda: MXFP8BlockScaling(block_len=0), "block_len must be 32"),
    (lambda: MXFP8BlockScaling(block_len=-32), "block_len must be 32"),
    (lambda: Float8BlockScaling(block_len=-128), "block_len must be a positive int"),
    (lambda: Float8BlockScaling(block_len=0), "block_len must be a positive int"),
])
def test_recipe_fields_the_recipe_fixes_are_refused(make, words):
    with pytest.raises(ValueError, match=words) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("block", [(1, 0), (0, 32), (-2, 32), (1, -16)])
def test_non_positive_blocks_are_refused(block):
    with pytest.raises(ValueError, match="positive ints or -1"):
        blockwise.quantize_fp32_scaled(torch.ones(64, 64), block)


@pytest.mark.parametrize("name", QUANTIZER_RECIPES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_quantizers_refuse_what_is_not_floating(name, dtype):
    q = engine.quantizers(QUANTIZER_RECIPES[name])["input"]
    x = torch.ones(128, 128).to(dtype)
    with pytest.raises(TypeError, match="float32/bfloat16/float16") as err:
        _quantize(q, x, 1)
    assert "\n" not in str(err.value)
    for rule in (lambda: blockwise.quantize_fp32_scaled(x, (1, 128)), lambda: mx.quantize_mx(x),
                 lambda: nvfp4.quantize_nvfp4(x)):
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            rule()


@pytest.mark.parametrize("spelling", ["fp8_autocast", "autocast"])
def test_a_recipe_name_in_place_of_a_recipe_is_refused(spelling):
    from mpcourse.core.quant import autocast, fp8_autocast
    with pytest.raises(TypeError, match="recipe must be a recipe object, not the name 'mxfp8'") as err:
        with (fp8_autocast(enabled=True, fp8_recipe="mxfp8") if spelling == "fp8_autocast"
              else autocast(enabled=True, recipe="mxfp8")):
            pass
    assert "MXFP8BlockScaling" in str(err.value) and "BlockRecipe," not in str(err.value)
    with pytest.raises(TypeError, match="not the name 'mxfp8'"):
        engine.quantizers("mxfp8")


@pytest.mark.parametrize("impl", ["rule", "fastpath"])
def test_nvfp4_tensor_amax_given_is_checked(impl):
    """quantize_nvfp4's tensor_amax: a negative one used to be stored as a negative tensor scale (every element
    decoded with its sign flipped, no error), several elements failed in an internal reshape, a Python number in
    ``.float()``. A number is the one-element tensor; negative or several elements: a ValueError saying so."""
    from mpcourse.core.quant.kernels import nvfp4_quant
    from mpcourse.core.quant.rules import nvfp4

    q = nvfp4.quantize_nvfp4 if impl == "rule" else nvfp4_quant.quantize_nvfp4
    x = torch.linspace(-3, 3, 256).reshape(16, 16)
    ref = q(x, tensor_amax=torch.tensor(3.0))
    by_number = q(x, tensor_amax=3.0)
    assert torch.equal(by_number.dequantize(), ref.dequantize())
    assert torch.equal(ref.dequantize(), q(x).dequantize())            # 3 is x's amax: the same as not giving it
    with pytest.raises(ValueError, match="tensor_amax must be >= 0"):
        q(x, tensor_amax=torch.tensor(-3.0))
    with pytest.raises(ValueError, match="tensor_amax must be one number"):
        q(x, tensor_amax=torch.tensor([1.0, 2.0]))
