"""Checks for functions handed to the library in place of its own (a learner's ``round_to_bf16``, ...).

Several library pieces take, as an optional keyword, one function per concept with the signature of the
lesson that builds it (``DynamicLossScaler(update_scale=...)``, ``BF16Optimizer(stochastic_round_bf16=...)``,
``MasterWeights(round_to_model=...)``, the FP8 recipes' ``compute_scale_fn`` / ``quantize_fn`` / ``update_fn``,
the block recipes' ``block_quantize_fn`` / ``mx_shared_exponent_fn`` / ``nvfp4_scales_fn``, the loss scalers'
``all_reduce_found_inf_``). The library calls the rule it is given and checks what comes back
with these helpers, so that a wrong return value stops with one line naming the function and the fix
instead of spreading NaNs or shape errors through the training step. Without such a function the
library runs its own (fused where torch has a kernel).
"""
from __future__ import annotations

import torch


class SeamError(TypeError):
    """A function given in place of the library's returned something the library cannot use."""


def check_rounded(name: str, x: torch.Tensor, out, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (from ``name(x)``) as a tensor of ``dtype``: it must be a tensor of x's shape holding values of
    ``dtype`` (in that dtype or in float32). Raises ``SeamError`` naming ``name`` otherwise."""
    if not isinstance(out, torch.Tensor):
        raise SeamError(f"{name} returned {type(out).__name__}, expected a tensor")
    if out.shape != x.shape:
        raise SeamError(f"{name} returned shape {tuple(out.shape)} for input shape {tuple(x.shape)}")
    if out.dtype not in (dtype, torch.float32):
        raise SeamError(f"{name} returned dtype {out.dtype}, expected {dtype} or torch.float32")
    low = out.to(dtype)
    if out.dtype == torch.float32:
        same = (low.float() == out) | out.isnan()
        if not bool(same.all()):
            bad = out[~same].flatten()[0].item()
            raise SeamError(f"{name} returned {bad!r}, which is not a {str(dtype).replace('torch.', '')} value")
    return low


def _tensor(name: str, out, what: str, shape, dtypes) -> torch.Tensor:
    """``out`` if it is a tensor of ``shape`` with a dtype in ``dtypes``; ``SeamError`` naming ``name`` otherwise."""
    if not isinstance(out, torch.Tensor):
        raise SeamError(f"{name} returned {type(out).__name__} for {what}, expected a tensor")
    if tuple(out.shape) != tuple(shape):
        raise SeamError(f"{name} returned {what} of shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise SeamError(f"{name} returned {what} of dtype {out.dtype}, expected {want}")
    return out


def _pair(name: str, out, what: str) -> tuple:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise SeamError(f"{name} returned {type(out).__name__}, expected a tuple {what}")
    return tuple(out)


def check_scale(name: str, amax: torch.Tensor, out, what: str = "the scale") -> torch.Tensor:
    """``out`` (from e.g. ``compute_scale(amax, ...)``) as float32 of amax's shape, every element finite and > 0."""
    out = _tensor(name, out, what, amax.shape, (torch.float32,))
    ok = torch.isfinite(out) & (out > 0)
    if not bool(ok.all()):
        bad = out[~ok].flatten()[0].item()
        raise SeamError(f"{name} returned {what} {bad!r}: an FP8 scale must be finite and > 0 (amax 0, inf or "
                        "NaN keeps a usable scale; an overflowing one is capped at the largest float32)")
    return out


def check_fp8(name: str, x: torch.Tensor, out, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (from e.g. ``quantize(x, ...)``) as FP8 ``dtype`` of x's shape, NaN only where x is NaN."""
    out = _tensor(name, out, "the FP8 data", x.shape, (dtype,))
    if bool((out.float().isnan() & ~x.isnan()).any()):
        raise SeamError(f"{name} returned NaN for a finite input: clamp to [-fp8_max, fp8_max] before the cast")
    return out


def check_delayed_update(name: str, history: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``update(history, scale, amax, ...)``) as (history (L,) float32, scale () float32 finite > 0)."""
    new_history, new_scale = _pair(name, out, "(new_history, new_scale)")
    new_history = _tensor(name, new_history, "the history", history.shape, (torch.float32,))
    return new_history, check_scale(name, torch.zeros(()), new_scale)


def check_block_scaled(name: str, x: torch.Tensor, block: tuple[int, int], out, dtype: torch.dtype,
                       scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``block_quantize(x, block)``) as (data ``dtype`` x's shape, scale_inv ``scale_dtype`` per
    block, finite and > 0)."""
    data, scale_inv = _pair(name, out, "(data, scale_inv)")
    (M, K), (r, c) = x.shape, block
    data = check_fp8(name, x, data, dtype)
    scale_inv = _tensor(name, scale_inv, "scale_inv", (M // r, K // c), (scale_dtype,))
    return data, check_scale(name, scale_inv.float(), scale_inv.float(), "scale_inv").to(scale_dtype)


def check_exponents(name: str, amax: torch.Tensor, out) -> torch.Tensor:
    """``out`` (from ``mx_shared_exponent(amax, elem)``) as int64 of amax's shape within E8M0's [-127, 127]."""
    ints = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    out = _tensor(name, out, "the exponents", amax.shape, ints).long()
    if bool(((out < -127) | (out > 127)).any()):
        raise SeamError(f"{name} returned an exponent outside [-127, 127]: clamp k to E8M0's range")
    return out


def check_nvfp4_scales(name: str, x: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``nvfp4_scales(x)``) as (t () float32 finite >= 0, s (M, K/16) float8_e4m3fn, no NaN)."""
    t, s = _pair(name, out, "(t, s)")
    t = _tensor(name, t, "t", (), (torch.float32,))
    if not (bool(torch.isfinite(t)) and float(t) >= 0):
        raise SeamError(f"{name} returned t = {float(t)!r}: the tensor scale amax / (448 * 6) is finite and >= 0")
    M, K = x.shape
    s = _tensor(name, s, "s", (M, K // 16), (torch.float8_e4m3fn,))
    if bool(s.float().isnan().any()):
        raise SeamError(f"{name} returned NaN block scales: clamp amax_block / 6 / t to [2**-6, 448] before the cast")
    return t, s


def check_found_inf(name: str, out) -> torch.Tensor:
    """``out`` (from ``all_reduce_found_inf_(flag, group)``) as float32 () holding 0.0 or 1.0: each rank's flag is
    0 or 1, so their MAX is too (a SUM counts the ranks that overflowed)."""
    out = _tensor(name, out, "the flag", (), (torch.float32,))
    value = float(out)
    if value not in (0.0, 1.0):
        raise SeamError(f"{name} returned {value!r}: every rank's flag is 0 or 1, so the MAX over the ranks is "
                        "too (a SUM counts the ranks that overflowed): all-reduce with dist.ReduceOp.MAX")
    return out
