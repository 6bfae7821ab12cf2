"""Attention in FP8 (lesson 14): which attention tensors survive FP8, each with its own per-tensor scale.

* ``fp8_attention``: the rule, plain torch: causal scaled-dot-product attention forward and backward with Q, K,
  V, P, O, dO, dS, dQ, dK, dV each optionally in FP8 (TE ``DotProductAttention`` ``fp8_dpa``; cuDNN's FP8 SDPA
  reference; FlashAttention-3's FP8 forward).
* ``scaling``: each role's scale and amax history under a recipe (``DelayedScaling``, ``CurrentScaling``), reusing
  ``mpcourse.core.quant``'s rules and region.
* ``layer``: ``FP8DotProductAttention``, the module (its autograd function and its checkpointed state).
* ``inspected``: what the numerics inspector sees of it (every tensor it casts, under TE's names).
"""
