"""AdamW with its moments stored blockwise-quantized between steps: FP8 (E4M3) or 8-bit dynamic codes.

The optimizer torchao 0.18 ships as ``torchao.optim.AdamWFp8`` and ``torchao.optim.AdamW8bit``
(``torchao/optim/adam.py``: ``_AdamBase.step``, ``_new_buffer`` and ``single_param_adam``), stated as plain
rules: the storage of a moment is ``mpcourse.core.optim.fp8`` (``fmt="fp8"``) or ``mpcourse.core.optim.int8``
(``fmt="int8"``, Dettmers et al. 2021, arXiv 2110.02861); the step is ``adamw_step`` below.

One step of one parameter (``adamw_step``; the order of the operations is torchao's, so results match it bit
for bit where torch runs the same ops eagerly):

1. dequantize both moments to FP32 (``m``, ``v``), upcast ``p`` and ``grad`` to FP32;
2. decoupled weight decay ``p = p - (lr * wd) * p`` (``lr`` an FP32 tensor, as torchao keeps it);
3. ``m = m.lerp(g, 1 - beta1)``, ``v = v.lerp(g*g, 1 - beta2)`` (the same as ``beta*m + (1-beta)*g``);
4. ``p = p - lr * (m / (1 - beta1**t)) / (sqrt(v) / sqrt(1 - beta2**t) + eps)`` with the FP32 ``m``, ``v``
   of this step: the update uses the moments before they are quantized;
5. quantize ``m`` (signed) and ``v`` (``state_rule``, below) for the next step.

How the second moment is stored (``state_rule``; the first moment is torchao's under both):

* ``"torchao"``: ``v`` itself, with the unsigned map (int8) or as E4M3 (fp8): torchao's rule, bit for bit
  (tests/core/test_optim_state_torchao.py). It stores ``v = 0`` under a surviving ``m``. ``v`` spans the square of
  the gradients' range, so a coordinate whose gradient is ``r`` times its block's largest sits ``r**2`` under
  the block's largest ``v`` while its ``m`` sits only about ``r`` under: for r ~ 1e-3 (FP8: half of the smallest
  code is 2**-10 / 448 = 2.2e-6 of the block's amax) or r ~ 3e-4 (8-bit: half the map's smallest positive value
  is 1.6e-7) ``v`` is stored as 0 and ``m`` is not. The next step reads ``v = 0``, so ``sqrt(v_hat)`` is
  ``|g| * sqrt(1 - beta2)`` of this step alone, and once the gradient is 0 (a rare token's embedding row, a sparse
  feature) the step is ``lr * m_hat / eps``: measured 8.8e4 lr (FP8, r = 1e-3) and 8.0e3 lr (8-bit, r = 1e-4)
  where FP32 AdamW steps 0.91 lr (tests/core/test_optim_state_stopped.py). torchao's 4-bit optimizer avoids exactly
  this with an unsigned map that has no zero (``torchao/optim/subclass_4bit.py``, after Li, Chen, Zhu 2023,
  "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507: the "zero-point problem");
  its FP8 and 8-bit optimizers do not.
* ``"sqrt-nonzero"`` (the course's default, recipes ``fp8-moments`` and ``int8-moments``): store ``sqrt(v)``
  with the same quantizer (same codes and block scales, so the same bytes), and give a positive value that would
  round to 0 the smallest positive code instead (``nonzero_fp8_codes``, ``nonzero_int8_codes``); dequantize and
  square. Two parts, each measured alone on constructed coordinates (a block's largest gradient 1, one
  coordinate's ``r``, then 0; FP32 AdamW's first step after the stop is 0.91 lr):

  - ``sqrt(v)`` has ``m``'s units (``|m_hat| <= C * sqrt(v_hat)`` by Cauchy-Schwarz over the two EMAs, C about
    7 at betas (0.9, 0.999)), so it needs ``m``'s dynamic range, not its square: 0.91 lr at r = 1e-3 (FP8) and
    0.85 lr at r = 1e-4 (8-bit). FP8-LM (Peng et al. 2023, arXiv 2310.18313, section 3.2) stores ``m`` in FP8
    but keeps ``v`` in FP16. Alone it still fails where ``sqrt(v)`` sits further under its block's largest than ``m`` does (a
    block whose largest coordinate is noisy: large ``v``, small ``m``): 83 lr, FP8, r = 1e-6.
  - never 0 for a positive value (Li et al.'s zero-free map, here the zero code kept for ``v = 0`` itself): then
    ``v`` is 0 only where every gradient so far was 0, where ``m`` is 0 too, and the step is bounded. Alone,
    storing ``v``, the smallest code is far above a small ``v`` and starves the coordinate: 0.43 lr at r = 1e-3
    (FP8), 0.14 lr at r = 1e-4 (8-bit).
  - Together: never over 2x FP32 AdamW's step at any ratio measured (1e-1 .. 1e-7, both block patterns); where
    ``m`` itself rounds to 0 (FP8 below ~2e-6 of its block's largest, 8-bit below ~3e-7) the coordinate stops,
    under every rule. Over 60 steps of heavy-tailed sparse gradients the displacement is 10-16% from FP32
    AdamW's (storing ``v`` with no zero: 35-46%; torchao: 1e2 or more). Bounding the update instead
    (``|m_hat| / sqrt(v_hat) <=`` Adam's bound) stops the blow-up but leaves a step of 2 lr that does not decay
    (55 lr over 30 steps against FP32's 9); zeroing ``m`` where ``v``'s code is 0 freezes the coordinate (0 lr).

  The cost is FP8's: E4M3's relative spacing (2**-3) now falls on ``sqrt(v)``, so a stored ``sqrt(v)`` is off by
  up to 6% rather than 3%, and at beta2 = 0.999 its codes stop following small changes sooner (a stored ``v``
  moves by a code only on a large gradient, up, and comes down only through the block's scale): after 300 steps
  of dense noisy gradients the stored ``v`` is 1.18 to 1.28 times FP32's (torchao's rule: 1.10 to 1.16) and the
  weights 13-14% from FP32 AdamW's (torchao's rule: 6-9%), by the gradient distribution (lesson 11 prints the
  N(0, 1) case: 1.18 and 14% against 1.16 and 9%); ``moment_decay.second_moment_ratio("fp8")`` is 1.02 (1.00). The
  8-bit map spends its codes by decade, and there storing ``sqrt(v)`` costs little (1.02 and 1.4% against 1.01
  and 1.1%). On the 80-step GPT of ``mpcourse compare`` both rules end within noise of each other
  (validation loss 2.422 against torchao's rule's 2.426 for FP8, 2.419 against 2.422 for 8-bit; fp32 2.437).

  Left as torchao has it: the first moment does not decay at the bottom of its range either. ``0.9 * m`` rounds
  back to ``m`` where the codes are more than 20% apart (E4M3's subnormals, the 8-bit map's lowest decades), so
  a stopped coordinate keeps a constant step (8-bit, r = 1e-4: 0.85 lr every step, where FP32's shrinks by 0.9
  per step) until its block's scale moves. That is bounded, and a rounding question (stochastic rounding of
  ``m``, as ``mpcourse.core.optim.state`` does for BF16), not one of range.

Which tensors are quantized (torchao following bitsandbytes): those with at least 4096 elements and a
``numel`` divisible by the block size; the others keep FP32-exact moments in the parameter's dtype.
The state is plain tensors (``exp_avg``, ``exp_avg_sq`` codes; ``exp_avg_scale``, ``exp_avg_sq_scale`` per
block; ``step`` an FP32 scalar), so ``state_dict``/``load_state_dict`` and ``mpcourse.experiment.measure.memory`` see
what is stored; loading keeps each tensor's stored dtype (torch would cast FP8 codes to the parameter's dtype).

Checkpoints: what the stored numbers mean (``STORAGE_KEYS``: ``fmt``, the ``state_rule`` that says whether the codes
of ``exp_avg_sq`` mean ``v`` or ``sqrt(v)``, and ``block_size``) is recorded in every param group, where torch's
``state_dict`` and ``torch.distributed.checkpoint`` (which keeps only 'state' and 'param_groups') both keep it.
Loading state stored otherwise is refused, naming both values and the one to build the optimizer with. State that
holds quantized moments but records no rule is refused too, never read under a guessed one: a DCP checkpoint of an
earlier version dropped the rule (then a top-level key), and before the option ``v`` itself was stored. A
one-process state_dict of the version before this one (the rule as a top-level key) loads by what it records: its
rule, and the ``fmt`` and ``block_size`` its codes show (their dtype; elements per scale).

Under FSDP2 the parameters are DTensor shards of rows; the step runs on each rank's local rows and the blocks stay
the whole tensor's (``mpcourse.core.optim.shards``: block amaxes all-reduced), so the weights, codes and scales are
one process's bit for bit, whatever the number of ranks. torchao's optimizers quantize each local shard in blocks
of its own and decide by the shard's size whether to quantize at all, so their state changes with the mesh
(pytorch/ao#4912).
"""
from __future__ import annotations

