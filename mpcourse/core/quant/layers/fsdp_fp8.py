"""FP8 all-gather of ``QuantizedLinear`` weights under FSDP2: each rank casts its shard, the ranks gather bytes.

Without it FSDP2 all-gathers a block's FP32 weights (4 bytes per element) and each ``QuantizedLinear`` then casts
the whole weight to E4M3 with current scaling. With it, each rank casts *its shard* to E4M3 before the
all-gather and the ranks exchange 1 byte per element plus one FP32 scale. The rule
(``quantize_shard_for_all_gather``)::

    amax  = max|shard|                      this rank's rows
    amax  = all_reduce(amax, MAX)           the whole weight's amax, the same on every rank
    scale = compute_scale(amax, 448)        the layer's current-scaling rule (power-of-two if the recipe says so)
    data  = e4m3(shard * scale)             elementwise, so it equals the rows of e4m3(weight * scale)

Since MAX is exact and the cast is elementwise, the gathered E4M3 weight and its scale are bit for bit those of
casting the gathered FP32 weight: the GEMMs, hence the losses, do not change; only the bytes on the wire do.

This is torchao's ``enable_fsdp_float8_all_gather`` (``torchao/float8/fsdp_utils.py``: its weight wrapper's
``fsdp_pre_all_gather`` casts the shard with a MAX-all-reduced amax, ``fsdp_post_all_gather`` wraps the gathered
bytes and the scale in a tensor its ``QuantizedLinear`` consumes as the ready FP8 weight).

Uneven shards (``padded_shard_rows``, ``pad_rows``). FSDP2 shards dim 0 as ``torch.chunk`` does: the first ranks
hold ceil(rows / N) rows, the last ones fewer, or none when the weight has fewer rows than ranks (128 rows on 3
ranks: 43, 43, 42; 2 rows on 3 ranks: 1, 1, 0). Its all-gather needs inputs of one size, so it keeps every FP32
shard padded with zero rows to ceil(rows / N) (``_fsdp_param.py``: the padded sharded size is
``chunks[0].size()``) and, for a parameter whose local tensor has the two hooks, requires
``fsdp_pre_all_gather`` to return inputs of that padded size itself (its ``all_gather_inputs`` checks it on the
short ranks; the 5-argument signature passes ``outer_size``, the unsharded shape, for this). So each rank pads
its E4M3 rows with zero bytes to ceil(rows / N), and ``fsdp_post_all_gather`` keeps the first ``rows`` of the
N * ceil(rows / N) gathered ones: the short ranks are the last ones, so the padding is the gathered tail. An
empty shard contributes amax 0 to the MAX (an amax is >= 0, so it changes nothing) and casts to an empty shard.
Here the course departs from torchao 0.18: its weight wrapper's ``fsdp_pre_all_gather(mesh)`` keeps the
1-argument signature, which FSDP2 does not check, and returns the unpadded shard, so its FP8 all-gather assumes
rows divisible by the world size. No option keeps that: on even shards both send the same bytes, and on uneven
ones the unpadded shard cannot be gathered.

How FSDP2 is extended (torch.distributed.fsdp ``fully_shard`` docs; the contract is in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): when the local tensor of a sharded parameter has the
methods ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata)`` and
``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (unsharded, inner_tensors)``, FSDP2
gathers the tensors the first returns instead of the shard, and makes the unsharded parameter from what the
second returns (from the second all-gather on, it passes ``out=``, the unsharded parameter of the first, whose
inner tensors it refilled in place). So two small tensor subclasses:

* ``FP8AllGatherWeight``: the FP32 weight (then its shard), a wrapper that behaves as its FP32 tensor for every
  op (the optimizer steps it) and carries the two hooks;
* ``GatheredFloat8Weight``: the unsharded parameter, FP32 to autograd, holding the gathered E4M3 data and the
  scale; ``QuantizedLinear`` takes its ``fp8_all_gathered()`` as the weight's FP8 copy instead of casting again. Any other op
  on it sees the dequantized weight.

gloo has no FP8 dtype: the shard's E4M3 data travel as a ``uint8`` view (same bytes; FSDP2 gathers a block of
mixed dtypes as ``uint8`` anyway). Only current per-tensor scaling is supported: delayed scaling would cast
with last step's scale and record the shard's amax, which is another rule (``enable_fp8_all_gather`` refuses it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ...distributed import all_reduce_max_
from ..recipe import CurrentScaling
from ..rules.tensor import Float8Tensor, apply_amax_epsilon, compute_amax, compute_scale, fp8_max, to_float8


def quantize_shard_for_all_gather(shard: torch.Tensor, fp8_format, *, use_power_2_scales: bool = False,
                                  amax_epsilon: float = 0.0, group=None) -> Float8Tensor:
    """This rank's ``shard`` of a weight cast to FP8 with the scale of the *whole* weight (current scaling).

    shard: (rows, K) float32, this rank's rows; collective over ``group`` (every rank calls it, in the same order).
    Returns a ``Float8Tensor``: data (rows, K) in ``fp8_format``, scale_inv () float32, the same on every rank.
    """
    amax = compute_amax(shard).reshape(1)          # (1,) fp32, max|shard|
    all_reduce_max_(amax, group)                   # (1,) the whole weight's amax (MAX is exact)
    amax = apply_amax_epsilon(amax[0], amax_epsilon)
    scale = compute_scale(amax, fp8_max(fp8_format), 0, None, use_power_2_scales)   # () fp32
    return to_float8(shard, fp8_format, scale)     # elementwise: the rows of to_float8(weight, ., scale)


def padded_shard_rows(rows: int, world: int) -> int:
    """The rows of every rank's all-gather input when FSDP2 shards ``rows`` rows over ``world`` ranks: ceil(rows /
    world), the first (largest) ``torch.chunk`` (``_fsdp_param.py``'s padded sharded size, dim 0)."""
    return -(-rows // world)


def pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``data`` (r, ...) with zero rows appended up to (rows, ...); ``data`` itself when r == rows."""
    if data.shape[0] == rows:
        return data
    if data.shape[0] > rows:
        raise ValueError(f"a shard of {data.shape[0]} rows cannot be padded to {rows}")
    out = data.new_zeros((rows, *data.shape[1:]))
    out[: data.shape[0]] = data
    return out


#: ops whose result is still the wrapped weight (views, copies, FSDP2's sharding ops): torchao's list
_KEEP_WRAPPED = {torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
                 torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
                 torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
                 torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def _wrapper(cls, t: torch.Tensor, dtype: torch.dtype):
    return torch.Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                               dtype=dtype, layout=t.layout, device=t.device,
                                               requires_grad=t.requires_grad)


class FP8AllGatherWeight(torch.Tensor):
    """An FP32 weight (``_tensor``) whose FSDP2 all-gather sends FP8: ``quantize_shard_for_all_gather`` with the
    layer's weight quantizer (``layer``: its ``QuantizedLinear``, for the recipe and the bound amax/scale/cast)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, layer):
        return _wrapper(cls, tensor, tensor.dtype)

    def __init__(self, tensor: torch.Tensor, layer):
        self._tensor, self._layer = tensor, layer

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        layer = next(a._layer for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, layer), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"layer": self._layer}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"], meta["layer"])

    def __repr__(self):
        return f"FP8AllGatherWeight({self._tensor!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """((uint8 view of this shard's FP8 data, padded with zero rows to ``padded_shard_rows``),), metadata
        (its scale_inv, FP8 dtype, the unsharded rows ``outer_size[0]``). Collective over ``mesh``'s group."""
        q = self._layer.quantizers["weight"]           # the layer's bound amax, scale and cast
        amax = q.amax(self._tensor).reshape(1)         # (1,) fp32, this shard
        all_reduce_max_(amax, mesh.get_group())        # the whole weight's amax
        amax = apply_amax_epsilon(amax[0], q.recipe.amax_epsilon)
        w8 = q.cast(self._tensor, q.fmt, q.scale(amax, fp8_max(q.fmt)))
        rows = outer_size[0]
        data = pad_rows(w8.data.view(torch.uint8), padded_shard_rows(rows, mesh.size()))   # (ceil(rows/N), K)
        record = getattr(self._layer, "all_gather_record", None)
        if record is not None:
            record.append(data.numel())                # FP8 elements this rank sends, padding included
        return (data,), (w8.scale_inv, w8.data.dtype, rows)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale_inv, dtype, rows) = outputs, metadata   # data: (N * ceil(rows/N), K) uint8, padded
        if out is not None:                               # FSDP2 refilled out's data in place: the new scale
            out._scale_inv = scale_inv
            return None
        # the weight: the first ``rows`` rows (the padding is the tail); FSDP2 frees and reallocates the whole buffer
        return GatheredFloat8Weight(data[:rows], dtype, scale_inv, param_dtype), (data,)


class GatheredFloat8Weight(torch.Tensor):
    """The all-gathered weight: E4M3 bits (``_data``, uint8) and ``_scale_inv``; to autograd a ``param_dtype``
    tensor. ``fp8_all_gathered()`` is the ``Float8Tensor`` the FP8 GEMMs take; other ops see ``dequantize()``."""

    @staticmethod
    def __new__(cls, data, fp8_dtype_, scale_inv, param_dtype):
        return _wrapper(cls, data, param_dtype)

    def __init__(self, data, fp8_dtype_, scale_inv, param_dtype):
        self._data, self._fp8_dtype, self._scale_inv, self._param_dtype = data, fp8_dtype_, scale_inv, param_dtype

    def fp8_all_gathered(self) -> Float8Tensor:
        return Float8Tensor(self._data.view(self._fp8_dtype), self._scale_inv, self._param_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.fp8_all_gathered().dequantize()

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func in (torch.ops.aten.as_strided.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                    torch.ops.aten.view.default):
            t = args[0]                                   # FSDP2's as_strided to the same shape, nn.Parameter's detach
            return cls(func(t._data, *args[1:], **(kwargs or {})), t._fp8_dtype, t._scale_inv, t._param_dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self):
        return f"GatheredFloat8Weight(shape={tuple(self.shape)}, {self._fp8_dtype}, scale_inv={self._scale_inv})"


def fp8_all_gather_recipes_error(recipe) -> Optional[str]:
    """Why ``recipe`` cannot gather its weights in FP8, or None (current per-tensor scaling can)."""
    if isinstance(recipe, CurrentScaling):
        return None
    return (f"the FP8 all-gather takes current per-tensor scaling (CurrentScaling), not {type(recipe).__name__}: "
            "its scale comes from the whole weight at each all-gather")


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Make every ``QuantizedLinear`` weight of ``model`` gather in FP8 under FSDP2 (call before ``fully_shard``).

    Returns the number of weights wrapped. Raises ValueError for a layer whose recipe is not current scaling.
    """
    from .linear import QuantizedLinear

    n = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            why = fp8_all_gather_recipes_error(m.recipe)
            if why:
                raise ValueError(f"{name}: {why}")
            w = m.weight
            m.weight = nn.Parameter(FP8AllGatherWeight(w.data, m), requires_grad=w.requires_grad)
            n += 1
    return n


__all__ = ["quantize_shard_for_all_gather", "padded_shard_rows", "pad_rows", "FP8AllGatherWeight",
           "GatheredFloat8Weight", "enable_fp8_all_gather",
           "fp8_all_gather_recipes_error"]
