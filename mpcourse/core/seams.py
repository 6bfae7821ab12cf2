"""The run-time checks on what a learner's function returned (``round_to_bf16``, ``update_scale``, ...).

Several library pieces take, as an optional keyword, one function per concept with the signature of the
lesson that builds it (``DynamicLossScaler(update_scale=...)``, ``BF16Optimizer(stochastic_round_bf16=...)``,
``MasterWeights(round_to_model=..., make_master=...)``, ``MasterWeights.step_with(master_step)``, the loss
scalers' ``unscale_grads_=`` and ``all_reduce_found_inf_``, ``fp16-static``'s ``choose_loss_scale``, a quantization
recipe's ``functions={"compute_scale": ..., "quantize": ..., "update": ..., "block_quantize": ...,
"mx_shared_exponent": ..., "nvfp4_scales": ..., "pad_token_groups": ..., "group_scales": ...}``, the course autocast's ``cast_args`` / ``cached_cast``).
The library calls the rule it is given and checks what comes back with one ``returned_*`` function here, so
that a wrong return value stops with one line naming the function and the fix (``SeamError``) instead of
spreading NaNs or shape errors through the training step. Without such a function the library runs its own
(fused where torch has a kernel).

Which check belongs to which function is one column of the table of the exercises' functions
(``mpcourse.core.learner_table``); the library reaches these checks through it
(``learner_table.returned(name, ...)``). Each takes the function's name first (for the message), then what
it was called with and what it returned, and gives back the value in the form the library uses. (The graders
of ``mpcourse.course.grading``, ``check_<function>``, are another idea: they grade a learner's function in a
notebook's check cell against an oracle.)
"""
from __future__ import annotations

import math

import torch


class SeamError(TypeError):
    """A function given in place of the library's returned something the library cannot use."""


def returned_rounded(name: str, x: torch.Tensor, out, dtype: torch.dtype) -> torch.Tensor:
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


def returned_flag(name: str, out) -> bool:
    """``out`` (from ``name(...)``, a yes/no answer such as found_inf) as a bool: a bool, or a one-element bool or
    0/1 tensor. Raises ``SeamError`` naming ``name`` otherwise (None: a forgotten ``return``)."""
    if isinstance(out, torch.Tensor) and out.numel() == 1 and (out.dtype == torch.bool or bool((out == 0) | (out == 1))):
        return bool(out)
    if isinstance(out, bool) or type(out).__name__ == "bool_":            # Python or NumPy bool
        return bool(out)
    raise SeamError(f"{name} returned {out!r}, expected True or False")


def returned_loss_scale(name: str, out) -> float:
    """``out`` (from ``name(...)``, a loss scale) as a float: a positive finite number. ``SeamError`` otherwise."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not (math.isfinite(out) and out > 0):
        raise SeamError(f"{name} returned {out!r}, expected a positive finite loss scale")
    return float(out)


def returned_masters(name: str, params: list, out) -> list:
    """``out`` (from ``name(params)``, FP32 master copies) as a list: one float32 leaf tensor per param, same shape,
    equal values, requires_grad, sharing no memory with it. ``SeamError`` naming ``name`` and the index otherwise."""
    if not isinstance(out, (list, tuple)) or len(out) != len(params):
        got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
        raise SeamError(f"{name} returned {got}, expected a list of {len(params)} tensors (one per parameter)")
    for i, (p, m) in enumerate(zip(params, out)):
        where = f"{name} returned, for parameter {i} of shape {tuple(p.shape)},"
        if not isinstance(m, torch.Tensor):
            raise SeamError(f"{where} a {type(m).__name__}, expected a tensor")
        if m.dtype != torch.float32 or m.shape != p.shape:
            raise SeamError(f"{where} {m.dtype} of shape {tuple(m.shape)}, expected torch.float32 of its shape")
        if not (m.is_leaf and m.requires_grad):
            raise SeamError(f"{where} a tensor that is not a leaf with requires_grad=True (use .detach() then "
                            ".requires_grad_(True))")
        if m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            raise SeamError(f"{where} a tensor sharing memory with the parameter (copy it)")
        if not torch.equal(m.detach(), p.detach().float()):
            raise SeamError(f"{where} values that differ from the parameter's (a master starts as an exact copy)")
    return list(out)


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


def returned_scale(name: str, amax: torch.Tensor, out, what: str = "the scale") -> torch.Tensor:
    """``out`` (from e.g. ``compute_scale(amax, ...)``) as float32 of amax's shape, every element finite and > 0."""
    out = _tensor(name, out, what, amax.shape, (torch.float32,))
    ok = torch.isfinite(out) & (out > 0)
    if not bool(ok.all()):
        bad = out[~ok].flatten()[0].item()
        raise SeamError(f"{name} returned {what} {bad!r}: an FP8 scale must be finite and > 0 (amax 0, inf or "
                        "NaN keeps a usable scale; an overflowing one is capped at the largest float32)")
    return out


