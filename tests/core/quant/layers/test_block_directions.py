"""A format per GEMM direction (``PerDirectionBlockScaling``, recipe ``mxfp8-fwd-nvfp4-bwd``) against the two
single-format recipes it combines and against the rules run by hand.

Oracles: the ``mxfp8`` recipe's layer (forward GEMM), the ``nvfp4`` recipe's layer (both backward GEMMs), with the
same weights, input, output gradient and generator state; and each backward GEMM written out from the rules
``mx.quantize_mx``, ``nvfp4.quantize_nvfp4`` and ``hadamard.rht`` (TE ``MXFP8BlockScaling`` / ``NVFP4BlockScaling``:
16x16 weight blocks, RHT on wgrad's inputs, stochastic rounding of dy), dequantized and multiplied in FP32.
"""
import dataclasses

import pytest
import torch

from mpcourse.core.quant import (Float8BlockScaling, Float8Linear, MXFP8BlockScaling, NVFP4BlockScaling,
                                 PerDirectionBlockScaling, autocast, quantize_mx, quantize_nvfp4, token_multiple)
from mpcourse.core.quant.layers.block_linear import check_backward_shapes
from mpcourse.core.quant.block_recipes import block_for, direction_recipe
from mpcourse.core.quant.engine import quantizers
from mpcourse.core.quant.rules.hadamard import rht
from mpcourse.experiment.recipes import NOT_IN_DEFAULT_RUN, TABLE_ORDER, get_recipe

M, K, N = 64, 128, 96


def batch(seed=0):
    """A fixed layer's weight, bias, input and output gradient, spread over a few binades with an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    b = torch.randn(N, generator=g) * 0.1
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K, base=2.0)
    x[3, 5] = 40.0
    dy = torch.randn(M, N, generator=g) * 1e-3
    return w, b, x, dy


def run(recipe, seed=0, sr_seed=7):
    """(y, dx, dW, db) of one Float8Linear under ``recipe``; the generator is seeded before the backward."""
    w, b, x, dy = batch(seed)
    layer = Float8Linear(K, N, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    x = x.clone().requires_grad_(True)
    with autocast(enabled=True, recipe=recipe):
        y = layer(x)
    torch.manual_seed(sr_seed)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


SR = {"sr-on": NVFP4BlockScaling(), "sr-off": NVFP4BlockScaling(disable_stochastic_rounding=True)}


@pytest.mark.parametrize("sr", SR)
def test_forward_equals_mxfp8_and_backward_equals_nvfp4_bit_for_bit(sr):
    nv = SR[sr]
    split = PerDirectionBlockScaling(fwd_recipe=MXFP8BlockScaling(), bwd_recipe=nv)
    y, dx, dw, db = run(split)
    y_mx = run(MXFP8BlockScaling())[0]
    _, dx_nv, dw_nv, db_nv = run(nv)
    assert same_bits(y, y_mx)                          # fprop: MXFP8's operands
    assert same_bits(dx, dx_nv) and same_bits(dw, dw_nv) and same_bits(db, db_nv)   # dgrad, wgrad: NVFP4's
    # and not trivially: the other recipe's GEMMs differ
    assert not same_bits(y, run(nv)[0]) and not same_bits(dw, run(MXFP8BlockScaling())[2])


def by_hand(operand: str, sr: bool, seed=0, sr_seed=7):
    """dx and dW of the split recipe written out from the rules: the backward copies of W and x come from the
    FP32 tensors ("source") or from the forward's MXFP8 copies dequantized ("dequantized")."""
    w, _, x, dy = batch(seed)
    if operand == "dequantized":
        w = quantize_mx(w, (1, 32), "e4m3", "rceil").dequantize(torch.float32)   # what fprop multiplied
        x = quantize_mx(x, (1, 32), "e4m3", "rceil").dequantize(torch.float32)
    rounding = "stochastic" if sr else "nearest"
    torch.manual_seed(sr_seed)
    g1 = quantize_nvfp4(dy, (1, 16), rounding=rounding).dequantize(torch.float32)          # (M, N) along N
    w1 = quantize_nvfp4(w, (16, 16)).dequantize(torch.float32)                              # (N, K) 16x16
    g0 = quantize_nvfp4(rht(dy), (16, 1), rounding=rounding).dequantize(torch.float32)     # (M, N) along M
    x0 = quantize_nvfp4(rht(x), (16, 1)).dequantize(torch.float32)                          # (M, K) along M
    return g1 @ w1, g0.t() @ x0


