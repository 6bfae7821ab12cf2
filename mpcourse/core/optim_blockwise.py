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
5. quantize ``m`` (signed) and ``v`` (unsigned map for int8; FP8 stores it as it is) for the next step.

Which tensors are quantized (torchao following bitsandbytes): those with at least 4096 elements and a
``numel`` divisible by the block size; the others keep FP32-exact moments in the parameter's dtype.
The state is plain tensors (``exp_avg``, ``exp_avg_sq`` codes; ``exp_avg_scale``, ``exp_avg_sq_scale`` per
block; ``step`` an FP32 scalar), so ``state_dict``/``load_state_dict`` and ``mpcourse.experiment.memory`` see
what is stored; loading keeps each tensor's stored dtype (torch would cast FP8 codes to the parameter's dtype).
"""
from __future__ import annotations

import torch

from .optim_fp8 import dequantize_fp8_state, quantize_fp8_state
from .optim_int8 import dequantize_int8_state, dynamic_map, quantize_int8_state

FORMATS = ("fp8", "int8")
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
    ``AdamW8bit``) between steps; defaults are torchao's (weight_decay 1e-2, block_size 256)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 fmt: str = "fp8", block_size: int = 256):
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"need lr >= 0, eps >= 0 and 0 <= betas < 1, got lr={lr}, eps={eps}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.fmt, self.block_size = fmt, block_size

    def quantizes(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments are stored quantized (else in ``p``'s dtype)."""
        return p.numel() >= MIN_QUANTIZED_NUMEL and p.numel() % self.block_size == 0

    def _init_state(self, p, st):
        st["step"] = torch.tensor(0.0)
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if self.quantizes(p):
                st[key], st[key + "_scale"] = quantize_state(torch.zeros_like(p, dtype=torch.float32),
                                                             self.fmt, signed, self.block_size)
                st[key + "_scale"].zero_()                # torchao starts from zero scales
            else:
                st[key] = torch.zeros_like(p)

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p``'s stored first and second moments, dequantized to FP32 (as the next step reads them)."""
        st = self.state[p]
        return self._read(p, st, "exp_avg", True), self._read(p, st, "exp_avg_sq", False)

    def _read(self, p, st, key, signed):
        if key + "_scale" in st:
            return dequantize_state(st[key], st[key + "_scale"], self.fmt, signed)
        return st[key].float()

    def _write(self, st, key, signed, value):
        if key + "_scale" in st:
            st[key], st[key + "_scale"] = quantize_state(value, self.fmt, signed, self.block_size)
        else:
            st[key].copy_(value)

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
                m, v = self._read(p, st, "exp_avg", True), self._read(p, st, "exp_avg_sq", False)
                new_p, m, v = adamw_step(p, p.grad, st["step"], m, v, lr, beta1, beta2,
                                         group["weight_decay"], group["eps"])
                self._write(st, "exp_avg", True, m)
                self._write(st, "exp_avg_sq", False, v)
                p.copy_(new_p)                                              # to p's dtype, nearest
        return loss

    def load_state_dict(self, state_dict):
        """torch's load casts floating state to the parameter's dtype (FP8 codes to FP32, scales to a BF16
        parameter's dtype); put back the tensors as stored, on the parameter's device."""
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for p, i in zip(group["params"], saved_group["params"]):
                for k, v in state_dict["state"].get(i, {}).items():
                    if torch.is_tensor(v) and k != "step":
                        self.state[p][k] = v.to(device=p.device, copy=True)
