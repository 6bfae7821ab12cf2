"""``--parallel ep``: the MoE recipes trained with their experts split over 2 and 4 gloo ranks, against one process.

One job per world size (spawned ranks, loopback) trains each case for a few steps and saves what every rank saw;
the tests compare the losses with ``Trainer`` in this process on the whole batch, its MoE layers running the same
dispatch as a rule (``MoEFeedForward.dispatch``; none for ``--dispatch fp32``, which is exact).

Tolerances, and why they are not zero: as under DDP (``test_distributed.py``), each rank's attention, embeddings and
router see half (a quarter) of the batch and their gradients are averaged over the ranks, where one process sums the
whole batch at once, so FP32 results differ in the last bits and AdamW carries that on; the experts themselves see
the same rows in the same order (``core.experts.expert_parallel``). Measured over 4 steps of the tiny MoE GPT below:
with FP32 and BF16 trips the losses agree to ~2e-7 relative; an FP8 trip (and ``moe-fp8-rowwise``'s FP8 linears)
rounds a row to 3 mantissa bits, so from the first update on, a last-bit difference can flip one E4M3 rounding and
the losses drift apart by up to ~6e-5 by step 3. Asserted: step 0 (the same weights; only the forward's sums differ)
to 1e-6 in every case, far below the 7e-5 that the FP8 dispatch itself moves it; later steps 1e-5 (FP32, BF16
trips) or 5e-4 (FP8). The first step's gradients (an expert's, the router's) and every step's clipped global norm
are compared too: AdamW hardly sees a gradient's scale, so a loss alone would not show an expert gradient left
nproc times too large.
"""
from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.parallel.distributed import DataParallelTrainer, Job, ranks as gloo_ranks, rendezvous, spawn
from mpcourse.experiment.parallel.distributed import run_distributed_compare
from mpcourse.experiment.training.train import Trainer, TrainConfig

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