import torch

from .fp8 import dequantize_fp8_state, fp8_state_scale, nonzero_fp8_codes, quantize_fp8_state
from .int8 import dequantize_int8_state, dynamic_map, int8_state_absmax, nonzero_int8_codes, quantize_int8_state
from .shards import Span, block_amax, from_blocks, local, replicated_like, shard_like, span_of, to_blocks

FORMATS = ("fp8", "int8")
STATE_RULES = ("sqrt-nonzero", "torchao")    # how v is stored; the first is the default (module docstring)
STORAGE_KEYS = ("fmt", "state_rule", "block_size")   # what the stored numbers mean: recorded in every param group
CODE_FORMATS = {torch.float8_e4m3fn: "fp8", torch.uint8: "int8"}   # the fmt a code dtype is
MIN_QUANTIZED_NUMEL = 4096       # smaller tensors keep full-precision moments (bitsandbytes' rule)
_QMAPS: dict = {}                # (signed, device) -> the int8 map


def _qmap(signed: bool, device) -> torch.Tensor:
    key = (signed, torch.device(device))
    if key not in _QMAPS:
        _QMAPS[key] = dynamic_map(signed).to(device)
    return _QMAPS[key]


def quantize_state(x: torch.Tensor, fmt: str, signed: bool, block_size: int, span: Span | None = None):
    """fp32 moment -> (codes shaped like x, scale (numel // block_size,) fp32) in ``fmt``. ``span``: ``x`` is this
    rank's part of the moment (``mpcourse.core.optim.shards``): the blocks and scales are the whole moment's (every
    block's scale returned, the same on every rank; collective), the codes ``x``'s."""
    if span is not None and not span.whole:
        blocks, first = to_blocks(x, span, block_size)                           # (k, block) fp32
        amax = block_amax(blocks, first, span, block_size)                      # (B,) the whole moment's
        scale = fp8_state_scale(amax) if fmt == "fp8" else int8_state_absmax(amax)
        codes, _ = quantize_state_blocks(blocks, fmt, signed, block_size, scale[first:first + blocks.shape[0]])
        return from_blocks(codes, span, block_size, x.shape), scale
    return quantize_state_blocks(x, fmt, signed, block_size)


