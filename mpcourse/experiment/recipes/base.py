"""The precision-recipe interface and its registry.

A *training recipe* (``TrainingRecipe``) decides, for one training run, how each of the four parts of a step is
done in which precision (a *quantization recipe*, ``mpcourse.core.quant.QuantizationRecipe``, Transformer Engine's
``Recipe``, says only how a quantized linear layer's tensors are scaled; the quantized training recipes hold one as
``fp8_recipe``, TE's name for it):

    model      ``prepare_model``    what dtype the parameters live in (FP32, FP16, BF16, FP8 layers)
    forward    ``forward_context``  a region the forward pass runs in (autocast, FP8 autocast, none)
    backward   ``backward``         how the loss is turned into gradients (scaled or not)
    step       ``step``             how gradients update the weights (master copy, loss-scaler
                                    skip/update, stochastic rounding, Kahan compensation)

The training loop (``mpcourse.experiment.training.train``) calls only these methods, so a new recipe is one small
class: subclass ``TrainingRecipe``, override what differs, decorate it with ``@register``. Every recipe
gets the same FP32-initialised model, the same batches and the same optimizer hyper-parameters;
only precision differs. ``mpcourse recipes`` lists the registry.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn as nn

from mpcourse.core.checkpoint import CheckpointError, check_optimizer_state_dict
from mpcourse.core.learner_table import CheckedFunctions, check_overrides, exercise_names, guarded
from mpcourse.core.master import MasterWeights, cast_model

RECIPES: dict[str, type["TrainingRecipe"]] = {}


def register(cls: type["TrainingRecipe"]) -> type["TrainingRecipe"]:
    """Class decorator: add a recipe to ``RECIPES`` under ``cls.name`` (``recipes.TABLE_ORDER`` sets the table order)."""
    if not cls.name or cls.name in RECIPES:
        raise ValueError(f"recipe name {cls.name!r} is empty or already registered")
    RECIPES[cls.name] = cls
    return cls


def get_recipe(name: str) -> type["TrainingRecipe"]:
    """The recipe class registered as ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)} "
                       "(run `mpcourse recipes`)") from None


@dataclass
class OptimConfig:
    """Optimizer hyper-parameters shared by every recipe (AdamW, as nanoGPT).

    Attributes:
        lr: learning rate (default 3e-3, constant after ``warmup_steps``).
        betas: Adam betas (default (0.9, 0.99)).
        eps: Adam epsilon (default 1e-8; note: 0 in FP16, the point of lesson 02).
        weight_decay: decoupled weight decay (default 0.0).
        grad_clip: max global gradient norm after unscaling (default 1.0; 0 disables).
        warmup_steps: linear learning-rate warm-up (default 20).
        min_lr_ratio: after warm-up the rate follows a cosine from ``lr`` down to
            ``lr * min_lr_ratio`` at the last step (default 0.1, as nanoGPT/GPT-3; 1.0 keeps it
            constant). Decaying makes the end of a short run less noisy, so the gaps between
            recipes measure precision, not where each run happened to be in its oscillation.
    """

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass
class StepResult:
    """What one optimizer step did: ``skipped`` (inf/NaN gradients), the loss scale in force (None: no scaling),
    and ``stats``: opt-in per-step statistics (e.g. ``lost_updates``), copied into the step's history record."""

    skipped: bool = False
    loss_scale: float | None = None
    stats: dict = field(default_factory=dict)


