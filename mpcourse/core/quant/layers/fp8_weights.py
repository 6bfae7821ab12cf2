"""FP8 weights with an FP32 master: a linear layer that holds its weight only in FP8 (E4M3 data + scale).

Transformer Engine's design, re-derived here (sources, read not copied):

* ``transformer_engine.pytorch.quantized_model_init`` (TE 2.x; ``fp8_model_init`` in TE 1.x) creates the weights
  of TE's modules as FP8 tensors (data + ``scale_inv``); the module keeps no high-precision weight. Its
  ``preserve_high_precision_init_val=True`` keeps the initial high-precision values aside so that the master
  copy can start from them rather than from the FP8-rounded weight.
* ``te.optimizers.FusedAdam(master_weights=True)`` (``transformer_engine/pytorch/optimizers/fused_adam.py``)
  keeps an FP32 master per parameter in its state, initialised from the parameter as it is (for an FP8
  parameter: its dequantized value). For an FP8 parameter its step kernel (``multi_tensor_adam.cu``, the
  master-weights functor with an FP8 parameter type) updates the FP32 master, writes the FP8 data as
  ``cast(master * scale)`` with the scale the parameter's quantizer holds (delayed scaling: the scale from
  the amax history), writes ``scale_inv`` and records ``amax(master)`` for the next scale update.

Here, per layer::

    layer.weight            (N, K) float8_e4m3fn  nn.Parameter, requires_grad=False   1 B per element
    layer.weight_scale_inv  ()     float32        buffer (the FP8 weight's 1 / scale)  4 B per layer
    layer.master_weight     (N, K) float32        nn.Parameter held by the optimizer, *not* by the module
                                                  (not in parameters() or state_dict()); backward writes its grad

One training step::

    forward    y  = x8 @ w8^T       x quantized as in QuantizedLinear; w8 is the stored weight, never re-quantized
    backward   dx = dy8 @ w8        the stored weight again
               dW = dy8^T @ x8      written in FP32 to master_weight.grad (the weight gradient flows to the master)
    optimizer  AdamW steps master_weight (and the model's FP32 parameters)
    cast       cast_master_to_weight_(): w8 := quantize(master) with the layer's weight quantizer, in place

The cast uses the layer's own weight quantizer, so the recipe decides the scale: under ``DelayedScaling`` it
quantizes with the weight state's current scale, records ``amax(master)`` and updates the state (outside an FP8
region: at once, ``region.schedule_update``), which is what ``QuantizedLinear``'s forward does to its FP32 weight
one forward later. Hence, with the master started from the FP32 initial weights (``master_init="fp32"``), the
FP8 weight every forward and backward uses is bit for bit the one ``QuantizedLinear`` would quantize from its FP32
weight, and training is bit-identical; only where the bytes live differs. ``master_init="fp8"`` starts the
master from the dequantized FP8 weight, as FusedAdam does without the preserved initial values: the master is
then rounded to E4M3 once, at the start, and training differs slightly.

Loading: ``load_state_dict`` into a layer with a master refreshes that master from the loaded FP8 weight
(dequantized, exact in FP32), so the next ``cast_master_to_weight_`` starts from the loaded weight instead of casting
the stale master over it. The master's low bits are not in the module's state: to resume a run exactly, load the
recipe's checkpoint, whose masters are copied in after the model (``mpcourse.experiment.recipes.fp8_weights``).

Per-tensor recipes only (``DelayedScaling``, ``CurrentScaling``): the finer-grained recipes quantize the weight
along each GEMM's contraction dimension (two differently blocked copies), so one stored copy cannot serve.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .gemm import fp8_gemm
from .linear import QuantizedLinear, _FP8LinearFunction
from ..rules.tensor import Float8Tensor, fp8_dtype

MASTER_INITS = ("fp32", "fp8")     # the master starts from the FP32 initial weight / from the FP8 weight


class _StoredWeightFunction(_FP8LinearFunction):
    """y = x @ W^T (+ b) with the layer's stored FP8 weight; the backward (inherited) gives ``master`` the dW."""

    @staticmethod
    def forward(ctx, x, master, bias, layer, out_dtype, record):
        # x: (M, K) fp32/bf16/fp16; master: (N, K) fp32 or None (no weight gradient); bias: (N,) or None
        x8 = layer._quantize("input", x, record)  # (M, K) E4M3, row-major
        w8 = layer.fp8_weight()  # (N, K) E4M3 as stored: no cast of the weight here
        y = fp8_gemm(x8, w8.t(), out_dtype, pad_inner_dim=layer.pad_inner_dim, use_fast_accum=True,
                     backend=layer.quantizers["input"].backend)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # The weight's data is a parameter (saved: version-checked at backward); its scale_inv is layer state that
        # changes only together with the data, so the backward reads it from ctx instead of saving a copy.
        ctx.save_for_backward(x8.data, x8.scale_inv, w8.data)
        ctx.w_scale_inv = w8.scale_inv
        ctx.layer = layer
        ctx.dtypes = (x.dtype, torch.float32 if master is None else master.dtype,
                      None if bias is None else bias.dtype)
        return y


