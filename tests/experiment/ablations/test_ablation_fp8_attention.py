"""The FP8 attention ablation (lesson 14): its variants cast what their labels say, its per-op errors are zero where
the oracle says they must be ("representable inputs give identical outputs") and positive otherwise, its probe reads
without changing the fp32 run, and a short run of it produces the record the lesson reads."""
import pytest
import torch

from mpcourse.core.attention.layer import FP8DotProductAttention
from mpcourse.core.quant import Float8Linear
from mpcourse.experiment.ablations import fp8_attention as ablation
from mpcourse.experiment.ablations.common import AblationConfig, over_seeds
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import OptimConfig, get_recipe

E4M3_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])   # exact in E4M3 after any power-of-two scale


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_each_variant_casts_its_roles_and_leaves_the_linears_fp32(corpus):
    for label, options in ablation.VARIANTS:
        torch.manual_seed(0)
        r = ablation.attention_only(label, options)(GPT(GPTConfig(vocab_size=corpus.vocab_size, n_layer=1)),
                                                    OptimConfig())
        assert not any(isinstance(m, Float8Linear) for m in r.model.modules())
        [att] = [m for m in r.model.modules() if isinstance(m, FP8DotProductAttention)]
        assert att.roles == tuple(options["roles"]) and att.fp8_dpa_bwd == options.get("fp8_dpa_bwd", True)
        assert att.kv_block == options.get("kv_block", 128) and att.fixed_scales == options.get("fixed_scales", {})


def test_op_errors_vanish_for_representable_inputs_only():
    """Q, K, V from values exact in E4M3 with amax 7 (current scale 448 / 7 = 64, a power of two: every cast exact),
    dO from values exact in E5M2 with amax 7 (scale 57344 / 7 = 8192): S = Q K^T and dP = dO V^T equal the FP32
    products (sums of exact products of small numbers); P and dS are not representable, so the products that read
    them differ."""
    g = torch.Generator().manual_seed(0)
    pick = lambda *shape: E4M3_GRID[torch.randint(0, len(E4M3_GRID), shape, generator=g)]      # noqa: E731
    q, k, v = (pick(1, 2, 16, 8) * torch.sign(torch.randn(1, 2, 16, 8, generator=g)) for _ in range(3))
    for t in (q, k, v):
        t.view(-1)[0] = 7.0                                       # amax 7: scale 448 / 7 = 64, a power of two
    do = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 6.0])[torch.randint(0, 6, (1, 2, 16, 8), generator=g)]
    do.view(-1)[0] = 7.0 * 2 ** 10                                # 57344 / 7168 = 8: E5M2 casts 0..6 exactly
    errors = ablation.op_errors(q, k, v, do * 2 ** -10, 8 ** -0.5)
    assert errors["S=QK^T"] == 0.0 and errors["dP=dOV^T"] == 0.0
    assert all(errors[k] > 0 for k in ("O=PV (P delayed)", "dV=P^TdO", "dQ=dSK", "dK=dS^TQ"))
    rand = ablation.op_errors(*(torch.randn(1, 2, 16, 8, generator=g) for _ in range(4)), 8 ** -0.5)
    assert 0 < rand["S=QK^T"] < 2 ** -4 and 0 < rand["dP=dOV^T"] < 2 ** -3
    assert rand["P zero (P fixed-1)"] >= rand["P zero (P fixed-16)"] >= rand["P zero (P delayed)"]


def test_a_short_run_records_what_the_lesson_reads(corpus, monkeypatch):
    """Two steps of fp32 and of every tensor in FP8: the fp32 run equals a plain fp32 run (the probe only reads),
    op errors for every layer, scale_s 448 after the first update (P's amax is 1)."""
    monkeypatch.setattr(ablation, "VARIANTS", (("all", {"roles": ablation.ROLES}),))
    acfg = AblationConfig(steps=2, batch_size=2, seeds=(0,), eval_batches=1)
    out = ablation.run(acfg)
    fp32, all_ = out["runs"]
    assert (fp32["label"], all_["label"]) == ("fp32", "all") and all_["roles"] == list(ablation.ROLES)
    plain = over_seeds("fp32", lambda m, o: get_recipe("fp32")(m, o), acfg)[0]
    assert [h["loss"] for h in plain["history"]] == [h["loss"] for h in fp32["history"]]
    errors = out["op_errors"]["0"]
    assert set(errors) == {f"blocks.{i}.attn" for i in range(GPTConfig().n_layer)}
    assert all(0 < e < 0.5 for layer in errors.values() for k, e in layer.items() if not k.startswith("P zero"))
    assert all_["history"][-1]["p_scale"] == [448.0] * GPTConfig().n_layer
    assert all_["final_val_loss"] != fp32["final_val_loss"]
