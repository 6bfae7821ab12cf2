"""A recipe made data-parallel: DDP replicates it, FSDP2 shards it (one process per rank, torch.distributed).

What each mode does to a recipe (``prepare``); the recipe's own code runs unchanged unless said so:

``ddp`` (``torch.nn.parallel.DistributedDataParallel``): every rank holds the whole recipe (weights, master
copy, optimizer state: the bytes per parameter of the single-process table) and runs its slice of the
batch; DDP all-reduces the gradients (mean over ranks) during backward, in the gradients' dtype (FP16/BF16
for the low-precision models; ``bf16-pure*`` too: ``BF16Optimizer`` writes each step back into the BF16
parameters in place, so the autograd gradient accumulators DDP's reducer hooks stay the same objects).
``reduce_dtype`` puts a communication hook in front that casts each bucket to
that dtype for the all-reduce and back (torch's ``bf16_compress_hook`` does the same for BF16). Since every
rank then holds the same gradients, the loss scalers' inf checks agree without a collective; the course's
scalers all-reduce their flag anyway (``mpcourse.core.scaling``), torch's ``GradScaler`` does not need to.

``fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard`` on every block, then on the whole model): parameters,
gradients and optimizer state are sharded (ZeRO stage 3): each rank keeps 1/N of every tensor as a DTensor
shard, all-gathers a block's parameters just before its forward (and again for its backward) and
reduce-scatters its gradients. Per recipe:

* master-weights recipes (``fp16-master``, ``fp16-static``, ``fp16-dynamic``, ``bf16-master``,
  ``bf16-master-bf16-moments``): the FP32
  parameters *are* the master copy, sharded; ``MixedPrecisionPolicy(param_dtype=fp16/bf16,
  reduce_dtype=fp32)`` casts each all-gathered block to the working dtype, so forward and backward run in
  FP16/BF16 exactly as the single-process recipe's model does, and the gradients are reduce-scattered in FP32
  onto the FP32 shards. The recipe's ``master_optimizer`` steps the shards (AdamW; for
  ``bf16-master-bf16-moments`` AdamW with its moments stored in BF16, sharded too); no copy-down is needed (the next all-gather
  casts again, round to nearest even as ``MasterWeights.copy_master_to_model``). The FP32 initialisation is
  first rounded through the working dtype so the master starts from the same values as the single-process
  ``MasterWeights`` (built from the cast model, Apex O2). The course's loss scaler all-reduces its inf flag
  (each rank checks only its shard). This is ``ShardedMasterRecipe``.
* ``torch-amp-fp16``: its ``GradScaler`` is replaced by FSDP's ``ShardedGradScaler`` (the same rules plus an
  explicit all-reduce of the inf flag), the scaler torch documents for sharded gradients. (Measured in torch
  2.13: torch's DTensor dispatch of the fused inf check already reduces the flag with MAX over the mesh, so
  a plain ``GradScaler`` agrees across ranks on DTensor gradients too; a check on ``.to_local()`` shards
  would not.)
* FP32-parameter recipes (``fp32``, ``torch-amp-bf16``, ``bf16-autocast``, ``fp8-*`` but ``fp8-delayed-fp8-weights``, which ``UNSUPPORTED`` refuses under both modes): sharded as they are;
  ``reduce_dtype`` (if given) is the policy's. The FP8 layers all-gather their FP32 weights and quantize after
  the all-gather; with ``fp8_all_gather`` (``--fp8-all-gather``, ``fp8-current`` only) each rank casts its
  shard to E4M3 with the whole weight's scale and the ranks gather the FP8 bytes instead: the same FP8
  weight, bit for bit, a quarter of the weights' bytes (``mpcourse.core.quant.layers.fsdp_fp8``; a weight whose rows
  do not divide among the ranks has its FP8 shards padded to FSDP2's padded sharded size, as the FP32 ones are).
  ``AllGatherLog`` counts what each rank sends into FSDP2's all-gathers (every FSDP2 run).
  ``fp8-moments`` and ``int8-moments`` step their quantized AdamW on each rank's rows; the moments' blocks of 256
  stay the whole tensor's, also where a rank's rows end inside a block (the block amaxes are all-reduced,
  ``mpcourse.core.optim.shards``), so the optimizer gives one process's bits whatever the number of ranks.
* ``fp16-pure``: FP16 parameters sharded as they are (plain AdamW over FP16 shards).
* ``bf16-pure``, ``bf16-pure-sr``, ``bf16-pure-kahan``: BF16 parameters sharded as they are, gradients
  reduce-scattered in BF16 (or ``reduce_dtype``). ``BF16Optimizer`` steps FP32 temporaries of the DTensor shards
  (AdamW element by element, its BF16 state sharded too), then writes the result back into each rank's local
  shard by the recipe's rule; the Kahan compensation is sharded with the weight. Stochastic rounding: every rank
  holds the same generator (same seed) and, for each parameter, advances it over the draws of the *whole*
  tensor, using the slice of its own rows; so (CPU generator) an element gets the random bits it gets in one process, whatever
  the number of ranks, and the generators stay identical on every rank (``mpcourse.core.bf16``).

``ep`` (the moe-* recipes only): DDP as above for everything but the experts, which are split over the ranks and
reached by all-to-all (``mpcourse.experiment.parallel.expert_parallel``).

Sources: torch.distributed.fsdp docs (``fully_shard``, ``MixedPrecisionPolicy``); FSDP
``sharded_grad_scaler.py``; DDP communication hooks (``torch/distributed/algorithms/ddp_comm_hooks``);
Rajbhandari et al. 2020, "ZeRO" (bytes per parameter by stage).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from mpcourse.core.learner_table import exercise_names
from ..recipes import RECIPES, MasterWeightsRecipe, TrainingRecipe, StepResult

PARALLEL_MODES = ("ddp", "fsdp", "ep")      # ep: expert parallelism, ``parallel.expert_parallel``
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: recipe name -> why it cannot run under that mode (the message the driver prints instead of a row); a new
#: recipe that cannot must be listed here with the reason
_FP8_WEIGHTS = "fp8-delayed-fp8-weights"
UNSUPPORTED: dict[str, dict[str, str]] = {
    "fsdp": {_FP8_WEIGHTS: "its FP8 weights (E4M3 data + a scale, no gradient) would need an FP8 all-gather and "
                           "sharded masters outside the module, which this library does not build; run it on one "
                           "process"},
    "ddp": {_FP8_WEIGHTS: "DDP averages the gradients of the module's parameters, but its weight gradients go to "
                          "FP32 masters outside the module, which DDP would leave unreduced; run it on one process"},
}


def unsupported(recipe_name: str, parallel: str) -> str | None:
    """Why ``recipe_name`` cannot run under ``parallel``, or None if it can (``ep``: the MoE recipes only)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if parallel == "ep":
        return None if moe_experts(recipe_name) else (
            "not a mixture-of-experts recipe: --parallel ep splits the experts of the moe-* recipes over the ranks; "
            "run it under --parallel ddp or fsdp")
    return UNSUPPORTED[parallel].get(recipe_name)


