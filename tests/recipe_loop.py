"""Test helper shared by the recipe tests: build a recipe on a small GPT and step it the way
``mpcourse.experiment.train.Trainer`` does, one step at a time, with an optional hook before ``step()``."""
import torch

from mpcourse.core.emulation import tensor_cores
from mpcourse.experiment.model import GPT, GPTConfig
from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.experiment.train import lr_at


def make_recipe(name, corpus, model_cfg: GPTConfig, seed=0, optim=None):
    """TrainingRecipe ``name`` on a freshly seeded FP32 GPT of ``model_cfg`` (vocabulary from ``corpus``)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**model_cfg.__dict__, "vocab_size": corpus.vocab_size}))   # fp32 init
    return get_recipe(name)(model, optim or OptimConfig())


def run_steps(recipe, corpus, gen, steps, *, block_size, batch_size, start=0, inject=None):
    """Train ``steps`` steps from step ``start``; ``inject(step, recipe)`` runs after backward.
    Returns [(loss as float, StepResult)] per step."""
    out = []
    with tensor_cores():
        for step in range(start, start + steps):
            x, y = corpus.batch("train", batch_size, block_size, gen)               # (B, T) int64
            recipe.set_lr(lr_at(step, recipe.optim))
            with recipe.forward_context():
                _, loss = recipe.model(x, y)                                         # fp32 ()
            recipe.backward(loss)
            if inject is not None:
                inject(step, recipe)
            result = recipe.step()
            recipe.zero_grad()
            out.append((float(loss.detach()), result))
    return out
