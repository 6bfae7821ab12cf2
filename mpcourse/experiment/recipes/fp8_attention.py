"""FP8 attention recipes: the FP8 linear layers of ``fp8-delayed`` / ``fp8-current`` plus attention in FP8.

Transformer Engine's ``fp8_dpa=True`` (``DotProductAttention`` computed by cuDNN's fused FP8 attention): inside each
block's attention, the two products Q K^T and P V and the backward's four run in FP8, softmax in FP32, each tensor
with its own per-tensor scale (``mpcourse.core.attention``: the rule, its layer and its state)::

    FP8   as fp8-delayed / fp8-current (blocks.*.attn.qkv, attn.proj, mlp.fc, mlp.proj), and now
          blocks.*.attn.core_attention: Q, K, V, P, O (E4M3) and dO, dS, dQ, dK, dV (E5M2 under HYBRID)
    FP32  the embeddings, the LayerNorms, the softmax's exp and sums, GELU, the head, the loss

* ``fp8-attention``: ``fp8-delayed`` (``DelayedScaling``, HYBRID, amax history 16) for the linears and for every
  attention tensor (TE supported FP8 attention under delayed scaling first).
* ``fp8-attention-current``: ``fp8-current`` for the linears; in attention Q, K, V, O, dO, dQ, dK, dV current, P and
  dS delayed with a history of 1, "most_recent" (what TE's ``DotProductAttention`` builds under
  ``Float8CurrentScaling``: a fused kernel must know those two scales before it computes the tensors).

Both use the course's GPT option ``CausalSelfAttention.core_attention`` and are left out of the default run:
production recipes keep attention high (DeepSeek-V3 report, arXiv 2412.19437 section 3.3.1; NVIDIA's NVFP4
pretraining recipe, arXiv 2509.25149, TE ``NVFP4BlockScaling`` sets ``fp8_dpa=False``); lesson 14 measures why, op
by op (``python -m mpcourse.experiment.ablations fp8-attention``).

Checkpoints: every attention scale and amax history is in its module's extra state
(``blocks.N.attn.core_attention._extra_state``), beside the linears', so a run resumes bit for bit.
"""
from __future__ import annotations

import torch.nn as nn

from mpcourse.core.attention.layer import FP8DotProductAttention, attention_layers
from mpcourse.experiment.gpt.model import CausalSelfAttention
from .base import register
from .fp8 import FP8Current, FP8Delayed


class WithFP8Attention:
    """Mixin for a ``QuantizedRecipe``: after converting the linears, every ``CausalSelfAttention`` gets an
    ``FP8DotProductAttention`` under the same recipe (so the FP8 region's recipe is the layer's)."""

    attention_options: dict = {}        # FP8DotProductAttention's keywords (roles, kv_block, ...); the ablation's
    OVERRIDABLE = ()    # a learner's quantize / update would reach the linears only, not attention: none taken

    def prepare_model(self, model: nn.Module) -> nn.Module:
        attentions = [(n, m) for n, m in model.named_modules() if isinstance(m, CausalSelfAttention)]
        if not attentions:
            raise ValueError(f"{self.name} puts FP8 attention into the course's GPT's CausalSelfAttention modules; "
                             "this model has none")
        if any(m.drop.p > 0 for _, m in attentions):
            raise ValueError(f"{self.name}: FP8 attention has no dropout on P; build the GPT with dropout=0.0")
        model = super().prepare_model(model)          # the linears (the attention modules stay where they are)
        device = next(model.parameters()).device
        for name, m in attentions:
            m.core_attention = FP8DotProductAttention(self.fp8_recipe, key=name, device=device,
                                                      **self.attention_options)
        return model

    def attention_layers(self) -> dict[str, FP8DotProductAttention]:
        """The model's FP8 attention modules by fully qualified name."""
        return attention_layers(self.model)

    def memory_tensors(self):
        """The linears' FP8 state plus every attention scale and amax history (FP32)."""
        out = super().memory_tensors()
        out["extra"] = out.get("extra", []) + [t for m in self.attention_layers().values()
                                               for s in m.scaling_state.values() for t in (s.scale, s.amax_history)]
        return out


@register
class FP8Attention(WithFP8Attention, FP8Delayed):
    name = "fp8-attention"
    description = "fp8-delayed plus attention in FP8 (Q, K, V, P, O and their gradients, TE fp8_dpa), FP32 softmax"


@register
class FP8AttentionCurrent(WithFP8Attention, FP8Current):
    name = "fp8-attention-current"
    description = "fp8-current plus attention in FP8 (P and dS delayed, history 1, as TE under current scaling)"