def returned_fp8(name: str, x: torch.Tensor, out, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (from e.g. ``quantize(x, ...)``) as FP8 ``dtype`` of x's shape, NaN only where x is NaN."""
    out = _tensor(name, out, "the FP8 data", x.shape, (dtype,))
    if bool((out.float().isnan() & ~x.isnan()).any()):
        raise SeamError(f"{name} returned NaN for a finite input: clamp to [-fp8_max, fp8_max] before the cast")
    return out


def returned_delayed_update(name: str, history: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``update(history, scale, amax, ...)``) as (history (L,) float32, scale () float32 finite > 0)."""
    new_history, new_scale = _pair(name, out, "(new_history, new_scale)")
    new_history = _tensor(name, new_history, "the history", history.shape, (torch.float32,))
    return new_history, returned_scale(name, torch.zeros(()), new_scale)


def returned_block_scaled(name: str, x: torch.Tensor, block: tuple[int, int], out, dtype: torch.dtype,
                       scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``block_quantize(x, block)``) as (data ``dtype`` x's shape, scale_inv ``scale_dtype`` per
    block, finite and > 0)."""
    data, scale_inv = _pair(name, out, "(data, scale_inv)")
    (M, K), (r, c) = x.shape, block
    data = returned_fp8(name, x, data, dtype)
    scale_inv = _tensor(name, scale_inv, "scale_inv", (M // r, K // c), (scale_dtype,))
    return data, returned_scale(name, scale_inv.float(), scale_inv.float(), "scale_inv").to(scale_dtype)


def returned_exponents(name: str, amax: torch.Tensor, out) -> torch.Tensor:
    """``out`` (from ``mx_shared_exponent(amax, elem)``) as int64 of amax's shape within E8M0's [-127, 127]."""
    ints = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    out = _tensor(name, out, "the exponents", amax.shape, ints).long()
    if bool(((out < -127) | (out > 127)).any()):
        raise SeamError(f"{name} returned an exponent outside [-127, 127]: clamp k to E8M0's range")
    return out


def returned_nvfp4_scales(name: str, x: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
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


def returned_found_inf(name: str, out) -> torch.Tensor:
    """``out`` (from ``all_reduce_found_inf_(flag, group)``) as float32 () holding 0.0 or 1.0: each rank's flag is
    0 or 1, so their MAX is too (a SUM counts the ranks that overflowed)."""
    out = _tensor(name, out, "the flag", (), (torch.float32,))
    value = float(out)
    if value not in (0.0, 1.0):
        raise SeamError(f"{name} returned {value!r}: every rank's flag is 0 or 1, so the MAX over the ranks is "
                        "too (a SUM counts the ranks that overflowed): all-reduce with dist.ReduceOp.MAX")
    return out


def returned_cast_args(name: str, args: tuple, out, dtypes) -> tuple:
    """``out`` (from ``cast_args(op, args, device_type, dtype)``, lesson 05) as a tuple like ``args``: the same
    length; each non-tensor argument returned as it was; each tensor of the same shape, in its own dtype or one
    of ``dtypes`` (the region's dtype, float32), holding exactly ``arg.to(that dtype)``; lists element by element."""
    if not isinstance(out, (tuple, list)) or len(out) != len(args):
        got = type(out).__name__ + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise SeamError(f"{name} returned {got}, expected a tuple of the {len(args)} arguments")
    for i, (a, o) in enumerate(zip(args, out)):
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            returned_cast_args(name, tuple(a), o, dtypes)
        elif isinstance(a, torch.Tensor):
            o = _tensor(name, o, f"argument {i}", a.shape, (a.dtype, *dtypes))
            if o is a:
                continue
            with torch.no_grad():
                want = a.to(o.dtype)
            if not bool(((o.detach() == want) | (o.isnan() & want.isnan())).all()):
                raise SeamError(f"{name} changed the values of argument {i}: return arg.to(dtype), not other values")
        elif o is not a and o != a:
            raise SeamError(f"{name} changed argument {i} ({a!r} -> {o!r}): leave non-tensor arguments as they are")
    return tuple(out)


def returned_cast(name: str, t: torch.Tensor, out, to_type: torch.dtype) -> torch.Tensor:
    """``out`` (from ``cached_cast(cache, t, to_type)``, lesson 05): a tensor of t's shape and ``to_type`` equal to
    ``t.to(to_type)`` of t's *current* value (a stale cast is refused), with autograd history where grad mode is
    on and ``t`` requires grad."""
    out = _tensor(name, out, "the cast", t.shape, (to_type,))
    with torch.no_grad():
        fresh = t.to(to_type)
    if not bool(((out.detach() == fresh) | (out.isnan() & fresh.isnan())).all()):
        raise SeamError(f"{name} returned a cast of another value than the tensor's current one (a stale cast: "
                        "reuse a cached cast only while t._version is the one recorded with it)")
    if torch.is_grad_enabled() and t.requires_grad and out.grad_fn is None:
        raise SeamError(f"{name} returned a cast without autograd history, so no gradient reaches the weight: "
                        "make cacheable casts under torch.enable_grad()")
    return out


def returned_update_scale(name: str, out) -> tuple[float, int]:
    """``out`` (from ``update_scale(scale, growth_tracker, found_inf, ...)``, lesson 04) as (new_scale, new_tracker):
    a tuple of a positive finite number and an int >= 0 (one-element tensors are read as their value)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise SeamError(f"{name} returned {type(out).__name__}, expected a tuple (new_scale, new_growth_tracker)")
    new_scale, new_tracker = (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in out)
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)) \
            or not (math.isfinite(new_scale) and new_scale > 0):
        raise SeamError(f"{name} returned scale {new_scale!r}, expected a positive finite number")
    if isinstance(new_tracker, bool) or not isinstance(new_tracker, int) or new_tracker < 0:
        raise SeamError(f"{name} returned growth_tracker {new_tracker!r}, expected an int >= 0")
    return new_scale, new_tracker


def returned_kahan_add(name: str, w: torch.Tensor, comp: torch.Tensor, like: torch.Tensor, out) -> None:
    """After ``kahan_add_(w, comp, update)`` (lesson 06), which updates ``w`` and ``comp`` in place: ``out`` is None
    (or ``w``), and ``w`` and ``comp`` are still bfloat16 of ``like``'s shape."""
    if out is not None and out is not w:
        raise SeamError(f"{name} returned {type(out).__name__}: it should update w and comp in place and return None")
    if w.dtype != torch.bfloat16 or comp.dtype != torch.bfloat16 or w.shape != like.shape:
        raise SeamError(f"{name} changed the dtype or shape of w or comp: update them in place")


def returned_master_step(name: str, params: list, before: list, out) -> None:
    """After ``master_step(model_params, master_params, optimizer, loss_scale)`` (lesson 02), which writes the
    rounded masters into the model in place: every model parameter keeps its (dtype, shape) of ``before``."""
    for i, (p, (dtype, shape)) in enumerate(zip(params, before)):
        if (p.dtype, p.shape) != (dtype, shape):
            raise SeamError(f"{name} turned model parameter {i} into {p.dtype} of shape {tuple(p.shape)} "
                            f"(was {dtype}, {tuple(shape)}): write the rounded master with p.copy_(master)")


def returned_mask(name: str, w: torch.Tensor, out) -> torch.Tensor:
    """``out`` (from ``name(w, ...)``, a per-element yes/no answer such as ``is_update_lost``) as a bool tensor: it
    must be a bool tensor of w's shape. Raises ``SeamError`` naming ``name`` otherwise."""
    if not isinstance(out, torch.Tensor):
        raise SeamError(f"{name} returned {type(out).__name__}, expected a bool tensor of shape {tuple(w.shape)}")
    if out.shape != w.shape:
        raise SeamError(f"{name} returned shape {tuple(out.shape)} for weights of shape {tuple(w.shape)}")
    if out.dtype != torch.bool:
        raise SeamError(f"{name} returned dtype {out.dtype}, expected torch.bool (a comparison, e.g. a == b)")
    return out


def returned_padded_groups(name: str, x: torch.Tensor, padded_offs: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (from ``pad_token_groups(x, counts, alignment)``) as (padded (rows, K) in x's dtype, padded_offs (E,)
    int32), its group ends those of the library's ``padded_offs`` (rows = their last, 0 for no expert)."""
    padded, offs = _pair(name, out, "(padded, padded_offs)")
    rows = int(padded_offs[-1]) if padded_offs.numel() else 0
    padded = _tensor(name, padded, "the padded tokens", (rows, *x.shape[1:]), (x.dtype,))
    offs = _tensor(name, offs, "the group ends", padded_offs.shape, (torch.int32, torch.int64))
    if not torch.equal(offs.int(), padded_offs.int()):
        raise SeamError(f"{name} returned group ends {offs.tolist()}, expected {padded_offs.tolist()}: each group "
                        "is rounded up to a multiple of the alignment, then the ends are their running sum")
    return padded, offs.int()


def returned_unpadded_groups(name: str, y: torch.Tensor, num_tokens: int, out) -> torch.Tensor:
    """``out`` (from ``unpad_token_groups(y, counts, alignment)``): (num_tokens, N) in y's dtype."""
    return _tensor(name, out, "the real rows", (num_tokens, *y.shape[1:]), (y.dtype,))


def returned_group_scales(name: str, t: torch.Tensor, offs: torch.Tensor, out) -> torch.Tensor:
    """``out`` (from ``group_scales(t, offs)``) as float32 (E, C), every scale finite and > 0."""
    like = torch.empty(offs.shape[0], t.shape[1], dtype=torch.float32)
    return returned_scale(name, like, out, "a group scale")
