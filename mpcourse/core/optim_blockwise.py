"""AdamW with its moments stored blockwise-quantized between steps: FP8 (E4M3) or 8-bit dynamic codes.

The optimizer torchao 0.18 ships as ``torchao.optim.AdamWFp8`` and ``torchao.optim.AdamW8bit``
(``torchao/optim/adam.py``: ``_AdamBase.step``, ``_new_buffer`` and ``single_param_adam``), stated as plain
rules: the storage of a moment is ``mpcourse.core.optim_fp8`` (``fmt="fp8"``) or ``mpcourse.core.optim_int8``
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
  ``m``, as ``mpcourse.core.optim_state`` does for BF16), not one of range.

Which tensors are quantized (torchao following bitsandbytes): those with at least 4096 elements and a
``numel`` divisible by the block size; the others keep FP32-exact moments in the parameter's dtype.
The state is plain tensors (``exp_avg``, ``exp_avg_sq`` codes; ``exp_avg_scale``, ``exp_avg_sq_scale`` per
block; ``step`` an FP32 scalar), so ``state_dict``/``load_state_dict`` and ``mpcourse.experiment.measure.memory`` see
what is stored; loading keeps each tensor's stored dtype (torch would cast FP8 codes to the parameter's dtype).
``state_dict`` records the ``state_rule`` (the codes of ``exp_avg_sq`` mean ``v`` or ``sqrt(v)``); loading
state stored under the other rule is refused, naming the rule to build the optimizer with.
"""
from __future__ import annotations

import torch

from .optim_fp8 import dequantize_fp8_state, nonzero_fp8_codes, quantize_fp8_state
from .optim_int8 import dequantize_int8_state, dynamic_map, nonzero_int8_codes, quantize_int8_state

FORMATS = ("fp8", "int8")
STATE_RULES = ("sqrt-nonzero", "torchao")    # how v is stored; the first is the default (module docstring)
MIN_QUANTIZED_NUMEL = 4096       # smaller tensors keep full-precision moments (bitsandbytes' rule)
_QMAPS: dict = {}                # (signed, device) -> the int8 map


def _qmap(signed: bool, device) -> torch.Tensor:
    key = (signed, torch.device(device))
    if key not in _QMAPS:
        _QMAPS[key] = dynamic_map(signed).to(device)
    return _QMAPS[key]


def quantize_state(x: torch.Tensor, fmt: str, signed: bool, block_size: int):
    """fp32 moment -> (codes shaped like x, scale (numel // block_size,) fp32) in ``fmt``."""
    if fmt == "fp8":
        return quantize_fp8_state(x, block_size)
    return quantize_int8_state(x, _qmap(signed, x.device), block_size)


def dequantize_state(codes: torch.Tensor, scale: torch.Tensor, fmt: str, signed: bool) -> torch.Tensor:
    """(codes, scale) in ``fmt`` -> fp32 shaped like codes."""
    if fmt == "fp8":
        return dequantize_fp8_state(codes, scale)
    return dequantize_int8_state(codes, scale, _qmap(signed, codes.device))


def quantize_second_moment(v: torch.Tensor, fmt: str, block_size: int, state_rule: str):
    """fp32 second moment (>= 0) -> (codes shaped like v, scale per block) under ``state_rule``: ``"torchao"``
    quantizes ``v``; ``"sqrt-nonzero"`` quantizes ``sqrt(v)`` and gives a positive value that rounded to 0 the
    smallest positive code."""
    if state_rule == "torchao":
        return quantize_state(v, fmt, False, block_size)
    root = v.sqrt()
    codes, scale = quantize_state(root, fmt, False, block_size)
    if fmt == "fp8":
        return nonzero_fp8_codes(codes, root), scale
    return nonzero_int8_codes(codes, root, _qmap(False, v.device)), scale


def dequantize_second_moment(codes: torch.Tensor, scale: torch.Tensor, fmt: str, state_rule: str) -> torch.Tensor:
    """(codes, scale) stored by ``quantize_second_moment`` -> fp32 ``v`` (squared back under "sqrt-nonzero")."""
    stored = dequantize_state(codes, scale, fmt, False)
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


