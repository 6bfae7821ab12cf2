"""BF16 training without an FP32 master copy: stochastic rounding and Kahan-compensated weight updates.

Sources: Zamirai, Zhang, Aberger and De Sa 2020, "Revisiting BFloat16 Training" (arXiv 2010.06192): nearest
rounding of the weight update cancels updates smaller than half a BF16 step; stochastic rounding and Kahan
summation with a 16-bit compensation buffer (Algorithm 2) recover FP32 accuracy (abstract: -0.1%...+0.2%).
Gupta et al. 2015, "Deep Learning with Limited Numerical Precision" (ICML): stochastic rounding
rounds x up with probability (x - lo) / (hi - lo), so E[round(x)] = x. The bit form used here (add 16 uniform
random bits below BF16's last bit, then truncate) is the one of pytorch/pytorch#120376 and torchao's low-bit
optimizers (torchao/optim/quant_utils.py, ``_fp32_to_bf16_sr``).

Why: a BF16 weight keeps 8 significant bits, so ``w + u`` rounds back to ``w`` when |u| < ulp(w) / 2, between
|w| * 2**-9 and |w| * 2**-8 (1 + 1e-3 == 1 in BF16). ``BF16Optimizer`` wraps any ``torch.optim`` optimizer
built over BF16 parameters: storage stays BF16, the arithmetic of a step runs in FP32 (what a fused optimizer
kernel on BF16 storage does: load, compute in FP32 registers, round once on store), and the new weight is
written back rounded by ``rounding``: "nearest" (round to nearest even: the stagnation case) or "stochastic";
``kahan=True`` instead adds each step's update with Kahan compensation (round to nearest, plus a BF16 buffer
of what the weight still owes).

Where each dtype lives (bytes per parameter, persistent unless noted)::

    param (model weight)       bf16  2   forward and backward run on it
    param.grad                 bf16 (2)  written by backward; accumulate_grads() moves it into the FP32 buffer
    FP32 gradient buffer       fp32  4   sums micro-batch grads exactly (BF16 would stall: 256 + 1 = 256)
    optimizer state            bf16  4   Adam's exp_avg, exp_avg_sq; rounded to nearest after each step
    Kahan compensation         bf16  2   kahan=True only:   what the weight still owes, w + comp ~ exact
    step() temporaries         fp32  4 + 4 per state tensor, alive only inside step()
    -> 10 B/param (rounding only), 12 B (kahan=True); an FP32 master copy (mpcourse.core.master) needs 20 B.

The rules (lesson 06's functions, plain: no kernel, no fast path): `stochastic_round_bf16(x, generator)` and
`kahan_add_(w, comp, update)`. They have no kernel module; round to nearest is torch's own FP32 -> BF16 cast
(`formats.round_to(x, "bf16")` is its rule, checked against it in tests/core/test_formats.py). `BF16Optimizer` binds
a learner's functions (``mpcourse.core.learner_table.returned`` checks their results) or these.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .checkpoint import CheckpointError, check_optimizer_state_dict
from .learner_table import returned

ROUNDINGS = ("nearest", "stochastic")   # how BF16Optimizer rounds the new FP32 weight into BF16


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (its own storage), ``t`` itself otherwise."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _flat_range(param: torch.Tensor, shard: torch.Tensor) -> tuple[int, int]:
    """(index of the first element of ``shard`` in ``param``'s row-major order, ``param.numel()``).

    A plain tensor is its own shard: (0, numel). A DTensor on a 1-D mesh sharded on dim 0 (FSDP2's default)
    holds rows [r*c, r*c + rows) with c = ceil(dim0 / ranks) (``torch.chunk``), so its elements are one
    contiguous range of the whole tensor's; replicated, the whole tensor. Raises ValueError otherwise."""
    n = param.numel()
    if type(param).__name__ != "DTensor":
        return 0, n
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim == 1 and isinstance(placements[0], Replicate):
        return 0, n
    if mesh.ndim != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise ValueError(f"BF16Optimizer's stochastic rounding takes DTensor parameters sharded on dim 0 over a 1-D "
                         f"mesh (FSDP2's default), got placements {placements} on a {mesh.ndim}-D mesh: shard with "
                         "fully_shard's default placement")
    rows, ranks = param.shape[0], mesh.size()
    first_row = min(mesh.get_local_rank() * math.ceil(rows / ranks), rows)
    if shard.shape[0] != max(0, min(math.ceil(rows / ranks), rows - first_row)):
        raise ValueError(f"a shard of {shard.shape[0]} rows is not torch.chunk's shard of {rows} rows over {ranks} ranks")
    return first_row * (n // rows if rows else 0), n


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to BF16 stochastically: up (in magnitude) with probability (|x| - |lo|) / ulp.

    The result is always one of the two BF16 neighbours of x (x itself when representable) and its mean is x.
    BF16 is the top 16 bits of FP32, so: add a uniform random integer in [0, 2**16) to the FP32 bit pattern and
    clear the low 16 bits; a carry (probability = dropped bits / 2**16) moves to the next magnitude, and a carry
    out of the largest finite value gives inf, as in ``mpcourse.core.formats.round_to(..., rounding="stochastic")``.
    Args: x float32 tensor (any shape); generator: a torch.Generator on x's device (seeded for reproducibility).
    Returns a bfloat16 tensor of x's shape; NaN stays NaN, +-inf stay +-inf, -0.0 stays -0.0.
    Raises TypeError for a non-float32 x (upcast BF16/FP16 first: .float()).
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes a float32 tensor, got {getattr(x, 'dtype', type(x))}; "
                        "call .float() first")
    r = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    bits = (x.view(torch.int32) + r) & -65536           # (shape) int32; -65536 == 0xFFFF0000
    out = bits.view(torch.float32)                      # low 16 bits zero: a BF16 value, exact in FP32
    return torch.where(x.isnan(), x, out).to(torch.bfloat16)


@torch.no_grad()
def kahan_add_(w: torch.Tensor, comp: torch.Tensor, update: torch.Tensor) -> None:
    """w += update with Kahan compensation, in place on BF16 ``w`` and its BF16 compensation ``comp``.

    Zamirai et al. 2020, Algorithm 2, with ``comp`` holding what the weight still owes (the negative of Kahan's
    textbook c), so ``w + comp`` tracks the exact sum::

        y    = update + comp                # fp32: this step's update plus what earlier steps left over
        new  = bf16_nearest(w + y)          # what the BF16 weight can take
        comp = bf16_nearest(y - (new - w))  # the part it could not take (new - w is exact in fp32)
        w    = new

    Ten updates of +1e-3 to w = 1.0 leave w = 1.0078125 and comp ~ 0.0021875 (w + comp ~ 1.01); plain BF16
    addition leaves 1.0. Args: w, comp bf16 tensors of one shape; update: float tensor broadcastable to it.
    Raises TypeError for non-BF16 w or comp.
    """
    if w.dtype != torch.bfloat16 or comp.dtype != torch.bfloat16:
        raise TypeError(f"kahan_add_ needs bf16 weight and compensation, got {w.dtype} and {comp.dtype}")
    w32 = w.float()
    y = update.float() + comp.float()                   # (shape) fp32
    new = (w32 + y).to(torch.bfloat16)                  # round to nearest even
    comp.copy_(y - (new.float() - w32))                 # fp32 -> bf16, nearest
    w.copy_(new)


class BF16Optimizer:
    """Wrap a ``torch.optim`` optimizer over BF16 params: FP32 arithmetic, BF16 storage, a chosen write-back.

    Args:
        optimizer: any torch.optim.Optimizer built over bfloat16 parameters (e.g. ``AdamW(model.parameters())``
            after ``model.bfloat16()``). It runs unchanged, on FP32 temporaries of the params, grads and state.
        rounding: how the new FP32 weight is rounded into BF16: "nearest" (round to nearest even) or
            "stochastic" (``stochastic_round_bf16``). Default "stochastic".
        kahan: add each step's update with ``kahan_add_`` (one BF16 compensation buffer per parameter) instead
            of rounding the new weight; it rounds to nearest, so it needs ``rounding="nearest"``. Default False.
        seed: seeds the stochastic-rounding generator (default 0; on the params' device).
        fp32_grads: accumulate micro-batch gradients in FP32 buffers (default True); False keeps autograd's BF16
            accumulation in ``param.grad``.
        round_to_bf16, stochastic_round_bf16, kahan_add_: optional functions with the signatures of lesson 00's
            ``round_to_bf16(x)`` and lesson 06's ``stochastic_round_bf16(x, generator)`` / ``kahan_add_(w, comp,
            update)``, used for the write-back in place of the library's (None, the default: the library's,
            with the fused cast for round to nearest). Their results are checked (``learner_table.returned``).
        state_dtype: dtype the optimizer state is stored in between steps, torch.bfloat16 (default, rounded to
            nearest) or torch.float32. State tensors with the parameter's shape are converted; "step" is not.
    Use: ``backward(); opt.accumulate_grads()`` per micro-batch, then ``opt.clip_grad_norm_(max_norm)`` (optional),
    ``opt.step()``, ``opt.zero_grad()``. ``param_groups`` and ``state`` are the wrapped optimizer's.
    ``lost``/``changed`` count, for the last step, the elements whose FP32 step changed the weight (changed) but
    whose stored BF16 weight did not (lost). Raises ValueError for non-BF16 params, an unknown rounding, or
    kahan=True with stochastic rounding.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, rounding: str = "stochastic", seed: int = 0,
                 fp32_grads: bool = True, state_dtype: torch.dtype = torch.bfloat16, kahan: bool = False, *,
                 round_to_bf16=None, stochastic_round_bf16=None, kahan_add_=None):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}"
                             + (" (Kahan compensation is kahan=True with rounding='nearest')"
                                if rounding == "kahan" else ""))
        if kahan and rounding != "nearest":
            raise ValueError("kahan=True rounds to nearest (Zamirai et al. 2020, Algorithm 2): pass "
                             "rounding='nearest' with it")
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.float32, got {state_dtype}")
        self.optimizer, self.fp32_grads, self.state_dtype = optimizer, fp32_grads, state_dtype
        self.rounding, self.kahan = rounding, bool(kahan)
        self.round_to_bf16, self.stochastic_round_bf16, self.kahan_add_ = round_to_bf16, stochastic_round_bf16, kahan_add_
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        bad = [p.dtype for p in self.params if p.dtype != torch.bfloat16]
        if bad:
            raise ValueError(f"BF16Optimizer needs bfloat16 parameters, got {bad[0]}: call model.bfloat16() (or "
                             "cast_model(model, torch.bfloat16)) before building the optimizer; for FP32 master "
                             "weights use mpcourse.core.master.MasterWeights")
        self.generator = torch.Generator(device=self.params[0].device).manual_seed(seed)
        self.comp = [torch.zeros_like(p) for p in self.params] if kahan else None  # (shape) bf16
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)                    # (shape) fp32
        self.lost = self.changed = 0

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add each ``param.grad`` (bf16) into its FP32 buffer exactly and free it. Call after every backward."""
        if not self.fp32_grads:
            return
        for i, p in enumerate(self.params):
            if p.grad is not None:
                if self.grads[i] is None:
                    self.grads[i] = p.grad.float()          # (shape) fp32, a new tensor
                else:
                    self.grads[i].add_(p.grad)              # fp32 += bf16, the bf16 value upcast exactly
                p.grad = None

    def _grad32(self, i: int):
        g = self.grads[i] if self.fp32_grads else self.params[i].grad
        return None if g is None else g.float()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the FP32 gradients so their global L2 norm is at most ``max_norm``; returns the norm before.
        Same rule as torch.nn.utils.clip_grad_norm_: multiply by min(1, max_norm / (norm + 1e-6))."""
        self.accumulate_grads()
        grads = [g for g in (self.grads if self.fp32_grads else [p.grad for p in self.params]) if g is not None]
        if not grads:
            return 0.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return float(norm)

    def _elementwise(self, v, p) -> bool:
        """Is optimizer state ``v`` one value per element of ``p`` (converted between steps; "step" is not)?"""
        return torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape

    @contextlib.contextmanager
    def _stepping(self, temps: list[torch.Tensor]):
        """Let the wrapped optimizer see the FP32 tensors ``temps`` in place of the parameters (same order), with
        their state in FP32; afterwards the parameters, their state back in ``state_dtype``, keyed by them again.

        The parameters themselves are never touched: their dtype, storage and autograd gradient accumulators stay
        (DDP's reducer hooks those accumulators; FSDP2's DTensor shards keep their dtype). ``param_groups`` and
        ``state`` are read again on the way out because ``Optimizer.load_state_dict`` replaces both objects."""
        it = iter(temps)
        pairs = [(p, next(it)) for g in self.optimizer.param_groups for p in g["params"]]
        saved = [list(g["params"]) for g in self.optimizer.param_groups]
        done = 0
        for g in self.optimizer.param_groups:
            g["params"] = [t for _, t in pairs[done:done + len(g["params"])]]
            done += len(g["params"])
        state = self.optimizer.state
        for p, t in pairs:
            if p in state:
                state[t] = {k: v.to(torch.float32) if self._elementwise(v, p) else v for k, v in state.pop(p).items()}
        try:
            yield
        finally:
            for g, params in zip(self.optimizer.param_groups, saved):
                g["params"] = params
            state = self.optimizer.state
            for p, t in pairs:
                if t in state:
                    state[p] = {k: v.to(self.state_dtype) if self._elementwise(v, p) else v
                                for k, v in state.pop(t).items()}

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: FP32 temporaries in, the wrapped ``optimizer.step()``, BF16 written back by
        ``rounding`` (or ``kahan``) in place into each parameter, which keeps its dtype, storage and identity.
        Closures are not supported (as torch.amp.GradScaler.step). Grads are kept until zero_grad().
        DTensor parameters (FSDP2 shards): the optimizer steps the FP32 DTensors and the write-back works on
        this rank's local shard, element by element; ``lost``/``changed`` then count this rank's shard."""
        if closure is not None:
            raise ValueError("BF16Optimizer.step does not take a closure: run forward/backward before step()")
        self.accumulate_grads()
        temps = []
        for i, p in enumerate(self.params):
            t = p.detach().float()                          # (shape) fp32 temporary, a copy (a DTensor under FSDP2)
            t.grad = self._grad32(i)                        # (shape) fp32
            temps.append(t)
        with self._stepping(temps):
            self.optimizer.step()                           # the wrapped optimizer, in fp32, on the temporaries
        self.lost = self.changed = 0
        for i, (p, t) in enumerate(zip(self.params, temps)):
            w16, w32 = _local(p.detach()), _local(t)        # (shard) bf16, the parameter's own storage; fp32
            old = w16.clone()
            self._write_back(w16, w32, old, i)
            wanted = w32 != old.float()
            self.changed += int(wanted.sum())
            self.lost += int((wanted & (w16 == old)).sum())

    def _write_back(self, w16, w32, old, i) -> None:
        """w16 (bf16) := the new weight w32 (fp32), by the chosen rule (a given function, else the library's)."""
        if self.kahan:
            comp16 = _local(self.comp[i])                     # (shard) bf16
            if self.kahan_add_ is None:
                kahan_add_(w16, comp16, w32 - old.float())
                return
            w, comp = w16.clone(), comp16.clone()             # the learner's function works on copies
            returned("kahan_add_", w, comp, w16, self.kahan_add_(w, comp, w32 - old.float()))
            w16.copy_(w)
            comp16.copy_(comp)
        elif self.rounding == "nearest":
            if self.round_to_bf16 is None:
                w16.copy_(w32)                                 # fused cast: round to nearest even
            else:
                w16.copy_(returned("round_to_bf16", w32, self.round_to_bf16(w32.clone()), torch.bfloat16))
        else:
            fn = self.stochastic_round_bf16 or stochastic_round_bf16
            first, total = _flat_range(self.params[i], w16)
            self._skip_draws(first)                            # the elements before this rank's shard
            out = fn(w32.clone(), self.generator)
            self._skip_draws(total - first - w16.numel())      # and after it: every rank ends in one state
            w16.copy_(returned("stochastic_round_bf16", w32, out, torch.bfloat16))

    def _skip_draws(self, n: int) -> None:
        """Advance the generator past the draws of ``n`` elements (``stochastic_round_bf16`` draws one 32-bit number
        per element, in row-major order, from the CPU generator's serial stream). On CUDA, torch's Philox
        generator advances by offsets per launch, not per element, so there a sharded run still rounds
        stochastically but neither one process's bits nor equal generator states across ranks are to be expected
        (not run: no GPU here)."""
        if n > 0:
            torch.randint(0, 1 << 16, (n,), generator=self.generator, device=self.generator.device, dtype=torch.int32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` and the FP32 buffers (freed with set_to_none=True, the default)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.grads = [None if set_to_none or g is None else g.zero_() for g in self.grads]

    def extra_bytes(self) -> int:
        """Bytes of the Kahan compensation buffers (0 without kahan)."""
        return sum(c.numel() * c.element_size() for c in self.comp or [])

    def grad_bytes(self) -> int:
        """Bytes of the FP32 gradient buffers alive now."""
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)

    def state_dict(self) -> dict:
        """{"optimizer", "rounding", "kahan", "generator" (SR state), "compensation" (bf16 tensors or None)}: everything to
        resume bit for bit. Take it at a step boundary (after zero_grad): FP32 grad buffers are not saved."""
        return {"optimizer": self.optimizer.state_dict(), "rounding": self.rounding, "kahan": self.kahan,
                "generator": self.generator.get_state(),
                "compensation": None if self.comp is None else [c.clone() for c in self.comp]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()``. Everything is checked before anything changes (CheckpointError, a ValueError):
        the keys, the same ``rounding`` and ``kahan``, the optimizer state's shapes, and one BF16 compensation
        buffer of each parameter's shape (a (1,) buffer would otherwise broadcast into every element)."""
        keys = {"optimizer", "rounding", "kahan", "generator", "compensation"}
        if not isinstance(state, dict) or set(state) != keys:
            raise CheckpointError(f"not a BF16Optimizer state_dict: expected the keys {sorted(keys)}, got "
                                  f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        saved_mode, mode = (state["rounding"], state["kahan"]), (self.rounding, self.kahan)
        if saved_mode != mode:
            raise CheckpointError(f"checkpoint was saved with rounding={saved_mode[0]!r}, kahan={saved_mode[1]}; "
                                  f"this optimizer uses rounding={mode[0]!r}, kahan={mode[1]}: build it with the "
                                  "same ones")
        comp = state["compensation"]
        if self.kahan:
            if not isinstance(comp, (list, tuple)) or len(comp) != len(self.params):
                raise CheckpointError(f"compensation: expected {len(self.params)} buffers, got "
                                      f"{len(comp) if isinstance(comp, (list, tuple)) else comp!r}")
            for i, (c, p) in enumerate(zip(comp, self.params)):
                if not isinstance(c, torch.Tensor) or c.shape != p.shape or c.dtype != torch.bfloat16:
                    raise CheckpointError(f"compensation buffer {i}: expected a bfloat16 tensor of shape "
                                          f"{tuple(p.shape)}, got {getattr(c, 'dtype', type(c).__name__)} of shape "
                                          f"{tuple(getattr(c, 'shape', ()))}")
        elif comp is not None:
            raise CheckpointError("compensation buffers in a checkpoint of an optimizer without kahan=True")
        gen = state["generator"]
        if not isinstance(gen, torch.Tensor) or gen.dtype != torch.uint8 or gen.shape != \
                self.generator.get_state().shape:
            raise CheckpointError("generator: not a torch.Generator state of this device (Generator.get_state())")
        check_optimizer_state_dict(self.optimizer, state["optimizer"], "BF16Optimizer optimizer")
        temps = [p.detach().float() for p in self.params]   # torch casts loaded state to the param dtype:
        with self._stepping(temps):                         # fp32 stand-ins make that cast exact
            self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(gen)
        for c, s in zip(self.comp or [], comp or []):
            c.copy_(s)
