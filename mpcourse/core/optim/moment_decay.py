"""Does a low-precision second moment decay? AdamW's ``v`` over a quiet run, against FP32 AdamW's.

After the gradients go quiet, AdamW's second moment should shrink by ``beta2`` per step: ``v * 0.999`` at
beta2 = 0.999, a relative change of 2**-10. Stored in BF16 rounded to nearest (8 significant bits, relative
spacing 2**-7 to 2**-8) that change is under half a step, so ``v`` rounds back to itself and stays: after 500
quiet steps it is ``1 / 0.999**500 = 1.65`` times FP32's, and the steps AdamW takes are about
``sqrt(1.65) = 1.28`` times too small (``mpcourse.core.optim.state``). Stochastic rounding makes the stored value
FP32's in expectation. The blockwise formats (``mpcourse.core.optim.blockwise``: FP8 as torchao's ``AdamWFp8``,
8-bit dynamic codes as its ``AdamW8bit``, Dettmers et al. 2021, arXiv 2110.02861) carry the decay in the block's
FP32 scale: the whole block shrinks together, its absmax with it, so the codes stay and the scale decays. (Under
the course's default ``state_rule``, ``sqrt(v)`` is stored: its scale shrinks by ``sqrt(beta2)``, ``v`` by
``beta2``. FP8's ratio comes out 1.02, not 1.00, from the loud steps before the quiet ones: E4M3's codes follow
``sqrt(v)`` more coarsely than ``v``; see ``optim.blockwise``.)

``second_moment_ratio(storage)`` runs the same gradients through FP32 AdamW and through AdamW with
``storage``'s moments, and returns sum(stored v) / sum(FP32 v) at the end: 1 is no drift.

The other way a stored ``v`` goes wrong is at the bottom of its block: a coordinate whose gradient is small
against its block's largest and then stops. ``stopped_gradient_steps`` (``stopped_gradient_table`` prints it)
puts one such coordinate through FP32 AdamW, torchao's FP8 and 8-bit storage (``state_rule="torchao"``: ``v``
stored as 0 under a surviving ``m``, a step of ``lr * m / eps``) and the course's default (``"sqrt-nonzero"``:
``sqrt(v)`` stored, never 0 for a positive value; ``mpcourse.core.optim.blockwise`` says why).
"""
from __future__ import annotations

import torch

from .blockwise import BlockQuantizedAdamW
from .state import LowPrecisionState

STORAGES = ("fp32", "bf16", "bf16-sr", "fp8", "int8")
#: (label, fmt, state_rule) of ``stopped_gradient_steps``; fmt None is torch.optim.AdamW with FP32 state
STOPPED_RULES = (("fp32 AdamW", None, None), ("fp8 torchao", "fp8", "torchao"), ("int8 torchao", "int8", "torchao"),
                 ("fp8 sqrt-nonzero", "fp8", "sqrt-nonzero"), ("int8 sqrt-nonzero", "int8", "sqrt-nonzero"))


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


def stopped_gradient_steps(ratio: float = 1e-4, on_steps: int = 50, after: int = 5, lr: float = 1e-3,
                           numel: int = 4096) -> dict[str, list[float]]:
    """{label: the stopped coordinate's steps, in units of lr, at the ``after`` steps after its gradient stopped},
    per rule in ``STOPPED_RULES``. Constructed coordinates, one parameter of ``numel`` elements (>= 4096, so the
    blockwise formats quantize it): element 0 gets gradient 1 every step (its block's largest), element 1 gets
    ``ratio`` for ``on_steps`` steps and then 0, the rest 0. AdamW with betas (0.9, 0.999), eps 1e-8, no weight
    decay; each measured step starts from p[1] = 0, so it is the update itself (no decay: the state never reads p).
    Raises ValueError for a numel the blockwise formats would not quantize or a count under 1."""
    if numel < 4096 or numel % 256:
        raise ValueError(f"numel must be a multiple of 256 and at least 4096 (so the state is quantized), got {numel}")
    if on_steps < 1 or after < 1:
        raise ValueError(f"on_steps and after must be at least 1, got {on_steps} and {after}")
    out = {}
    for label, fmt, rule in STOPPED_RULES:
        p = torch.zeros(numel, requires_grad=True)
        kw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        opt = (torch.optim.AdamW([p], foreach=False, **kw) if fmt is None
               else BlockQuantizedAdamW([p], fmt=fmt, state_rule=rule, **kw))
        steps = []
        for t in range(on_steps + after):
            g = torch.zeros(numel)                                            # (numel,) fp32
            g[0], g[1] = 1.0, (ratio if t < on_steps else 0.0)
            p.grad = g
            with torch.no_grad():
                p[1] = 0.0
            opt.step()
            steps.append(abs(p.detach()[1].item()) / lr)
        out[label] = steps[on_steps:]
    return out


def stopped_gradient_table(ratio: float = 1e-4, on_steps: int = 50, after: int = 5) -> str:
    """``stopped_gradient_steps`` as a table, each step rounded to 3 significant digits (the same text with torch's
    default, AVX2 and AVX-512 kernels, checked)."""
    steps = stopped_gradient_steps(ratio, on_steps, after)
    head = (f"a coordinate with gradient {ratio:g} x its block's largest for {on_steps} steps, then 0: "
            "its next steps, in units of lr")
    lines = [head, f"{'rule':18s}" + "".join(f"{f'+{k + 1}':>9s}" for k in range(after))]
    for label, row in steps.items():
        cells = [float(f"{x:.3g}") for x in row]
        lines.append(f"{label:18s}" + "".join(f"{x:>9,.0f}" if x >= 100 else f"{x:>9.3g}" for x in cells))
    return "\n".join(lines)
