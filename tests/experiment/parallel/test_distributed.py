"""Data-parallel training over two gloo ranks on the CPU, against single-process runs (the oracle).

One job of two spawned ranks (``_worker``) runs every distributed case and saves what each rank saw; the
tests compare that with runs in this process. Starting ranks is the slow part, so there is one job for the
correct runs and one for the failing rank.

Tolerances, and why they are not zero: with two ranks each computes the mean loss of 8 rows and the
gradients are averaged over the ranks, where one process sums 16 rows at once; the same numbers are added
in another order (and the matmuls see another M), so FP32 results differ in the last bits (~1e-7 relative)
and AdamW, which divides by sqrt(v), carries that on. Measured over 5 steps of the small GPT below: the
loss curves of DDP and one process agree to about 1e-6 relative for ``fp32``; FP16 rounds every
activation to 11 bits, so a last-bit difference can flip one rounding and the ``fp16-master`` curves agree
to about 1e-4. The asserted tolerances (``RTOL``) leave a margin of about 10x over those measurements.
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from mpcourse.experiment.parallel.distributed import ranks as gloo_ranks, rendezvous
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.parallel.distributed import DataParallelTrainer, Job, RankFailed, run_distributed_compare, spawn
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.parallel.data_parallel import local
from mpcourse.experiment.training.train import Trainer, TrainConfig

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

STEPS = 5
CFG = TrainConfig(steps=STEPS, batch_size=16, eval_interval=1000, eval_batches=1,
                  model=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
RTOL = {"fp32": 1e-5, "fp16-master": 1e-3}
CASES = [("ddp", "fp32"), ("ddp", "fp16-master"), ("fsdp", "fp32"), ("fsdp", "fp16-master")]


def _losses(trainer):
    return [h["loss"] for h in trainer.history]


def _plant_inf_on_rank(recipe, rank):
    """Make ``recipe.step`` see one inf in this rank's gradient shard (before the loss scaler's check)."""
    step = recipe.step

    def planted():
        if dist.get_rank() == rank:
            p = next(p for p in recipe.optimizer.param_groups[0]["params"] if p.grad is not None)
            local(p.grad).view(-1)[0] = float("inf")           # this rank's shard only
        return step()

    recipe.step = planted


def _overflow_case(name, corpus):
    """Two clean steps, then one where only rank 1's shard overflows; what each rank did and holds."""
    t = DataParallelTrainer(name, corpus, CFG, "fsdp")
    t.run(steps=2)
    _plant_inf_on_rank(t.recipe, 1)
    before = [local(p).detach().clone() for p in t.recipe.optimizer.param_groups[0]["params"]]
    rec = t.train_step()
    after = [local(p).detach() for p in t.recipe.optimizer.param_groups[0]["params"]]
    return {"skipped": rec["skipped"], "scale_after": t.recipe.scaler.get_scale(),
            "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


def _plain_shard_case(group, all_reduce_found_inf_=None, inf_ranks=(1,)):
    """A rank holding its gradient shard as a plain tensor (ZeRO-style, no DTensor): the shards of ``inf_ranks``
    overflow. ``group`` is the scaler's process group (a one-rank group: each rank decides alone);
    ``all_reduce_found_inf_`` a learner's all-reduce in place of the library's (a SeamError becomes its message)."""
    from mpcourse.core.scaling import DynamicLossScaler
    from mpcourse.core.seams import SeamError

    w = torch.nn.Parameter(torch.ones(4))                      # this rank's shard, fp32
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**16, process_group=group, all_reduce_found_inf_=all_reduce_found_inf_)
    scaler.scale((w * 1.0).sum()).backward()                  # grad = S everywhere
    if dist.get_rank() in inf_ranks:
        w.grad[0] = float("inf")
    try:
        scaler.step(opt)
    except SeamError as e:
        return {"error": str(e)}
    scaler.update()
    return {"skipped": scaler.last_step_skipped, "scale_after": scaler.get_scale()}


def _max_all_reduce(found_inf, group=None):                   # lesson 10's solution
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def _sum_all_reduce(found_inf, group=None):                   # planted bug: the default op, SUM
    dist.all_reduce(found_inf, group=group)
    return found_inf