class TrainingRecipe:
    """Base recipe: plain FP32 training with AdamW. Subclasses override what differs.

    Args:
        model: an FP32 model (``mpcourse.experiment.gpt.model.GPT``), freshly initialised; the recipe may cast or
            convert it in ``prepare_model``.
        optim: optimizer hyper-parameters.

    Attributes:
        model: the model as trained (after ``prepare_model``).
        optimizer: the ``torch.optim`` optimizer that steps (over master params where a recipe keeps them).
    """

    name: str = ""
    description: str = ""
    #: the one statement of which of a learner's functions this recipe takes (``overrides``): names from the table of
    #: the exercises' functions (``mpcourse.core.learner_table``; write them with ``exercise_names(...)``), each
    #: called with that exercise's signature.
    OVERRIDABLE: tuple[str, ...] = ()
    #: the dtype most of a step's GEMM FLOPs run in: "fp32", "bf16", "fp16", or "fp8" for quantized linears (FP8,
    #: MX, NVFP4 operands). ``mpcourse compare``'s %peak measures the row against that dtype's peak
    #: (``mpcourse.experiment.measure.speed.peak_key``); ``tests/experiment/test_compare_outputs.py`` checks it against the matmuls
    #: one step runs.
    gemm_dtype: str = "fp32"
    #: a learner's functions this recipe class carries (``with_functions``); none for the library's own recipes
    FUNCTIONS: Mapping[str, Callable] = MappingProxyType({})

    @classmethod
    def with_functions(cls, functions: Mapping[str, Callable] | None) -> type["TrainingRecipe"]:
        """This recipe with a learner's ``functions`` in place of the library's: a subclass of the same name that
        carries them (``FUNCTIONS``), as a quantization recipe carries its own (``mpcourse.core.quant.Recipe``),
        so whatever builds and trains the recipe (``Trainer``, ``train``, the data-parallel trainers) takes one
        recipe and no functions beside it. They are checked where the recipe is built (``checked_overrides``)."""
        if not functions:
            return cls
        return type(cls.__name__, (cls,), {"FUNCTIONS": MappingProxyType(dict(functions)), "__doc__": cls.__doc__,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})

    def __init__(self, model: nn.Module, optim: OptimConfig | None = None):
        # The one check of the learner's functions the class carries (``checked_overrides``): OverrideRefused, a
        # ValueError naming the fix; then each is wrapped so that what it raises is one OverrideError naming it
        # (``learner_table.guarded``; still a CheckedFunctions).
        self.overrides = self.checked_overrides(self.FUNCTIONS).wrapped(guarded)
        self.optim = optim or OptimConfig()
        self.model = self.prepare_model(model)
        self.optimizer = self.make_optimizer(list(self.model.parameters()))

    def checked_overrides(self, overrides: Mapping[str, Callable] | None, *,
                          refuse: Callable[[str], str | None] | None = None,
                          checked_for: object = None) -> CheckedFunctions:
        """The one check of a learner's ``overrides`` (``learner_table.check_overrides``: the names, this recipe's
        ``OVERRIDABLE``, the signatures), read-only. A recipe with reasons of its own to refuse a name it takes
        extends it with ``refuse(name)`` and says what the check depended on (``checked_for``): the FP8 recipes
        pass the quant engine's refusal and their quantization recipe, so the engine does not check again."""
        return check_overrides(overrides, self.OVERRIDABLE, self.who(), takers=self.recipes_taking, refuse=refuse,
                               checked_for=checked_for)

    def who(self) -> str:
        """How a refusal of a learner's function names this recipe."""
        return f"recipe {self.name!r}"

    def recipes_taking(self, name: str) -> list[str]:
        """The registered recipes that take the exercise function ``name`` (a refusal names them: the fix)."""
        return [r for r, cls in RECIPES.items() if name in cls.OVERRIDABLE]

    # -- the four decisions ---------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        o = self.optim
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def forward_context(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> StepResult:
        self.clip_grads(self.optimizer)
        self.optimizer.step()
        return StepResult()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    # -- helpers --------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def clip_grads(self, optimizer: torch.optim.Optimizer) -> float | None:
        """Clip the global norm of ``optimizer``'s (unscaled) gradients to ``optim.grad_clip``."""
        if not self.optim.grad_clip:
            return None
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, self.optim.grad_clip))

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this recipe holds that the generic accounting cannot see, by kind: ``"grads"`` (own
        gradient buffers) and ``"extra"`` (FP8 scaling state, Kahan compensation). Default: none."""
        return {}

    def memory(self) -> dict[str, int]:
        """Bytes held now, by kind (weights, grads, master, optimizer, extra), each storage counted once;
        counted by ``recipes.held`` (the one counter, which ``mpcourse.experiment.measure.memory`` uses too). Call after ``step()`` and before
        ``zero_grad()``; ``memory.measure_step`` adds activations and the peak of a step."""
        from .held import count_bytes, state_tensors

        return count_bytes(state_tensors(self))

    def state_dict(self) -> dict:
        """Everything needed to resume: model and optimizer state (subclasses add scaler, master, FP8 state)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: keys and optimizer state shapes are checked before anything is loaded
        (``CheckpointError``, a ValueError); the model's own ``load_state_dict`` checks its keys and shapes."""
        self.check_state_keys(state)
        if isinstance(self.optimizer, torch.optim.Optimizer):  # wrappers (BF16Optimizer) check their own
            check_optimizer_state_dict(self.optimizer, state["optimizer"], f"recipe {self.name!r} optimizer")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def check_state_keys(self, state: dict) -> None:
        """CheckpointError unless ``state`` has exactly the keys this recipe's ``state_dict()`` has."""
        want = set(self.state_dict())
        if not isinstance(state, dict) or set(state) != want:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"not a checkpoint of recipe {self.name!r}: expected the keys {sorted(want)}, "
                                  f"got {got}")


