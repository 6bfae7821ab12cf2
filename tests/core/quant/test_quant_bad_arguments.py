"""Arguments the quant modules used to take silently: each is now one clear error (one line, no traceback from deep
inside) naming what is allowed.

* MX blocks: OCP MX v1.0 defines 32 elements sharing one scale along one dimension, (1, 32) or (32, 1); a (2, 32)
  block (64 elements per scale), a (1, 16) or a whole-row block quantized as if it were MX.
* NVFP4 blocks: 16 elements along a row or a column, or the 16 x 16 weight blocks (NVIDIA's recipe); any other
  block shape gave block scales of another granularity under NVFP4's name.
* ``edge_blocks_filter(3.5)``, ``edge_blocks_filter(True)``, a float or bool ``first``/``last``: the comparison
  ``first <= i < n_blocks - last`` took them (3.5 blocks, True as 1); a non-string ``container`` failed later inside
  a regex, or matched nothing.
* ``is_small_gemm`` with a size that is no positive int (0, -16, 16.0, True) decided on it; ``all_of`` with
  something that is not a filter, or with no filter (which converts every layer), built a filter.
* ``MXFP8BlockScaling(block_len=32.0)``: a float equal to 32 passed the ``== 32`` check.
* a block given as one number (``quantize_fp32_scaled(x, 32)``) failed with "object of type 'int' has no len()".
* the block recipes' switches and sizes: ``NVFP4BlockScaling(disable_rht="False")`` turned the transform off (a
  non-empty string is true), ``rht_seed=True`` / ``1.5`` seeded a generator, ``Float8BlockScaling(
  x_block_scaling_dim=True)`` or ``2.0`` passed the ``in (1, 2)`` check, ``power_2_scales="no"`` meant yes.

Each case was accepted (or failed with an unrelated message) before the fix.
"""
import pytest
import torch
import torch.nn as nn

from mpcourse.core.quant import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from mpcourse.core.quant.kernels import blocks, nvfp4_quant
from mpcourse.core.quant.layers.module_filter import all_of, edge_blocks_filter, is_small_gemm
from mpcourse.core.quant.rules import blockwise, mx, nvfp4

X = torch.randn(64, 64)


def refused(error, words, call):
    with pytest.raises(error, match=words) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("block", [(2, 32), (1, 16), (1, 64), (32, 32), (1, -1), (-1, 1), (16, 1)], ids=str)
@pytest.mark.parametrize("impl", ["rule", "fastpath"])
def test_mx_takes_only_the_two_mx_blocks(impl, block):
    q = mx.quantize_mx if impl == "rule" else blocks.quantize_mx
    msg = refused(ValueError, r"MX blocks are \(1, 32\) or \(32, 1\)", lambda: q(X, block))
    assert str(tuple(block)) in msg
    enc = mx.encode_mx if impl == "rule" else blocks.encode_mx
    refused(ValueError, r"MX blocks are \(1, 32\) or \(32, 1\)",
            lambda: enc(X, block, "e4m3", torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)))


@pytest.mark.parametrize("block", [(1, 32), (32, 1)], ids=str)
def test_the_mx_blocks_still_quantize(block):
    for q in (mx.quantize_mx, blocks.quantize_mx):
        assert q(X, block).block == block


@pytest.mark.parametrize("block", [(2, 16), (1, 32), (32, 32), (1, -1), (16, 2), (8, 8)], ids=str)
@pytest.mark.parametrize("impl", ["rule", "fastpath"])
def test_nvfp4_takes_only_its_three_blocks(impl, block):
    q = nvfp4.quantize_nvfp4 if impl == "rule" else nvfp4_quant.quantize_nvfp4
    words = r"NVFP4 blocks are \(1, 16\), \(16, 1\) or \(16, 16\)"
    msg = refused(ValueError, words, lambda: q(X, block))
    assert str(tuple(block)) in msg
    refused(ValueError, words, lambda: nvfp4.two_level_scales(X, block))
    t, s = nvfp4.two_level_scales(X)
    enc = nvfp4.encode_nvfp4 if impl == "rule" else nvfp4_quant.encode_nvfp4
    refused(ValueError, words, lambda: enc(X, block, t, s))