def moe_experts(recipe_name: str) -> int:
    """The number of experts per block of a MoE recipe (``recipes.moe.MoERecipe``); 0 for any other recipe."""
    from ..recipes.moe import MoERecipe

    cls = RECIPES.get(recipe_name)
    return cls.moe["n_experts"] if cls is not None and issubclass(cls, MoERecipe) else 0


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


# -- DDP ------------------------------------------------------------------------------------------------
def _cast_allreduce_hook(dtype: torch.dtype):
    """A DDP communication hook: all-reduce each gradient bucket in ``dtype`` (mean over ranks), then copy the
    result back into the bucket (its own dtype). torch's ``default_hooks.bf16_compress_hook`` is this for BF16."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()                                          # (n,) grads' dtype, flat
        comm = buf.to(dtype).div_(dist.get_world_size(group))          # (n,) dtype, divided first as DDP does
        fut = dist.all_reduce(comm, group=group, async_op=True).get_future()

        def copy_back(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(copy_back)

    return hook


def wrap_ddp(model: nn.Module, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """``DistributedDataParallel(model)`` with gradients as bucket views (no second gradient copy), buffers not
    re-broadcast (they are constant masks), and a cast hook when ``reduce_dtype`` differs from the gradients'."""
    with warnings.catch_warnings():   # torch 2.13 deprecates broadcast_buffers, but its successor still syncs at init
        warnings.simplefilter("ignore", FutureWarning)
        ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    grad_dtype = next(model.parameters()).dtype
    if reduce_dtype is not None and reduce_dtype != grad_dtype:
        ddp.register_comm_hook(None, _cast_allreduce_hook(reduce_dtype))
    return ddp


