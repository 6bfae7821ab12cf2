"""Lesson 09's planted outlier channels (``ablations.outlier_channels``): the same function in FP32, outliers in
``mlp.fc``'s input, and per-tensor E4M3 flushing the ordinary channels there while 1x32 MX blocks do not."""
import torch

from mpcourse.core.quant import quantize_fp32_scaled, quantize_mx
from mpcourse.experiment.ablations.outlier_channels import OUTLIER_CHANNELS, plant_outliers
from mpcourse.experiment.model import GPT, GPTConfig


def test_plant_keeps_the_function_and_makes_outlier_channels():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    idx = torch.randint(0, 103, (2, 64))
    seen = {}
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("x", i[0].detach()))
    with torch.no_grad():
        before = model(idx)[0] if isinstance(model(idx), tuple) else model(idx)
        plant_outliers(model)
        after = model(idx)[0] if isinstance(model(idx), tuple) else model(idx)
    assert torch.allclose(before, after, rtol=1e-3, atol=1e-3)
    x = seen["x"].reshape(-1, 128)                                     # (tokens, channels) fc input
    ordinary = torch.ones(128, dtype=torch.bool)
    ordinary[list(OUTLIER_CHANNELS)] = False
    assert float(x[:, ~ordinary].abs().median()) > 1e4 * float(x[:, ordinary].abs().median())
    per_tensor = quantize_fp32_scaled(x, (-1, -1)).dequantize()[:, ordinary]
    mx = quantize_mx(x, (1, 32), "e4m3", "rceil").dequantize()[:, 32:]
    rel = float((per_tensor - x[:, ordinary]).norm() / x[:, ordinary].norm())
    assert float((per_tensor == 0).float().mean()) > 0.3 and rel > 0.3   # flushed or one bit left, per tensor
    assert float((mx - x[:, 32:]).norm() / x[:, 32:].norm()) < 0.05      # blocks without an outlier: fine
