"""Does a low-precision second moment decay? AdamW's ``v`` over a quiet run, against FP32 AdamW's.

After the gradients go quiet, AdamW's second moment should shrink by ``beta2`` per step: ``v * 0.999`` at
beta2 = 0.999, a relative change of 2**-10. Stored in BF16 rounded to nearest (8 significant bits, relative
spacing 2**-7 to 2**-8) that change is under half a step, so ``v`` rounds back to itself and stays: after 500
quiet steps it is ``1 / 0.999**500 = 1.65`` times FP32's, and the steps AdamW takes are about
``sqrt(1.65) = 1.28`` times too small (``mpcourse.core.optim_state``). Stochastic rounding makes the stored value
FP32's in expectation. The blockwise formats (``mpcourse.core.optim_blockwise``: FP8 as torchao's ``AdamWFp8``,
8-bit dynamic codes as its ``AdamW8bit``, Dettmers et al. 2021, arXiv 2110.02861) carry the decay in the block's
FP32 scale: the whole block shrinks together, its absmax with it, so the codes stay and the scale decays.

``second_moment_ratio(storage)`` runs the same gradients through FP32 AdamW and through AdamW with
``storage``'s moments, and returns sum(stored v) / sum(FP32 v) at the end: 1 is no drift.
"""
from __future__ import annotations

import torch

from .optim_blockwise import BlockQuantizedAdamW
from .optim_state import LowPrecisionState

STORAGES = ("fp32", "bf16", "bf16-sr", "fp8", "int8")


def _adamw(storage: str, params, beta2: float, seed: int) -> torch.optim.Optimizer:
    kw = dict(lr=1e-3, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0)
    if storage in ("fp8", "int8"):
        return BlockQuantizedAdamW(params, fmt=storage, **kw)
    if storage in ("bf16", "bf16-sr"):
        rounding = "stochastic" if storage == "bf16-sr" else "nearest"
        return LowPrecisionState(torch.optim.AdamW, torch.bfloat16, rounding=rounding, seed=seed)(params, **kw)
    return torch.optim.AdamW(params, **kw)


def _second_moment(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    if isinstance(opt, BlockQuantizedAdamW):
        return opt.moments(p)[1]
    return opt.state[p]["exp_avg_sq"].float()


def second_moment_ratio(storage: str, beta2: float = 0.999, loud_steps: int = 100, quiet_steps: int = 500,
                        quiet_grad: float = 1e-4, numel: int = 4096, seed: int = 0) -> float:
    """sum(v stored as ``storage``) / sum(v of FP32 AdamW) after ``loud_steps`` of N(0, 1) gradients and
    ``quiet_steps`` of N(0, quiet_grad**2) ones, same gradients for both, on one parameter of ``numel``
    elements (>= 4096 so the blockwise formats quantize it). ``storage`` in ``STORAGES``."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    gen = torch.Generator().manual_seed(seed)
    ref, low = torch.zeros(numel, requires_grad=True), torch.zeros(numel, requires_grad=True)
    opt_ref, opt_low = _adamw("fp32", [ref], beta2, seed), _adamw(storage, [low], beta2, seed)
    for t in range(loud_steps + quiet_steps):
        g = torch.randn(numel, generator=gen) * (1.0 if t < loud_steps else quiet_grad)   # (numel,) fp32
        ref.grad, low.grad = g.clone(), g.clone()
        opt_ref.step()
        opt_low.step()
    return (_second_moment(opt_low, low).double().sum() / _second_moment(opt_ref, ref).double().sum()).item()