def _no_all_reduce(found_inf, group=None):                    # planted bug: each rank keeps its own flag
    return found_inf


SHARDS = {"0": (64 * 128 // 2, 128 // 2), "2": (128 * 64 // 2, 64 // 2)}  # layer -> (weight, bias) elements a rank


def _fp8_all_gather_case():
    """torchao ``Float8Linear`` under FSDP2 with an FP32 or an FP8 all-gather (``enable_fsdp_float8_all_gather``),
    and plain ``nn.Linear`` with a 16-bit one (``MixedPrecisionPolicy(param_dtype=float16)``, a bytes reference).
    Returns per way the (dtype, bytes) this rank sent into each FSDP2 all-gather during 3 steps, and the losses.
    The bytes are counted at ``dist.all_gather_single``, which torch 2.13's FSDP2 ``DefaultAllGather`` calls; the
    test asserts calls were seen, so a torch that gathers elsewhere fails instead of passing with zero bytes.
    The layers have biases on purpose: gloo has no FP8 dtype, and an all-gather whose inputs are all
    float8_e4m3fn fails on gloo ("Invalid scalar type"); with an FP32 bias in the group FSDP2 gathers bytes
    (uint8), which gloo can."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    sent, gather = [], dist.all_gather_single

    def counting(out, inp, *args, **kwargs):
        sent.append((str(inp.dtype), inp.numel() * inp.element_size()))
        return gather(out, inp, *args, **kwargs)

    out = {}
    dist.all_gather_single = counting
    try:
        for way in ("fp32", "16-bit", "fp8"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
            if way != "16-bit":
                # emulate: FP8 GEMMs in FP32 arithmetic; torch._scaled_mm on the CPU needs oneDNN's FP8 kernels,
                # which AVX2-only CPUs (and the AVX2 path forced with DNNL_MAX_CPU_ISA) do not have
                convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=way == "fp8",
                                                                            emulate=True))
            policy = MixedPrecisionPolicy(param_dtype=torch.float16 if way == "16-bit" else None)
            for layer in model[::2]:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(dist.get_rank()))  # this rank's rows
            sent.clear()
            losses = []
            for _ in range(3):
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                t = loss.detach().reshape(1)
                dist.all_reduce(t)
                losses.append(float(t) / 2)
            out[way] = {"sent": list(sent), "losses": losses}
    finally:
        dist.all_gather_single = gather
    return out


BF16_VARIANTS = {"bf16-pure": dict(rounding="nearest"), "bf16-pure-sr": dict(rounding="stochastic"),
                 "bf16-pure-kahan": dict(rounding="nearest", kahan=True)}


def _bf16_mlp():
    """A BF16 MLP whose layers have row counts odd over two ranks (33 -> 17 + 16, 7 -> 4 + 3)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7)).to(torch.bfloat16)


def _bf16_optimizer_steps(model, variant, seed=5, steps=4):
    """``BF16Optimizer`` (AdamW, weight decay, clipping) for ``steps`` steps of the same full batch on every rank."""
    from mpcourse.core.bf16 import BF16Optimizer

    opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), seed=seed,
                        **BF16_VARIANTS[variant])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)   # (8, 16) bf16
    for s in range(steps):
        model(x * (s + 1)).float().square().mean().backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return opt