def quantize_state_blocks(x: torch.Tensor, fmt: str, signed: bool, block_size: int, scale=None):
    """``quantize_state`` of a tensor that holds whole blocks; ``scale`` (B,): the blocks' scales, else x's own."""
    if fmt == "fp8":
        return quantize_fp8_state(x, block_size, scale)
    return quantize_int8_state(x, _qmap(signed, x.device), block_size, scale)


def dequantize_state(codes: torch.Tensor, scale: torch.Tensor, fmt: str, signed: bool,
                     span: Span | None = None) -> torch.Tensor:
    """(codes, scale) in ``fmt`` -> fp32 shaped like codes. ``span``: the codes are this rank's part of the moment,
    ``scale`` every block's (as ``quantize_state`` returns them)."""
    if span is not None and not span.whole:
        if span.numel == 0:
            return codes.float()                                                 # a rank that holds no row
        block_size = span.total // scale.numel()
        blocks, first = to_blocks(codes, span, block_size)                       # (k, block) codes
        values = dequantize_state(blocks, scale[first:first + blocks.shape[0]], fmt, signed)
        return from_blocks(values, span, block_size, codes.shape)
    if fmt == "fp8":
        return dequantize_fp8_state(codes, scale)
    return dequantize_int8_state(codes, scale, _qmap(signed, codes.device))


def quantize_second_moment(v: torch.Tensor, fmt: str, block_size: int, state_rule: str, span: Span | None = None):
    """fp32 second moment (>= 0) -> (codes shaped like v, scale per block) under ``state_rule``: ``"torchao"``
    quantizes ``v``; ``"sqrt-nonzero"`` quantizes ``sqrt(v)`` and gives a positive value that rounded to 0 the
    smallest positive code. ``span`` as in ``quantize_state``."""
    if state_rule == "torchao":
        return quantize_state(v, fmt, False, block_size, span)
    root = v.sqrt()
    codes, scale = quantize_state(root, fmt, False, block_size, span)
    if fmt == "fp8":
        return nonzero_fp8_codes(codes, root), scale
    return nonzero_int8_codes(codes, root, _qmap(False, v.device)), scale


def dequantize_second_moment(codes: torch.Tensor, scale: torch.Tensor, fmt: str, state_rule: str,
                             span: Span | None = None) -> torch.Tensor:
    """(codes, scale) stored by ``quantize_second_moment`` -> fp32 ``v`` (squared back under "sqrt-nonzero")."""
    stored = dequantize_state(codes, scale, fmt, False, span)
    return stored if state_rule == "torchao" else stored.square()


