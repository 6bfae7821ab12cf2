"""A mixture-of-experts feed-forward layer: a router, top-k routing, E experts through grouped GEMMs, a shared expert.

Per token x (C,) (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral; DeepSeek-V3 2412.19437)::

    p        = softmax(x @ R^T)                      (E,)   the router, in FP32 whatever the recipe
    e_1..e_k = top-k(p),  g_i = p_e_i / sum_j p_e_j         the combine weights (k = 1: g = p_e, Switch)
    y        = sum_i g_i * W_out[e_i] @ gelu(W_in[e_i] @ x)  + shared(x)      summed in FP32

The k (token, expert) assignments of every token are sorted into one group per expert and padded to the format's
alignment (``grouping``); each expert projection is one ``grouped_mm`` over all groups. The router, its softmax and
top-k and the combine weights stay FP32 (torchtitan's MoE keeps its router gate FP32, PR #2389; Megatron
``--moe-router-dtype fp32``; DeepSeek-V3 3.3.1 keeps the gating out of FP8): a routing decision is discrete, and a
rounding that flips it moves a token to another expert. ``router_dtype`` moves it to BF16 for the ablation.

The experts' format (``format_in_effect``): ``expert_format`` if set, else the enclosing FP8 region's block
recipe (``quant.autocast(recipe=Float8RowwiseScaling() | Float8BlockScaling() | MXFP8BlockScaling())``), else the
autocast dtype in effect (torch's or the course's), else the experts' weight dtype. The shared expert is a dense
MLP of ``nn.Linear`` layers, which a recipe converts as it converts every other linear layer.

Load balance: ``aux_loss`` = E * sum_e f_e * P_e (Switch Transformer eq. 4: f_e the fraction of assignments routed
to e, P_e the mean router probability of e), 1 when balanced; the model adds ``coef * aux_loss`` to its loss.
A learner's lesson 13 ``pad_token_groups`` / ``unpad_token_groups`` replace ``pad_groups`` / ``unpad_groups`` where
the format's recipe carries them (``recipe.functions``: the FP8 region's recipe, ``mpcourse compare --with``).
``tokens_per_expert`` holds the last forward's counts, ``routed`` their sum over the training forwards, ``flipped``
the fraction of the last forward's tokens a non-FP32 router sent elsewhere than the FP32 router would have.

Expert parallelism (``expert_parallel.ExpertParallelMoE``) replaces ``experts``: the rows travel to the ranks that
hold their experts and back (``dispatch``); ``dispatch`` set on this layer applies the same trips in one process.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..autocast import autocast_dtype_in_effect
from ..quant.block_recipes import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling
from ..quant.region import get_fp8_recipe, in_fp8_region, is_fp8_enabled
from .dispatch import from_experts, to_experts
from .formats import GroupedFormat, grouped_format
from ..learner_table import returned
from .grouped_mm import grouped_mm, learner_function, own_dtypes
from .grouping import ALIGNMENT, TokenGroups, group_tokens, pad_groups, token_groups, unpad_groups

#: the grouped format each FP8 region's recipe class gives the experts (its own fields kept: e.g. MXFP8's floor rule)
FORMAT_OF_RECIPE = {Float8RowwiseScaling: "fp8-rowwise", Float8BlockScaling: "fp8-block", MXFP8BlockScaling: "mxfp8"}
DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def format_of_recipe(recipe) -> GroupedFormat:
    """The experts' format under an FP8 region's ``recipe``; ValueError naming the fix for one they cannot take."""
    name = FORMAT_OF_RECIPE.get(type(recipe))
    if name is None:
        raise ValueError(f"the experts' grouped GEMMs take rowwise FP8, 1x128/128x128 blocks or MXFP8 (torchao's and "
                         f"DeepSeek-V3's MoE formats), not {type(recipe).__name__}: run the FP8 region with "
                         "Float8RowwiseScaling(), Float8BlockScaling() or MXFP8BlockScaling(), or set the layer's "
                         "expert_format")
    return GroupedFormat(name, recipe, None, ALIGNMENT[name])


def route(tokens: torch.Tensor, router: torch.Tensor, top_k: int, dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(combine weights (S, k) fp32, experts (S, k) int64, probabilities (S, E) fp32) of tokens (S, C) under the
    router (E, C): logits, softmax and top-k computed in ``dtype`` with no autocast (then upcast, exactly)."""
    with own_dtypes(tokens.device.type):
        probs = F.softmax(F.linear(tokens.to(dtype), router.to(dtype)), dim=-1)          # (S, E)
        top, experts = probs.topk(top_k, dim=-1)                                           # (S, k)
        weights = top / top.sum(-1, keepdim=True) if top_k > 1 else top
    return weights.float(), experts, probs.float()


