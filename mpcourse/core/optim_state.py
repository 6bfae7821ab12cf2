"""Optimizer state stored in a low-precision dtype between steps (BF16 AdamW moments, as DeepSeek-V3).

DeepSeek-V3 (arXiv 2412.19437, section 3.3.3, "Low-Precision Storage"): the AdamW first and second
moments are stored in BF16 while the master weights and gradients stay FP32; they report no loss of
accuracy. That cuts Adam's state from 8 to 4 bytes per parameter.

``LowPrecisionState(optimizer_cls, state_dtype=torch.bfloat16)`` wraps any ``torch.optim`` optimizer
class: at each ``step()`` the state tensors shaped like their parameter are upcast exactly to the
parameter's dtype, the wrapped optimizer steps in that precision, and the new state is rounded back
to ``state_dtype`` (round to nearest even: torch's cast). Scalar entries (Adam's ``step``) are left alone.
"""
from __future__ import annotations

import torch

LOW_STATE_DTYPES = (torch.bfloat16, torch.float16)


def _cast_state(optimizer: torch.optim.Optimizer, to_param_dtype: bool, state_dtype: torch.dtype) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape and v.dim() > 0:
                    st[k] = v.to(p.dtype if to_param_dtype else state_dtype)


def LowPrecisionState(optimizer_cls, state_dtype: torch.dtype = torch.bfloat16):
    """A subclass of ``optimizer_cls`` whose per-parameter state lives in ``state_dtype`` between steps.

    Raises ValueError for a ``state_dtype`` other than bfloat16/float16, TypeError for a non-optimizer class.
    """
    if state_dtype not in LOW_STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {LOW_STATE_DTYPES}, got {state_dtype}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")

    class _Low(optimizer_cls):
        @torch.no_grad()
        def step(self, closure=None):
            _cast_state(self, True, state_dtype)          # (shape) bf16 -> param dtype, exact
            out = super().step(closure)
            _cast_state(self, False, state_dtype)         # (shape) -> bf16, nearest even
            return out

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)           # torch casts state to the param dtype
            _cast_state(self, False, state_dtype)

    _Low.__name__ = _Low.__qualname__ = f"{optimizer_cls.__name__}With{str(state_dtype).split('.')[-1].upper()}State"
    return _Low
