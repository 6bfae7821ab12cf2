"""The FP8 layer off the happy path: conversion, gradients, checkpoints, odd inputs, mismatched ranks.

Oracles run side by side: torchao 0.18 (``torchao/float8``: ``convert_to_float8_training`` refuses a root
``nn.Linear`` with children; ``hp_tensor_and_scale_to_float8(...).to_original_precision()`` is
straight-through), ``nn.Linear`` (what inputs a linear layer takes and what it returns for them),
``safetensors`` and ``torch.save``. The torchao checks are skipped when torchao is not installed.
"""
import copy
import io
import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from mpcourse.core.quant import (CurrentScaling, DelayedScaling, Float8Linear, convert_to_float8_training,
                                 fp8_autocast, quantize_current, to_float8)

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.float8 as ao_float8
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
except Exception:  # not installed, or built for another torch
    ao_float8 = None

needs_torchao = pytest.mark.skipif(ao_float8 is None, reason="needs torchao (pip install --no-deps torchao)")


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _train_steps(model, recipe, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        with fp8_autocast(fp8_recipe=recipe):
            loss = model(torch.randn(8, 16, generator=g) * 3).square().mean()
        loss.backward()


# -- conversion ---------------------------------------------------------------------------------------------

def test_root_linear_with_children_is_refused_like_torchao():
    def root():
        m = nn.Linear(8, 8)
        m.extra = nn.Linear(8, 8)  # a child that a swap of the root would drop
        return m
    with pytest.raises(ValueError, match="child modules"):
        convert_to_float8_training(root())
    if ao_float8 is not None:
        with pytest.raises(AssertionError, match="root nn.Linear with children"):
            ao_float8.convert_to_float8_training(root())
    assert isinstance(convert_to_float8_training(nn.Linear(8, 8)), Float8Linear)  # a bare root still converts


# -- gradients ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_backward_is_straight_through(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, generator=g) * 300).to(dtype)  # many values saturate E4M3 at scale 1
    gy = torch.randn(64, generator=g).to(dtype)  # gradients that FP8 cannot represent
    for make in (lambda t: to_float8(t, "e4m3", 1.0), lambda t: quantize_current(t, "e5m2")):
        xr = x.clone().requires_grad_(True)
        make(xr).dequantize().backward(gy)
        assert torch.equal(xr.grad, gy)  # identity: neither rounded to FP8 nor zeroed where x saturated
    xr = x.clone().requires_grad_(True)
    q = to_float8(xr.reshape(8, 8), "e4m3", 2.0)
    q.t().dequantize(torch.float32).backward(gy.reshape(8, 8).t().float())
    assert torch.equal(xr.grad, gy)  # the transposed view keeps the path to its source
    if ao_float8 is not None:
        xa = x.clone().requires_grad_(True)
        hp_tensor_and_scale_to_float8(xa, torch.tensor(1.0), torch.float8_e4m3fn).to_original_precision().backward(gy)
        assert torch.equal(xa.grad, gy)  # torchao's rule, side by side


def test_quantize_without_grad_keeps_no_reference():
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        assert to_float8(x, "e4m3", 1.0).source is None
    assert to_float8(x.detach(), "e4m3", 1.0).source is None
    assert not to_float8(x, "e4m3", 1.0).data.requires_grad


# -- checkpoints --------------------------------------------------------------------------------------------

def test_checkpoint_from_before_conversion_loads_and_starts_fp8_state_fresh():
    recipe = DelayedScaling(amax_history_len=4)
    plain = _mlp()
    ckpt = plain.state_dict()
    model = convert_to_float8_training(_mlp(), recipe=recipe)
    _train_steps(model, recipe)  # non-trivial FP8 state that the loaded weights must not inherit
    assert float(model[0].scaling_state["input"].scale) != 1.0
    result = model.load_state_dict(ckpt)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, p in plain.named_parameters():
        assert torch.equal(model.get_parameter(name), p)
    fresh = convert_to_float8_training(_mlp(), recipe=recipe)
    for layer, new in ((model[0], fresh[0]), (model[2], fresh[2])):
        assert torch.equal(layer.get_extra_state(), new.get_extra_state())  # scale 1, empty history
    if ao_float8 is not None:  # torchao's converted model takes the same checkpoint (it has no FP8 state)
        ao = ao_float8.convert_to_float8_training(_mlp(), config=ao_float8.Float8LinearConfig(emulate=True))
        ao.load_state_dict(ckpt)
    missing = model.load_state_dict({k: v for k, v in ckpt.items() if k != "0.weight"}, strict=False).missing_keys
    assert missing == ["0.weight"]  # other missing keys are still reported


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()])
def test_converted_state_dict_round_trips_through_safetensors_and_torch_save(recipe):
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(3)
    model = convert_to_float8_training(_mlp(), recipe=recipe)
    _train_steps(model, recipe)
    want = model.state_dict()
    buf = io.BytesIO()
    torch.save(want, buf)
    buf.seek(0)
    for loaded in (st.load(st.save(want)), torch.load(buf, weights_only=True)):
        other = convert_to_float8_training(_mlp(), recipe=recipe)
        other.load_state_dict(loaded)
        got = other.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        _train_steps(other, recipe, steps=1, seed=9)  # and they continue identically
        twin = copy.deepcopy(model)
        _train_steps(twin, recipe, steps=1, seed=9)
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), twin.state_dict().values()))


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), -2.0])
def test_checkpoint_with_a_bad_fp8_scale_is_refused_at_load_time(bad):
    recipe = DelayedScaling(amax_history_len=4)
    model = convert_to_float8_training(_mlp(), recipe=recipe)
    _train_steps(model, recipe)
    ckpt = model.state_dict()
    target = convert_to_float8_training(_mlp(), recipe=recipe)
    before = target[2].get_extra_state().clone()
    damaged = dict(ckpt)
    damaged["2._extra_state"] = ckpt["2._extra_state"].clone()
    damaged["2._extra_state"][2, 0] = bad  # the grad_output scale
    with pytest.raises(ValueError, match="finite and > 0"):
        target.load_state_dict(damaged)
    assert torch.equal(target[2].get_extra_state(), before)  # nothing of that layer changed
    legacy = {"recipe": repr(recipe), **{r: s.state_dict() for r, s in model[2].scaling_state.items()}}
    legacy["weight"]["scale"] = torch.tensor(bad)
    with pytest.raises(ValueError, match="'weight'.*finite and > 0"):  # the earlier dict format too
        target[2].set_extra_state(legacy)