class MasterWeightsRecipe(TrainingRecipe):
    """Low-precision model (``model_dtype``: fp16 or bf16) with an FP32 master copy stepped by AdamW; no
    loss scaling. Shared by ``fp16-master`` (and the scaled FP16 rows) and ``bf16-master``."""

    model_dtype = torch.float16
    gemm_dtype = "fp16"                       # the model's dtype (a subclass with another model_dtype says so)
    #: lesson 00: the master -> model rounding (bf16 subclasses: round_to_bf16); lesson 02: the master copy and the
    #: step through it (``master_step`` does its own rounding: given both, ``round_to_fp16`` is not used).
    OVERRIDABLE = exercise_names("round_to_fp16", "make_master", "master_step")
    #: the torch optimizer class that steps the FP32 master (under FSDP2, ``ShardedMasterRecipe`` steps the
    #: sharded FP32 parameters with it, so a subclass's choice of optimizer state carries over)
    master_optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW

    def round_name(self) -> str:
        return {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}[self.model_dtype]

    def prepare_model(self, model):
        return cast_model(model, self.model_dtype)                    # every param (N,) fp16 / bf16

    def make_optimizer(self, params):
        o = self.optim
        # The master copy (fp32) is built from the fp16 params: the fp32 init's low bits are gone, as in Apex O2.
        self.master = MasterWeights(params, self.master_optimizer, lr=o.lr, betas=o.betas, eps=o.eps,
                                    weight_decay=o.weight_decay, round_to_model=self.overrides.get(self.round_name()),
                                    make_master=self.overrides.get("make_master"), model=self.model)
        return self.master.optimizer                                   # steps the fp32 master params

    def step(self) -> StepResult:
        if "master_step" in self.overrides:                            # lesson 02's step, clipping before AdamW
            self.master.step_with(self.overrides["master_step"], 1.0,
                                  before_step=lambda: self.clip_grads(self.optimizer))
            return StepResult()
        self.master.copy_grads_to_master()                             # fp16 grads -> fp32 master grads
        self.clip_grads(self.optimizer)                                # on the fp32 master grads
        self.optimizer.step()                                          # AdamW in fp32
        self.master.copy_master_to_model()                             # fp32 -> fp16, nearest even
        return StepResult()

    def zero_grad(self) -> None:
        self.master.zero_grad(set_to_none=True)                        # fp16 model grads and fp32 master grads

    def state_dict(self) -> dict:
        """{"model": fp16 state_dict, "master": MasterWeights.state_dict() (fp32 copy + optimizer state)}.
        Tensors are shared with the live run, as torch's state_dicts: torch.save or copy.deepcopy before going on."""
        return {"model": self.model.state_dict(), "master": self.master.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load the model, then rebuild the master from the checkpoint (never from the fp16 model) and write it
        back into the model rounded to fp16 (the same values the model had when saved). Keys are checked first;
        MasterWeights checks its params and optimizer state before changing anything."""
        self.check_state_keys(state)
        self.model.load_state_dict(state["model"])
        self.master.load_state_dict(state["master"])
