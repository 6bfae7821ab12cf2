"""The training step of the project, one function: `training_step` (forward, backward, ``recipe.step()``).

``Trainer.train_step`` (``mpcourse.experiment.training.train``) runs it for every step, timed; ``memory.measure_step``
wraps the same call to count the first step's memory (a region around the forward, a peak tracker around the
whole), so the step that is measured is the step that trains. It sits with the recipes, below ``measure`` and
``training``, which both import it (the folders' floors: ``mpcourse.experiment``). No kernel here: the recipe decides the precision of each line
(``mpcourse.experiment.recipes.base``).
"""
from __future__ import annotations

import contextlib


def training_step(recipe, x, y, forward_loss, *, forward_region=None, after_backward=None, after_step=None):
    """One training step of ``recipe`` on batch ``(x, y)`` (B, T) int64, without ``zero_grad``.

    ``forward_loss(x, y) -> loss`` fp32 (); ``forward_region``: a context manager entered around the forward,
    outside ``recipe.forward_context()`` (memory measurement counts saved tensors there; None: nothing);
    ``after_backward(recipe)`` runs before ``recipe.step()``, ``after_step(recipe, result)`` after it.
    Returns ``(loss, StepResult)``.
    """
    with forward_region or contextlib.nullcontext(), recipe.forward_context():
        loss = forward_loss(x, y)                                  # fp32 ()
    recipe.backward(loss)                                          # loss.backward(), or scaled
    if after_backward is not None:
        after_backward(recipe)
    result = recipe.step()                                         # clip, step (maybe skipped), scaler update
    if after_step is not None:
        after_step(recipe, result)
    return loss, result
