"""Empty tensors on every quantizer and GEMM path: (0, K), (K, 0) and (0, 0) inputs give correctly shaped empty
outputs, no exception, as the per-tensor path does.

The rule the per-tensor path sets (``tensor.compute_amax`` of an empty tensor is 0, so its scale is that of amax 0)
carries over to blocks (``scaled.resolve_block``): a whole-dimension block (-1) along an empty dimension still counts
as one block, a fixed-size block along it gives none; every scale is the one an all-zero block gets. Checked for the
rules and both kernels (``fastpath``'s torch bodies and ``fused``'s numba passes), with and without the kept FP32
copy, for FP32-scaled FP8 (1x128, 128x1, 128x128, rowwise, columnwise, tensorwise, 1x32, 1x16, 16x16), MX (1x32,
32x1; every element format, both scale rules, both edge policies), NVFP4 (1x16, 16x1, 16x16, its only blocks;
nearest and stochastic, with the random Hadamard transform of the weight-gradient path) and the per-tensor casts,
in float32 and bfloat16; then the GEMMs (emulated, ``F.scaled_mm`` where the CPU runs it, per-tensor FP8, the
accumulator model): an (M, 0) @ (0, N) product is (M, N) zeros. Last, a converted linear layer under every recipe
trains on an empty batch, on zero input features and on zero output features.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling, Format,
                                 MXFP8BlockScaling, NVFP4BlockScaling, PerDirectionBlockScaling,
                                 convert_to_float8_training, engine, fp8_gemm)
from mpcourse.core import kernels_switch
from mpcourse.core.quant.kernels import blocks, jit, nvfp4_quant, per_tensor, upcast
from mpcourse.core.quant.rules import blockwise, hadamard, mx, nvfp4, tensor
from mpcourse.core.quant.layers.block_gemm import accumulator_model_gemm, emulated_gemm, scaled_gemm
from mpcourse.core.quant.rules.scaled import block_amax, grid, resolve_block

SHAPES = [(0, 256), (256, 0), (0, 0)]
FP32_BLOCKS = [(1, 128), (128, 1), (128, 128), (1, -1), (-1, 1), (-1, -1), (1, 32), (32, 1), (1, 16), (16, 16)]
MX_BLOCKS = [(1, 32), (32, 1)]
NVFP4_BLOCKS = [(1, 16), (16, 1), (16, 16)]            # nvfp4.NVFP4_BLOCKS: any other is refused
PATHS = ["rule", "numba", "torch"]


@contextlib.contextmanager
def path(name: str):
    """The rule ("rule": the call given is the rule's) or ``fastpath`` with numba's passes ("numba") or its torch
    bodies ("torch": ``fused`` off)."""
    if name == "numba" and not jit.AVAILABLE:
        pytest.skip("numba is not installed (or MPCOURSE_FUSED=0)")
    with pytest.MonkeyPatch.context() as mp:
        if name == "torch":
            mp.setattr(jit, "COMPILED", False)
        yield


def expected_grid(shape, block) -> tuple[int, int]:
    """The scale grid of an empty ``shape``: one block along a dimension a -1 block spans, n / b otherwise."""
    return tuple(1 if b == -1 else n // b for n, b in zip(shape, block))


def check_empty(q, x: torch.Tensor, block, zero_ref) -> None:
    """q (a ScaledTensor) of the empty x: data of x's shape, the scale grid of ``block``, each scale that of an
    all-zero block (``zero_ref``: the same quantizer on zeros), dequantized copies of x's shape and dtype."""
    assert tuple(q.data.shape) == tuple(x.shape) and q.data.dtype == zero_ref.data.dtype
    assert tuple(q.scale_inv.shape) == expected_grid(x.shape, block), (tuple(q.scale_inv.shape), block)
    assert q.scale_inv.dtype == zero_ref.scale_inv.dtype
    if q.scale_inv.numel():
        want = zero_ref.scale_inv.float().flatten()[0]
        assert torch.equal(q.scale_inv.float(), torch.full(q.scale_inv.shape, float(want))), block
    if zero_ref.tensor_scale_inv is not None:
        assert torch.equal(q.tensor_scale_inv, zero_ref.tensor_scale_inv)
    for d, dtype in ((q.dequantize(), x.dtype), (q.dequantize_fp32(), torch.float32),
                     (upcast.dequantize(q, torch.float32), torch.float32)):
        assert tuple(d.shape) == tuple(x.shape) and d.dtype == dtype


# ------------------------------------------------------------------------------------------------ quantizers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("block", FP32_BLOCKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_scaled_quantizers_take_empty_tensors(shape, block, mode, dtype):
    x = torch.zeros(shape, dtype=dtype)
    zeros = torch.zeros(256, 256, dtype=dtype)
    for p2 in (False, True):
        with path(mode):
            if mode == "rule":
                q, ref = (blockwise.quantize_fp32_scaled(t, block, "e4m3", power_2_scale=p2) for t in (x, zeros))
                check_empty(q, x, block, ref)
                continue
            for keep in (False, True):
                q, ref = (blocks.quantize_fp32_scaled(t, block, "e4m3", power_2_scale=p2, keep_fp32=keep)
                          for t in (x, zeros))
                check_empty(q, x, block, ref)


@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("block", MX_BLOCKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mx_quantizers_take_empty_tensors(shape, block, mode):
    """Every element format (E5M2 with the kept FP32 copy included), both scale rules, both edge policies."""
    x = torch.zeros(shape)
    zeros = torch.zeros(256, 256)
    for elem in ("e4m3", "e5m2", "e2m1", "e2m3", "e3m2"):
        for rule in ("floor", "rceil"):
            for edges in ("course", "torchao"):
                with path(mode):
                    if mode == "rule":
                        q, ref = (mx.quantize_mx(t, block, elem, rule, edges=edges) for t in (x, zeros))
                        check_empty(q, x, block, ref)
                        continue
                    for keep in (False, True):
                        q, ref = (blocks.quantize_mx(t, block, elem, rule, keep_fp32=keep, edges=edges)
                                  for t in (x, zeros))
                        check_empty(q, x, block, ref)


@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("block", NVFP4_BLOCKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nvfp4_quantizers_take_empty_tensors(shape, block, mode):
    """Nearest and stochastic rounding, with and without the random Hadamard transform (16-row groups: any empty
    shape has whole groups), both edge policies; t = 0 as for an all-zero tensor."""
    x = torch.zeros(shape)
    zeros = torch.zeros(256, 256)
    for rounding in ("nearest", "stochastic"):
        for rht in (False, True):
            for edges in ("course", "torchao"):
                with path(mode):
                    transform = hadamard.rht if mode == "rule" else nvfp4_quant.rht
                    xs = [transform(t) if rht else t for t in (x, zeros)]
                    assert tuple(xs[0].shape) == shape
                    if mode == "rule":
                        q, ref = (nvfp4.quantize_nvfp4(t, block, rounding=rounding, edges=edges) for t in xs)
                        check_empty(q, x, block, ref)
                        assert float(q.tensor_scale_inv) == 0.0
                        continue
                    for keep in (False, True):
                        q, ref = (nvfp4_quant.quantize_nvfp4(t, block, rounding=rounding, keep_fp32=keep, edges=edges)
                                  for t in xs)
                        check_empty(q, x, block, ref)
                        assert float(q.tensor_scale_inv) == 0.0
    t, s = nvfp4.two_level_scales(x, block)
    assert float(t) == 0.0 and tuple(s.shape) == expected_grid(shape, block)


def test_resolve_block_takes_its_own_result():
    """A block resolved for an empty dimension (-1 -> 0) resolves to itself, so a rule that resolves twice
    (``quantize_nvfp4`` then ``two_level_scales``) takes whole-dimension blocks of empty tensors; a 0 along a non-empty
    dimension is still refused."""
    for shape in SHAPES:
        for block in NVFP4_BLOCKS + FP32_BLOCKS:
            b = resolve_block(shape, block)
            assert resolve_block(shape, b) == b and grid(shape, b) == expected_grid(shape, block)
    with pytest.raises(ValueError, match="positive ints or -1"):
        resolve_block((16, 256), (0, 16))


@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_per_tensor_casts_and_reductions_take_empty_tensors(shape, mode):
    x = torch.zeros(shape)
    for fmt in ("e4m3", "e5m2"):
        with path(mode):
            if mode == "rule":
                amax, q = tensor.compute_amax(x), tensor.quantize_current(x, fmt)
            else:
                amax = per_tensor.compute_amax(x)
                q = per_tensor.to_float8(x, fmt, tensor.compute_scale(amax, tensor.fp8_max(fmt)))
            assert float(amax) == 0.0 and float(q.scale_inv) == 1.0
            assert tuple(q.data.shape) == shape and tuple(q.dequantize().shape) == shape
            codes = torch.zeros(shape).to(q.data.dtype)
            up = codes.float() if mode == "rule" else upcast.fp8_to_float32(codes, torch.tensor(2.0))
            assert tuple(up.shape) == shape and up.dtype == torch.float32
            for block in FP32_BLOCKS + NVFP4_BLOCKS:
                b = resolve_block(shape, block)
                got = (block_amax if mode == "rule" else blocks.block_amax)(x, b)
                assert tuple(got.shape) == expected_grid(shape, block) and not bool(got.any())


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_engine_quantizers_take_empty_tensors_on_every_role_axis_and_gemm(shape, kernels):
    """The engine's quantizers of every recipe (the HYBRID MXFP8 recipe's E5M2 gradients, NVFP4's weight-gradient
    copies with the Hadamard transform, the per-direction recipe's backward copies), along both axes, with and
    without the kept FP32 copy."""
    recipes = [Float8RowwiseScaling(), Float8BlockScaling(), MXFP8BlockScaling(fp8_format=Format.HYBRID),
               MXFP8BlockScaling(scale_rule="floor"), NVFP4BlockScaling(), PerDirectionBlockScaling()]
    for recipe in recipes:
        q = engine.quantizers(recipe, kernels=kernels)
        for role, quantizer in q.items():
            for axis in (0, 1):
                for wgrad in (False, True):
                    for keep in (None, False, True):
                        st = quantizer(torch.zeros(shape), axis, wgrad=wgrad, keep_fp32=keep)
                        assert tuple(st.data.shape) == shape and tuple(st.dequantize_fp32().shape) == shape, \
                            (type(recipe).__name__, role, axis)


# ------------------------------------------------------------------------------------------------ GEMMs
QUANTIZERS = {
    "tensorwise": lambda t: blockwise.quantize_fp32_scaled(t, (-1, -1)),
    "rowwise": lambda t: blocks.quantize_fp32_scaled(t, (1, -1), power_2_scale=True, keep_fp32=True),
    "1x128": lambda t: blocks.quantize_fp32_scaled(t, (1, 128), power_2_scale=True, keep_fp32=True),
    "mxfp8": lambda t: blocks.quantize_mx(t, (1, 32), "e4m3", "rceil", keep_fp32=True),
    "mxfp8-e5m2-rule": lambda t: mx.quantize_mx(t, (1, 32), "e5m2", "floor"),
    "nvfp4": lambda t: nvfp4_quant.quantize_nvfp4(t, (1, 16), keep_fp32=True),
    "nvfp4-rule": lambda t: nvfp4.quantize_nvfp4(t, (1, 16)),
}
MKN = [(0, 256, 128), (128, 0, 128), (128, 256, 0), (0, 0, 0), (0, 0, 128), (128, 0, 0)]


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("mkn", MKN, ids=str)
def test_block_scaled_gemms_on_empty_operands(mkn, name):
    M, K, N = mkn
    a = QUANTIZERS[name](torch.randn(M, K))
    # E5M2 x E5M2 is refused: the E5M2 rule's weight in E4M3
    b = mx.quantize_mx(torch.randn(N, K), (1, 32), "e4m3", "floor") if name == "mxfp8-e5m2-rule" \
        else QUANTIZERS[name](torch.randn(N, K))
    backends = ["auto", "emulate"] + (["native"] if name in ("tensorwise", "rowwise") else [])
    for out_dtype in (torch.float32, torch.bfloat16):
        for backend in backends:
            y = scaled_gemm(a, b.t(), out_dtype, route=backend)
            assert tuple(y.shape) == (M, N) and y.dtype == out_dtype, backend
            assert K or not bool(y.any()), backend                # an empty contraction: zeros
        y = emulated_gemm(a, b.t(), out_dtype)
        assert tuple(y.shape) == (M, N) and (K or not bool(y.any()))


@pytest.mark.parametrize("mkn", MKN, ids=str)
def test_per_tensor_gemms_on_empty_operands(mkn):
    M, K, N = mkn
    a8, w8 = tensor.quantize_current(torch.randn(M, K), "e4m3"), tensor.quantize_current(torch.randn(N, K), "e4m3")
    for out_dtype in (torch.float32, torch.bfloat16):
        y = fp8_gemm(a8, w8.t(), out_dtype)
        assert tuple(y.shape) == (M, N) and y.dtype == out_dtype
        z = upcast.cpu_scaled_mm(a8.data, w8.data.t(), a8.scale_inv, w8.scale_inv, out_dtype)
        assert tuple(z.shape) == (M, N) and z.dtype == out_dtype
        if K == 0:
            assert not bool(y.any()) and not bool(z.any())
    acc = accumulator_model_gemm(torch.randn(M, K), torch.randn(K, N))
    assert tuple(acc.shape) == (M, N) and (K or not bool(acc.any()))


# ------------------------------------------------------------------------------------------------ layers
LAYER_RECIPES = {"fp8-current": CurrentScaling(), "fp8-delayed": DelayedScaling(),
                 "fp8-rowwise": Float8RowwiseScaling(), "fp8-block": Float8BlockScaling(),
                 "mxfp8": MXFP8BlockScaling(fp8_format=Format.HYBRID), "nvfp4": NVFP4BlockScaling(),
                 "mxfp8-fwd-nvfp4-bwd": PerDirectionBlockScaling()}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("name", LAYER_RECIPES)
@pytest.mark.parametrize("mkn", [(0, 256, 128), (128, 0, 128), (128, 256, 0), (0, 0, 0)], ids=str)
def test_float8_linear_trains_on_empty_shapes(mkn, name, kernels):
    """Forward and backward: y (M, N), dx (M, K), dW (N, K), the bias gradient (N,), all finite; an empty
    contraction gives zeros (K = 0: y is the bias alone; M = 0: dW and the bias gradient are zeros)."""
    M, K, N = mkn
    torch.manual_seed(0)
    with kernels_switch.flags(enabled=kernels):           # the layer's quantizers and GEMMs: kernels or rules
        lin = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(K, N)), recipe=LAYER_RECIPES[name])
    assert lin[0].quantizers["input"].backend.kernels is kernels
    x = torch.randn(M, K, requires_grad=True)
    y = lin(x)
    assert tuple(y.shape) == (M, N)
    if K == 0:
        assert torch.equal(y, lin[0].bias.detach().expand(M, N))
    y.backward(torch.randn(M, N))
    assert tuple(x.grad.shape) == (M, K) and tuple(lin[0].weight.grad.shape) == (N, K)
    if M == 0:
        assert not bool(lin[0].weight.grad.any()) and not bool(lin[0].bias.grad.any())
    for t in (y, x.grad, lin[0].weight.grad, lin[0].bias.grad):
        assert torch.isfinite(t).all()