def adamw_step(p, grad, step, m, v, lr, beta1: float, beta2: float, weight_decay: float, eps: float):
    """One AdamW step in FP32, torchao's order of operations. p, grad: any float dtype, same shape;
    step: the FP32 scalar tensor t (already incremented); m, v: FP32 moments; lr: FP32 scalar tensor.
    Returns (new p fp32, new m fp32, new v fp32); nothing is written."""
    p32, g32 = p.float(), grad.float()
    p32 = p32 - lr * weight_decay * p32                                     # decoupled weight decay
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    m = m.lerp(g32, 1 - beta1)
    v = v.lerp(g32.square(), 1 - beta2)
    denom = v.sqrt() / bias2.sqrt() + eps
    return p32 - lr * (m / bias1) / denom, m, v


def recorded_storage(state_dict) -> dict:
    """What ``state_dict`` (a ``BlockQuantizedAdamW``'s) says about how its moments are stored: the ``STORAGE_KEYS``
    its param groups record; from a one-process state_dict written before they were there, its top-level
    ``state_rule`` and the ``fmt`` and ``block_size`` its codes show (their dtype; elements per scale), both read
    from what is stored, not assumed. A key it does not tell is left out."""
    groups = state_dict.get("param_groups") or [{}]
    out = {k: groups[0][k] for k in STORAGE_KEYS if all(k in g for g in groups)}
    if "state_rule" in state_dict and "state_rule" not in out:               # the key before the groups held it
        out["state_rule"] = state_dict["state_rule"]
    for st in state_dict.get("state", {}).values():
        if "exp_avg_scale" in st and "exp_avg" in st:
            out.setdefault("fmt", CODE_FORMATS.get(st["exp_avg"].dtype, str(st["exp_avg"].dtype)))
            out.setdefault("block_size", st["exp_avg"].numel() // max(st["exp_avg_scale"].numel(), 1))
    return out


def storage_mismatch(saved: dict, mine: dict) -> str | None:
    """Why moments stored as ``saved`` (``recorded_storage``) cannot be read by an optimizer storing as ``mine``
    (``BlockQuantizedAdamW.storage()``), naming both; None if they agree. No rule recorded: refused, never
    guessed (the codes of exp_avg_sq would be read as v or as sqrt(v) on a guess)."""
    if "state_rule" not in saved:
        return ("the optimizer state holds quantized moments but does not record its state_rule, so its "
                "exp_avg_sq codes may stand for v (state_rule='torchao') or for sqrt(v) ('sqrt-nonzero'): it was "
                "written by an older mpcourse (a torch.distributed.checkpoint dropped the rule; before the option "
                "v itself was stored). Not guessing: resume it with the mpcourse version that wrote it, or start "
                "the run again")
    for k in STORAGE_KEYS:
        if saved.get(k) != mine[k]:
            return (f"the optimizer state was stored with {k}={saved.get(k)!r} and this optimizer uses "
                    f"{k}={mine[k]!r}: build BlockQuantizedAdamW(..., {k}={saved.get(k)!r}) to load it")
    return None


class BlockQuantizedAdamW(torch.optim.Optimizer):
    """AdamW whose moments live blockwise-quantized (``fmt`` "fp8" as torchao's ``AdamWFp8``, "int8" as its
    ``AdamW8bit``) between steps; defaults are torchao's (weight_decay 1e-2, block_size 256) but for
    ``state_rule``: "sqrt-nonzero" (default) stores sqrt(v) and never 0 for a positive v, "torchao" is torchao's
    storage bit for bit, which can store v = 0 under a surviving m (module docstring). Parameters may be FSDP2
    DTensor shards: the blocks stay the whole tensor's (``mpcourse.core.optim.shards``). ``fmt``, ``state_rule`` and
    ``block_size`` are the optimizer's (one value for every parameter group) and every param group records them,
    so its ``state_dict`` says how its numbers are stored, through torch.save and torch.distributed.checkpoint."""

    EXTRA_STATE_KEYS = ("state_rule",)   # a one-process state_dict's key before the groups held it (read, not written)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 fmt: str = "fp8", block_size: int = 256, state_rule: str = "sqrt-nonzero"):
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if state_rule not in STATE_RULES:
            raise ValueError(f"state_rule must be one of {STATE_RULES}, got {state_rule!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"need lr >= 0, eps >= 0 and 0 <= betas < 1, got lr={lr}, eps={eps}, betas={betas}")
        self.fmt, self.block_size, self.state_rule = fmt, block_size, state_rule
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      **self.storage()))

    def storage(self) -> dict:
        """How this optimizer stores its moments: {"fmt", "state_rule", "block_size"} (``STORAGE_KEYS``)."""
        return {"fmt": self.fmt, "state_rule": self.state_rule, "block_size": self.block_size}

    def add_param_group(self, param_group):
        """torch's, refusing a group that sets ``fmt``, ``state_rule`` or ``block_size`` to another value."""
        for k, mine in self.storage().items():
            if k in param_group and param_group[k] != mine:
                raise ValueError(f"{k} is set for the whole optimizer ({k}={mine!r}), not per parameter group "
                                 f"(got {param_group[k]!r}): build one BlockQuantizedAdamW per {k}")
        super().add_param_group(param_group)

    def quantizes(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments are stored quantized (else in ``p``'s dtype); a DTensor by its whole size."""
        return p.numel() >= MIN_QUANTIZED_NUMEL and p.numel() % self.block_size == 0

    def _init_state(self, p, st):
        st["step"] = torch.tensor(0.0)
        if not self.quantizes(p):
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            return
        zeros = torch.zeros_like(local(p), dtype=torch.float32)
        self._write(p, st, "exp_avg", zeros)
        self._write(p, st, "exp_avg_sq", zeros)
        local(st["exp_avg_scale"]).zero_()                # torchao starts from zero scales
        local(st["exp_avg_sq_scale"]).zero_()

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p``'s stored first and second moments, dequantized to FP32 (as the next step reads them); for a
        DTensor ``p``, this rank's rows."""
        st = self.state[p]
        return self._read(p, st, "exp_avg"), self._read(p, st, "exp_avg_sq")

    def _read(self, p, st, key):
        if key + "_scale" not in st:
            return local(st[key]).float()
        codes, scale, span = local(st[key]), local(st[key + "_scale"]), span_of(p)
        if key == "exp_avg":
            return dequantize_state(codes, scale, self.fmt, True, span)
        return dequantize_second_moment(codes, scale, self.fmt, self.state_rule, span)

    def _write(self, p, st, key, value):
        if key in st and key + "_scale" not in st:
            local(st[key]).copy_(value)
            return
        if key == "exp_avg":
            codes, scale = quantize_state(value, self.fmt, True, self.block_size, span_of(p))
        else:
            codes, scale = quantize_second_moment(value, self.fmt, self.block_size, self.state_rule, span_of(p))
        st[key], st[key + "_scale"] = shard_like(p, codes), replicated_like(p, scale)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient (on a DTensor: its local rows, with collectives for the
        block amaxes, so every rank of its mesh must step it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = torch.tensor(group["lr"], dtype=torch.float32)            # torchao keeps lr as an fp32 tensor
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BlockQuantizedAdamW does not support sparse gradients")
                st = self.state[p]
                if not st:
                    self._init_state(p, st)
                st["step"] += 1
                m, v = self._read(p, st, "exp_avg"), self._read(p, st, "exp_avg_sq")
                new_p, m, v = adamw_step(local(p), local(p.grad), st["step"], m, v, lr, beta1, beta2,
                                         group["weight_decay"], group["eps"])
                self._write(p, st, "exp_avg", m)
                self._write(p, st, "exp_avg_sq", v)
                local(p).copy_(new_p)                                       # to p's dtype, nearest
        return loss

    def state_dict_mismatch(self, state_dict) -> str | None:
        """Why ``state_dict`` cannot load here, or None: its quantized moments were stored with another ``fmt``,
        ``state_rule`` or ``block_size`` (``recorded_storage``), or it does not record them. A state_dict with no
        quantized moment has nothing to misread."""
        if not any("exp_avg_scale" in st for st in state_dict.get("state", {}).values()):
            return None
        return storage_mismatch(recorded_storage(state_dict), self.storage())

    def load_state_dict(self, state_dict):
        """torch's load casts floating state to the parameter's dtype (FP8 codes to FP32, scales to a BF16
        parameter's dtype); put back the tensors as stored, on the parameter's device. Refuses (ValueError, before
        anything loads) state stored with another ``fmt``, ``state_rule`` or ``block_size``, or not saying how."""
        why = self.state_dict_mismatch(state_dict)
        if why is not None:
            raise ValueError(why)
        state_dict = {k: v for k, v in state_dict.items() if k != "state_rule"}
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update(self.storage())                  # a saved group may predate the record
            for p, i in zip(group["params"], saved_group["params"]):
                for k, v in state_dict["state"].get(i, {}).items():
                    if torch.is_tensor(v) and k != "step":
                        self.state[p][k] = v.to(device=p.device, copy=True)