# -- FSDP2 ----------------------------------------------------------------------------------------------
class ShardedMasterRecipe(TrainingRecipe):
    """A master-weights recipe under FSDP2: sharded FP32 parameters are the master, FSDP's
    ``MixedPrecisionPolicy(param_dtype=model_dtype)`` makes the FP16/BF16 working copy, block by block.

    Built from the single-process class ``base`` (its ``name``, ``model_dtype`` and loss scaler); the step is
    the scaled step of ``mpcourse.experiment.recipes.fp16`` without the two copies (FSDP's casts are them)::

        scaler.scale(loss).backward()   # fp16 grads of the all-gathered block -> reduce-scatter (fp32) -> shard
        scaler.unscale_(optimizer)      # fp32 shard / S; inf flag all-reduced (MAX) over the ranks
        clip_grads(optimizer)           # global norm over all shards (DTensor)
        scaler.step(optimizer)          # AdamW on the fp32 shards, or skipped on every rank
        scaler.update()
    """

    #: a learner's functions it can use: the loss scaler's (FSDP's casts replace the master -> model rounding)
    OVERRIDABLE = exercise_names("choose_loss_scale", "unscale_grads_", "update_scale", "all_reduce_found_inf_")

    def __init__(self, base: type[MasterWeightsRecipe], model, optim=None):
        self.OVERRIDABLE = overridable(base, "fsdp")   # what this instance takes: TrainingRecipe checks overrides by it
        self.FUNCTIONS = base.FUNCTIONS                # the learner's functions the base recipe carries
        self.base = base
        self.name = base.name
        self.model_dtype = base.model_dtype
        self.description = base.description + "; FSDP2: FP32 master sharded, working copy all-gathered per block"
        super().__init__(model, optim)
        make_scaler = getattr(base, "make_scaler", None)
        self.scaler = make_scaler(self) if make_scaler is not None else None

    def who(self) -> str:
        return f"recipe {self.name!r} under FSDP"

    def recipes_taking(self, name: str) -> list[str]:
        return [r for r, cls in RECIPES.items() if name in overridable(cls, "fsdp")]

    def make_optimizer(self, params):
        """The base recipe's master optimizer (``master_optimizer``: AdamW, or AdamW with BF16 moments for
        ``bf16-master-bf16-moments``) over the FP32 parameters, which are the master. Raises ValueError for a
        parameter that is not FP32 (the master copy is FP32 by definition; its optimizer state follows it)."""
        low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        if low:
            raise ValueError(f"recipe {self.name!r} under FSDP2: the master copy must be FP32, got parameters in "
                             f"{', '.join(low)}; build the recipe over an FP32 model (model.float()): the policy "
                             "casts the working copy")
        o = self.optim
        return self.base.master_optimizer(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def prepare_model(self, model):
        # A model given already in BF16/FP16 is upcast (exact): its parameters become the FP32 master, as
        # MasterWeights makes an FP32 master from the model's parameters whatever their dtype; never a BF16 "master".
        model = model.float()
        with torch.no_grad():                  # the master starts from the cast model's values, as MasterWeights
            for p in model.parameters():
                p.copy_(p.to(self.model_dtype).float())
        return model                           # FP32; sharded by prepare() next

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> StepResult:
        if self.scaler is None:
            return super().step()
        self.scaler.unscale_(self.optimizer)
        self.clip_grads(self.optimizer)
        self.scaler.step(self.optimizer)
        skipped = self.scaler.last_step_skipped
        scale_used = self.scaler.get_scale()
        self.scaler.update()
        return StepResult(skipped=skipped, loss_scale=scale_used)

    def memory(self) -> dict[str, int]:
        """As ``TrainingRecipe.memory`` per rank, with the FP32 shards counted as ``master`` and ``weights`` the working
        copy: the largest sum of all-gathered (unsharded) parameter bytes seen at a block's forward."""
        out = super().memory()
        out["master"], out["weights"] = out["weights"], getattr(self, "working_copy_bytes", 0)
        return out

    def state_dict(self):
        sd = super().state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _measure_working_copy(recipe: TrainingRecipe) -> None:
    """Forward pre-hooks (after FSDP's all-gather) that record in ``recipe.working_copy_bytes`` the largest
    total of unsharded parameter bytes registered at once during a forward."""
    recipe.working_copy_bytes = 0

    def hook(module, args):
        live = sum(p.numel() * p.element_size() for p in recipe.model.parameters() if not is_dtensor(p))
        recipe.working_copy_bytes = max(recipe.working_copy_bytes, live)

    for m in [*recipe.model.blocks, recipe.model]:
        m.register_forward_pre_hook(hook)


def overridable(recipe_cls: type[TrainingRecipe], parallel: str) -> tuple[str, ...]:
    """The names of a learner's functions ``recipe_cls`` uses under ``parallel`` ("ddp": all of its ``OVERRIDABLE``;
    "fsdp": for a master-weights recipe, those of ``ShardedMasterRecipe`` it has too)."""
    if parallel == "fsdp" and issubclass(recipe_cls, MasterWeightsRecipe):
        return tuple(n for n in recipe_cls.OVERRIDABLE if n in ShardedMasterRecipe.OVERRIDABLE)
    return tuple(recipe_cls.OVERRIDABLE)


#: recipes whose FP8 layers can all-gather their weights in FP8 (``--fp8-all-gather``): current per-tensor scaling
FP8_ALL_GATHER_RECIPES = ("fp8-current",)


def fp8_all_gather_error(recipe_name: str) -> str | None:
    """Why ``--fp8-all-gather`` cannot run ``recipe_name``, or None."""
    if recipe_name in FP8_ALL_GATHER_RECIPES:
        return None
    return (f"--fp8-all-gather supports {', '.join(FP8_ALL_GATHER_RECIPES)} (current per-tensor scaling), "
            f"not {recipe_name}")


class AllGatherLog:
    """What this rank sends into FSDP2's all-gathers while the model trains (evaluation's are not counted).

    ``calls``: one dict per all-gather: ``bytes`` (of the input this rank sends), ``dtype``, ``fp8_elements``
    (how many of those bytes are FP8 weight elements, recorded by ``FP8AllGatherWeight.fsdp_pre_all_gather``;
    both count a short shard's padding rows, which FSDP2 sends as it sends an FP32 shard's)."""

    def __init__(self, model: nn.Module):
        self.model, self.calls, self.fp8_pending = model, [], []

    def per_step(self, steps: int) -> dict:
        """Bytes per rank per training step: ``sent`` (measured), and the same elements as an ``fp32`` and a
        ``bf16`` all-gather would send them (4 and 2 B per element); ``amax_all_reduce`` the 4 B per FP8 weight
        and all-gather that its scale costs (an all-reduce, not in ``sent``)."""
        steps = max(steps, 1)
        sent = sum(c["bytes"] for c in self.calls)
        fp8 = sum(c["fp8_elements"] for c in self.calls)
        n8 = sum(c["fp8_tensors"] for c in self.calls)
        # elements gathered: FP8 ones (1 B each) and the others, in the call's dtype (FP32 in a mixed uint8 call)
        elements = fp8 + sum((c["bytes"] - c["fp8_elements"]) // (2 if c["dtype"] in ("bfloat16", "float16") else 4)
                             for c in self.calls)
        return {"sent": sent / steps, "fp32": 4 * elements / steps, "bf16": 2 * elements / steps,
                "fp8_elements": fp8 / steps, "amax_all_reduce": 4 * n8 / steps,
                "calls": len(self.calls) / steps, "dtypes": sorted({c["dtype"] for c in self.calls})}


def counting_all_gather(log: AllGatherLog):
    """FSDP2's default all-gather (``dist.all_gather_single``) that logs what this rank sends
    (``FSDPModule.set_custom_all_gather``, torch.distributed.fsdp docs)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            fp8, log.fp8_pending[:] = list(log.fp8_pending), []
            if log.model.training:
                log.calls.append({"bytes": input_tensor.numel() * input_tensor.element_size(),
                                  "dtype": str(input_tensor.dtype).replace("torch.", ""),
                                  "fp8_elements": sum(fp8), "fp8_tensors": len(fp8)})
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return CountingAllGather()


def shard_recipe(recipe_cls: type[TrainingRecipe], model: nn.Module, optim,
                 reduce_dtype: torch.dtype | None = None, fp8_all_gather: bool = False) -> TrainingRecipe:
    """Build ``recipe_cls`` over ``model`` (FP32, the same init on every rank) and shard it with FSDP2.

    ``fp8_all_gather``: the FP8 layers' weights travel in FP8 (``mpcourse.core.quant.layers.fsdp_fp8``; recipes in
    ``FP8_ALL_GATHER_RECIPES``). Returns the recipe, with ``recipe.model`` the sharded module (forward
    all-gathers), an optimizer rebuilt over the sharded parameters and ``recipe.all_gather_log`` (an
    ``AllGatherLog``). Raises ValueError for a recipe in ``UNSUPPORTED['fsdp']``, or one ``fp8_all_gather`` refuses.
    """
    from mpcourse.core.quant import QuantizedLinear
    from mpcourse.core.quant.layers.fsdp_fp8 import enable_fp8_all_gather

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    why = unsupported(recipe_cls.name, "fsdp")
    if why:
        raise ValueError(f"recipe {recipe_cls.name!r} cannot run under FSDP2: {why}")
    if issubclass(recipe_cls, MasterWeightsRecipe):
        recipe = ShardedMasterRecipe(recipe_cls, model, optim)
        policy = MixedPrecisionPolicy(param_dtype=recipe.model_dtype, reduce_dtype=reduce_dtype or torch.float32)
    else:
        recipe = recipe_cls(model, optim)
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    if fp8_all_gather:
        why = fp8_all_gather_error(recipe_cls.name)
        if why:
            raise ValueError(why)
        enable_fp8_all_gather(recipe.model)             # before fully_shard: the shards keep the wrapper
    log = recipe.all_gather_log = AllGatherLog(recipe.model)
    for m in recipe.model.modules():
        if isinstance(m, QuantizedLinear):
            m.all_gather_record = log.fp8_pending
    for block in recipe.model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(recipe.model, mp_policy=policy)        # the rest: embeddings (tied head), ln_f
    for m in [*recipe.model.blocks, recipe.model]:
        m.set_custom_all_gather(counting_all_gather(log))
    recipe.optimizer = recipe.make_optimizer(list(recipe.model.parameters()))   # over the DTensor shards
    if isinstance(getattr(recipe, "scaler", None), torch.amp.GradScaler):        # torch-amp-fp16
        old = recipe.scaler
        recipe.scaler = ShardedGradScaler(next(recipe.model.parameters()).device.type, init_scale=old.get_scale(), growth_factor=old.get_growth_factor(),
                                          backoff_factor=old.get_backoff_factor(),
                                          growth_interval=old.get_growth_interval())
    if isinstance(recipe, ShardedMasterRecipe):
        _measure_working_copy(recipe)
    return recipe