CFG = TrainConfig(steps=4, batch_size=8, eval_interval=1000, eval_batches=1,
                  model=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
CASES = {2: [("moe-fp32", "fp32"), ("moe-fp32", "fp8"), ("moe-fp32", "bf16"), ("moe-fp8-rowwise", "fp8")],
         4: [("moe-fp32", "fp8")]}
RTOL = {"fp32": 1e-5, "bf16": 1e-5, "fp8": 5e-4}


def _train(t):
    """Run ``t``, recording the first step's gradients of block 0's experts and router, and every step's global
    gradient norm (``clip_grads``' return, before the optimizer steps)."""
    seen = {"norms": []}
    clip = t.recipe.clip_grads

    def watched(optimizer):
        if "w_in" not in seen:
            mlp = t.recipe.model.blocks[0].mlp
            seen["w_in"], seen["router"] = mlp.w_in.grad.clone(), mlp.router.grad.clone()
        seen["norms"].append(clip(optimizer))
        return seen["norms"][-1]

    t.recipe.clip_grads = watched
    t.run()
    seen["losses"] = [h["loss"] for h in t.history]
    return seen


def _worker(rank, world, init_method, out_dir):
    with gloo_ranks(rank, world, init_method, threads=1):
        corpus, res = load_corpus(None), {}
        for name, dispatch in CASES[world]:
            t = DataParallelTrainer(name, corpus, CFG, "ep", dispatch=dispatch, timeout_s=60)
            res[(name, dispatch)] = {**_train(t), "bytes": t.dispatch_bytes(),
                                     "counts": [h["tokens_per_expert"] for h in t.history],
                                     "experts": t.recipe.model.blocks[0].mlp.w_in.shape[0],
                                     "final": t.result().final_val_loss}
        try:                                          # refused on every rank before any collective
            t.save(os.path.join(out_dir, "checkpoint"))
        except ValueError as e:
            res["save"] = str(e)
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


@functools.lru_cache(maxsize=None)
def _job(world):
    """What each of ``world`` ranks saw (one spawned job per world size, shared by the tests)."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, (world, rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def _one_process(name, dispatch):
    t = Trainer(name, load_corpus(None), CFG)
    for block in t.recipe.model.blocks:
        block.mlp.dispatch = None if dispatch == "fp32" else dispatch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                      # as each rank (two threads round some FP32 rows differently)
    try:
        return _train(t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4])
def test_losses_equal_one_process_up_to_the_reduction_order(world):
    ranks = _job(world)
    for name, dispatch in CASES[world]:
        got = ranks[0][(name, dispatch)]
        assert all(r[(name, dispatch)]["losses"] == got["losses"] for r in ranks)     # every rank: the batch's loss
        assert got["experts"] == 4 // world                                            # each rank holds E / W
        one = _one_process(name, dispatch)
        close = lambda a, b, rtol, atol=0.0: torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b),
                                                                         rtol=rtol, atol=atol)
        close(got["losses"][0], one["losses"][0], 1e-6)
        close(got["losses"], one["losses"], RTOL[dispatch])
        close(got["norms"][0], one["norms"][0], 1e-5)
        close(got["norms"], one["norms"], 10 * RTOL[dispatch])
        for r, res in enumerate(ranks):                       # rank r holds experts r E/W .. (r + 1) E/W - 1
            e = res[(name, dispatch)]["w_in"].shape[0]
            close(res[(name, dispatch)]["w_in"], one["w_in"][r * e:(r + 1) * e], 1e-4, 1e-7)
            close(res[(name, dispatch)]["router"], one["router"], 1e-4, 1e-7)
        assert sum(map(sum, got["counts"][0])) == CFG.batch_size * CFG.model.block_size * 2 * CFG.model.n_layer


def test_the_dispatch_mode_reaches_the_loss():
    """FP8 rows change the run (not a vacuous tolerance): the fp8 losses differ from the fp32 ones from step 0."""
    ranks = _job(2)
    fp32, fp8 = (ranks[0][("moe-fp32", d)]["losses"] for d in ("fp32", "fp8"))
    assert fp32[0] != fp8[0] and fp32 != fp8


def test_bytes_per_rank_fp8_against_bf16():
    """Each rank's measured bytes: the FP8 run sends (C + 4) / (2 C) of the BF16 run's dispatch bytes per row, its
    combine in BF16; the "as BF16" column of the FP8 run is what a BF16 run sends for the same rows."""
    world, ranks = 2, _job(2)
    C, n = CFG.model.n_embd, CFG.steps
    for r in range(world):
        fp8 = ranks[0][("moe-fp32", "fp8")]["bytes"][r]
        assert fp8 == ranks[1][("moe-fp32", "fp8")]["bytes"][r]                     # gathered on every rank
        by = {k: v * n for k, v in fp8["by"].items()}                                # over the whole run
        rows_out = by["dispatch forward"] / (C + 4)                                  # rows this rank sent
        assert rows_out == int(rows_out) > 0 and by["dispatch backward"] == by["dispatch forward"]
        rows_back = by["combine forward"] / (2 * C)                                  # rows it sent back
        assert by["combine backward"] == by["combine forward"] and rows_back == int(rows_back)
        counts = fp8["by"]["counts forward"]
        assert counts == 2 * 4 * 8 * (world - 1)                                     # 2 blocks x E int64, per step
        assert fp8["sent"] * n == counts * n + 2 * rows_out * (C + 4) + 2 * rows_back * 2 * C
        assert fp8["bf16"] * n == counts * n + 2 * rows_out * 2 * C + 2 * rows_back * 2 * C
        assert fp8["sent"] < fp8["bf16"]


def test_a_non_moe_recipe_is_refused():
    job = Job(recipes=["fp32"], corpus=load_corpus(None), cfg=CFG, out=None, parallel="ep", quiet=True)
    assert run_distributed_compare(job, 2) in ([], None)           # not run: nothing trained, said in not_run


@pytest.mark.parametrize("flags,said", [
    (["--recipes", "moe-fp32,fp32"], "--parallel ep splits the experts of the moe-* recipes over the ranks; fp32 has "
                                     "none: name only moe-* recipes with --recipes, or use --parallel ddp or fsdp"),
    (["--recipes", "moe-fp32", "--nproc", "3", "--batch-size", "6"],
     "--parallel ep needs the experts to split evenly, but 4 experts per block do not divide over --nproc 3: use a "
     "number of processes that divides 4"),
])
def test_the_cli_refuses_what_ep_cannot_split(flags, said, capsys, tmp_path):
    from mpcourse.cli import main

    args = ["compare", "--parallel", "ep", "--nproc", "2", "--out", str(tmp_path / "o"), *flags]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"mpcourse compare: error: {said}"]
    assert not (tmp_path / "o").exists()


def test_the_cli_refuses_dispatch_without_ep(capsys):
    from mpcourse.cli import main

    assert main(["compare", "--parallel", "ddp", "--nproc", "2", "--dispatch", "fp8", "--recipes", "moe-fp32"]) == 2
    assert capsys.readouterr().err.strip() == ("mpcourse compare: error: --dispatch needs --parallel ep (it says how "
                                               "the experts' rows travel between the ranks)")


def test_the_cli_trains_ep_with_the_fp8_dispatch_and_reports_bytes_per_rank(tmp_path):
    """``mpcourse compare --parallel ep --nproc 2 --recipes moe-fp8-rowwise`` (2 steps), as a person runs it: in a
    process of its own (rank 0 prints from a spawned process, whose output a test's capture may not see)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "ep"
    proc = subprocess.run([sys.executable, "-m", "mpcourse", "compare", "--parallel", "ep", "--nproc", "2", "--recipes",
                           "moe-fp8-rowwise", "--steps", "2", "--batch-size", "2", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("moe-fp8-rowwise: expert-parallel all-to-all"))
    assert "(fp8 to the experts, bf16 back; payload + scales + counts): rank 0 " in line and ", rank 1 " in line
    saved = json.loads((out / "results.json").read_text())["parallel"]
    assert (saved["mode"], saved["nproc"], saved["dispatch"]) == ("ep", 2, "fp8")
    per_rank = saved["dispatch_bytes_per_rank_per_step"]["moe-fp8-rowwise"]
    assert len(per_rank) == 2 and all(0 < b["sent"] < b["bf16"] for b in per_rank)
    assert f"rank 0 {per_rank[0]['sent']:,.0f} B, rank 1 {per_rank[1]['sent']:,.0f} B" in line


def test_a_checkpoint_of_an_ep_run_is_refused():
    assert all(r["save"].startswith("checkpoints of a --parallel ep run are not supported") for r in _job(2))
