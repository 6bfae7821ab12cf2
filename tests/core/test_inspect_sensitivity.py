"""``mpcourse.core.inspect.layer_sensitivity``: one layer quantized at a time against FP32 on the same batch.
Oracles: torch's own casts (a layer's weight rounded to BF16 or E4M3 by ``Tensor.to``) and ``F.linear`` on the
layer's captured FP32 input."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpcourse.core.inspect import layer_sensitivity, relative_error
from mpcourse.experiment.gpt.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=24, block_size=16, n_layer=2, n_head=2, n_embd=32)
LAYERS = [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    y = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    return model, (lambda m: m(x, y)[1]), x, y


def rounded(dtype_of):
    """quantize_only that rounds the one layer's weight through ``dtype_of(fqn)`` with torch's cast."""
    def quantize_only(model, fqn):
        w = model.get_submodule(fqn).weight
        with torch.no_grad():
            w.copy_(w.to(dtype_of(fqn)).float())
        return model
    return quantize_only


def test_relative_error():
    ref = torch.tensor([3.0, -4.0])
    assert relative_error(ref * 1.5, ref) == 0.5
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_nothing_quantized_means_no_error(setup):
    model, loss_fn, _, _ = setup
    rows = layer_sensitivity(model, loss_fn, LAYERS, lambda m, fqn: m)
    assert {r["layer"] for r in rows} == set(LAYERS)
    assert all(r[k] == 0 for r in rows for k in ("output_error", "weight_grad_error", "grad_error", "loss_delta"))


def test_output_error_is_the_layers_own_against_torch_casts(setup):
    model, loss_fn, x, y = setup
    before = copy.deepcopy(model.state_dict())
    rows = {r["layer"]: r for r in layer_sensitivity(model, loss_fn, LAYERS, rounded(lambda f: torch.bfloat16))}
    for k, v in model.state_dict().items():                   # the model itself is untouched
        assert torch.equal(v, before[k]), k
    inputs = {}

    def keep(fqn):
        def hook(m, args):
            inputs[fqn] = args[0].detach()
        return hook
    hooks = [model.get_submodule(f).register_forward_pre_hook(keep(f)) for f in LAYERS]
    with torch.no_grad():
        model(x, y)
    for h in hooks:
        h.remove()
    for fqn in LAYERS:
        m = model.get_submodule(fqn)
        want = relative_error(F.linear(inputs[fqn], m.weight.to(torch.bfloat16).float(), m.bias),
                              F.linear(inputs[fqn], m.weight, m.bias))
        assert rows[fqn]["output_error"] == pytest.approx(want, rel=1e-5)
        assert 1e-4 < rows[fqn]["output_error"] < 1e-2            # BF16's 8 bits: about 2^-9 relative


def test_the_coarsest_layer_ranks_first(setup):
    model, loss_fn, _, _ = setup
    worst = "blocks.0.mlp.fc"
    rows = layer_sensitivity(model, loss_fn, LAYERS,
                             rounded(lambda f: torch.float8_e4m3fn if f == worst else torch.bfloat16))
    assert rows[0]["layer"] == worst
    assert [r["grad_error"] for r in rows] == sorted((r["grad_error"] for r in rows), reverse=True)
    assert rows[0]["weight_grad_error"] > 10 * max(r["weight_grad_error"] for r in rows[1:])


def test_nvfp4_on_every_layer_runs_with_the_recipe_region(setup):
    from mpcourse.core import quant
    model, loss_fn, _, _ = setup
    r = quant.NVFP4BlockScaling()
    rows = layer_sensitivity(model, loss_fn, LAYERS[:2],
                             lambda m, fqn: quant.convert_to_float8_training(
                                 m, module_filter_fn=lambda _, f: f == fqn, recipe=r),
                             context=lambda: quant.autocast(enabled=True, recipe=r))
    # E2M1 with per-16 E4M3 scales: a few per cent to tens of per cent on one layer's output, never zero
    assert all(0.02 < row["output_error"] < 0.5 and row["grad_error"] > 0 for row in rows)


def test_sensitivity_cli_refuses_a_recipe_without_quantized_layers(capsys):
    from mpcourse.experiment.ablations.sensitivity import main
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "fp32", "--steps", "0"])
    assert e.value.code == 2 and "does not quantize linear layers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "nvfp4", "--steps", "-1"])
    assert e.value.code == 2


def test_block_means_groups_by_block():
    from mpcourse.experiment.ablations.sensitivity import block_means
    rows = [{"layer": "blocks.1.mlp.fc", "grad_error": 0.3}, {"layer": "blocks.0.attn.qkv", "grad_error": 0.2},
            {"layer": "blocks.1.attn.qkv", "grad_error": 0.1}, {"layer": "head", "grad_error": 9.0}]
    assert block_means(rows) == {0: 0.2, 1: pytest.approx(0.2)}
