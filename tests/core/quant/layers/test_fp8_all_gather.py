"""FP8 all-gather of the FP8 layers' weights under FSDP2 (``mpcourse.core.quant.layers.fsdp_fp8``, ``--fp8-all-gather``).

Oracles: the one-process cast of the whole weight (``to_float8(W, e4m3, compute_scale(max|W|))``) for the rule, and
the FSDP2 run that all-gathers FP32 and casts after the gather for the training run: with current scaling both
give the same E4M3 weight and scale, so the loss history must be equal bit for bit (tolerance 0). One spawn of
two gloo ranks (file rendezvous) runs every distributed case; one spawn of three ranks runs the uneven ones again
(FSDP2 pads a short shard to the first rank's rows, and a layer with fewer rows than ranks leaves a rank empty).
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from mpcourse.core.quant import CurrentScaling, DelayedScaling, Float8Linear, compute_scale, to_float8
from mpcourse.core.quant.layers.fsdp_fp8 import (FP8AllGatherWeight, enable_fp8_all_gather, pad_rows, padded_shard_rows,
                                          quantize_shard_for_all_gather)
from mpcourse.cli import main

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2


def _weight():
    """(64, 32) fp32 with rows of very different size: rank 1's rows hold the whole weight's amax."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)) * 0.02
    w[40, 5] = 0.9
    return w


def _one_process_cast(w, p2=False):
    return to_float8(w, "e4m3", compute_scale(w.abs().amax(), 448.0, 0, None, p2))


# ---------------------------------------------------------------------------------------------- one process
def test_the_rule_in_one_process_is_the_plain_cast():
    w = _weight()
    for p2 in (False, True):
        q, ref = quantize_shard_for_all_gather(w, "e4m3", use_power_2_scales=p2), _one_process_cast(w, p2)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale_inv,
                                                                                                   ref.scale_inv)


def test_the_wrapped_weight_behaves_as_its_fp32_tensor():
    layer = Float8Linear(32, 64, bias=False, recipe=CurrentScaling())
    w = FP8AllGatherWeight(_weight(), layer)
    assert w.dtype == torch.float32 and type(w.clone()) is FP8AllGatherWeight        # FSDP2's copies stay wrapped
    w.mul_(2.0)                                                                       # an optimizer's in-place step
    assert torch.equal(w._tensor, _weight() * 2.0) and type(w + 1) is torch.Tensor


def test_an_empty_shard_casts_to_an_empty_shard_with_the_scale_of_amax_0():
    """A rank holding no rows (fewer rows than ranks): amax 0, the scale current scaling gives amax 0 (1.0), no NaN."""
    q = quantize_shard_for_all_gather(torch.empty(0, 32), "e4m3")
    assert q.data.shape == (0, 32) and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(q.scale_inv, compute_scale(torch.tensor(0.0), 448.0).reciprocal())
    assert torch.equal(q.scale_inv, torch.tensor(1.0))


