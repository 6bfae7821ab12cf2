"""Training one recipe: ``step`` (the one training step: forward, backward, ``recipe.step()``), ``train`` (the loop
every recipe runs: same init, batches and schedule) and ``threads`` (one intra-op thread, so bits do not depend on
the machine's core count)."""