@pytest.mark.parametrize("sr", [True, False])
@pytest.mark.parametrize("operand", ["source", "dequantized"])
def test_backward_operands_are_quantized_from_the_stated_tensor(operand, sr):
    nv = NVFP4BlockScaling(disable_stochastic_rounding=not sr)
    _, dx, dw, _ = run(PerDirectionBlockScaling(MXFP8BlockScaling(), nv, backward_operand=operand))
    want_dx, want_dw = by_hand(operand, sr)
    assert same_bits(dx, want_dx) and same_bits(dw, want_dw)
    other = by_hand("source" if operand == "dequantized" else "dequantized", sr)
    assert not same_bits(dx, other[0]) and not same_bits(dw, other[1])   # the two ways differ


def test_dequantized_forward_is_unchanged():
    """The backward operand's source does not touch the forward GEMM."""
    y_src = run(PerDirectionBlockScaling(backward_operand="source"))[0]
    y_deq = run(PerDirectionBlockScaling(backward_operand="dequantized"))[0]
    assert same_bits(y_src, y_deq)


def rel_err(a, ref):
    return ((a - ref).norm() / ref.norm()).item()


def test_double_quantization_adds_error_to_both_backward_gemms():
    """Q_bwd(dequant(Q_fwd(t))) carries MXFP8's rounding into NVFP4's: over 8 batches, dgrad's and wgrad's error
    against FP32 is larger from the dequantized copies than from the source (round to nearest, so no draw
    decides it)."""
    nv = NVFP4BlockScaling(disable_stochastic_rounding=True)
    errs = {"source": [0.0, 0.0], "dequantized": [0.0, 0.0]}
    for seed in range(8):
        w, _, x, dy = batch(seed)
        for operand in errs:
            _, dx, dw, _ = run(PerDirectionBlockScaling(MXFP8BlockScaling(), nv, backward_operand=operand), seed)
            errs[operand][0] += rel_err(dx, dy @ w)
            errs[operand][1] += rel_err(dw, dy.t() @ x)
    assert errs["dequantized"][0] > errs["source"][0] and errs["dequantized"][1] > errs["source"][1]


def test_which_recipe_quantizes_what():
    split = PerDirectionBlockScaling()
    fwd, bwd = split.fwd_recipe, split.bwd_recipe
    assert direction_recipe(split, "input", 1) is fwd and direction_recipe(split, "weight", 1) is fwd
    for role, axis in (("grad_output", 1), ("grad_output", 0), ("weight", 0), ("input", 0)):
        assert direction_recipe(split, role, axis) is bwd
    assert block_for(split, "input", 1) == (1, 32) and block_for(split, "input", 0) == (16, 1)
    assert block_for(split, "weight", 0) == (16, 16) and block_for(split, "grad_output", 1) == (1, 16)
    q = quantizers(split)
    assert [q[k].recipe for k in ("input", "weight", "grad_output", "wgrad_input", "dgrad_weight")] == \
        [fwd, fwd, bwd, bwd, bwd]
    q1 = quantizers(MXFP8BlockScaling())                  # a single-format recipe: all its own
    assert {q1[k].recipe for k in q1} == {MXFP8BlockScaling()}
    # MXFP8's blocks run along K only in the forward: the token count needs NVFP4's 16, not 32
    assert token_multiple(split) == 16 and token_multiple(MXFP8BlockScaling()) == 32
    check_backward_shapes(split, (48, K), N, (True, True))
    with pytest.raises(ValueError, match="multiple of 16"):
        check_backward_shapes(split, (40, K), N, (True, True))


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="'source'.*'dequantized'"):
        PerDirectionBlockScaling(backward_operand="fp32")
    with pytest.raises(TypeError, match="single-format block recipe"):
        PerDirectionBlockScaling(fwd_recipe=PerDirectionBlockScaling())
    with pytest.raises(TypeError, match="single-format block recipe"):
        PerDirectionBlockScaling(bwd_recipe="nvfp4")
    with pytest.raises(TypeError, match="single-format block recipe"):
        PerDirectionBlockScaling(fwd_recipe=Float8BlockScaling, bwd_recipe=NVFP4BlockScaling())   # the class


def test_registered_recipe_is_the_two_rows_recipes_and_follows_nvfp4():
    split = get_recipe("mxfp8-fwd-nvfp4-bwd").fp8_recipe
    assert split.fwd_recipe == get_recipe("mxfp8").fp8_recipe
    assert split.bwd_recipe == get_recipe("nvfp4").fp8_recipe          # RHT and SR as the nvfp4 row has them
    assert split.backward_operand == "source"
    assert TABLE_ORDER.index("mxfp8-fwd-nvfp4-bwd") > TABLE_ORDER.index("nvfp4")
    assert "mxfp8-fwd-nvfp4-bwd" in NOT_IN_DEFAULT_RUN
    assert dataclasses.replace(split, backward_operand="dequantized") != split