def test_padded_rows_are_fsdp2s_padded_sharded_size():
    """Oracle: FSDP2's own chunking (``_chunk_with_empty``; its padded sharded size is the first chunk's)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    for world in range(1, 6):
        for rows in range(0, 14):
            chunks = _chunk_with_empty(torch.empty(rows, 2), world, dim=0)
            assert padded_shard_rows(rows, world) == chunks[0].shape[0] >= max(c.shape[0] for c in chunks)
    assert padded_shard_rows(128, 3) == 43 and padded_shard_rows(2, 3) == 1


def test_pad_rows_appends_zero_rows():
    d = torch.arange(1, 13, dtype=torch.uint8).reshape(3, 4)
    p = pad_rows(d, 5)
    assert p.shape == (5, 4) and torch.equal(p[:3], d) and not p[3:].any()
    assert pad_rows(d, 3) is d and pad_rows(d[:0], 2).shape == (2, 4)
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_rows(d, 2)


def test_delayed_scaling_is_refused():
    model = torch.nn.Sequential(Float8Linear(8, 8, recipe=DelayedScaling()))
    with pytest.raises(ValueError, match="current per-tensor scaling"):
        enable_fp8_all_gather(model)


@pytest.mark.parametrize("args, msg", [
    (["--nproc", "2", "--parallel", "fsdp", "--recipes", "fp8-current,fp8-delayed"], "supports fp8-current"),
    (["--nproc", "2", "--parallel", "ddp", "--recipes", "fp8-current"], "needs --parallel fsdp"),
    (["--recipes", "fp8-current"], "needs --parallel fsdp")])
def test_cli_refuses_in_one_line_exit_2(args, msg, tmp_path, capsys):
    assert main(["compare", "--fp8-all-gather", "--steps", "1", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- two gloo ranks
def _rule_case():
    """Each rank casts its rows with the rule and with the hook; the uint8 all-gather of both, and of a planted bug
    (each rank's own amax, no all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh

    w = _weight()
    shard = w.chunk(WORLD)[dist.get_rank()]                     # (32, 32) fp32, this rank's rows
    mesh = init_device_mesh("cpu", (WORLD,))

    def gathered(data):                                         # (32, 32) uint8 -> (64, 32) uint8
        out = [torch.empty_like(data) for _ in range(WORLD)]
        dist.all_gather(out, data.contiguous())
        return torch.cat(out)

    rule = quantize_shard_for_all_gather(shard, "e4m3")
    layer = Float8Linear(32, 64, bias=False, recipe=CurrentScaling())
    (hook_data,), (hook_scale_inv, dtype, rows) = FP8AllGatherWeight(shard, layer).fsdp_pre_all_gather(
        mesh, w.shape, w.stride(), None, None)
    local = to_float8(shard, "e4m3", compute_scale(shard.abs().amax(), 448.0))     # planted bug: no MAX all-reduce
    return {"rule": gathered(rule.data.view(torch.uint8)), "rule_scale_inv": rule.scale_inv,
            "hook": gathered(hook_data), "hook_scale_inv": hook_scale_inv, "dtype": dtype,
            "local": gathered(local.data.view(torch.uint8))}


def _training_case(batch_size: int = 4, steps: int = 3):
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.parallel.distributed import DataParallelTrainer
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.parallel.data_parallel import local
    from mpcourse.experiment.training.train import TrainConfig

    cfg = TrainConfig(steps=steps, batch_size=batch_size, eval_interval=1000, eval_batches=1,
                      model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64))
    corpus, out = load_corpus(None), {}
    for flag in (False, True):
        t = DataParallelTrainer("fp8-current", corpus, cfg, "fsdp", fp8_all_gather=flag).run()
        out[flag] = {"losses": [h["loss"] for h in t.history], "bytes": t.all_gather_bytes(),
                     "weights": [getattr(local(p), "_tensor", local(p)).detach().clone()     # this rank's shards
                                 for p in t.recipe.model.parameters()],
                     "wrapped": sum(type(local(p)).__name__ == "FP8AllGatherWeight"
                                    for p in t.recipe.model.parameters())}
    return out


#: out_features of the three layers of ``_Uneven``: 128 rows (43, 43, 42 on 3 ranks), 5 rows (3, 2 on 2 ranks;
#: 2, 2, 1 on 3), 2 rows (1, 1, 0 on 3 ranks: an empty shard)
UNEVEN_ROWS = (128, 5, 2)