def test_checkpoint_of_another_recipe_names_the_fix():
    delayed = convert_to_float8_training(_mlp(), recipe=DelayedScaling(amax_history_len=4))
    current = convert_to_float8_training(_mlp(), recipe=CurrentScaling())
    with pytest.raises(ValueError, match="checkpoint's recipe"):
        delayed.load_state_dict(current.state_dict())
    current.load_state_dict(delayed.state_dict())  # current scaling needs no saved scales


# -- inputs -------------------------------------------------------------------------------------------------

def _pair(K=16, N=8, bias=True):
    ref = nn.Linear(K, N, bias=bias)
    return ref, Float8Linear.from_float(copy.deepcopy(ref), recipe=CurrentScaling())


def test_wrong_feature_size_names_the_fix():
    ref, layer = _pair()
    for x in (torch.randn(4, 32), torch.randn(32), torch.randn(2, 8), torch.tensor(1.0)):
        with pytest.raises(RuntimeError):
            ref(x)  # nn.Linear refuses these too, with a matmul message
        with pytest.raises(ValueError, match=r"in_features=16.*\(\.\.\., 16\)"):
            layer(x)


def test_transposed_and_non_contiguous_inputs_work_like_contiguous_ones():
    ref, layer = _pair()
    base = torch.randn(16, 12)
    for x in (base.t(), torch.randn(12, 32)[:, ::2], torch.randn(3, 16, 4).transpose(1, 2)):
        assert not x.is_contiguous()
        want_shape = ref(x).shape
        xa, xb = x.clone().requires_grad_(True), x.contiguous().requires_grad_(True)
        ya, yb = layer(xa), layer(xb)
        assert ya.shape == want_shape and torch.equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    assert layer(torch.randn(16)).shape == (8,)  # a 1-D input, as nn.Linear takes it


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_empty_batch_and_zero_features_match_nn_linear(shape):
    ref, layer = _pair(K=shape[1])
    with torch.no_grad():
        ref.bias.uniform_(-1, 1)
        layer.bias.copy_(ref.bias)
    xa, xb = torch.randn(shape, requires_grad=True), None
    xb = xa.detach().clone().requires_grad_(True)
    ya, yb = layer(xa), ref(xb)
    assert ya.shape == yb.shape and torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_meta_tensors_give_shapes_and_device_mismatch_names_the_fix():
    layer = Float8Linear(16, 8, device="meta", recipe=DelayedScaling(amax_history_len=4))
    y = layer(torch.randn(3, 5, 16, device="meta", dtype=torch.bfloat16))
    assert y.device.type == "meta" and y.shape == (3, 5, 8) and y.dtype == torch.bfloat16
    _, cpu_layer = _pair()
    with pytest.raises(ValueError, match="move one of them"):
        cpu_layer(torch.randn(4, 16, device="meta"))


# -- many processes -----------------------------------------------------------------------------------------

def _mismatch_worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))  # a hang fails the test instead of blocking CI
    try:
        recipe = DelayedScaling(amax_history_len=4)
        out = {}
        # Case 1: same number of layers, different layers (rank 1's is wider).
        layer = Float8Linear(16, 16 * (rank + 1), bias=False, recipe=recipe)
        before = layer.get_extra_state().clone()
        try:
            with fp8_autocast(fp8_recipe=recipe):
                layer(torch.randn(4, 16))
            out["different_layers"] = "no error"
        except RuntimeError as e:
            out["different_layers"] = str(e)
        out["unchanged"] = torch.equal(layer.get_extra_state()[:, 0], before[:, 0])  # scales
        # Case 2: a different number of layers (rank 0 runs one more): never a hang.
        model = nn.Sequential(*[Float8Linear(16, 16, bias=False, recipe=recipe) for _ in range(2 - rank)])
        try:
            with fp8_autocast(fp8_recipe=recipe):
                model(torch.randn(4, 16))
            out["different_count"] = "no error"
        except RuntimeError as e:
            out["different_count"] = str(e)
        # Case 3: the same layers still reduce (the check lets matching ranks through).
        same = Float8Linear(16, 16, bias=False, recipe=recipe)
        with fp8_autocast(fp8_recipe=recipe):
            same(torch.full((4, 16), float(rank + 1)))
        out["same_scale"] = float(same.scaling_state["input"].scale)
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_amax_all_reduce_refuses_ranks_that_ran_different_layers():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_mismatch_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        outs = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(2)]
    for out in outs:
        assert "ran different FP8 layers" in out["different_layers"] and out["unchanged"]
        assert "between 2 and 4" in out["different_count"]  # input + weight state per layer
        assert out["same_scale"] == 224.0  # 448 / max(1, 2): the ordinary reduce still happens
