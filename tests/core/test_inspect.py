"""The numerics inspector (mpcourse.core.inspect): planted tensors with known fractions, the threshold rule
against torch's own casts, and the hooks on a model."""
import json

import pytest
import torch

from mpcourse.core.formats import FORMATS
from mpcourse.core.inspect import Inspector, plot_heatmap, plot_histogram, tensor_stats, underflow_grid


def test_planted_fp16_and_bf16_fractions():
    t = torch.cat([torch.full((100,), 1e-9), torch.full((200,), 1e-6), torch.full((50,), 1e5),
                   torch.ones(650), torch.zeros(10)])
    s = tensor_stats(t)
    f16, b16 = s["formats"]["fp16"], s["formats"]["bf16"]
    assert (f16["underflow"], f16["subnormal"], f16["overflow"]) == (0.1, 0.2, 0.05)   # of the 1000 nonzero
    assert (b16["underflow"], b16["subnormal"], b16["overflow"]) == (0.0, 0.0, 0.0)
    assert s["zeros"] == 10 and s["amax"] == 1e5
    assert s["min_nonzero"] == pytest.approx(1e-9)
    assert s["dynamic_range_binades"] == pytest.approx(torch.log2(torch.tensor(1e5 / 1e-9)).item(), rel=1e-5)
    # the loss scale moves FP16's what-if: x 2**10 lifts the 1e-6 out of the subnormals, 1e5 stays overflowing
    g = tensor_stats(t, loss_scale=2.0 ** 10)["formats"]["fp16"]
    assert (g["underflow"], g["subnormal"], g["overflow"]) == (0.0, 0.1, 0.05)


def test_planted_fp8_fractions_under_current_scaling():
    """Current scaling maps amax to fp8_max: nothing overflows. A value 2**-32 times amax lands at 2**-32 x 448 =
    2**-23.2 in E4M3 (below half its 2**-9 floor: flushed) and at 2**-32 x 57344 = 2**-16.2 in E5M2 (between
    half its 2**-16 floor and its 2**-14 min normal: subnormal)."""
    t = torch.cat([torch.ones(90), torch.full((10,), 2.0 ** -32)])
    s = tensor_stats(t)
    e4, e5 = s["formats"]["e4m3"], s["formats"]["e5m2"]
    assert e4["scale"] == 448.0 and e5["scale"] == 57344.0
    assert (e4["underflow"], e4["overflow"]) == (0.1, 0.0)
    assert (e5["underflow"], e5["subnormal"], e5["overflow"]) == (0.0, 0.1, 0.0)
    fixed = tensor_stats(t, scales={"e4m3": 1000.0})["formats"]["e4m3"]                # a stale (delayed) scale
    assert fixed["overflow"] == 0.9


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e4m3", "e5m2"])
def test_rule_agrees_with_torch_casts(fmt):
    """Oracle: torch's cast. underflow <=> the cast is 0; subnormal <=> 0 < |cast| < min_normal."""
    f = FORMATS[fmt]
    torch.manual_seed(0)
    x = torch.exp2(torch.empty(20000).uniform_(torch.log2(torch.tensor(f.min_subnormal)).item() - 3,
                                              torch.log2(torch.tensor(f.max)).item() - 1))
    s = tensor_stats(x, [fmt], scales={fmt: 1.0})["formats"][fmt]
    c = x.to(f.torch_dtype).float().abs()
    assert s["underflow"] == float((c == 0).sum()) / x.numel()
    assert s["subnormal"] == float(((c > 0) & (c < f.min_normal)).sum()) / x.numel()


def test_hooks_record_every_role_every_n_steps(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ins = Inspector(model, every=2)
    for step in range(4):
        ins.set_step(step)
        model(torch.randn(5, 8)).pow(2).sum().backward()
    roles = {(r["step"], r["layer"], r["role"]) for r in ins.records}
    assert roles == {(s, l, r) for s in (0, 2) for l in ("0", "2")
                     for r in ("activation", "weight", "output_grad", "weight_grad")}
    w = next(r for r in ins.records if r["layer"] == "0" and r["role"] == "weight")
    assert w["amax"] == pytest.approx(float(model[0].weight.abs().max()))
    with torch.no_grad():
        ins.set_step(4)
        model(torch.randn(5, 8))                       # evaluation records nothing
    assert len(ins.records) == 16
    ins.to_json(tmp_path / "log.json")
    assert len(json.loads((tmp_path / "log.json").read_text())["records"]) == 16
    layers, steps, grid = underflow_grid(ins.records, "output_grad", "e4m3")
    assert layers == ["0", "2"] and steps == [0, 2]
    plot_heatmap(ins.records, tmp_path / "h.png")
    plot_histogram(model[0].weight, tmp_path / "w.png", "e4m3", scale=448 / float(model[0].weight.abs().max()))
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    ins.remove()
    ins.set_step(6)
    model(torch.randn(5, 8)).sum().backward()
    assert len(ins.records) == 16
    with pytest.raises(ValueError, match="every"):
        Inspector(model, every=0)


def test_trainer_inspect_every_hooks_the_inspector(tmp_path):
    """``Trainer(..., inspect_every=N)`` (what ``compare --inspect N`` builds) records every N-th step."""
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.training.train import TrainConfig, Trainer

    cfg = TrainConfig(steps=3, batch_size=2, eval_interval=10 ** 9,
                      model=GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    corpus = load_corpus(None)
    assert Trainer("fp32", corpus, cfg).inspector is None
    trainer = Trainer("fp32", corpus, cfg, inspect_every=2).run()
    assert trainer.inspector is not None and {r["step"] for r in trainer.inspector.records} == {0, 2}
    trainer.inspector.remove()


def test_binades_count_floor_log2_exactly():
    """Oracle: floor(log2 |x|) in float64 for every nonzero element (normals, FP32 subnormals, powers of two
    and the values just below them); zeros, infs and NaNs are not counted."""
    torch.manual_seed(0)
    for tiny in (False, True):
        x = torch.exp2(torch.empty(5000).uniform_(-140 if tiny else -40, 20)) * torch.randn(5000).sign()
        x[:10] = torch.exp2(torch.arange(-5.0, 5.0))
        x[10:20] = torch.nextafter(x[:10], torch.zeros(10))
        x[20:23] = torch.tensor([0.0, float("inf"), float("nan")])
        b = tensor_stats(x)["binades"]
        a = x.double().abs()
        a = a[(a > 0) & torch.isfinite(a)]
        k = torch.floor(torch.log2(a)).long()
        assert b["lo"] == int(k.min())
        assert b["counts"] == torch.bincount(k - k.min()).tolist()
        assert sum(b["counts"]) == 4997
