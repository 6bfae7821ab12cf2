"""A small GPT for character-level language modelling: the model every recipe trains.

Architecture as in GPT-2 (Radford et al. 2019) and nanoGPT: token and position embeddings, ``n_layer``
pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final LayerNorm and a linear head
(tied to the token embedding by default). About a million parameters with the default config.

Precision notes (what the lessons point at):

* Attention is written out (``q @ k^T``, mask, softmax, ``@ v``) rather than calling a fused kernel,
  so autocast's op policy, the tensor-core emulation and the FP8 layers see every matmul.
* The causal mask is applied with ``masked_fill(-inf)``: the diagonal is never masked, so no row is
  all ``-inf`` and no softmax row can be NaN, in any dtype. (Adding a large negative constant such
  as the FP16 minimum -65504 instead can overflow to -inf in FP16: lesson 05.)
* The loss is computed in FP32 from the logits (``logits.float()``), in every recipe.
* ``CausalSelfAttention.core_attention`` is None (the attention written out) unless a recipe puts a module there:
  the ``fp8-attention`` recipes put ``mpcourse.core.attention.FP8DotProductAttention`` (lesson 14).

A config switch makes it a mixture of experts (lesson 13): ``n_experts > 0`` replaces every block's MLP by
``mpcourse.core.experts.MoEFeedForward`` (top-``top_k`` routing in FP32, the experts' GEMMs grouped in the format
the recipe's region gives, an optional shared expert); ``n_experts=0`` (the default) builds the dense model exactly
as before. The load-balancing loss enters the gradient only (``loss + (b - b.detach())``, b = ``aux_loss_coef`` x
the blocks' mean balance loss), so the loss a run reports stays the cross-entropy, comparable with the dense rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from mpcourse.core.experts.layer import MoEFeedForward, expert_hidden


@dataclass
class GPTConfig:
    """Hyper-parameters of the GPT.

    Attributes:
        vocab_size: number of distinct tokens (characters); set from the corpus.
        block_size: context length T in tokens (default 64).
        n_layer: transformer blocks (default 5).
        n_head: attention heads per block (default 4); must divide ``n_embd``.
        n_embd: model width C (default 128). Multiples of 16 keep every FP8 GEMM legal on GPUs.
        dropout: dropout probability (default 0.0: training is deterministic).
        tie_weights: share the token embedding with the output head (default True, as GPT-2).
        bias: biases in Linear layers (default True).
        n_experts: experts per block (default 0: the dense MLP); > 0 makes every block's MLP a mixture of experts.
        top_k: experts each token visits (default 2).
        expert_hidden: each expert's hidden width (default 0: 4 * n_embd / top_k, rounded up to a multiple of 128).
        shared_expert: add a dense MLP of that width beside the routed experts (DeepSeek-V3; default False).
        aux_loss_coef: weight of the load-balancing loss (default 0.01, Switch Transformer's).

    With ``vocab_size=103`` (the default corpus) the model has about 1.0M parameters.
    """

    vocab_size: int = 103
    block_size: int = 64
    n_layer: int = 5
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True
    n_experts: int = 0
    top_k: int = 2
    expert_hidden: int = 0
    shared_expert: bool = False
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_experts < 0 or self.expert_hidden < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"GPTConfig: n_experts >= 0, expert_hidden >= 0 and 1 <= top_k <= n_experts, got "
                             f"n_experts={self.n_experts}, top_k={self.top_k}, expert_hidden={self.expert_hidden}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)  # True above the diagonal
        self.register_buffer("mask", mask, persistent=False)
        self.core_attention = None   # None: the attention written out in forward; else a causal module (q, k, v, scale)

    def forward(self, x):                                              # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)                          # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)              # (B, H, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)              # (B, H, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)              # (B, H, T, hs)
        if self.core_attention is not None:                            # e.g. FP8 attention (lesson 14)
            y = self.core_attention(q, k, v, 1.0 / math.sqrt(hs))      # (B, H, T, hs)
            return self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))        # (B, H, T, T)
        att = att.masked_fill(self.mask[:T, :T], float("-inf"))        # future positions -> -inf
        att = F.softmax(att, dim=-1)                                   # (B, H, T, T)
        att = self.drop(att)
        y = att @ v                                                    # (B, H, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)               # (B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):                                              # (B, T, C)
        return self.drop(self.proj(F.gelu(self.fc(x))))                # (B, T, 4C) inside


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg) if not cfg.n_experts else MoEFeedForward(
            cfg.n_embd, expert_hidden(cfg.n_embd, cfg.top_k, cfg.expert_hidden), cfg.n_experts, cfg.top_k,
            cfg.shared_expert, cfg.bias, out_std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x):                                              # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The course's GPT. ``forward(idx, targets=None) -> (logits, loss)``.

    Args (forward):
        idx: (B, T) int64 token ids, T <= block_size.
        targets: optional (B, T) int64 next-token ids.

    Returns:
        logits: (B, T, vocab_size) in the model's compute dtype (the parameters' dtype, or the
            autocast dtype inside an autocast region).
        loss: FP32 scalar mean cross-entropy in nats, or None without targets.

    Raises:
        ValueError: a sequence longer than ``block_size``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():             # GPT-2: scale residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}; "
                             "crop the input or build the model with a larger block_size")
        pos = torch.arange(T, device=idx.device)                       # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))            # (B, T, C)
        for block in self.blocks:
            x = block(x)                                                # (B, T, C)
        x = self.ln_f(x)
        logits = self.head(x)                                           # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))  # fp32 ()
            if self.cfg.n_experts and torch.is_grad_enabled():
                balance = self.cfg.aux_loss_coef * self.aux_loss()             # fp32 (): its gradient only
                loss = loss + (balance - balance.detach())
        return logits, loss

    def aux_loss(self) -> torch.Tensor:
        """The blocks' mean load-balancing loss of the last forward (FP32; 1 when every block is balanced)."""
        return torch.stack([b.mlp.aux_loss for b in self.blocks]).mean()


def mlp_weights_per_token(cfg: GPTConfig) -> int:
    """The GEMM weights one token meets in a block's MLP: the dense MLP's 8 C^2 (C -> 4C -> C), or a mixture of
    experts' top_k experts (2 C H each), its router (C E) and a shared expert (2 C H)."""
    C = cfg.n_embd
    if not cfg.n_experts:
        return 8 * C * C
    H = expert_hidden(C, cfg.top_k, cfg.expert_hidden)
    return cfg.top_k * 2 * C * H + C * cfg.n_experts + (2 * C * H if cfg.shared_expert else 0)


def to_moe(model: GPT, **moe) -> GPT:
    """The mixture-of-experts twin of a dense ``model``: ``GPTConfig`` with the ``moe`` fields (``n_experts``,
    ``top_k``, ``expert_hidden``, ``shared_expert``, ``aux_loss_coef``), every parameter the two share (embeddings,
    attention, norms) copied from ``model``, the experts and routers drawn from a generator seeded by torch's
    initial seed (the run's seed), so every MoE recipe of a run starts from the same weights and the global RNG is
    left as it was."""
    cfg = replace(model.cfg, **moe)
    if not cfg.n_experts:
        raise ValueError("to_moe needs n_experts > 0 (e.g. to_moe(model, n_experts=4, top_k=2))")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + 1)
        twin = GPT(cfg).to(next(model.parameters()).device)
    shared = {k: v for k, v in model.state_dict().items() if ".mlp." not in k}
    missing, unexpected = twin.load_state_dict(shared, strict=False)
    assert not unexpected and all(".mlp." in k for k in missing), (missing, unexpected)
    return twin