@pytest.mark.parametrize("block", [(1, 16), (16, 1), (16, 16)], ids=str)
def test_the_nvfp4_blocks_still_quantize(block):
    for q in (nvfp4.quantize_nvfp4, nvfp4_quant.quantize_nvfp4):
        assert q(X, block).block == block


@pytest.mark.parametrize("args", [(3.5,), (True,), (4, 1.0), (4, 0, True), (4, False, 1), (4.0, 0, 1), ("4",)],
                         ids=repr)
def test_edge_blocks_filter_takes_ints_only(args):
    msg = refused(TypeError, r"edge_blocks_filter: n_blocks, first and last must be ints",
                  lambda: edge_blocks_filter(*args))
    assert "bool" in msg


@pytest.mark.parametrize("container", [None, 0, ("blocks",)], ids=repr)
def test_edge_blocks_filter_takes_a_container_path_string(container):
    refused(TypeError, r"container must be a string", lambda: edge_blocks_filter(4, container=container))


def test_the_valid_edge_filters_still_decide():
    f = edge_blocks_filter(4, 1, 1)
    assert [f(None, f"blocks.{i}.mlp.fc") for i in range(4)] == [False, True, True, False]


@pytest.mark.parametrize("k,n", [(0, 16), (-16, 16), (16, 0), (16.0, 16), (True, 16), (16, None)], ids=repr)
def test_is_small_gemm_takes_positive_int_sizes(k, n):
    refused((TypeError, ValueError), r"is_small_gemm: k and n .*positive ints", lambda: is_small_gemm(k, n))


def test_all_of_takes_filters():
    refused(TypeError, r"all_of takes module filters, .*got int", lambda: all_of(lambda m, f: True, 3))
    refused(ValueError, r"all_of needs at least one filter", lambda: all_of())
    assert all_of(lambda m, f: True, lambda m, f: f != "head")(nn.Linear(1, 1), "head") is False


@pytest.mark.parametrize("block_len", [32.0, 32.5, "32"], ids=repr)
def test_mxfp8_block_len_is_the_int_32(block_len):
    refused(ValueError, r"block_len must be 32", lambda: MXFP8BlockScaling(block_len=block_len))


@pytest.mark.parametrize("block", [32, "1x32", None], ids=repr)
def test_a_block_that_is_not_a_pair_is_one_clear_error(block):
    refused(ValueError, r"a block is \(rows, cols\)", lambda: blockwise.quantize_fp32_scaled(X, block))


@pytest.mark.parametrize("kw", [dict(disable_rht="False"), dict(disable_stochastic_rounding=0),
                                dict(disable_2d_quantization=None)], ids=repr)
def test_nvfp4_switches_are_bools(kw):
    refused(TypeError, r"NVFP4BlockScaling\.disable_\w+ must be True or False", lambda: NVFP4BlockScaling(**kw))


@pytest.mark.parametrize("seed", [True, 1.5, "0"], ids=repr)
def test_nvfp4_rht_seed_is_an_int(seed):
    refused(TypeError, r"rht_seed must be an int", lambda: NVFP4BlockScaling(rht_seed=seed))


@pytest.mark.parametrize("kw,error,words", [
    (dict(x_block_scaling_dim=True), ValueError, r"x_block_scaling_dim must be 1 .* or 2"),
    (dict(grad_block_scaling_dim=1.0), ValueError, r"grad_block_scaling_dim must be 1 .* or 2"),
    (dict(power_2_scales="no"), TypeError, r"Float8BlockScaling\.power_2_scales must be True or False"),
    (dict(fp8_dpa=0), TypeError, r"fp8_dpa must be True or False"),
], ids=repr)
def test_float8_block_scaling_fields_take_their_types(kw, error, words):
    refused(error, words, lambda: Float8BlockScaling(**kw))


def test_the_default_block_recipes_still_build():
    assert NVFP4BlockScaling(disable_rht=True, rht_seed=3).rht_seed == 3
    assert Float8BlockScaling(power_2_scales=False, w_block_scaling_dim=1).w_block_scaling_dim == 1