class _Uneven(torch.nn.Module):
    """Three FP8 layers side by side on the same (B, 32) input, outputs concatenated: (B, 135)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Float8Linear(32, n, recipe=CurrentScaling()) for n in UNEVEN_ROWS)
        with torch.no_grad():                     # each weight's amax in its last rows (the short or empty rank's)
            for m in self.layers:
                m.weight[-1, 3] = 0.9

    def forward(self, x):
        return torch.cat([m(x) for m in self.layers], dim=-1)


def _uneven_case(world: int, steps: int = 2):
    """``_Uneven`` under FSDP2, FP32 all-gather then FP8 all-gather, ``steps`` SGD steps: what each layer's
    forward sees (the gathered FP32 weight, or the gathered FP8 bytes and scale), the outputs, the input gradients
    and this rank's shard of every parameter's gradient, per step."""
    from torch.distributed.fsdp import fully_shard

    from mpcourse.experiment.parallel.data_parallel import local

    rank, out = dist.get_rank(), {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = _Uneven()
        if flag:
            enable_fp8_all_gather(model)
        for m in model.layers:
            fully_shard(m)
        fully_shard(model)
        gathered = []

        def see(m, args):                         # after FSDP2's all-gather: the unsharded weight of this layer
            w = m.weight
            if hasattr(w, "fp8_all_gathered"):
                w8 = w.fp8_all_gathered()
                gathered.append((w8.data.view(torch.uint8).clone(), w8.scale_inv.clone(), tuple(w.shape)))
            else:
                gathered.append(w.detach().clone())

        for m in model.layers:
            m.register_forward_pre_hook(see)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(4 * steps, 32, generator=torch.Generator().manual_seed(10 + rank))   # this rank's rows
        run = {"seen": [], "y": [], "dx": [], "grads": []}
        for s in range(steps):
            gathered.clear()
            xs = x[4 * s: 4 * s + 4].clone().requires_grad_(True)
            y = model(xs)
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            run["seen"].append(list(gathered))
            run["y"].append(y.detach().clone())
            run["dx"].append(xs.grad.clone())
            run["grads"].append([local(p.grad).clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        out[flag] = run
    return out


def _worker(rank, init_method, out_dir):
    from mpcourse.experiment.parallel.distributed import ranks

    with ranks(rank, WORLD, init_method, threads=1):
        torch.save({"rule": _rule_case(), "train": _training_case(), "uneven": _uneven_case(WORLD)},
                   os.path.join(out_dir, f"{rank}.pt"))


def _worker3(rank, init_method, out_dir):
    from mpcourse.experiment.parallel.distributed import ranks

    with ranks(rank, 3, init_method, threads=1):
        torch.save({"train": _training_case(batch_size=6, steps=2), "uneven": _uneven_case(3)},
                   os.path.join(out_dir, f"{rank}.pt"))


def _spawned(worker, world):
    from mpcourse.experiment.parallel.distributed import rendezvous, spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(worker, world, (rendezvous(d), d))
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def seen():
    return _spawned(_worker, WORLD)


@pytest.fixture(scope="module")
def seen3():
    return _spawned(_worker3, 3)


@pytest.mark.slow
def test_shards_cast_with_the_global_scale_gather_the_one_process_cast(seen):
    ref = _one_process_cast(_weight())
    for r in seen:
        c = r["rule"]
        assert torch.equal(c["rule"], ref.data.view(torch.uint8)) and torch.equal(c["rule_scale_inv"], ref.scale_inv)
        assert torch.equal(c["hook"], c["rule"]) and torch.equal(c["hook_scale_inv"], c["rule_scale_inv"])
        assert c["dtype"] == torch.float8_e4m3fn
        assert not torch.equal(c["local"], c["rule"])       # the planted bug (each rank's own amax) is caught


def test_fp8_all_gather_trains_bit_for_bit_as_the_fp32_all_gather(seen):
    for r in seen:
        fp32, fp8 = r["train"][False], r["train"][True]
        assert fp8["wrapped"] == 4 and fp32["wrapped"] == 0      # qkv, proj, fc, proj of the one block
        assert fp8["losses"] == fp32["losses"]                   # tolerance 0
        assert all(torch.equal(a, b) for a, b in zip(fp8["weights"], fp32["weights"]))
    assert seen[0]["train"][True]["losses"] == seen[1]["train"][True]["losses"]


def test_fp8_all_gather_bytes_per_rank(seen):
    """Measured at FSDP2's all-gather: the FP32 run sends 4 B per element; the FP8 run 1 B per FP8 weight element
    and 4 B for the rest (biases, LayerNorms, embeddings), as uint8; its computed FP32 equivalent is the FP32 run."""
    for r in seen:
        fp32, fp8 = r["train"][False]["bytes"], r["train"][True]["bytes"]
        assert fp32["dtypes"] == ["float32"] and "uint8" in fp8["dtypes"] and fp32["calls"] == fp8["calls"] > 0
        assert fp8["fp32"] == fp32["sent"] and fp8["bf16"] == fp32["sent"] / 2
        n8 = fp8["fp8_elements"]
        assert n8 > 0 and fp8["sent"] == fp32["sent"] - 3 * n8
        assert fp8["amax_all_reduce"] > 0 and fp32["fp8_elements"] == 0


# ---------------------------------------------------------------------------------------------- uneven and empty shards
def _check_uneven(seen_ranks):
    """Every layer's forward saw, at every step, the one-process cast of the FP32 weight the FP32 all-gather gave
    that step (the whole weight's scale, data of its full shape); outputs, input gradients and gradient shards
    equal the FP32 all-gather run's bit for bit."""
    for r in seen_ranks:
        fp32, fp8 = r["uneven"][False], r["uneven"][True]
        for step in range(len(fp32["y"])):
            assert len(fp8["seen"][step]) == len(fp32["seen"][step]) == len(UNEVEN_ROWS)
            for w, (data, scale_inv, shape) in zip(fp32["seen"][step], fp8["seen"][step]):
                ref = _one_process_cast(w)
                assert shape == tuple(w.shape) and data.shape == w.shape
                assert torch.equal(data, ref.data.view(torch.uint8)) and torch.equal(scale_inv, ref.scale_inv)
            assert torch.equal(fp8["y"][step], fp32["y"][step])
            assert torch.equal(fp8["dx"][step], fp32["dx"][step])
            assert all(torch.equal(a, b) for a, b in zip(fp8["grads"][step], fp32["grads"][step]))
        assert [w.shape[0] for w in fp32["seen"][0]] == list(UNEVEN_ROWS)
        assert not torch.equal(fp32["seen"][0][0], fp32["seen"][1][0])          # the step changed the weights


@pytest.mark.slow
def test_uneven_shards_gather_the_one_process_cast_on_2_ranks(seen):
    _check_uneven(seen)                   # 5 rows: 3 and 2


@pytest.mark.slow
def test_uneven_and_empty_shards_gather_the_one_process_cast_on_3_ranks(seen3):
    _check_uneven(seen3)                  # 128 rows: 43, 43, 42; 5: 2, 2, 1; 2: 1, 1, 0 (an empty shard)


@pytest.mark.slow
def test_fp8_all_gather_trains_bit_for_bit_on_3_ranks(seen3):
    """The GPT (n_embd 64: 64 and 256 rows, uneven on 3 ranks) trains as with the FP32 all-gather, bit for bit."""
    for r in seen3:
        fp32, fp8 = r["train"][False], r["train"][True]
        assert fp8["wrapped"] == 4 and fp8["losses"] == fp32["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fp8["weights"], fp32["weights"]))
        assert fp8["bytes"]["sent"] < fp32["bytes"]["sent"] and fp8["bytes"]["fp32"] == fp32["bytes"]["sent"]
    assert seen3[0]["train"][True]["losses"] == seen3[2]["train"][True]["losses"]


# ---------------------------------------------------------------------------------------------- stored for lesson 10
@pytest.mark.slow
def test_stored_reduce_dtype_runs_are_what_the_command_gives():
    """``notebooks/data/10/reduce-dtype-fp32-params.json`` (``python -m mpcourse.experiment.parallel.reduce_precision``): strict JSON with
    its command; the command's first two steps on 2 ranks, re-run here, give the stored losses bit for bit (one
    thread per rank, the same seed), and the BF16 reduction changed the losses (the measurement is not empty)."""
    import json
    from pathlib import Path

    from mpcourse.experiment.parallel.reduce_precision import measure

    path = Path(__file__).resolve().parents[4] / "notebooks" / "data" / "10" / "reduce-dtype-fp32-params.json"
    stored = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {path.name}"))
    assert stored["command"].startswith("python -m mpcourse.experiment.parallel.reduce_precision")
    runs = {r["nproc"]: r for r in stored["runs"]}
    assert set(runs) == {2, 4} and all(r["max_rel_diff"] > 0 for r in runs.values())
    short = measure(2, 2, runs[2]["batch_size"])
    for dtype in ("fp32", "bf16"):
        assert short["losses"][dtype] == runs[2]["losses"][dtype][:2]
