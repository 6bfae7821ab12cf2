"""The FP8 break-even model (mpcourse.core.breakeven) against torchao's published H100 measurements, and the
speed helpers (mpcourse.experiment.measure.speed) against hand counts. The model's inputs are datasheet peaks and
published achievable fractions only; nothing here is fitted to the numbers it is checked against."""
import dataclasses

import pytest

from mpcourse.core.breakeven import H100_TORCHAO, H200, break_even_width, fp8_speedup, linear_times, model_speedup
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.measure.speed import flops_per_token, fraction_of_peak, gpu_peak


@pytest.mark.parametrize("mkn,published", [((1024, 2048, 1024), 0.80), ((4096, 8192, 16384), 1.39)])
def test_predicts_torchao_tensorwise_h100_within_20_percent(mkn, published):
    """torchao float8 README, tensorwise, H100, forward + backward of one linear: 0.80x and 1.39x BF16."""
    assert fp8_speedup(*mkn, chip=H100_TORCHAO) == pytest.approx(published, rel=0.20)


def test_lands_near_torchao_auto_filter_boundary():
    """torchao's auto-filter keeps a linear out of FP8 when K <= 4096 and N <= 1024: at that corner the model
    should be near break-even for a typical per-GPU token count, below it inside, above it well outside."""
    for M in (4096, 8192, 16384):
        assert 0.9 <= fp8_speedup(M, 4096, 1024) <= 1.1
        assert fp8_speedup(M, 2048, 512) < 0.9            # deep inside the filtered region: FP8 loses
        assert fp8_speedup(M, 8192, 4096) > 1.3           # well outside: FP8 wins


def test_cast_cost_is_memory_bound_bytes_over_bandwidth():
    """Large shapes: 6 B per element of x, W and g over the achievable bandwidth, by hand."""
    M, K, N = 8192, 8192, 8192
    t = linear_times(M, K, N)
    bw = H100_TORCHAO.mem_bw * H100_TORCHAO.mem_fraction
    assert t["fp8_cast"] == pytest.approx(3 * M * K * 6 / bw)
    assert t["bf16"] == pytest.approx(3 * 2 * M * K * N / (989e12 * 0.78))
    assert t["fp8_gemm"] == pytest.approx(t["bf16"] / 2 * 989 / 989.5, rel=1e-3)   # 1979 = 2 x 989.5


def test_faster_memory_moves_the_break_even_down():
    slow, fast = H100_TORCHAO, H200                       # H200: 4.8 TB/s, same tensor cores
    assert fp8_speedup(1024, 2048, 1024, chip=fast) > fp8_speedup(1024, 2048, 1024, chip=slow)
    assert break_even_width(8192, chip=fast) <= break_even_width(8192, chip=slow)
    no_overhead = dataclasses.replace(slow, mem_bw=1e30, min_kernel_s=0.0)
    assert fp8_speedup(4096, 4096, 4096, chip=no_overhead) == pytest.approx(1979 / 989, rel=1e-6)


def test_tokens_beyond_a_few_thousand_do_not_move_the_break_even():
    """Past a few thousand tokens per GPU the weight cast is amortised and the break-even is set by the width alone
    (the casts of x and g grow with the tokens like the GEMMs); 2^21 tokens gives what 16,384 gives."""
    widths = {t: break_even_width(t) for t in (4096, 16384, 2 ** 21)}
    assert widths[16384] == widths[2 ** 21] == 1024
    assert model_speedup(4096, 2 ** 21) == pytest.approx(model_speedup(4096, 16384), rel=0.05)
    assert model_speedup(512, 2 ** 21) < 1 < model_speedup(2048, 2 ** 21)
    assert break_even_width(1024) > widths[16384]         # few tokens: the weight casts dominate


def test_model_flops_per_token_by_hand():
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=50)
    model = GPT(cfg)
    # every GEMM weight: the blocks' linears plus the (tied) head
    gemm = sum(m.weight.numel() for n, m in model.named_modules() if n.startswith("blocks") and hasattr(m, "in_features"))
    gemm += cfg.vocab_size * cfg.n_embd
    fwd = 2 * gemm + cfg.n_layer * 2 * 2 * cfg.block_size * cfg.n_embd
    assert flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size, training=False) == fwd
    assert flops_per_token(cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size) == 3 * fwd
    assert fraction_of_peak(1000.0, 3 * fwd, 1e9) == pytest.approx(1000 * 3 * fwd / 1e9)
    assert gpu_peak("NVIDIA H200") == 989e12 and gpu_peak("NVIDIA H100 80GB HBM3", fp8=True) == 1979e12
    assert gpu_peak("Some Other GPU") is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="K must be >= 1"):
        fp8_speedup(16, 0, 16)


