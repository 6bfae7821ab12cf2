"""Checkpoints of a data-parallel run with ``torch.distributed.checkpoint`` (DCP): save, resume bit for bit.

``save(trainer, path)`` writes one DCP checkpoint directory from every rank of a ``DataParallelTrainer``;
``load(trainer, path)`` resumes a freshly built trainer (fresh processes, the same ranks) from it, so that the
steps after the resume give the same bits as the run that was never interrupted (``tests/test_checkpoint_
distributed.py`` checks losses, weights, optimizer state, loss scale and FP8 scales and amax histories).

What goes in (one state dict, flattened by DCP's default planner)::

    "model"   get_model_state_dict / get_state_dict: DTensor shards under FSDP2 (each rank writes its
              shard), plain tensors under DDP (replicated: DCP's planner writes them once). The FP8 layers'
              scales and amax histories ride in it as their ``_extra_state`` (fp32, identical on every rank
              because the amax is all-reduced before each update).
    "optim"   get_state_dict's optimizer state, keyed by parameter name (sharded as the parameters): its
              'state' and 'param_groups' only (a state_dict's other keys are dropped), so
              ``BlockQuantizedAdamW`` records how its moments are stored (fmt, state_rule, block_size) in
              the param groups. For the master-weights recipes under DDP the optimizer steps the FP32 master,
              not the model: "master" holds the master (by the model's parameter names) and "optim" its
              optimizer.
    "extra"   the loss scaler's state (``state_dict()``, Python scalars) and, for the pure-BF16 recipes,
              ``BF16Optimizer``'s stochastic-rounding generator and Kahan compensation.
    "rank{r}" this rank's loop state: step, history, skipped steps, the batch generator's and torch's RNG,
              and (``bf16-master-bf16-moments-sr``) the stochastic rounding's generators of its
              ``LowPrecisionState`` optimizer, which differ by rank under FSDP2.

Beside them, rank 0 writes ``mpcourse.json`` (format, recipe, parallel mode, world size, reduce dtype, step),
read first by ``load``: a checkpoint saved by another number of ranks, another mode or another recipe is refused
with a message naming both (DCP itself could reshard the tensors to another world size, but each rank's
batch slice and the reduction order change with it, so the run would not continue bit for bit). Format 1
(before the storage record and the generators were saved) is refused for the optimizers that need them
(``fp8-moments``, ``int8-moments``, ``bf16-master-bf16-moments-sr``), saying what it lacks; the others resume
from it. For ``BlockQuantizedAdamW`` the recorded storage is read next, alone (``check_storage``): moments
stored otherwise are refused naming both, before anything is read into the trainer.

Loading: the fresh trainer's own state dict is the template (``get_state_dict`` creates the optimizer state
it needs with one zero-gradient step at learning rate 0, which changes no weight), ``dcp.load`` fills it in
place (each rank reads its shards), ``set_state_dict`` puts it into the model and optimizer, then the
stochastic-rounding generators are set.

Sources: torch.distributed.checkpoint docs and ``torch/distributed/checkpoint/state_dict.py``
(``get_state_dict``, ``set_state_dict``, ``StateDictOptions``); the DCP recipe "Getting started with
distributed checkpoint" (pytorch.org tutorials).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from mpcourse.core.bf16 import BF16Optimizer
from mpcourse.core.checkpoint import CheckpointError
from mpcourse.core.optim.blockwise import STORAGE_KEYS, BlockQuantizedAdamW, storage_mismatch
from ..recipes import MasterWeightsRecipe
from ..training.train import check_same_corpus, corpus_id

META_FILE = "mpcourse.json"
FORMAT = 2                # 2: the optimizer's storage record and stochastic-rounding generators; 1 had neither


class _MasterView(nn.Module):
    """The FP32 master parameters of a ``MasterWeights`` under the model's parameter names ('.' -> '/'), so that
    ``get_state_dict`` can name the optimizer state of an optimizer that does not step the model itself."""

    def __init__(self, model: nn.Module, master):
        super().__init__()
        names = {id(p): n for n, p in model.named_parameters()}
        self.master = nn.ParameterDict({names[id(p)].replace(".", "/"): m
                                        for p, m in zip(master.model_params, master.master_params)})


def _stepped(recipe) -> tuple[nn.Module, torch.optim.Optimizer, bool]:
    """(the module whose parameters the torch optimizer steps, that optimizer, is it a master view)."""
    if isinstance(recipe, MasterWeightsRecipe):               # DDP: optimizer over the fp32 master copy
        return _MasterView(recipe.model, recipe.master), recipe.master.optimizer, True
    opt = recipe.optimizer
    if isinstance(opt, BF16Optimizer):                       # bf16-pure*: the wrapped torch optimizer
        opt = opt.optimizer
    return recipe.model, opt, False


def _extra(recipe) -> dict:
    out = {}
    scaler = getattr(recipe, "scaler", None)
    if scaler is not None:
        out["scaler"] = scaler.state_dict()                   # Python scalars, the same on every rank
    if isinstance(recipe.optimizer, BF16Optimizer):
        sd = recipe.optimizer.state_dict()
        comp = sd["compensation"]
        out["bf16"] = {"rounding": sd["rounding"], "kahan": sd["kahan"], "generator": sd["generator"],
                       "compensation": None if comp is None else {str(i): c for i, c in enumerate(comp)}}
    return out


def _optim_rng(opt) -> dict:
    """This rank's stochastic-rounding generators of a ``LowPrecisionState`` optimizer ({} for any other): kept per
    rank, since under FSDP2 each rank draws for its own shard."""
    return opt.rng_state() if hasattr(opt, "rng_state") else {}


def _loop_state(trainer, opt) -> dict:
    loop = {"step": trainer.step, "history": json.dumps(trainer.history), "skipped": trainer.skipped,
            "diverged_at": trainer.diverged_at, "batch_rng": trainer.batches.get_state(),
            "torch_rng": torch.get_rng_state()}
    if _optim_rng(opt):
        loop["optim_rng"] = _optim_rng(opt)
    return loop


def _lost_in_format_1(opt) -> str | None:
    """What a checkpoint of format 1 did not keep of ``opt``'s state (DCP keeps an optimizer's 'state' and
    'param_groups' only), or None."""
    if isinstance(opt, BlockQuantizedAdamW):
        return ("how its quantized moments are stored (fmt, state_rule, block_size): its exp_avg_sq codes could be "
                "read as v where they hold sqrt(v)")
    if getattr(opt, "low_rounding", None) == "stochastic":
        return "its stochastic-rounding generators: its draws would not continue the run"
    return None


def _state(trainer) -> tuple[dict, nn.Module, torch.optim.Optimizer, bool]:
    recipe = trainer.recipe
    module, opt, is_view = _stepped(recipe)
    stepped_sd, optim_sd = get_state_dict(module, opt)      # a fresh optimizer takes one step at lr 0 first
    state = {"model": get_model_state_dict(recipe.model) if is_view else stepped_sd, "optim": optim_sd,
             "extra": _extra(recipe), f"rank{trainer.rank}": _loop_state(trainer, opt)}
    if is_view:
        state["master"] = stepped_sd
    return state, module, opt, is_view


def _meta(trainer) -> dict:
    rd = trainer.reduce_dtype
    return {"format": FORMAT, "recipe": trainer.name, "parallel": trainer.parallel, "world_size": trainer.world,
            "reduce_dtype": None if rd is None else str(rd).removeprefix("torch."), "step": trainer.step,
            "corpus": corpus_id(trainer.corpus)}


def _refuse_expert_parallel(trainer) -> None:
    """ValueError for a ``--parallel ep`` run: each rank holds other experts under the same names, which a DCP
    checkpoint of a DDP module would store once (rank 0's)."""
    if trainer.parallel == "ep":
        raise ValueError("checkpoints of a --parallel ep run are not supported (each rank holds its own experts "
                         "under the same parameter names): train it without checkpoints, or under --parallel ddp")


def save(trainer, path) -> Path:
    """Write ``trainer``'s state (a ``DataParallelTrainer``) to the directory ``path`` with DCP; collective (every
    rank calls it at the same step). Take it between steps. Returns the path. ValueError under ``--parallel ep``."""
    _refuse_expert_parallel(trainer)
    path = Path(path)
    state, *_ = _state(trainer)
    dcp.save(state, checkpoint_id=path)                      # every rank its shards; ends in a barrier
    if trainer.rank == 0:
        tmp = path / f"{META_FILE}.tmp"
        tmp.write_text(json.dumps(_meta(trainer), indent=1))
        os.replace(tmp, path / META_FILE)
    dist.barrier()
    return path


def check_compatible(saved: dict, trainer) -> None:
    """CheckpointError (a ValueError) unless the checkpoint's ``mpcourse.json`` matches this job."""
    here = _meta(trainer)
    if saved.get("format") not in (1, FORMAT):
        raise CheckpointError(f"not an mpcourse distributed checkpoint of format 1 or {FORMAT} (got "
                              f"{saved.get('format')!r})")
    lost = _lost_in_format_1(_stepped(trainer.recipe)[1]) if saved["format"] == 1 else None
    if lost:
        raise CheckpointError(
            f"the checkpoint was written by an older mpcourse (distributed checkpoint format 1), which did not save, "
            f"of recipe {saved['recipe']}'s optimizer, {lost}. Resume it with the mpcourse version that wrote it, or "
            "start the run again")
    if saved["world_size"] != here["world_size"]:
        raise CheckpointError(
            f"world size mismatch: the checkpoint was saved by {saved['world_size']} ranks, this job has "
            f"{here['world_size']}: resume with --nproc {saved['world_size']} (or torchrun --nproc-per-node "
            f"{saved['world_size']}); each rank's batch slice and the reduction order depend on the number of "
            "ranks, so a resume on another number would not continue the run bit for bit")
    for key, flag in (("recipe", "recipe"), ("parallel", "--parallel"), ("reduce_dtype", "--reduce-dtype")):
        if saved[key] != here[key]:
            raise CheckpointError(f"{key} mismatch: the checkpoint was saved with {flag} {saved[key]}, this job "
                                  f"uses {here[key]}: resume with {flag} {saved[key]}")
    check_same_corpus(saved.get("corpus"), trainer.corpus)


def read_meta(path) -> dict:
    meta = Path(path) / META_FILE
    if not meta.is_file():
        raise CheckpointError(f"{path} is not a distributed checkpoint written by DataParallelTrainer.save (no "
                              f"{META_FILE}; an interrupted save leaves none)")
    return json.loads(meta.read_text())


def check_storage(opt, path) -> None:
    """CheckpointError unless the quantized moments in ``path`` were stored as ``opt`` (a ``BlockQuantizedAdamW``)
    stores them: their ``fmt``, ``state_rule`` and ``block_size`` (recorded in the optimizer's param groups) read
    alone from the checkpoint, before anything is read into the trainer; collective. Other optimizers: nothing."""
    if not isinstance(opt, BlockQuantizedAdamW):
        return
    saved = {"optim": {"param_groups": [dict.fromkeys(STORAGE_KEYS) for _ in opt.param_groups]}}
    dcp.load(saved, checkpoint_id=Path(path))              # those keys only
    for group in saved["optim"]["param_groups"]:
        why = storage_mismatch(group, opt.storage())
        if why is not None:
            raise CheckpointError(why)


@torch.no_grad()
def load(trainer, path):
    """Resume ``trainer`` (freshly built, the same recipe, mode and number of ranks) from ``save``'s directory;
    collective. Raises CheckpointError before anything is read if the checkpoint does not match this job."""
    _refuse_expert_parallel(trainer)
    check_compatible(read_meta(path), trainer)
    check_storage(_stepped(trainer.recipe)[1], path)
    state, module, opt, is_view = _state(trainer)            # the template, tensors allocated
    dcp.load(state, checkpoint_id=Path(path))                # in place; non-tensor values replaced
    recipe = trainer.recipe
    if is_view:
        set_model_state_dict(recipe.model, state["model"])
        set_state_dict(module, opt, model_state_dict=state["master"], optim_state_dict=state["optim"])
        recipe.master.copy_master_to_model(refresh=False)   # the model := the loaded master rounded, as saved
    else:
        set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loop = state[f"rank{trainer.rank}"]
    if "optim_rng" in loop:                                 # set_state_dict passes 'state' and 'param_groups' only
        opt.load_rng_state(loop["optim_rng"])
    extra = state["extra"]
    if "scaler" in extra:
        recipe.scaler.load_state_dict(extra["scaler"])
    if "bf16" in extra:
        b = extra["bf16"]
        comp = b["compensation"]
        recipe.optimizer.load_state_dict({"optimizer": opt.state_dict(), "rounding": b["rounding"],
                                          "kahan": b["kahan"], "generator": b["generator"],
                                          "compensation": None if comp is None else
                                          [comp[str(i)] for i in range(len(comp))]})
    trainer.step, trainer.history = loop["step"], json.loads(loop["history"])
    trainer.skipped, trainer.diverged_at = loop["skipped"], loop["diverged_at"]
    trainer.batches.set_state(loop["batch_rng"])
    torch.set_rng_state(loop["torch_rng"])
    return trainer


__all__ = ["save", "load", "check_compatible", "read_meta", "META_FILE"]
