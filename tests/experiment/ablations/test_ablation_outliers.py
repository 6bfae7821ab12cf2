"""Lesson 09's planted outlier channels (``ablations.outlier_channels``): FP32 trains bit for bit as the
unplanted model, the planted layers' inputs hold outlier channels 2^20 times the rest, and per-tensor E4M3
flushes the ordinary channels there while 1x32 MX blocks without an outlier keep them."""
import pytest
import torch

from mpcourse.core.quant import quantize_fp32_scaled, quantize_mx
from mpcourse.experiment.ablations.common import AblationConfig, run_one
from mpcourse.experiment.ablations.outlier_channels import OUTLIER_CHANNELS, RATIO, main, plant_outliers
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import get_recipe


def _fp32_losses(plant: bool) -> list[float]:
    def make(model, optim):
        recipe = get_recipe("fp32")(model, optim)
        if plant:
            plant_outliers(recipe.model)
        return recipe
    run = run_one("fp32", make, AblationConfig(steps=3, batch_size=2).train_config(0),
                  model_cfg=GPTConfig(n_layer=1))
    return [h["loss"] for h in run["history"]]


def test_fp32_trains_bit_for_bit_as_the_unplanted_model():
    planted, plain = _fp32_losses(True), _fp32_losses(False)
    assert planted == plain                     # exact: RATIO is a power of two, the parameter is still W


def _loss_and_grads(ratio):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    if ratio is not None:
        plant_outliers(model, ratio)
    idx = torch.randint(0, 103, (2, 64))
    _, loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    grads = {n.replace("parametrizations.weight.original", "weight"): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def test_planted_forward_and_gradients_are_bit_for_bit_the_unplanted_ones():
    loss, grads = _loss_and_grads(None)
    for ratio in (RATIO, 2.0 ** 24):
        planted_loss, planted_grads = _loss_and_grads(ratio)
        assert torch.equal(planted_loss, loss)
        assert grads.keys() == planted_grads.keys()
        assert all(torch.equal(planted_grads[n], g) for n, g in grads.items()), ratio
    _, off = _loss_and_grads(1e6 + 1)            # not a power of two: rounding shows (the test can fail)
    assert not all(torch.equal(off[n], g) for n, g in grads.items())


def test_planted_input_has_outliers_that_per_tensor_e4m3_flushes_and_mx_blocks_keep():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    plant_outliers(model)
    seen = {}
    model.blocks[1].attn.qkv.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0].detach()))
    with torch.no_grad():
        model(torch.randint(0, 103, (2, 64)))
    x = seen["x"].reshape(-1, 128)                                     # (tokens, channels) x D, as the GEMM reads it
    ordinary = torch.ones(128, dtype=torch.bool)
    ordinary[list(OUTLIER_CHANNELS)] = False
    assert float(x[:, ~ordinary].abs().median()) > 1e5 * float(x[:, ordinary].abs().median())
    per_tensor = quantize_fp32_scaled(x, (-1, -1)).dequantize()
    assert float((per_tensor[:, ordinary] == 0).float().mean()) > 0.99          # flushed, per tensor
    mx = quantize_mx(x, (1, 32), "e4m3", "rceil").dequantize()[:, 32:]
    assert float((mx - x[:, 32:]).norm() / x[:, 32:].norm()) < 0.05             # blocks without an outlier: fine
    assert float((quantize_fp32_scaled(x / x.new_tensor([RATIO if c in OUTLIER_CHANNELS else 1.0 for c in range(128)]),
                                       (-1, -1)).dequantize() == 0).float().mean()) < 0.05   # unplanted: kept


def test_bad_ratio_is_refused():
    with pytest.raises(ValueError, match="ratio must be > 0"):
        plant_outliers(GPT(GPTConfig(n_layer=1)), ratio=0.0)
    with pytest.raises(SystemExit) as e:
        main(["--ratio", "-1"])
    assert e.value.code == 2