class Float8WeightLinear(QuantizedLinear):
    """A ``QuantizedLinear`` whose weight is stored only in FP8; its FP32 master lives in the optimizer.

    Build it with ``from_float8_linear`` (or ``convert_to_fp8_weights`` for a whole model), not directly.
    ``master_weight`` is the (N, K) FP32 parameter the weight gradient is written to (None: no weight
    gradient, e.g. a model loaded for evaluation); ``bind_master`` sets it. After each optimizer step call
    ``cast_master_to_weight_()``. ``load_state_dict`` refreshes the bound master from the loaded weight (the module
    docstring says why). Casting the module's dtype (``model.float()``, ``model.to(torch.bfloat16)``)
    raises TypeError: the FP8 weight would lose its scale.
    """

    master_weight: nn.Parameter | None = None

    @classmethod
    def from_float8_linear(cls, layer: QuantizedLinear, master_init: str = "fp32"
                           ) -> tuple["Float8WeightLinear", nn.Parameter]:
        """(the new layer, its FP32 master). The layer's bias, recipe and scaling state carry over; the master
        starts from the layer's weight (``master_init="fp32"``) or from its FP8 cast (``"fp8"``)."""
        if type(layer) is not QuantizedLinear:
            raise TypeError(f"from_float8_linear takes a QuantizedLinear (convert_to_float8_training first), "
                            f"got {type(layer).__name__}")
        if master_init not in MASTER_INITS:
            raise ValueError(f"master_init must be one of {MASTER_INITS}, got {master_init!r}")
        if not layer.quantizers["weight"].per_tensor:
            raise ValueError(f"FP8 weights need a per-tensor recipe (DelayedScaling or CurrentScaling), got "
                             f"{type(layer.recipe).__name__}: it re-quantizes the weight along each GEMM's "
                             "contraction dimension, so one stored FP8 copy cannot serve both GEMMs")
        if not layer.weight.is_floating_point() or layer.weight.dtype.itemsize < 2:
            raise TypeError(f"the layer's weight must be FP32, BF16 or FP16, got {layer.weight.dtype}")
        with torch.device("meta"):  # no second high-precision weight is ever allocated
            new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, recipe=layer.recipe,
                      pad_inner_dim=layer.pad_inner_dim)
        device = layer.weight.device
        new.bias = layer.bias
        new.quantizers, new.scaling_state = layer.quantizers, layer.scaling_state      # the scaling state goes on
        dtype = fp8_dtype(layer.quantizers["weight"].fmt)
        new.weight = nn.Parameter(torch.zeros(layer.weight.shape, dtype=dtype, device=device), requires_grad=False)
        new.register_buffer("weight_scale_inv", torch.ones((), dtype=torch.float32, device=device))
        master = nn.Parameter(layer.weight.detach().to(torch.float32, copy=True))     # (N, K) fp32
        new.bind_master(master)
        new.cast_master_to_weight_()        # the initial cast: records the weight's amax, as a first forward would
        if master_init == "fp8":
            with torch.no_grad():
                master.copy_(new.fp8_weight().dequantize(torch.float32))
        new.train(layer.training)
        return new, master

    def bind_master(self, master: nn.Parameter | None) -> None:
        """Set the FP32 master the weight gradient goes to (kept out of the module's parameters)."""
        if master is not None and (not isinstance(master, torch.Tensor) or master.dtype != torch.float32
                                   or master.shape != self.weight.shape or master.device != self.weight.device):
            got = (f"{master.dtype} {tuple(master.shape)} on {master.device}" if isinstance(master, torch.Tensor)
                   else type(master).__name__)
            raise ValueError(f"the master must be a float32 tensor of the weight's shape {tuple(self.weight.shape)} "
                             f"on {self.weight.device}, got {got}")
        self.__dict__["master_weight"] = master                     # not nn.Module.__setattr__: no registration

    def fp8_weight(self) -> Float8Tensor:
        """The stored weight: (N, K) E4M3 data and its () FP32 scale_inv (views of the module's state, no copy)."""
        return Float8Tensor(self.weight, self.weight_scale_inv)

    @torch.no_grad()
    def cast_master_to_weight_(self) -> None:
        """weight := quantize(master) with this layer's weight quantizer (recording its amax), in place."""
        if self.master_weight is None:
            raise RuntimeError("this Float8WeightLinear has no master weight to cast: bind_master(master) first")
        w8 = self._quantize("weight", self.master_weight, True)       # (N, K) E4M3, () fp32
        self.weight.copy_(w8.data)
        self.weight_scale_inv.copy_(w8.scale_inv)

    def _fp8_forward(self, x2d, out_dtype):
        if not self.quantizers["input"].per_tensor:
            raise ValueError("Float8WeightLinear computes with per-tensor recipes only")
        return _StoredWeightFunction.apply(x2d, self.master_weight, self.bias, self, out_dtype, torch.is_grad_enabled())

    def _high_precision(self, x, dtype):
        # The dequantized FP8 weight (what the layer holds); its gradient goes straight through to the master.
        m = self.master_weight
        source = m if m is not None and m.requires_grad and torch.is_grad_enabled() else None
        w = Float8Tensor(self.weight, self.weight_scale_inv, torch.float32, source=source).dequantize(dtype)
        return nn.functional.linear(x.to(dtype), w, None if self.bias is None else self.bias.to(dtype))

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(0, dtype=self.weight.dtype, device=self.weight.device))
        if probe.dtype != self.weight.dtype:
            raise TypeError(f"{type(self).__name__} stores its weight in {self.weight.dtype} with a scale; casting "
                            f"the module to {probe.dtype} would drop the scale. Cast the model before "
                            "convert_to_fp8_weights, or train the FP32 master instead")
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w, s = state_dict.get(prefix + "weight"), state_dict.get(prefix + "weight_scale_inv")
        if w is not None and w.dtype != self.weight.dtype:
            error_msgs.append(f"{prefix}weight: the checkpoint holds a {w.dtype} weight, this layer stores "
                              f"{self.weight.dtype} with a scale: load a high-precision checkpoint before "
                              "convert_to_fp8_weights (or into the masters)")
            return
        if s is not None and not (torch.isfinite(s).all() and (s > 0).all()):
            error_msgs.append(f"{prefix}weight_scale_inv must be finite and > 0, got {s}")
            return
        errors_before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        loaded = w is not None or s is not None
        if loaded and len(error_msgs) == errors_before and self.master_weight is not None:
            self._refresh_master_from_weight()

    @torch.no_grad()
    def _refresh_master_from_weight(self) -> None:
        """master := the stored FP8 weight, dequantized (FP32, exact): after a load, the master is the loaded
        weight, so the next ``cast_master_to_weight_`` starts from it instead of casting a stale master over it."""
        self.master_weight.copy_(self.fp8_weight().dequantize(torch.float32))      # (N, K) fp32


