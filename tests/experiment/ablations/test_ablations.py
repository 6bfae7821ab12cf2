"""The ablations of lesson 11: their building blocks against torch's own (the runs themselves are precomputed)."""
import json

import pytest
import torch
import torch.nn.functional as F

from mpcourse.experiment.ablations import ABLATIONS, get_ablation
from mpcourse.experiment.ablations.__main__ import main
from mpcourse.experiment.ablations.common import grad_probe
from mpcourse.experiment.ablations.op_precision import OpPrecision, cross_entropy_low
from mpcourse.experiment.ablations.optimizer_state import StateDtypeAdamW
from mpcourse.experiment.ablations.underflow import scaled_loss_trainer


def _adam_pair(dtype, state_dtype=None, steps=5):
    torch.manual_seed(0)
    w0 = torch.randn(64, dtype=torch.float32).to(dtype)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    oa = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1, foreach=False)
    ob = StateDtypeAdamW([b], lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    for i in range(steps):
        g = (torch.randn(64) * 10.0 ** -(i % 3)).to(dtype)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    return a, b, oa, ob


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dtype_adamw_is_torch_adamw_in_the_params_dtype(dtype):
    a, b, oa, ob = _adam_pair(dtype)
    assert torch.equal(a, b)
    assert torch.equal(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"])


def test_fp32_state_on_fp16_weights_is_the_fp32_update_rounded_once():
    a32, b, _, ob = _adam_pair(torch.float32, steps=1)           # oracle: torch AdamW in FP32, one step
    torch.manual_seed(0)
    w0 = torch.randn(64).half()
    p = w0.clone().requires_grad_()
    opt = StateDtypeAdamW([p], lr=1e-2, weight_decay=0.1, state_dtype=torch.float32)
    p.grad = torch.randn(64).half()
    opt.step()
    ref = w0.float().requires_grad_()
    o = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    ref.grad = p.grad.float()
    o.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and torch.equal(p, ref.detach().half())


def test_fp16_state_flushes_what_fp32_state_keeps():
    p = torch.zeros(4, requires_grad=True)
    opt = StateDtypeAdamW([p], lr=1e-3, state_dtype=torch.float16)
    p.grad = torch.tensor([1e-5, 1e-4, 1e-2, 0.0])               # g**2 * 0.01 < 2**-24 for the first two
    opt.step()
    v = opt.state[p]["exp_avg_sq"]
    assert v[0] == 0 and v[2] > 0 and not bool(torch.isfinite(p).all())   # m / (0 + eps in fp16 = 0): inf


def test_op_precision_fp32_path_is_torchs_kernel_and_low_path_differs():
    torch.manual_seed(0)
    x = torch.randn(8, 50).bfloat16()
    with OpPrecision(torch.bfloat16):
        s_fp32 = F.softmax(x, dim=-1)
    with OpPrecision(torch.bfloat16, low={"softmax"}):
        s_low = F.softmax(x, dim=-1)
    assert s_fp32.dtype == s_low.dtype == torch.bfloat16
    assert torch.equal(s_fp32, F.softmax(x.float(), dim=-1).bfloat16())
    assert not torch.equal(s_fp32, s_low) and (s_fp32.float() - s_low.float()).abs().max() < 0.02
    ln = torch.nn.LayerNorm(50).bfloat16()
    with OpPrecision(torch.bfloat16):
        y = ln(x)
    ref = F.layer_norm(x.float(), (50,), ln.weight.float(), ln.bias.float()).bfloat16()
    assert torch.equal(y, ref)
    with OpPrecision(torch.bfloat16, low={"layer_norm"}):
        y_low = ln(x)
    assert (y_low.float() - ref.float()).abs().max() < 0.1


def test_low_loss_is_close_to_fp32_and_only_while_training():
    torch.manual_seed(0)
    logits, t = torch.randn(64, 103) * 3, torch.randint(0, 103, (64,))
    want = F.cross_entropy(logits, t)
    got = cross_entropy_low(logits, t, torch.bfloat16)
    assert got.dtype == torch.float32 and abs(float(got) - float(want)) < 0.05 and float(got) != float(want)
    with OpPrecision(torch.bfloat16, low={"loss"}), torch.no_grad():
        assert torch.equal(F.cross_entropy(logits, t), want)     # evaluation: FP32
    with OpPrecision(torch.bfloat16, low={"loss"}), pytest.raises(ValueError, match="logits, target"):
        F.cross_entropy(logits.requires_grad_(), t, label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown ops"):
        OpPrecision(torch.bfloat16, low={"gelu"})


def test_grad_probe_counts_inf_and_zeros():
    m = torch.nn.Linear(2, 2, bias=False)
    m.weight.grad = torch.tensor([[0.0, 2.0], [-3.0, 0.0]])
    assert grad_probe(m) == {"grad_amax": 3.0, "grad_zero_fraction": 0.5}
    m.weight.grad[0, 0] = float("inf")
    assert grad_probe(m)["grad_amax"] == float("inf")


def test_scaled_loss_trainer_reports_the_true_loss():
    cls = scaled_loss_trainer(2.0 ** -12)
    t = cls.__new__(cls)
    assert t.loss_value(torch.tensor(2.0 ** -12 * 3.0)) == 3.0


def test_unknown_ablation_names_the_known_ones():
    with pytest.raises(KeyError, match="underflow"):
        get_ablation("nope")
    with pytest.raises(SystemExit):
        main(["nope"])


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_stored_results_are_strict_json_with_their_command(name):
    from pathlib import Path
    folder = Path(__file__).resolve().parents[3] / "notebooks" / "data" / "11"
    if True:
        d = json.loads((folder / f"{name}.json").read_text(), parse_constant=lambda c: pytest.fail(c))
        assert d["ablation"] == name and d["command"].startswith(f"python -m mpcourse.experiment.ablations {name}")
        assert d["runs"] and all(len(r["history"]) >= 1 for r in d["runs"])
