"""Graders for lesson 02 (master weights): building the FP32 master copy, and one master-weights step.

* ``check_make_master(fn)``: ``fn(model_params)`` returns FP32 master copies of FP16 parameters: new leaf tensors
  that require grad, equal value for value (every FP16 value is exact in FP32), sharing no memory with the model.
* ``check_master_step(fn)``: ``fn(model_params, master_params, optimizer, loss_scale)`` does one step of
  Micikevicius et al. 2018 ("Mixed Precision Training", ICLR 2018, section 3.1; Apex amp O2,
  apex/amp/_process_optimizer.py): copy the FP16 gradients up to FP32 and unscale them there, step the optimizer
  on the FP32 master, copy the master down into the FP16 model rounded to nearest even.

Oracle: an FP32 reference run of the same ``torch.optim`` optimizer fed ``grad.float() / loss_scale`` (the master
must equal it bit for bit), and torch's own cast ``master.to(torch.float16)`` for the model (bit for bit). Scenarios
(fixed seeds): SGD with momentum whose updates are swamped in FP16 (|w| / |dw| > 2048), AdamW (eps 1e-8, weight
decay) with a loss scale of 2**16 and gradients that are subnormal or zero in FP16 once unscaled, and plain SGD
without scaling. On the first mismatch the grader re-runs the step from the same state with common mistakes
(no unscaling, unscaling in FP16, stepping the FP16 weights, truncating instead of rounding) to name the mistake.
"""
from __future__ import annotations

import copy

import torch

from . import GradingError, call, verdict


def _model_params(seed: int, shapes=((6, 8), (8,), (3,))) -> list[torch.Tensor]:
    """FP16 leaf params: weights near 1 (LayerNorm-like gains, where FP16's spacing is 2**-10) and near 0.02."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        base = 1.0 if i % 2 == 0 else 0.02
        v = base + 0.01 * base * torch.randn(shape, generator=g)
        out.append(v.half().requires_grad_(True))                      # (shape) fp16 leaf
    return out


def _scaled_grads(params, step: int, seed: int, loss_scale: float, tiny: bool) -> list[torch.Tensor]:
    """FP16 gradients of loss * loss_scale for one step: true gradients from about 1e-9 to 1e-2, times S, rounded
    to FP16 (what the backward pass of a scaled loss leaves on the model)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for p in params:
        true = torch.randn(p.shape, generator=g) * torch.exp2(torch.rand(p.shape, generator=g) * -20 - 7)
        if tiny:                                                       # some below FP16's subnormal range
            true = true * torch.exp2(-torch.randint(0, 12, p.shape, generator=g).float())
        out.append((true * loss_scale).half())                         # (shape) fp16
    return out


SCENARIOS = [
    # name, optimizer class, kwargs, loss_scale, steps, tiny grads
    ("SGD momentum 0.9, lr 0.05, loss scale 1024", torch.optim.SGD, dict(lr=0.05, momentum=0.9), 1024.0, 4, False),
    ("AdamW lr 1e-3, eps 1e-8, weight decay 0.01, loss scale 2**16", torch.optim.AdamW,
     dict(lr=1e-3, eps=1e-8, weight_decay=0.01), 2.0**16, 4, True),
    ("SGD lr 0.1, no loss scaling (loss_scale 1)", torch.optim.SGD, dict(lr=0.1), 1.0, 3, False),
]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.detach().contiguous().view(iv), b.detach().contiguous().view(iv)))


def _toward_zero_fp16(m: torch.Tensor) -> torch.Tensor:
    """FP32 -> FP16 rounded toward zero (truncated): a common wrong copy-down."""
    r = m.half()
    over = r.float().abs() > m.abs()
    return torch.where(over, torch.nextafter(r, torch.zeros_like(r)), r)


def check_make_master(fn) -> None:
    """Grade ``fn(model_params: list of fp16 leaf tensors) -> list of fp32 master tensors``.

    Raises:
        GradingError: wrong length, dtype, shape, values, not a leaf / no requires_grad, or memory shared with
            the model (a change to the master must not touch the model).
    """
    name = "make_master"
    params = _model_params(0) + [torch.tensor([65504.0, 2.0**-24, -0.0, 6.1e-5], dtype=torch.float16,
                                              requires_grad=True)]
    before = [p.detach().clone() for p in params]
    masters = call(name, fn, params)
    if not isinstance(masters, (list, tuple)) or len(masters) != len(params):
        raise GradingError(f"FAIL {name}: return a list with one master tensor per model parameter "
                           f"({len(params)}), got {type(masters).__name__}"
                           + (f" of length {len(masters)}" if isinstance(masters, (list, tuple)) else ""))
    for i, (p, m) in enumerate(zip(params, masters)):
        where = f"parameter {i} (shape {tuple(p.shape)})"
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32:
            raise GradingError(f"FAIL {name}: {where}: the master must be a float32 tensor, got "
                               f"{m.dtype if isinstance(m, torch.Tensor) else type(m).__name__}. Use p.detach().float().")
        if m.shape != p.shape or not _bits_equal(m, p.detach().float()):
            raise GradingError(f"FAIL {name}: {where}: the master must hold exactly the model's values "
                               "(every FP16 value is exact in FP32): p.detach().float().")
        if not (m.is_leaf and m.requires_grad):
            raise GradingError(f"FAIL {name}: {where}: the master must be a leaf that requires grad, so an "
                               "optimizer can step it: p.detach().float().requires_grad_(True) (or nn.Parameter).")
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    for i, (p, b) in enumerate(zip(params, before)):
        if not _bits_equal(p, b):
            raise GradingError(f"FAIL {name}: parameter {i}: changing the master changed the model: the master "
                               "must be a copy with its own memory, not a view of the FP16 parameter.")
    verdict(name, f"{len(params)} FP16 parameters -> FP32 leaf copies, exact, own memory")


