"""Grader for lesson 04's whole dynamic loss-scaling step, run side by side against ``torch.amp.GradScaler``.

The learner's ``scaled_step(loss, optimizer, state, max_norm, growth_factor, backoff_factor, growth_interval)
-> skipped`` does one iteration after the forward pass: scale the loss, backward, unscale the gradients,
check them for inf/NaN, clip the unscaled gradients, step the optimizer or skip the step, update the scale
(``state["scale"]``, ``state["growth_tracker"]``, changed in place) and clear the gradients.

Oracle: torch's own loop (the "gradient clipping" example of the torch.amp documentation,
torch/amp/grad_scaler.py), on a second copy of the same model and data::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)        # skipped when an unscaled gradient is inf/NaN
    scaler.update()
    optimizer.zero_grad()

Over fixed runs with injected overflows (inf and NaN inputs, and scales so large that the scaled backward
itself overflows FP32), after every step: whether the optimizer stepped (AdamW's own step count, not the
learner's return value), the scale and growth tracker, and every parameter bit for bit. The first step that
differs raises a one-line ``GradingError`` naming the part of the step that is wrong.

Scales stay >= 1 and factors are powers of two, so every scale is exact in FP32 and unscaling cannot overflow
(torch checks the scaled gradients, which equals checking the unscaled ones there).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from . import GradingError, call, same_bits, verdict

# label, init_scale, growth_factor, backoff_factor, growth_interval, max_norm, input scale, steps, {step: inject}
STEP_RUNS = [
    ("injected inf and NaN inputs, unscaled norm below max_norm (no clipping)", 2.0 ** 16, 2.0, 0.5, 3, 4.0, 1.0, 24,
     {4: math.inf, 5: math.inf, 13: math.nan, 20: -math.inf}),
    ("the scaled backward overflows FP32 (scale 2**110, large activations), clipping always active",
     2.0 ** 110, 2.0, 0.5, 2, 1.0, 1e6, 24, {}),
    ("growth 4, backoff 0.25, growth_interval 1, small gradients", 2.0 ** 8, 4.0, 0.25, 1, 0.05, 0.1, 20,
     {7: math.nan, 8: math.inf}),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))   # fp32


def _batches(steps: int, x_scale: float, inject: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(40)
    out = []
    for t in range(steps):
        x = torch.randn(5, 6, generator=g) * x_scale                     # (5, 6) fp32
        y = torch.randn(5, 3, generator=g) * x_scale                     # (5, 3) fp32
        if t in inject:
            x[2, 3] = inject[t]
        out.append((x, y))
    return out


def _steps_taken(opt: torch.optim.Optimizer) -> int:
    p = opt.param_groups[0]["params"][0]
    return int(opt.state[p]["step"]) if p in opt.state else 0


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def check_scaled_step(fn) -> None:
    """Grade ``fn(loss, optimizer, state, max_norm, growth_factor, backoff_factor, growth_interval) -> bool``
    against torch.amp.GradScaler's loop over the runs of ``STEP_RUNS`` (see the module docstring)."""
    name = "scaled_step"
    total = skipped_total = 0
    for run in STEP_RUNS:
        skipped_total += _grade_run(name, fn, *run)
        total += run[7]                                                  # its steps
    verdict(name, f"{len(STEP_RUNS)} runs, {total} steps ({skipped_total} overflows skipped) identical to "
                  "torch.amp.GradScaler's loop: same skipped steps, scale trajectory and parameters bit for bit")


