"""What every ablation shares: one run of one recipe on the course's GPT, logged step by step.

``run_one(label, make_recipe, cfg)`` builds the GPT from ``cfg.seed`` (the same FP32 initialisation as
``mpcourse compare``), wraps the recipe ``make_recipe(model, optim)`` returns in the project's one training
step (``mpcourse.experiment.training.train.Trainer``), trains ``cfg.steps`` steps and returns a JSON-ready record:

    label, seed, final_train_loss, final_val_loss (None where the run diverged), diverged_at,
    history: one record per step with loss, skipped, loss_scale, and from the gradients right after the
             backward (in the dtype backward wrote them, before any unscaling): grad_amax (inf if any
             gradient is inf/NaN) and grad_zero_fraction (the fraction of gradient elements exactly 0)

The log is what the lesson's exercise diagnoses. Runs are short (tens of steps, batch 8) so that every
ablation is CPU minutes; the gaps they show are read against the seed-to-seed spread they also measure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import OptimConfig
from mpcourse.experiment.training.train import Trainer, TrainConfig


@dataclass(frozen=True)
class AblationConfig:
    """Size of every ablation run: ``steps`` x ``batch_size`` sequences of the default GPT, over ``seeds``."""

    steps: int = 80
    batch_size: int = 8
    seeds: tuple[int, ...] = (0, 1)
    eval_batches: int = 4

    def train_config(self, seed: int, optim: OptimConfig | None = None) -> TrainConfig:
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, eval_interval=self.steps,
                           eval_batches=self.eval_batches, seed=seed, optim=optim or OptimConfig())


def _finite_or_none(v: float):
    return v if math.isfinite(v) else None


@torch.no_grad()
def grad_probe(model: torch.nn.Module) -> dict:
    """amax and fraction of exact zeros over every parameter gradient of ``model`` (each storage once)."""
    amax, zeros, numel, seen = 0.0, 0, 0, set()
    for p in model.parameters():
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g = p.grad.detach()
        if not bool(torch.isfinite(g).all()):
            amax = math.inf
        else:
            amax = max(amax, float(g.abs().max().float()))
        zeros += int((g == 0).sum())
        numel += g.numel()
    return {"grad_amax": amax, "grad_zero_fraction": round(zeros / max(numel, 1), 6)}


@torch.no_grad()
def weight_probe(recipe) -> dict:
    """amax over the weights the optimizer updates (the FP32 master copy where a recipe keeps one), read after
    the step: inf if any is inf/NaN (the update itself broke them)."""
    amax = 0.0
    for group in recipe.optimizer.param_groups:
        for p in group["params"]:
            w = p.detach()
            if not bool(torch.isfinite(w).all()):
                return {"weight_amax": math.inf}
            amax = max(amax, float(w.abs().max().float()))
    return {"weight_amax": amax}


def run_one(label: str, make_recipe, cfg: TrainConfig, *, corpus=None, trainer_cls=Trainer, probe=None,
            model_cfg: GPTConfig | None = None, step_probe=None) -> dict:
    """Train one run and return its record (see the module docstring). ``probe(recipe) -> dict`` adds fields
    to each step's record (read after the backward, with the gradients present); ``step_probe(recipe) -> dict``
    likewise, read after the optimizer step (e.g. ``weight_probe``). ``model_cfg``: the GPT's
    size (default: ``GPTConfig()``, the ablations' size; its vocab_size is always the corpus's)."""
    corpus = corpus or load_corpus(None)
    torch.manual_seed(cfg.seed)
    model = GPT(replace(model_cfg or GPTConfig(), vocab_size=corpus.vocab_size))   # FP32 init, the same for every run
    recipe = make_recipe(model, cfg.optim)
    trainer = trainer_cls.wrap(recipe, corpus, cfg, evaluate=False)
    extra = {}

    def after_backward(step, r):
        extra.clear()
        extra.update(grad_probe(r.model))
        if probe is not None:
            extra.update(probe(r))

    def after_step(step, r, result):
        if step_probe is not None:
            extra.update(step_probe(r))

    history = []
    with trainer.emulation():
        while not trainer.done:
            rec = trainer.train_step(after_backward=after_backward, after_step=after_step)
            history.append({"step": rec["step"], "loss": _finite_or_none(rec["loss"]), "skipped": bool(rec["skipped"]),
                            "loss_scale": rec["loss_scale"],
                            **{k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in extra.items()}})
        res = trainer.result()
    return {"label": label, "seed": cfg.seed, "final_train_loss": _finite_or_none(res.final_train_loss),
            "final_val_loss": _finite_or_none(res.final_val_loss), "diverged_at": res.diverged_at,
            "history": history}


def over_seeds(label: str, make_recipe, acfg: AblationConfig, *, optim: OptimConfig | None = None, **kw) -> list[dict]:
    """``run_one`` once per seed of ``acfg``."""
    return [run_one(label, make_recipe, acfg.train_config(s, optim), **kw) for s in acfg.seeds]


def with_optim(cfg: TrainConfig, **changes) -> TrainConfig:
    return replace(cfg, optim=replace(cfg.optim, **changes))
