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

Checkpoints (``state_dict_mismatch``, asked by ``mpcourse.core.checkpoint.check_optimizer_state_dict``): state stored
in another dtype, or saved with the other rounding, is refused naming both; a stochastic optimizer's state without
its generators is refused (its draws would not continue the run). ``torch.distributed.checkpoint`` keeps only an
optimizer state_dict's 'state' and 'param_groups', so there the generators travel beside them (``rng_state``, one
per rank: under FSDP2 each rank draws for its own shard) and are set with ``load_rng_state``; until then the
optimizer refuses to step.
"""
from __future__ import annotations

import torch

from ..formats import round_to

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


class _LowPrecisionMixin:
    """The methods ``LowPrecisionState`` adds to a torch optimizer class (placed before it in the MRO); the class
    attributes ``low_state_dtype``, ``low_rounding`` and ``_low_seed`` are set by ``LowPrecisionState``."""

    EXTRA_STATE_KEYS = (_RNG_KEY,)   # read by core.checkpoint.check_optimizer_state_dict (refused when nearest)

    @property
    def _stochastic(self) -> bool:
        return self.low_rounding == "stochastic"

    def _low_generators(self):
        if not hasattr(self, "_low_gens"):
            self._low_gens = {}                           # device -> torch.Generator, made at the first step
        return self._low_gens

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "_low_rng_missing", False):
            raise RuntimeError(f"{type(self).__name__}: its state was loaded without the stochastic-rounding "
                               f"generator ('{_RNG_KEY}'), so its draws would not continue the saved run: load a "
                               "state_dict that has it, or call load_rng_state() with the saved rng_state()")
        _cast_state(self, True, self.low_state_dtype)     # (shape) low -> param dtype, exact
        out = super().step(closure)
        _cast_state(self, False, self.low_state_dtype, self._low_generators() if self._stochastic else None)
        return out

    def rng_state(self) -> dict:
        """{device: generator state (uint8)} of the stochastic rounding; {} when rounding to nearest. Under FSDP2
        each rank draws for its own shard, so each rank's differs: a checkpoint keeps one per rank."""
        return {str(d): g.get_state() for d, g in self._low_generators().items()} if self._stochastic else {}

    def load_rng_state(self, states: dict) -> None:
        """Set the generators from ``rng_state()``'s dict."""
        gens = self._low_generators()
        gens.clear()
        for d, s in states.items():
            gens[torch.device(d)] = torch.Generator(device=d)
            gens[torch.device(d)].set_state(s)
        self._low_rng_missing = False

    def state_dict(self):
        sd = super().state_dict()
        if self._stochastic:
            sd[_RNG_KEY] = self.rng_state()
        return sd

    def state_dict_mismatch(self, state_dict, need_rng: bool = True) -> str | None:
        """Why ``state_dict`` cannot resume this optimizer, or None: its moments are stored in another dtype, it was
        saved by an optimizer of the other rounding, or (stochastic, ``need_rng``) it holds state but not the
        generator that continues its draws."""
        stored = sorted({str(v.dtype) for st in state_dict.get("state", {}).values() for v in st.values()
                         if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0})
        if stored and stored != [str(self.low_state_dtype)]:
            return (f"the optimizer state is stored in {'/'.join(stored)} and this optimizer keeps it in "
                    f"{self.low_state_dtype}: build LowPrecisionState(..., state_dtype={'/'.join(stored)}) to load it")
        if _RNG_KEY in state_dict and not self._stochastic:
            return (f"the optimizer state was saved with rounding='stochastic' (it holds '{_RNG_KEY}') and this "
                    f"optimizer uses rounding={self.low_rounding!r}: build LowPrecisionState(..., "
                    "rounding='stochastic') to load it")
        if need_rng and self._stochastic and _RNG_KEY not in state_dict and state_dict.get("state"):
            return (f"the optimizer state holds no stochastic-rounding generator ('{_RNG_KEY}'): saved with "
                    "rounding='nearest', or by a checkpoint that dropped it, and this optimizer uses "
                    "rounding='stochastic'; its draws would not continue the run: resume from a checkpoint that "
                    "has it, or build LowPrecisionState(..., rounding='nearest') for a nearest one")
        return None

    def load_state_dict(self, state_dict):
        """torch's, then the state rounded back to ``low_state_dtype`` (exact: it was stored so) and the generators
        set. Refuses (ValueError) state stored in another dtype or by the other rounding. A stochastic optimizer
        given state without its generator (torch.distributed.checkpoint's ``set_state_dict`` passes only 'state'
        and 'param_groups') loads it and refuses to step until ``load_rng_state`` is called."""
        why = self.state_dict_mismatch(state_dict, need_rng=False)
        if why is not None:
            raise ValueError(why)
        state_dict = dict(state_dict)
        rng = state_dict.pop(_RNG_KEY, None)
        super().load_state_dict(state_dict)               # torch casts state to the param dtype
        if rng is not None:
            self.load_rng_state(rng)
        elif self._stochastic and self.state:
            self._low_gens, self._low_rng_missing = {}, True
        # the loaded state is what was stored, already in state_dtype's values: the cast down is exact
        _cast_state(self, False, self.low_state_dtype)


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
    suffix = "SR" if rounding == "stochastic" else ""
    name = f"{optimizer_cls.__name__}With{str(state_dtype).split('.')[-1].upper()}State{suffix}"
    attrs = {"_low_seed": seed, "low_state_dtype": state_dtype, "low_rounding": rounding, "__qualname__": name}
    return type(name, (_LowPrecisionMixin, optimizer_cls), attrs)