def test_other_format_pairs_count_their_own_bytes():
    """FP32 -> BF16 with no scale and one layout (the CPU sweep's pair): 4 B read + 2 B written per element, no
    amax pass; the defaults stay BF16 -> FP8 with amax and two layouts."""
    M, K, N = 8192, 8192, 8192
    t = linear_times(M, K, N, high_bytes=4, low_bytes=2, amax=False, layouts=1)
    bw = H100_TORCHAO.mem_bw * H100_TORCHAO.mem_fraction
    assert t["fp8_cast"] == pytest.approx(3 * M * K * 6 / bw)
    assert linear_times(M, K, N, high_bytes=2, low_bytes=1, amax=True, layouts=2) == linear_times(M, K, N)


def test_stored_sweep_is_one_consistent_run():
    """notebooks/data/11/breakeven-sweep.json (benchmarks/breakeven_sweep.py): every row's speedup is its own
    high / low time, the casts are a part of the low time, and the machine record says where it ran."""
    import json
    from pathlib import Path
    d = json.loads((Path(__file__).resolve().parents[2] / "notebooks/data/11/breakeven-sweep.json").read_text())
    assert d["command"].startswith("python benchmarks/breakeven_sweep.py") and d["pair"] in (
        ["float32", "bfloat16"], ["bfloat16", "float8_e4m3fn"])
    assert {"capability", "flags", "gemm"} <= set(d["machine"])
    assert len(d["rows"]) == len(d["tokens"]) * len(d["widths"])
    for r in d["rows"]:
        assert r["speedup"] == pytest.approx(r["high_s"] / r["low_s"]) and 0 < r["cast_s"] < r["low_s"]
    mc = d["model_chip"]
    assert all(v > 0 for v in mc.values())
    chip = dataclasses.replace(H100_TORCHAO, name="sweep", bf16_flops=mc["high_flops"], fp8_flops=mc["low_flops"],
                               mem_bw=mc["mem_bw"], gemm_fraction=1.0, mem_fraction=1.0, min_kernel_s=mc["min_kernel_s"])
    top = max(d["rows"], key=lambda r: r["M"] * r["K"] * r["N"])     # the model meets the measurement there
    t = linear_times(top["M"], top["K"], top["N"], chip, high_bytes=mc["high_bytes"], low_bytes=mc["low_bytes"],
                     amax=d["pair"][1] != "bfloat16", layouts=1 if d["pair"][1] == "bfloat16" else 2)
    assert t["bf16"] / t["fp8"] == pytest.approx(top["speedup"], rel=1e-6)


def test_sweep_measures_a_small_shape(tmp_path):
    """The benchmark's timing of one shape on this CPU: both variants run, and the casts are timed apart."""
    import importlib.util
    from pathlib import Path
    import torch
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "breakeven_sweep.py"
    spec = importlib.util.spec_from_file_location("breakeven_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure(16, 32, 48, torch.device("cpu"), repeats=2)
    assert (r["M"], r["K"], r["N"]) == (16, 32, 48) and r["speedup"] > 0 and r["low_s"] > 0
    high, low, cast = mod.cpu_pair(16, 32, 48, torch.device("cpu"))
    assert [t.dtype for t in cast()] == [torch.bfloat16] * 3


def test_flops_per_token_counts_a_mixture_of_experts_mlp_from_its_modules():
    """A MoE block's MLP term equals the GEMM weights its modules hold per token: top_k experts' (w_in, w_out) rows,
    the router's, a shared expert's; with 4C/k-wide experts the routed part equals the dense MLP's 8 C^2."""
    from dataclasses import replace

    from mpcourse.experiment.gpt.model import GPT, GPTConfig, mlp_weights_per_token
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=64)
    assert mlp_weights_per_token(cfg) == 8 * 64 * 64
    for moe in ({"n_experts": 4, "top_k": 2}, {"n_experts": 3, "top_k": 1, "expert_hidden": 128, "shared_expert": True}):
        mcfg = replace(cfg, **moe)
        mlp = GPT(mcfg).blocks[0].mlp
        per_expert = sum(p.numel() for n, p in mlp.named_parameters() if n.startswith("w_")) // mcfg.n_experts
        router = sum(p.numel() for n, p in mlp.named_parameters() if "router" in n)
        shared = sum(p.numel() for n, p in mlp.named_parameters() if n.startswith("shared") and p.dim() == 2)
        assert mlp_weights_per_token(mcfg) == mcfg.top_k * per_expert + router + shared, moe
