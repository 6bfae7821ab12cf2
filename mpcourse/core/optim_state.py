"""Optimizer state stored in a low-precision dtype between steps (BF16 AdamW moments, as DeepSeek-V3).

DeepSeek-V3 (arXiv 2412.19437, section 3.3.3, "Low-Precision Storage"): the AdamW first and second
moments are stored in BF16 while the master weights and gradients stay FP32; they report no loss of
accuracy. That cuts Adam's state from 8 to 4 bytes per parameter.

``LowPrecisionState(optimizer_cls, state_dtype=torch.bfloat16, rounding="nearest")`` wraps any
``torch.optim`` optimizer class: at each ``step()`` the state tensors shaped like their parameter are
upcast exactly to the parameter's dtype, the wrapped optimizer steps in that precision, and the new
state is rounded back to ``state_dtype``. Scalar entries (Adam's ``step``) are left alone.

How the state is rounded back (``rounding``):

* ``"nearest"`` (round to nearest even: torch's cast). A moment whose relative change in one step is
  below half a unit in the last place stays where it is: BF16 has 8 significant bits, so
  ``v * beta2`` with ``beta2 = 0.999`` (a change of 2**-10, under half of BF16's 2**-8 relative spacing)
  rounds back to ``v``. Once the gradients go quiet the second moment never decays: after 500 steps of
  zero gradient it is still ``v0`` where FP32 AdamW has ``v0 * 0.999**500`` (about 0.61 v0), so
  the steps that follow are about sqrt(1.65) = 1.28 times too small. The same stagnation as a BF16
  weight under small updates (lesson 06).
* ``"stochastic"``: up or down to a neighbour with probabilities that make the expected stored value
  the FP32 one (``mpcourse.core.formats.round_to(..., rounding="stochastic")``), so the moments decay
  as FP32's on average. DeepSeek-V3 (section 3.3.3) and MS-AMP (Peng et al. 2023, "FP8-LM", arXiv
  2310.18313, section 3.2) discuss rounding for low-precision optimizer state; stochastic rounding of
  low-precision values is Gupta et al. 2015. The draws come from a ``torch.Generator`` per device,
  seeded by ``seed``, kept in the optimizer's ``state_dict`` (key ``"low_precision_rng"``) so a resumed
  run draws as an uninterrupted one.
"""
from __future__ import annotations

import torch

from .formats import round_to

LOW_STATE_DTYPES = (torch.bfloat16, torch.float16)
STATE_ROUNDINGS = ("nearest", "stochastic")
_RNG_KEY = "low_precision_rng"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2's sharded state), ``t`` otherwise."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _rounded(v: torch.Tensor, state_dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``v`` (float) rounded stochastically to ``state_dtype``; a DTensor keeps its mesh and placements."""
    local = _local(v)
    out = round_to(local.float(), state_dtype, rounding="stochastic", generator=generator).to(state_dtype)
    if local is v:
        return out
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(out, v.device_mesh, v.placements, shape=v.shape, stride=v.stride())


def _cast_state(optimizer, to_param_dtype: bool, state_dtype: torch.dtype, generators=None) -> None:
    """Cast every state tensor shaped like its parameter: up to the parameter's dtype (exact), or down to
    ``state_dtype`` (to nearest; stochastically when ``generators``, a {device: torch.Generator}, is given)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape and v.dim() > 0:
                    if to_param_dtype or generators is None or v.dtype == state_dtype:
                        st[k] = v.to(p.dtype if to_param_dtype else state_dtype)
                    else:
                        dev = _local(v).device
                        if dev not in generators:
                            generators[dev] = torch.Generator(device=dev).manual_seed(optimizer._low_seed)
                        st[k] = _rounded(v, state_dtype, generators[dev])


def LowPrecisionState(optimizer_cls, state_dtype: torch.dtype = torch.bfloat16, rounding: str = "nearest",
                      seed: int = 0):
    """A subclass of ``optimizer_cls`` whose per-parameter state lives in ``state_dtype`` between steps.

    rounding: "nearest" (torch's cast; small decays of the moments are lost, see the module docstring) or
    "stochastic" (unbiased; draws from a generator seeded with ``seed`` and checkpointed in ``state_dict``).
    Raises ValueError for a ``state_dtype`` other than bfloat16/float16 or an unknown rounding, TypeError for
    a non-optimizer class or a non-integer seed.
    """
    if state_dtype not in LOW_STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {LOW_STATE_DTYPES}, got {state_dtype}")
    if rounding not in STATE_ROUNDINGS:
        raise ValueError(f"rounding must be one of {STATE_ROUNDINGS}, got {rounding!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
    stochastic = rounding == "stochastic"

    class _Low(optimizer_cls):
        _low_seed = seed
        EXTRA_STATE_KEYS = (_RNG_KEY,) if stochastic else ()   # read by core.checkpoint.check_optimizer_state_dict

        def _low_generators(self):
            if not hasattr(self, "_low_gens"):
                self._low_gens = {}                       # device -> torch.Generator, made at the first step
            return self._low_gens

        @torch.no_grad()
        def step(self, closure=None):
            _cast_state(self, True, state_dtype)          # (shape) low -> param dtype, exact
            out = super().step(closure)
            _cast_state(self, False, state_dtype, self._low_generators() if stochastic else None)
            return out

        def state_dict(self):
            sd = super().state_dict()
            if stochastic:
                sd[_RNG_KEY] = {str(d): g.get_state() for d, g in self._low_generators().items()}
            return sd

        def load_state_dict(self, state_dict):
            state_dict = dict(state_dict)
            rng = state_dict.pop(_RNG_KEY, None)
            super().load_state_dict(state_dict)           # torch casts state to the param dtype
            if stochastic and rng is not None:
                gens = self._low_generators()
                gens.clear()
                for d, s in rng.items():
                    gens[torch.device(d)] = torch.Generator(device=d)
                    gens[torch.device(d)].set_state(s)
            # the loaded state is what was stored, already in state_dtype's values: the cast down is exact
            _cast_state(self, False, state_dtype)

    suffix = "SR" if stochastic else ""
    _Low.__name__ = _Low.__qualname__ = (f"{optimizer_cls.__name__}With{str(state_dtype).split('.')[-1].upper()}"
                                         f"State{suffix}")
    return _Low