class BlockQuantizedAdamW(torch.optim.Optimizer):
    """AdamW whose moments live blockwise-quantized (``fmt`` "fp8" as torchao's ``AdamWFp8``, "int8" as its
    ``AdamW8bit``) between steps; defaults are torchao's (weight_decay 1e-2, block_size 256) but for
    ``state_rule``: "sqrt-nonzero" (default) stores sqrt(v) and never 0 for a positive v, "torchao" is torchao's
    storage bit for bit, which can store v = 0 under a surviving m (module docstring)."""

    EXTRA_STATE_KEYS = ("state_rule",)        # read by core.checkpoint.check_optimizer_state_dict

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
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.fmt, self.block_size, self.state_rule = fmt, block_size, state_rule

    def quantizes(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments are stored quantized (else in ``p``'s dtype)."""
        return p.numel() >= MIN_QUANTIZED_NUMEL and p.numel() % self.block_size == 0

    def _init_state(self, p, st):
        st["step"] = torch.tensor(0.0)
        if not self.quantizes(p):
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            return
        zeros = torch.zeros_like(p, dtype=torch.float32)
        st["exp_avg"], st["exp_avg_scale"] = quantize_state(zeros, self.fmt, True, self.block_size)
        st["exp_avg_sq"], st["exp_avg_sq_scale"] = quantize_second_moment(zeros, self.fmt, self.block_size,
                                                                          self.state_rule)
        st["exp_avg_scale"].zero_()                       # torchao starts from zero scales
        st["exp_avg_sq_scale"].zero_()

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p``'s stored first and second moments, dequantized to FP32 (as the next step reads them)."""
        st = self.state[p]
        return self._read(st, "exp_avg"), self._read(st, "exp_avg_sq")

    def _read(self, st, key):
        if key + "_scale" not in st:
            return st[key].float()
        if key == "exp_avg":
            return dequantize_state(st[key], st[key + "_scale"], self.fmt, True)
        return dequantize_second_moment(st[key], st[key + "_scale"], self.fmt, self.state_rule)

    def _write(self, st, key, value):
        if key + "_scale" not in st:
            st[key].copy_(value)
        elif key == "exp_avg":
            st[key], st[key + "_scale"] = quantize_state(value, self.fmt, True, self.block_size)
        else:
            st[key], st[key + "_scale"] = quantize_second_moment(value, self.fmt, self.block_size, self.state_rule)

    @torch.no_grad()
    def step(self, closure=None):
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
                m, v = self._read(st, "exp_avg"), self._read(st, "exp_avg_sq")
                new_p, m, v = adamw_step(p, p.grad, st["step"], m, v, lr, beta1, beta2,
                                         group["weight_decay"], group["eps"])
                self._write(st, "exp_avg", m)
                self._write(st, "exp_avg_sq", v)
                p.copy_(new_p)                                              # to p's dtype, nearest
        return loss

    def state_dict(self):
        return {**super().state_dict(), "state_rule": self.state_rule}

    def state_dict_mismatch(self, state_dict) -> str | None:
        """Why ``state_dict`` cannot load here (its quantized codes are in another ``fmt``, read from their dtype, or
        its ``exp_avg_sq`` codes were stored under another ``state_rule``), or None. A state_dict without the
        ``state_rule`` key predates the option: it was stored as torchao's."""
        saved = state_dict.get("state_rule", "torchao")
        quantized = [st for st in state_dict.get("state", {}).values() if "exp_avg_sq_scale" in st]
        code_fmt = {torch.float8_e4m3fn: "fp8", torch.uint8: "int8"}
        stored = sorted({code_fmt.get(st["exp_avg"].dtype, str(st["exp_avg"].dtype)) for st in quantized})
        if stored and stored != [self.fmt]:     # the codes would be read in the wrong format
            return (f"the optimizer state holds {'/'.join(stored)} codes and this optimizer uses fmt={self.fmt!r}: "
                    f"build BlockQuantizedAdamW(..., fmt={stored[0]!r}) to load it")
        if quantized and saved != self.state_rule:
            return (f"the optimizer state was stored under state_rule={saved!r} and this optimizer uses "
                    f"{self.state_rule!r}: build BlockQuantizedAdamW(..., state_rule={saved!r}) to load it")
        return None

    def load_state_dict(self, state_dict):
        """torch's load casts floating state to the parameter's dtype (FP8 codes to FP32, scales to a BF16
        parameter's dtype); put back the tensors as stored, on the parameter's device. Refuses state stored in
        another ``fmt`` or under another ``state_rule`` (ValueError) before anything loads."""
        why = self.state_dict_mismatch(state_dict)
        if why is not None:
            raise ValueError(why)
        state_dict = {k: v for k, v in state_dict.items() if k != "state_rule"}
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for p, i in zip(group["params"], saved_group["params"]):
                for k, v in state_dict["state"].get(i, {}).items():
                    if torch.is_tensor(v) and k != "step":
                        self.state[p][k] = v.to(device=p.device, copy=True)
