"""The training loop every recipe runs: same model init, same batches, same schedule.

One step (the recipe decides the precision of each line; see ``mpcourse.recipes.base``)::

    with recipe.forward_context():          # autocast / FP8 autocast / nothing
        _, loss = recipe.model(x, y)        # loss: fp32 ()
    recipe.backward(loss)                   # loss.backward(), or scaler.scale(loss).backward()
    result = recipe.step()                  # clip, optimizer step (maybe skipped), scaler update
    recipe.zero_grad()

All of it runs inside ``mpcourse.emulation.tensor_cores()``, so low-precision matmuls on a CPU
without BF16/FP16 units are computed as tensor cores compute them. Runs are seeded: on CPU the same
seed gives the same bits.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from .data import Corpus
from .emulation import tensor_cores
from .model import GPT, GPTConfig
from .recipes import OptimConfig, get_recipe


@dataclass
class TrainConfig:
    """One training run.

    Attributes:
        steps: optimizer steps (default 200).
        batch_size: sequences per step B (default 16); tokens per step = B * block_size.
        eval_interval: evaluate validation loss every this many steps (default 50) and at the end.
        eval_batches: batches per evaluation, per split (default 8).
        seed: seeds the model init and the batch order (default 0).
        optim: optimizer hyper-parameters (``mpcourse.recipes.OptimConfig``).
        model: model hyper-parameters; ``vocab_size`` is taken from the corpus.
    """

    steps: int = 200
    batch_size: int = 16
    eval_interval: int = 50
    eval_batches: int = 8
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: GPTConfig = field(default_factory=GPTConfig)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1 (got {self.steps}, {self.batch_size})")


@dataclass
class RunResult:
    """The outcome of one recipe's run (one object per recipe in ``results.json``).

    Losses are mean cross-entropy in nats per character; NaN where the run diverged.
    ``history`` holds one record per step: ``step``, ``loss``, ``skipped``, ``loss_scale``, and
    ``val_loss`` on evaluation steps.
    """

    recipe: str
    description: str
    final_train_loss: float
    final_val_loss: float
    skipped_steps: int
    final_loss_scale: float | None
    tokens_per_s: float
    bytes_per_param: dict
    activation_bytes: int
    steps_run: int
    diverged_at: int | None
    history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, optim: OptimConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then constant."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    return optim.lr


@torch.no_grad()
def evaluate(recipe, corpus: Corpus, cfg: TrainConfig) -> dict[str, float]:
    """Mean loss over ``eval_batches`` fixed batches of each split (same batches every call and every recipe)."""
    recipe.model.eval()
    out = {}
    for split in ("train", "val"):
        g = torch.Generator().manual_seed(10_000 + cfg.seed)
        losses = []
        for _ in range(cfg.eval_batches):
            x, y = corpus.batch(split, cfg.batch_size, cfg.model.block_size, g)
            with recipe.forward_context():
                _, loss = recipe.model(x, y)
            losses.append(float(loss))
        out[split] = sum(losses) / len(losses)
    recipe.model.train()
    return out


def activation_bytes(recipe, x, y) -> int:
    """Bytes of the tensors autograd saves for backward in one forward pass (parameters excluded,
    each storage counted once). Runs one forward and drops its graph."""
    param_ptrs = {p.data_ptr() for p in recipe.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with recipe.forward_context():
            _, loss = recipe.model(x, y)
    del loss
    return sum(seen.values())


def train(recipe_name: str, corpus: Corpus, cfg: TrainConfig, *, progress: bool = True,
          position: int = 0) -> RunResult:
    """Train a fresh GPT on ``corpus`` under recipe ``recipe_name`` and report the outcome.

    A run whose training loss becomes inf or NaN stops there (``diverged_at``), and its final
    losses are NaN: nothing is silently averaged away.

    Raises:
        KeyError: unknown recipe name (the message lists the known ones).
    """
    recipe_cls = get_recipe(recipe_name)
    mcfg = GPTConfig(**{**asdict(cfg.model), "vocab_size": corpus.vocab_size})
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)                                        # FP32 init, identical for every recipe
    history, skipped, diverged_at, scale = [], 0, None, None
    step_time, mem, act = 0.0, None, 0
    gen = torch.Generator().manual_seed(cfg.seed)            # identical batch order for every recipe
    bar = tqdm(range(cfg.steps), desc=f"{recipe_name:>16}", disable=not progress, position=position,
               leave=True, dynamic_ncols=True)
    with tensor_cores():
        recipe = recipe_cls(model, cfg.optim)
        for step in bar:
            x, y = corpus.batch("train", cfg.batch_size, mcfg.block_size, gen)   # (B, T) int64
            if step == 0:
                act = activation_bytes(recipe, x, y)
            recipe.set_lr(lr_at(step, cfg.optim))
            t0 = time.perf_counter()
            with recipe.forward_context():
                _, loss = recipe.model(x, y)                 # fp32 ()
            recipe.backward(loss)
            result = recipe.step()
            if mem is None:
                mem = recipe.memory()
            recipe.zero_grad()
            step_time += time.perf_counter() - t0
            loss_value = float(loss.detach())
            skipped += int(result.skipped)
            scale = result.loss_scale
            rec = {"step": step, "loss": loss_value, "skipped": result.skipped, "loss_scale": scale}
            if not math.isfinite(loss_value):
                diverged_at = step
                history.append(rec)
                break
            if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
                rec["val_loss"] = evaluate(recipe, corpus, cfg)["val"]
            history.append(rec)
            bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        bar.close()
        if diverged_at is None:
            final = evaluate(recipe, corpus, cfg)
        else:
            final = {"train": float("nan"), "val": float("nan")}
    n_params = sum(p.numel() for p in recipe.model.parameters())
    steps_run = len(history)
    return RunResult(
        recipe=recipe_name, description=recipe_cls.description,
        final_train_loss=final["train"], final_val_loss=final["val"],
        skipped_steps=skipped, final_loss_scale=scale,
        tokens_per_s=steps_run * cfg.batch_size * mcfg.block_size / max(step_time, 1e-9),
        bytes_per_param={k: v / n_params for k, v in (mem or {}).items()},
        activation_bytes=act, steps_run=steps_run, diverged_at=diverged_at, history=history)