def _bf16_sharded_case(variant, seed=5):
    """FSDP2 shards of the BF16 MLP stepped by ``BF16Optimizer``: every rank runs the same full batch, so the
    reduce-scattered gradient (the mean of two equal gradients) is exactly one process's and any difference
    from the one-process run would come from the sharded step. Returns the gathered weights, state, Kahan
    compensation and the generator state."""
    from torch.distributed.fsdp import fully_shard

    model = _bf16_mlp()
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    opt = _bf16_optimizer_steps(model, variant, seed)
    params = list(model.parameters())
    return {"types": {type(p).__name__ for p in params} | {str(p.dtype) for p in params},
            "params": [p.full_tensor() for p in params],
            "state": [{k: opt.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")} for p in params],
            "comp": None if opt.comp is None else [c.full_tensor() for c in opt.comp],
            "generator": opt.generator.get_state()}


def _worker(rank, init_method, out_dir):
    with gloo_ranks(rank, 2, init_method, threads=1):
        corpus = load_corpus(None)
        res = {}
        for parallel, name in CASES:
            reduce_dtype = torch.float32 if parallel == "fsdp" else None
            t = DataParallelTrainer(name, corpus, CFG, parallel, reduce_dtype).run()
            res[(parallel, name)] = {"losses": _losses(t), "memory": t.memory,
                                     "n_params": sum(p.numel() for p in t.recipe.model.parameters())}
        t = DataParallelTrainer("bf16-pure", corpus, CFG, "ddp").run()
        res[("ddp", "bf16-pure")] = {"losses": _losses(t),
                                     "params": [p.detach().clone() for p in t.recipe.model.parameters()]}
        for name in BF16_VARIANTS:
            t = DataParallelTrainer(name, corpus, CFG, "fsdp").run()
            res[("fsdp", name)] = {"losses": _losses(t), "memory": t.memory,
                                   "local": [local(p).detach().clone() for p in t.recipe.model.parameters()],
                                   "generator": t.recipe.optimizer.generator.get_state()}
            res[("sharded-step", name)] = _bf16_sharded_case(name)
        res[("sharded-step", "bf16-pure-sr", "seed 6")] = _bf16_sharded_case("bf16-pure-sr", seed=6)
        t = DataParallelTrainer("bf16-master-bf16-moments", corpus, CFG, "fsdp").run()
        opt = t.recipe.optimizer
        res[("fsdp", "bf16-master-bf16-moments")] = {
            "memory": t.memory, "losses": _losses(t),
            "moments": {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k != "step"}}
        for name in ("fp16-dynamic", "torch-amp-fp16"):
            res[("overflow", name)] = _overflow_case(name, corpus)
        if importlib.util.find_spec("torchao") is not None:     # the oracle test below skips without it
            res["fp8-all-gather"] = _fp8_all_gather_case()
        solo = [dist.new_group([r]) for r in range(2)][rank]  # every rank creates every group
        res[("plain", "all-reduce")] = _plain_shard_case(None)
        res[("plain", "alone")] = _plain_shard_case(solo)
        res[("plain", "yours-max")] = _plain_shard_case(None, _max_all_reduce)
        res[("plain", "yours-local")] = _plain_shard_case(None, _no_all_reduce)
        res[("plain", "yours-sum")] = _plain_shard_case(None, _sum_all_reduce, inf_ranks=(0, 1))
        del solo
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


@pytest.fixture(scope="module")
def ranks():
    """What each of the two ranks saw: [rank 0's dict, rank 1's dict]."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, (rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single():
    """The same recipes in one process, the whole batch at once: losses and bytes."""
    corpus = load_corpus(None)
    out = {}
    for name in ("fp32", "fp16-master", *BF16_VARIANTS, "bf16-master-bf16-moments"):
        t = Trainer(name, corpus, CFG).run()
        out[name] = {"losses": _losses(t), "memory": t.memory}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp16-master"])
def test_ddp_equals_one_process_up_to_reduction_order(ranks, single, name):
    ddp = ranks[0][("ddp", name)]["losses"]
    assert ddp == ranks[1][("ddp", name)]["losses"]            # every rank reports the same (global) loss
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single[name]["losses"]), rtol=RTOL[name], atol=0)
    assert ddp != single[name]["losses"] or name == "fp16-master"  # not bitwise: the tolerance is needed


@pytest.mark.slow
def test_ddp_bf16_pure_replicas_stay_identical(ranks, single):
    """``bf16-pure`` under plain DDP. An optimizer that changed the parameters' dtype around its step (as
    ``BF16Optimizer`` once did) would unhook DDP's reducer after the first step: each rank would then step on its
    own half batch and the replicas drift apart. Both ranks must hold the same bits, and the losses follow one
    process (BF16 gradients averaged in BF16: one more rounding per element, measured ~2e-5 relative over 5 steps)."""
    a, b = (r[("ddp", "bf16-pure")] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["losses"] == b["losses"]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(single["bf16-pure"]["losses"]),
                               rtol=1e-3, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(BF16_VARIANTS))
def test_fsdp2_bf16_optimizer_step_gives_the_one_process_bits(ranks, variant):
    """The sharded step of ``BF16Optimizer`` (DTensor shards of uneven rows, AdamW + clipping, 4 steps) against
    the same optimizer in this process on the whole tensors, bit for bit: weights, AdamW state, Kahan
    compensation. Stochastic rounding: each rank draws the whole tensor's random stream and keeps its rows'
    slice, so the same seed gives the one-process bits and both ranks end with the same generator state;
    another seed gives other bits (the control: the random bits matter)."""
    model = _bf16_mlp()
    opt = _bf16_optimizer_steps(model, variant)
    params = list(model.parameters())
    for r in ranks:
        got = r[("sharded-step", variant)]
        assert got["types"] == {"DTensor", "torch.bfloat16"}
        assert all(torch.equal(a.view(torch.int16), p.detach().view(torch.int16)) for a, p in zip(got["params"], params))
        for st, p in zip(got["state"], params):
            assert all(torch.equal(st[k], opt.state[p][k]) for k in st)
        if opt.comp is not None:
            assert all(torch.equal(a.view(torch.int16), c.view(torch.int16)) for a, c in zip(got["comp"], opt.comp))
        assert torch.equal(got["generator"], opt.generator.get_state())
    if variant == "bf16-pure-sr":
        other = ranks[0][("sharded-step", variant, "seed 6")]["params"]
        assert not all(torch.equal(a, b) for a, b in zip(other, ranks[0][("sharded-step", variant)]["params"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_VARIANTS))
def test_fsdp2_runs_the_pure_bf16_recipes(ranks, single, name):
    """The three pure-BF16 recipes under ``--parallel fsdp``: both ranks report the same losses and hold the same
    generator state, the losses follow one process within DDP's BF16 tolerance (BF16 gradients reduce-scattered
    in BF16), and each rank holds about half of the single-process bytes of weights, FP32 gradient buffers,
    AdamW state and Kahan compensation."""
    a, b = (r[("fsdp", name)] for r in ranks)
    assert a["losses"] == b["losses"] and torch.equal(a["generator"], b["generator"])
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(single[name]["losses"]), rtol=1e-3, atol=0)
    assert not all(torch.equal(x, y) for x, y in zip(a["local"], b["local"]))   # different shards, not replicas
    one = single[name]["memory"]
    for kind in ("weights", "grads", "optimizer", "extra"):
        total = a["memory"][kind] + b["memory"][kind]
        assert one[kind] <= total <= 1.01 * one[kind], (kind, one[kind], total)   # vocab rows padded
        assert (one[kind] == 0) == (kind == "extra" and name != "bf16-pure-kahan")


@pytest.mark.slow
def test_fsdp2_keeps_the_bf16_moments_of_bf16_master_bf16_moments(ranks, single):
    """Under FSDP2 the sharded FP32 parameters are the master and the recipe's own master optimizer steps them:
    AdamW with BF16 moments (2 + 2 bytes per parameter, sharded: about 2 per rank), not plain FP32 AdamW."""
    one = single["bf16-master-bf16-moments"]
    mem = [r[("fsdp", "bf16-master-bf16-moments")]["memory"] for r in ranks]
    total = one["memory"]["optimizer"]
    assert total <= mem[0]["optimizer"] + mem[1]["optimizer"] <= 1.01 * total
    for r in ranks:
        assert r[("fsdp", "bf16-master-bf16-moments")]["moments"] == {"torch.bfloat16"}
    a, b = (r[("fsdp", "bf16-master-bf16-moments")]["losses"] for r in ranks)
    assert a == b
    torch.testing.assert_close(torch.tensor(a), torch.tensor(one["losses"]), rtol=1e-3, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp16-master"])
def test_fsdp_fp32_reduce_matches_ddp(ranks, name):
    fsdp = ranks[0][("fsdp", name)]["losses"]
    assert fsdp == ranks[1][("fsdp", name)]["losses"]
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ranks[0][("ddp", name)]["losses"]),
                               rtol=RTOL[name], atol=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (CI installs it)")
def test_fsdp2_fp8_all_gather_moves_a_quarter_of_fp32_and_trains_the_same(ranks):
    """torchao's FSDP2 float8 all-gather runs on gloo CPU ranks (torch 2.13, torchao 0.18; see
    ``_fp8_all_gather_case`` for the one case where gloo refuses it). Each rank casts its weight shard to E4M3
    with the scale of the *whole* weight (torchao's ``fsdp_pre_all_gather`` all-reduces the shards' amax with MAX)
    and gathers the FP8 bytes: 1 byte per weight element against FP32's 4 and a 16-bit gather's 2 (the FP32
    biases are gathered as they are). Without it the FP32 weight is gathered and cast after the gather with the
    same amax: the same FP8 operand element by element, so the losses are equal bit for bit (tolerance 0: one
    cast of the same values with the same scale; the all-gather only moves bytes)."""
    for r in ranks:
        ag = r["fp8-all-gather"]
        n = len(ag["fp32"]["sent"])
        assert n > 0 and len(ag["fp8"]["sent"]) == len(ag["16-bit"]["sent"]) == n
        by_fp32_bytes = {4 * (w + b): (w, b) for w, b in SHARDS.values()}
        for (d32, b32), (d16, b16), (d8, b8) in zip(ag["fp32"]["sent"], ag["16-bit"]["sent"], ag["fp8"]["sent"]):
            w, b = by_fp32_bytes[b32]
            assert (d32, d16, d8) == ("torch.float32", "torch.float16", "torch.uint8")   # FP8 + FP32 bias as bytes
            assert b16 == 2 * (w + b) and b8 == 1 * w + 4 * b
        assert ag["fp8"]["losses"] == ag["fp32"]["losses"]
    assert ranks[0]["fp8-all-gather"] == ranks[1]["fp8-all-gather"]


@pytest.mark.slow
def test_one_rank_overflow_all_ranks_skip_with_the_same_scale(ranks):
    """FSDP2: only rank 1's gradient shard holds an inf; both ranks skip, back off once, keep their weights.
    (The gradients are DTensors, and torch's DTensor dispatch of the fused inf check already reduces the
    flag with MAX over the mesh; the course's scaler all-reduces it as well.)"""
    for name in ("fp16-dynamic", "torch-amp-fp16"):            # course scaler; torch's ShardedGradScaler
        seen = [r[("overflow", name)] for r in ranks]
        assert [s["skipped"] for s in seen] == [True, True], name
        assert seen[0]["scale_after"] == seen[1]["scale_after"] == 2.0**15, name   # 2**16 backed off once
        assert all(s["weights_unchanged"] for s in seen), name


@pytest.mark.slow
def test_plain_shards_need_the_all_reduce(ranks):
    """Gradient shards as plain tensors: with the all-reduce both ranks skip; each rank alone (the control),
    only rank 1 skips and the scales drift apart."""
    assert [r[("plain", "all-reduce")] for r in ranks] == [{"skipped": True, "scale_after": 2.0**15}] * 2
    assert [r[("plain", "alone")] for r in ranks] == [{"skipped": False, "scale_after": 2.0**16},
                                                      {"skipped": True, "scale_after": 2.0**15}]


@pytest.mark.slow
def test_a_learners_found_inf_all_reduce_runs_in_the_scaler(ranks):
    """Lesson 10's ``all_reduce_found_inf_`` in ``DynamicLossScaler``: the solution behaves as the library's MAX;
    a rank keeping its own flag drifts as the one-rank control does; a SUM stops with one line naming it."""
    assert [r[("plain", "yours-max")] for r in ranks] == [r[("plain", "all-reduce")] for r in ranks]
    assert [r[("plain", "yours-local")] for r in ranks] == [r[("plain", "alone")] for r in ranks]
    for r in ranks:
        assert r[("plain", "yours-sum")]["error"].startswith("all_reduce_found_inf_ returned 2.0: ")


@pytest.mark.slow
def test_bytes_per_param_per_rank(ranks, single):
    """DDP: each rank holds the single-process bytes. FSDP2: the shards of the two ranks add up to the
    single-process bytes of the sharded kinds (each rank about half), plus the all-gathered working copy."""
    for name in ("fp32", "fp16-master"):
        one = single[name]["memory"]
        for r in ranks:
            assert r[("ddp", name)]["memory"] == one
    mem = [r[("fsdp", "fp32")]["memory"] for r in ranks]
    for kind in ("weights", "grads", "optimizer"):             # 4 + 4 + 8 = 16 B/param -> 16/2 per rank
        one = single["fp32"]["memory"][kind]                   # FSDP2 pads an uneven dim (vocab 103 rows):
        assert one <= mem[0][kind] + mem[1][kind] <= 1.01 * one  # the shards' storages hold that padding
        assert abs(mem[0][kind] - mem[1][kind]) <= 0.02 * mem[0][kind]   # uneven rows (vocab 103) only
    n = ranks[0][("fsdp", "fp32")]["n_params"]
    assert 7.9 < sum(mem[0][k] for k in ("weights", "grads", "optimizer")) / n < 8.1
    # fp16-master: the fp32 master (4), its fp32 grads (4) and AdamW (8) sharded: 16/2 per rank;
    # the fp16 working copy is gathered block by block, so it is less than the full 2 B/param
    one = single["fp16-master"]["memory"]
    mem = [r[("fsdp", "fp16-master")]["memory"] for r in ranks]
    for kind, total in (("master", one["master"]), ("optimizer", one["optimizer"]), ("grads", 4 * n)):
        assert total <= mem[0][kind] + mem[1][kind] <= 1.01 * total, kind   # 4, 8 and 4 (fp32 grad shards)
    assert 0 < mem[0]["weights"] < 2 * n


@pytest.mark.slow
def test_a_raising_rank_stops_the_job_with_its_message():
    job = Job(recipes=["fp32"], corpus=load_corpus(None), cfg=CFG, out=None, parallel="ddp",
              timeout_s=300, fail_rank=1)
    with pytest.raises(RankFailed, match="rank 1 failed: .*planted failure on rank 1") as info:
        run_distributed_compare(job, 2)
    stopped = time.time()
    raised_at = float(info.value.message.rsplit("at time ", 1)[1])
    assert info.value.rank == 1
    # rank 0 waits in a collective: terminated, not timed out (300 s). The bound is a fifth of the timeout, not a
    # few seconds: on a loaded machine (a test suite beside other jobs) the exit and the poll took 11 s once
    assert stopped - raised_at < job.timeout_s / 5, stopped - raised_at


@pytest.mark.slow
def test_a_failing_rank_keeps_the_rows_already_finished(tmp_path, capsys):
    """Rank 1 fails at the start of the second of three recipes: the first recipe's row is kept, printed and
    written to results.json, whose ``failed`` names the recipe that was training (with the rank's message) and the
    one never started; ``RankFailed`` carries both."""
    cfg = TrainConfig(steps=2, batch_size=4, eval_interval=1000, eval_batches=1,
                      model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    job = Job(recipes=["fp32", "bf16-pure", "fp16-master"], corpus=load_corpus(None), cfg=cfg, out=tmp_path,
              parallel="ddp", fail_rank=1, fail_recipe="bf16-pure")
    with pytest.raises(RankFailed, match="rank 1 failed: .*planted failure") as info:
        run_distributed_compare(job, 2)
    assert [r.recipe for r in info.value.results] == ["fp32"]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["recipe"] for r in payload["results"]] == ["fp32"]
    failed = payload["failed"]
    assert [(f["recipe"], f["seed"]) for f in failed] == [("bf16-pure", 0), ("fp16-master", 0)]
    assert failed[0]["error"].startswith("rank 1 failed: RuntimeError: planted failure on rank 1")
    assert failed[1]["error"] == "not run: the job stopped when rank 1 failed"
    assert info.value.failed == failed
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("fp32 ") and "FAILED bf16-pure (seed 0): rank 1 failed" in out


def test_cli_flags_and_their_errors(capsys):
    from mpcourse.cli import build_parser, main

    args = build_parser().parse_args(["compare", "--nproc", "2", "--parallel", "fsdp", "--reduce-dtype", "bf16"])
    assert (args.nproc, args.parallel, args.reduce_dtype) == (2, "fsdp", "bf16")
    assert main(["compare", "--nproc", "2", "--recipes", "fp32"]) == 2
    assert "needs --parallel ddp or --parallel fsdp" in capsys.readouterr().err
    assert main(["compare", "--nproc", "3", "--parallel", "ddp", "--batch-size", "16"]) == 2
    assert "not divisible by --nproc 3" in capsys.readouterr().err