def flipped(experts: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of tokens whose set of k experts (S, k) differs from the ``reference`` decisions (S, k)."""
    return (experts.sort(-1).values != reference.sort(-1).values).any(-1).float().mean().item()


def pad(x: torch.Tensor, groups: TokenGroups, fmt: GroupedFormat) -> torch.Tensor:
    """x (S k, C) grouped by expert -> (rows, C) padded to the format's alignment: ``pad_groups``, or a learner's
    lesson 13 ``pad_token_groups`` where the format's recipe carries one (its result checked)."""
    fn = learner_function(fmt, "pad_token_groups")
    if fn is None:
        return pad_groups(x, groups)
    return returned("pad_token_groups", x, groups.padded_offs, fn(x, groups.counts, groups.alignment))[0]


def unpad(y: torch.Tensor, groups: TokenGroups, fmt: GroupedFormat) -> torch.Tensor:
    """y (rows, C) padded -> (S k, C): ``unpad_groups``, or a learner's lesson 13 ``unpad_token_groups``."""
    fn = learner_function(fmt, "unpad_token_groups")
    if fn is None:
        return unpad_groups(y, groups)
    return returned("unpad_token_groups", y, groups.num_tokens, fn(y, groups.counts, groups.alignment))


class MoEFeedForward(nn.Module):
    """Top-k mixture of experts replacing a transformer block's MLP: (B, T, C) -> (B, T, C).

    Args: dim C; hidden H of each expert; n_experts E; top_k k; shared_expert: add a dense MLP of hidden H;
    bias: biases of the shared expert's linears; out_std: init std of the output projections (GPT-2 scales the
    residual projections); router_dtype: the router's dtype (FP32; BF16 for the ablation); expert_format: a
    ``GROUPED_FORMATS`` name fixing the experts' format (None: ``format_in_effect``)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2, shared_expert: bool = False,
                 bias: bool = True, out_std: float = 0.02, router_dtype: torch.dtype = torch.float32,
                 expert_format: Optional[str] = None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must lie in [1, n_experts={n_experts}], got {top_k}")
        self.top_k, self.router_dtype, self.expert_format = top_k, router_dtype, expert_format
        self.router = nn.Parameter(torch.randn(n_experts, dim) * 0.02)                   # (E, C)
        self.w_in = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.02)             # (E, H, C)
        self.w_out = nn.Parameter(torch.randn(n_experts, dim, hidden) * out_std)         # (E, C, H)
        self.shared_fc = nn.Linear(dim, hidden, bias=bias) if shared_expert else None
        self.shared_proj = nn.Linear(hidden, dim, bias=bias) if shared_expert else None
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.routed = torch.zeros(n_experts, dtype=torch.long)
        self.flipped = 0.0             # fraction of tokens routed elsewhere than the FP32 router would (last forward)
        self.dispatch: Optional[str] = None   # a dispatch mode applied as one process's rule (None: no trip)

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]

    def format_in_effect(self, x: torch.Tensor) -> GroupedFormat:
        """The experts' GEMM format now (see the module docstring)."""
        if self.expert_format is not None:
            return grouped_format(self.expert_format)
        if in_fp8_region() and is_fp8_enabled() and get_fp8_recipe() is not None:
            return format_of_recipe(get_fp8_recipe())
        dtype = autocast_dtype_in_effect(x.device.type) or self.w_in.dtype
        return grouped_format(DTYPE_FORMATS[dtype])

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``route`` of tokens (S, C) with this layer's router, k and ``router_dtype``."""
        return route(tokens, self.router, self.top_k, self.router_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                                   # (B, T, C)
        tokens = x.reshape(-1, x.shape[-1])                                                # (S, C)
        fmt = self.format_in_effect(x)
        weights, experts, probs = self.route(tokens)
        order, counts = group_tokens(experts.flatten(), self.n_experts)                    # (S k,), (E,)
        src = order // self.top_k                                                          # token of each row
        y, counts = self.experts(tokens[src], counts, fmt)                                # (S k, C), (E,)
        with own_dtypes(x.device.type):                                                    # the combine, in FP32
            g = weights.flatten()[order]                                                   # (S k,)
            out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
            out = out.index_add(0, src, y.float() * g[:, None]).to(y.dtype)               # (S, C)
        self.record(counts, probs)
        if self.router_dtype != torch.float32:                                             # the ablation's measure
            self.flipped = flipped(experts, route(tokens.detach(), self.router.detach(), self.top_k)[1])
        if self.shared_fc is not None:
            out = out + self.shared_proj(F.gelu(self.shared_fc(tokens)))
        return out.reshape(x.shape[:-1] + (out.shape[-1],))

    def experts(self, rows: torch.Tensor, counts: torch.Tensor, fmt: GroupedFormat
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's expert output: rows (A, C) grouped by expert, ``counts`` (E,) -> ((A, C), the counts the
        balance loss takes). With ``dispatch`` set the rows take that mode's trips to and from the experts as one
        process's rule (``dispatch.to_experts`` / ``from_experts``); ``ExpertParallelMoE`` sends them to other ranks."""
        if self.dispatch is not None:
            rows = to_experts(rows, self.dispatch)
        y = self.run_experts(rows, counts, fmt)
        return (y if self.dispatch is None else from_experts(y, self.dispatch)), counts

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, fmt: GroupedFormat) -> torch.Tensor:
        """This module's experts on their rows: (A, C) grouped by expert (``counts``: one per expert of ``w_in``),
        each group padded to the format's alignment, two grouped GEMMs with a GELU between -> (A, C)."""
        groups = token_groups(counts, fmt.alignment)
        h = F.gelu(grouped_mm(pad(rows, groups, fmt), self.w_in, groups, fmt))            # (rows, H)
        return unpad(grouped_mm(h, self.w_out, groups, fmt), groups, fmt)                 # (A, C)

    def record(self, counts: torch.Tensor, probs: torch.Tensor) -> None:
        """Keep the counts and the load-balancing loss of this forward (in FP32; Switch Transformer eq. 4)."""
        f = counts.float() / counts.sum().clamp(min=1)                                    # (E,) fraction routed
        self.aux_loss = self.n_experts * (f * probs.mean(0)).sum()                        # () fp32, 1 if balanced
        self.tokens_per_expert = counts.detach()
        if self.training:
            self.routed = self.routed + counts.detach().cpu()


def expert_hidden(dim: int, top_k: int, hidden: int = 0) -> int:
    """Each expert's hidden width: ``hidden`` if given, else the dense MLP's 4 * dim shared by the k experts a token
    visits (so a token's expert FLOPs equal the dense MLP's), rounded up to a multiple of 128 (the FP8 blocks)."""
    return hidden or 128 * math.ceil(4 * dim / top_k / 128)