def convert_to_fp8_weights(model: nn.Module, *, master_init: str = "fp32") -> dict[str, nn.Parameter]:
    """Swap every ``QuantizedLinear`` in ``model`` (in place) for a ``Float8WeightLinear`` storing its weight in FP8.

    Returns ``{fqn: master}``: the FP32 masters, in the order of ``model.named_modules()``, for the optimizer to
    step in place of the FP8 weights (then ``cast_master_to_weight_()`` on each layer after every step).
    Raises ValueError if ``model`` has no ``QuantizedLinear`` (run ``convert_to_float8_training`` first) or is one.
    """
    if isinstance(model, QuantizedLinear):
        raise ValueError("cannot convert a bare QuantizedLinear in place: use Float8WeightLinear.from_float8_linear, "
                         "or wrap the layer in a parent module")
    masters: dict[str, nn.Parameter] = {}
    swapped: dict[int, Float8WeightLinear] = {}

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            fqn = f"{prefix}.{name}" if prefix else name
            if id(child) in swapped:                                  # a layer shared by several parents
                setattr(parent, name, swapped[id(child)])
            elif type(child) is QuantizedLinear:
                swapped[id(child)], masters[fqn] = Float8WeightLinear.from_float8_linear(child, master_init)
                setattr(parent, name, swapped[id(child)])
            elif child is not None:
                visit(child, fqn)

    visit(model, "")
    if not masters:
        raise ValueError("the model has no QuantizedLinear layer to store in FP8: run convert_to_float8_training first")
    return masters
