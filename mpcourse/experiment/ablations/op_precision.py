"""Ablation (iii): softmax, LayerNorm and the loss computed in low precision vs in FP32.

Autocast's op lists (lesson 05) keep softmax, the norms and the losses in FP32 on CUDA; PyTorch's kernels
for BF16/FP16 inputs also accumulate in FP32 inside and round once, at the output. This ablation runs the
``bf16-master`` recipe (BF16 model, FP32 master weights) with each of the three ops either

    fp32   upcast the inputs, run the op in FP32, round the output once to the model's dtype (what
           PyTorch's kernels and autocast do; the loss stays FP32, as the GPT computes it)
    low    the op written out step by step with every intermediate rounded to BF16, forward and
           backward (a kernel without FP32 intermediates; the reductions themselves, sum/mean/amax, are
           PyTorch's kernels, which accumulate in FP32 and round their result once)

``OpPrecision(dtype, low={"softmax", "layer_norm", "loss"})`` is a ``TorchFunctionMode`` that intercepts
``F.softmax``, ``F.layer_norm`` and ``F.cross_entropy`` (the GPT's calls; LayerNorm modules call
``F.layer_norm``) and computes each as asked. The low-precision loss applies to the training step only:
evaluation (under ``torch.no_grad``) computes the loss in FP32, so the final losses compare the models,
not the way each was measured.

    low softmax:    m = max(x); z = x - m; e = exp(z); s = sum(e); p = e / s          each rounded
    low LayerNorm:  mu = mean(x); d = x - mu; var = mean(d*d); r = rsqrt(var + eps); y = d*r*w + b
    low loss:       z = logits - max; lse = log(sum(exp(z))); logp = z - lse; mean of -logp[target]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpcourse.experiment.recipes import get_recipe
from .common import AblationConfig, over_seeds

OPS = ("softmax", "layer_norm", "loss")


def softmax_low(x, dim, dtype):
    x = x.to(dtype)
    z = x - x.amax(dim, keepdim=True)
    e = z.exp()
    return e / e.sum(dim, keepdim=True)


def layer_norm_low(x, normalized_shape, weight, bias, eps, dtype):
    dims = tuple(range(-len(normalized_shape), 0))
    x = x.to(dtype)
    d = x - x.mean(dims, keepdim=True)
    y = d * (d * d).mean(dims, keepdim=True).add(eps).rsqrt()
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y


def cross_entropy_low(logits, target, dtype):
    z = logits.to(dtype)                                               # (N, V) dtype
    z = z - z.amax(-1, keepdim=True)
    logp = z - z.exp().sum(-1, keepdim=True).log()
    return (-logp.gather(-1, target.unsqueeze(-1))).mean().float()     # () the value of a dtype mean


class OpPrecision(TorchFunctionMode):
    """Compute the ops named in ``low`` (subset of ``OPS``) step by step in ``dtype``; the others in FP32."""

    def __init__(self, dtype: torch.dtype, low=()):
        super().__init__()
        unknown = set(low) - set(OPS)
        if unknown:
            raise ValueError(f"unknown ops {sorted(unknown)}; choose from {OPS}")
        self.dtype, self.low = dtype, frozenset(low)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.softmax:
            a = {**dict(zip(("input", "dim"), args)), **kwargs}
            x, dim = a["input"], a["dim"]
            if "softmax" in self.low:
                return softmax_low(x, dim, self.dtype)
            return F.softmax(x.float(), dim=dim).to(x.dtype)
        if func is F.layer_norm:
            a = {"weight": None, "bias": None, "eps": 1e-5,
                 **dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args)), **kwargs}
            x, shape, w, b, eps = (a[k] for k in ("input", "normalized_shape", "weight", "bias", "eps"))
            if "layer_norm" in self.low:
                return layer_norm_low(x, shape, w, b, eps, self.dtype)
            f = lambda t: None if t is None else t.float()
            return F.layer_norm(x.float(), shape, f(w), f(b), eps).to(x.dtype)
        if func is F.cross_entropy and "loss" in self.low and torch.is_grad_enabled():
            defaults = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None,
                        "reduction": "mean", "label_smoothing": 0.0}
            if len(args) != 2 or any(kwargs.get(k, v) != v for k, v in defaults.items()):
                raise ValueError("OpPrecision's low-precision loss takes F.cross_entropy(logits, target) only")
            return cross_entropy_low(args[0], args[1], self.dtype)
        return func(*args, **kwargs)


def with_op_precision(base: str, dtype: torch.dtype, low) -> type:
    """Recipe ``base`` whose forward runs inside ``OpPrecision(dtype, low)``."""
    cls = get_recipe(base)

    class Variant(cls):
        def forward_context(self):
            return OpPrecision(dtype, low)

    Variant.__name__ = f"{cls.__name__}_{'_'.join(sorted(low)) or 'fp32ops'}"
    return Variant


VARIANTS = (  # (label, ops computed low)
    ("all-fp32", ()), ("softmax-low", ("softmax",)), ("layer_norm-low", ("layer_norm",)),
    ("loss-low", ("loss",)), ("all-low", OPS),
)


def run(acfg: AblationConfig) -> dict:
    runs = []
    fp32 = get_recipe("fp32")
    for r in over_seeds("fp32", lambda model, optim: fp32(model, optim), acfg):
        runs.append({**r, "low": None})
    for label, low in VARIANTS:
        cls = with_op_precision("bf16-master", torch.bfloat16, low)
        for r in over_seeds(label, lambda model, optim, cls=cls: cls(model, optim), acfg):
            runs.append({**r, "low": list(low)})
    return {"ablation": "op-precision", "base_recipe": "bf16-master", "dtype": "bf16", "runs": runs}