def _diagnose(pre, grads, loss_scale, opt_cls, kw, got_master, got_model, model_before) -> str:
    """Re-run the step from the pre-step state with common mistakes; name the one that matches the learner."""
    masters_pre, opt_state_pre = pre

    def alt(grad_fn):
        ms = [m.clone().requires_grad_(True) for m in masters_pre]
        opt = opt_cls(ms, **kw)
        opt.load_state_dict(copy.deepcopy(opt_state_pre))
        for m, g in zip(ms, grads):
            m.grad = grad_fn(g)
        opt.step()
        return [m.detach() for m in ms]

    if all(_bits_equal(a, b) for a, b in zip(got_master, masters_pre)):
        if not all(_bits_equal(a, b) for a, b in zip(got_model, model_before)):
            return ("the FP32 master did not change but the FP16 model did: you stepped the FP16 weights. Step the "
                    "optimizer that owns the master params, then copy the master into the model.")
        return ("the FP32 master did not change: set m.grad (FP32) from p.grad for every pair, then call "
                "optimizer.step().")
    if loss_scale != 1.0 and all(_bits_equal(a, b) for a, b in zip(got_master, alt(lambda g: g.float()))):
        return f"the gradients were not unscaled: divide them by loss_scale ({loss_scale:g}) in FP32 before the step."
    if loss_scale != 1.0 and all(_bits_equal(a, b) for a, b in zip(got_master, alt(lambda g: (g / loss_scale).float()))):
        return ("the gradients were unscaled in FP16 (p.grad / loss_scale), where small values become subnormal or "
                "0: convert to FP32 first, then divide: p.grad.float() / loss_scale.")
    return ("the FP32 master differs from an FP32 run of the same optimizer fed p.grad.float() / loss_scale: "
            "copy every gradient up (exactly), unscale in FP32, then one optimizer.step().")


def check_master_step(fn) -> None:
    """Grade ``fn(model_params, master_params, optimizer, loss_scale) -> None`` over the SCENARIOS.

    Each step: the grader puts FP16 gradients of the scaled loss on ``model_params``, calls ``fn``, and checks
    (1) ``master_params`` equal an FP32 reference run of the same torch.optim optimizer fed
    ``grad.float() / loss_scale``, bit for bit; (2) every model param equals its master rounded to FP16
    (``master.to(torch.float16)``, nearest even), bit for bit, in place (the same tensor objects).

    Raises:
        GradingError: the first wrong step, naming the scenario, the parameter and the likely mistake.
    """
    name = "master_step"
    total = 0
    for k, (label, opt_cls, kw, S, steps, tiny) in enumerate(SCENARIOS):
        params = _model_params(10 + k)
        masters = [p.detach().float().requires_grad_(True) for p in params]      # grader-built, (shape) fp32
        opt = opt_cls(masters, **kw)
        ref = [p.detach().float().requires_grad_(True) for p in params]          # the FP32 reference run
        ref_opt = opt_cls(ref, **kw)
        for step in range(steps):
            grads = _scaled_grads(params, step, seed=k, loss_scale=S, tiny=tiny)  # fp16
            for p, g in zip(params, grads):
                p.grad = g.clone()
            pre = ([m.detach().clone() for m in masters], copy.deepcopy(opt.state_dict()))
            model_before = [p.detach().clone() for p in params]
            call(name, fn, params, masters, opt, S)
            for r, g in zip(ref, grads):
                r.grad = g.float() / S                                            # fp32, exact for 2**k scales
            ref_opt.step()
            where = f"scenario '{label}', step {step}"
            for i, (m, r) in enumerate(zip(masters, ref)):
                if m.dtype != torch.float32 or not _bits_equal(m, r):
                    hint = _diagnose(pre, grads, S, opt_cls, kw, masters, params, model_before)
                    raise GradingError(f"FAIL {name}: {where}: master param {i} (shape {tuple(m.shape)}) differs "
                                       f"from the FP32 reference run (torch.optim.{opt_cls.__name__} on FP32 copies)."
                                       f"\n  hint: {hint}")
            for i, (p, m) in enumerate(zip(params, masters)):
                want = m.detach().half()
                if p.dtype != torch.float16:
                    raise GradingError(f"FAIL {name}: {where}: model param {i} became {p.dtype}; it must stay "
                                       "FP16: copy into it in place (p.copy_(m) under torch.no_grad()).")
                if _bits_equal(p, want):
                    continue
                if _bits_equal(p, model_before[i]):
                    hint = ("the model was not updated: copy the master into the model param in place "
                            "(with torch.no_grad(): p.copy_(m)); rebinding a name (p = m.half()) changes nothing.")
                elif _bits_equal(p, _toward_zero_fp16(m.detach())):
                    hint = ("the master was truncated (rounded toward zero) into FP16: round to nearest, ties to "
                            "even, as p.copy_(m) or m.half() do.")
                else:
                    hint = "the model param must equal its master rounded to nearest FP16: p.copy_(m)."
                bad = (p.detach().float() != want.float()).nonzero()[0].tolist()
                raise GradingError(f"FAIL {name}: {where}: model param {i} at index {bad} holds "
                                   f"{float(p.detach()[tuple(bad)])!r}, expected the master {float(m.detach()[tuple(bad)])!r} "
                                   f"rounded to FP16 = {float(want[tuple(bad)])!r}.\n  hint: {hint}")
            for p in params:
                p.grad = None
            total += 1
    verdict(name, f"{total} steps in {len(SCENARIOS)} scenarios: master equals an FP32 torch.optim run bit for bit, "
                  "model equals master rounded to FP16")