def _grade_run(name, fn, label, init, gf, bf, gi, max_norm, x_scale, steps, inject) -> int:
    """One run of ``STEP_RUNS``, the oracle and the learner's step side by side on two copies of one model;
    raises at the first step that differs. Returns how many steps the oracle skipped."""
    ref_model = _model()
    mine_model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    mine_opt = torch.optim.AdamW(mine_model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf,
                                  growth_interval=gi)
    state = {"scale": init, "growth_tracker": 0}
    skipped = 0
    for t, (x, y) in enumerate(_batches(steps, x_scale, inject)):
        ref_skipped, want_state = _oracle_step(scaler, ref_model, ref_opt, x, y, max_norm)
        # the learner's step
        scale_in = state["scale"]
        before = _steps_taken(mine_opt)
        out = call(name, fn, F.mse_loss(mine_model(x), y), mine_opt, state, max_norm, gf, bf, gi)
        mine_skipped = _steps_taken(mine_opt) == before
        at = f"FAIL {name}: step {t} of run '{label}' (scale {scale_in!r}"
        at += ", an overflow: torch.amp.GradScaler skipped optimizer.step())" if ref_skipped else ", no overflow)"
        _check_skip(at, ref_skipped, mine_skipped, out)
        _check_state(at, state, want_state)
        _check_grads_and_params(at, ref_opt, mine_opt)
        skipped += ref_skipped
    return skipped


def _oracle_step(scaler, model, opt, x, y, max_norm) -> tuple[bool, tuple[float, int]]:
    """torch.amp's documented loop, one step: (skipped, (scale, growth_tracker) after the update)."""
    before = _steps_taken(opt)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return _steps_taken(opt) == before, (scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"]))


def _check_skip(at: str, ref_skipped: bool, mine_skipped: bool, out) -> None:
    """The learner's step stepped exactly when torch did, and said so (a bool)."""
    if mine_skipped != ref_skipped:
        if ref_skipped:
            raise GradingError(f"{at}: your function called optimizer.step(); skip it when any unscaled "
                               "gradient is inf or NaN (torch.isfinite over every gradient).")
        raise GradingError(f"{at}: your function skipped optimizer.step(); step whenever every "
                           "gradient is finite.")
    if not isinstance(out, bool) or out != ref_skipped:
        raise GradingError(f"{at}: returned {out!r}; return True when the step was skipped, False "
                           "when the optimizer stepped (a bool).")


def _check_state(at: str, state: dict, want_state: tuple[float, int]) -> None:
    """The learner's state holds GradScaler's scale and growth tracker after the update."""
    try:
        got_state = (float(state["scale"]), int(state["growth_tracker"]))
    except (KeyError, TypeError, ValueError):
        raise GradingError(f"{at}: state must keep the keys 'scale' (a float) and 'growth_tracker' (an int), "
                           f"updated in place; got {state!r}.") from None
    if got_state != want_state:
        raise GradingError(f"{at}: after your step scale={got_state[0]!r}, growth_tracker={got_state[1]}; "
                           f"torch.amp.GradScaler has scale={want_state[0]!r}, growth_tracker="
                           f"{want_state[1]}: call update_scale(state['scale'], state['growth_tracker'], "
                           "found_inf, growth_factor, backoff_factor, growth_interval) once per step and "
                           "store both results in state.")


def _check_grads_and_params(at: str, ref_opt, mine_opt) -> None:
    """The gradients are cleared and every parameter equals torch's run bit for bit."""
    left = [p for p in _params(mine_opt) if p.grad is not None and bool((p.grad != 0).any())]
    if left:
        raise GradingError(f"{at}: gradients are left in .grad after your step; clear them every "
                           "iteration, skipped or not (optimizer.zero_grad()), or the next backward adds "
                           "to them.")
    for k, (a, b) in enumerate(zip(_params(ref_opt), _params(mine_opt))):
        if not bool(same_bits(a, b).all()):
            raise GradingError(
                f"{at}: parameter {k} differs from torch.amp.GradScaler's run bit for bit; backward "
                "(loss * scale), then multiply every gradient by inv_scale = float32(1/scale), then "
                "clip the unscaled gradients with torch.nn.utils.clip_grad_norm_(params, max_norm), "
                "then optimizer.step() (clipping before unscaling clips the scaled norm).")
