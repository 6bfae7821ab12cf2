"""Test helper shared by the recipe tests: build a recipe on a small GPT and step it with the trainer's own
step (``mpcourse.experiment.training.train.Trainer.train_step``), with an optional hook after backward."""
import torch

from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.experiment.training.train import TrainConfig, Trainer


def make_recipe(name, corpus, model_cfg: GPTConfig, seed=0, optim=None):
    """TrainingRecipe ``name`` on a freshly seeded FP32 GPT of ``model_cfg`` (vocabulary from ``corpus``)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**model_cfg.__dict__, "vocab_size": corpus.vocab_size}))   # fp32 init
    return get_recipe(name)(model, optim or OptimConfig())


def run_steps(recipe, corpus, gen, steps, *, block_size, batch_size, start=0, inject=None):
    """Train ``steps`` steps from step ``start`` (learning rate constant after warm-up, no evaluation);
    ``inject(step, recipe)`` runs after backward. Returns [(loss as float, StepResult)] per step."""
    cfg = TrainConfig(steps=start + steps, batch_size=batch_size, model=GPTConfig(block_size=block_size))
    trainer = Trainer.wrap(recipe, corpus, cfg, gen, start_step=start, lr_decay=False, evaluate=False)
    results = []
    with trainer.emulation():
        for _ in range(steps):
            rec = trainer.train_step(after_backward=inject,
                                     after_step=lambda step, r, result: results.append(result))
            results[-1] = (rec["loss"], results[-1])
    return results
