"""The quantized linear layer, ``QuantizedLinear`` (``Float8Linear``, torchao's name, is the same class): its three
GEMMs run in the format of its quantization recipe (per-tensor FP8 through ``torch._scaled_mm``; rowwise, 1x128 /
128x128 blocks, MXFP8 and NVFP4 through the block-scaled GEMMs).

For y = x @ W^T + b with x (M, K), W (N, K), the layer quantizes three tensors, each with its own
per-tensor scale (Transformer Engine ``te.Linear``; torchao ``torchao/float8/float8_linear.py``):

    forward GEMM         y  = x  @ W^T     x: E4M3, W: E4M3                 -> (M, N) out dtype
    input-gradient GEMM  dx = dy @ W       dy: E5M2 under HYBRID (E4M3 under Format.E4M3)
    weight-gradient GEMM dW = dy^T @ x     reuses the FP8 x and dy          -> (N, K) weight dtype

Scales come from the recipe, through one quantizer per role ("input", "weight", "grad_output") that the
engine builds from the recipe (``engine.quantizers(...)``; the layer never asks which recipe it holds), and the
GEMMs' CPU functions from what the engine bound with them (each quantizer's ``backend``: rules or kernels):
``DelayedScaling``'s keep a ``DelayedScalingState`` (scale, amax_history) each and use scales from earlier
steps (see ``recipe.py`` and, for when they update, ``region.py``); ``CurrentScaling``'s compute each scale
from the tensor itself. The finer-grained recipes (``block_recipes.py``: rowwise, 1x128/128x128, MXFP8,
NVFP4) build quantizers that re-quantize along each GEMM's contraction dimension, and the layer runs
``block_linear.BlockScaledLinearFunction`` for them (a quantizer's ``per_tensor`` says which function).
The bias is added after the GEMM in the output dtype (TE fuses it into the GEMM epilogue, a single
rounding; here a BF16 output is rounded twice), and its gradient is summed in FP32.

The output dtype is the autocast dtype inside a ``torch.autocast`` or ``mpcourse.core.autocast``
region, else the input's dtype
(float32, bfloat16 or float16). The input gradient has the input's dtype, the weight gradient the
weight's dtype.

Checkpoints. The delayed-scaling states are saved in the module's extra state
(``state_dict()['..._extra_state']``, as TE does), in FP32 whatever ``model.to(dtype)`` does to the
parameters, so a checkpoint resumes bit for bit. The extra state is one float32 tensor of shape
(3, 1 + amax_history_len), a row per role (input, weight, grad_output): ``[scale, *amax_history]``
((0, 1) under ``CurrentScaling``, which keeps no state). Being a plain tensor, a converted model's
``state_dict`` saves with ``safetensors`` as well as ``torch.save`` (TE serialises its extra state into a
byte tensor for the same reason). Loading checks every scale is finite and > 0 before changing anything
(a checkpoint is refused at load time, on any device). A checkpoint of the model *before* conversion
loads into the converted model, ``strict=True`` included: its layers then start their FP8 state fresh
(scale 1, empty history), as a newly converted model does.

Inputs. Any shape (..., in_features) that ``nn.Linear`` takes, transposed or non-contiguous ones too
(they are made contiguous first, one copy), empty batches and zero features; a wrong feature size or device
raises ValueError naming the fix. An empty input (an expert that received no token, an empty micro-batch) is
computed exactly: in high precision where the recipe keeps no state, and under delayed scaling through the FP8
path, whose quantizers record the amax of nothing, 0 (as in one process: each forward and backward records
and updates whatever its data). So a rank with no rows still enters the amax all-reduces the other ranks enter
(``region``), and its scales and histories are those of one process on the union of the ranks' rows (the
MAX with 0 changes no amax). Skipping it would leave that rank out of a collective: the others wait until the
timeout (pytorch/ao PR #933: a rank left out of the amax all-reduce; experts with zero tokens hung torchtitan,
PR #1166), or, worse, pair it with the rank's next collective and go on with wrong amaxes. Transformer Engine
asks every module to run on every rank for the same reason.
A meta input gives a meta output of the right shape and dtype (nothing is recorded).

``convert_to_float8_training(model, module_filter_fn=..., recipe=...)`` swaps ``nn.Linear`` modules
for ``QuantizedLinear`` in place, as torchao's function of that name does (``float8_linear_utils.py``);
torchao's ``config=Float8LinearConfig(...)`` keyword works too (the fields of torchao's
``torchao/float8/config.py`` this layer supports).
Not supported: activation checkpointing (the recomputed forward would record amaxes twice).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...autocast import any_autocast_enabled, autocast_dtype_in_effect, no_autocast
from ..region import get_fp8_recipe, is_fp8_enabled
from .gemm import fp8_gemm, fp8_linear_backward_gemms
from .block_linear import BlockScaledLinearFunction, check_backward_shapes
from ..block_recipes import backward_operand
from ..engine import quantizers
from .module_filter import check_filter
from ..recipe import CurrentScaling, DelayedScaling, Recipe, recipe_names
from ..rules.tensor import Float8Tensor
from ...checkpoint import extra_state_missing

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class _FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T (+ b) with FP8 forward, input-gradient and weight-gradient GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, out_dtype, record):
        # x: (M, K) fp32/bf16/fp16; weight: (N, K); bias: (N,) or None
        x8 = layer._quantize("input", x, record)  # (M, K) E4M3, row-major
        w8 = layer._quantize("weight", weight, record)  # (N, K) E4M3, row-major
        # Forward GEMM. _scaled_mm wants A (M, K) row-major: x8 as it is. B (K, N) column-major:
        # w8.t() is a view of the row-major (N, K) storage, which *is* (K, N) column-major: no copy.
        y = fp8_gemm(x8, w8.t(), out_dtype, pad_inner_dim=layer.pad_inner_dim, use_fast_accum=True,
                     backend=layer.quantizers["input"].backend)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # Save the FP8 copies (1 byte per element), not x and W: the backward GEMMs consume FP8 anyway.
        ctx.save_for_backward(x8.data, x8.scale_inv, w8.data, w8.scale_inv)
        ctx.layer = layer
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: (M, N) out dtype
        x_data, x_scale_inv, w_data, *w_saved = ctx.saved_tensors
        # A stored FP8 weight (fp8_weights.Float8WeightLinear) hands its scale_inv over as state, not a saved tensor.
        w_scale_inv = w_saved[0] if w_saved else ctx.w_scale_inv
        layer, (x_dtype, w_dtype, b_dtype) = ctx.layer, ctx.dtypes
        pad = layer.pad_inner_dim
        g8 = layer._quantize("grad_output", grad_y.contiguous(), True)  # (M, N) E5M2 under HYBRID, row-major
        # Input-gradient GEMM dx = dy @ W and weight-gradient GEMM dW = dy^T @ x, reusing the forward's FP8 x and W.
        dx, dw = fp8_linear_backward_gemms(g8, Float8Tensor(w_data, w_scale_inv), Float8Tensor(x_data, x_scale_inv),
                                           x_dtype, w_dtype, need_dx=ctx.needs_input_grad[0],
                                           need_dw=ctx.needs_input_grad[1], pad_inner_dim=pad,
                                           backend=layer.quantizers["grad_output"].backend)
        db = None
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = grad_y.float().sum(0).to(b_dtype)  # (N,) summed in fp32
        return dx, dw, db, None, None, None


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run quantized under its recipe: FP8 (E4M3 / E5M2 with per-tensor scales) via
    ``torch._scaled_mm``, or a finer-grained recipe's blocks (``Float8Linear`` is the same class, torchao's name).

    Args (besides nn.Linear's in_features, out_features, bias, device, dtype):
      recipe: ``DelayedScaling`` (default ``DelayedScaling()``: HYBRID, history 1024, "max", margin 0,
              TE's default), ``CurrentScaling`` or a finer-grained recipe (``BLOCK_RECIPES``).
      pad_inner_dim: zero-pad GEMM dimensions to multiples of 16 (needed on CUDA when in_features,
              out_features or the number of tokens is not a multiple of 16; exact). Without it such
              shapes raise ValueError on CUDA. CPUs take any shape.
    Input (..., in_features) float32/bfloat16/float16 -> output (..., out_features) (see module doc).
      (A learner's functions in place of the library's ride in the recipe: ``recipe.with_functions(...)``.)
    ``quantizers``: {role: quantizer} built by ``engine.quantizers``; ``scaling_state``: {role: DelayedScalingState} of
    those that keep one (empty for the other recipes).
    Raises RuntimeError on a GPU without FP8 tensor cores (compute capability < 8.9).
    """

    #: True: every GEMM in high precision (``_high_precision``, the input's dtype), exactly as an ``nn.Linear`` that
    #: ``module_filter_fn`` kept out, FP8 region or not; set on one layer by ``mpcourse.core.autoswitch``
    high_precision = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe=None, pad_inner_dim: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        recipe = DelayedScaling() if recipe is None else recipe
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be one of {recipe_names()}, got {recipe!r}")
        self.recipe = recipe            # with the learner's functions, if any (``recipe.functions``, checked once)
        self.pad_inner_dim = pad_inner_dim
        self._reset_scaling_state()

    def _reset_scaling_state(self) -> None:
        # One quantizer per role, built by the engine; delayed scaling's hold their state.
        key = f"QuantizedLinear({self.in_features}, {self.out_features})"
        self.quantizers = quantizers(self.recipe, key, self.weight.device)
        self.scaling_state = {role: q.state for role, q in self.quantizers.items() if q.state is not None}

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe=None, pad_inner_dim: bool = False) -> "QuantizedLinear":
        """A QuantizedLinear sharing ``linear``'s weight and bias Parameters (optimizers and ties keep working)."""
        with torch.device("meta"):  # build without allocating or initialising a second weight
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      recipe=recipe, pad_inner_dim=pad_inner_dim)
        new.weight, new.bias = linear.weight, linear.bias
        new._reset_scaling_state()  # now on the weight's device
        new.train(linear.training)
        return new

    def _quantize(self, role: str, x: torch.Tensor, record: bool) -> Float8Tensor:
        """Quantize one role's tensor per tensor with this layer's quantizer; delayed scaling records the amax
        if ``record``. A weight FSDP2 all-gathered in FP8 (``fsdp_fp8.GatheredFloat8Weight``) is already that copy."""
        if role == "weight" and hasattr(x, "fp8_all_gathered"):
            return x.fp8_all_gathered()                  # cast on each rank's shard with the whole weight's scale
        return self.quantizers[role](x, record)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype not in HIGH_PRECISION:
            raise TypeError(f"QuantizedLinear takes float32/bfloat16/float16 inputs, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantizedLinear(in_features={self.in_features}) takes inputs of shape "
                             f"(..., {self.in_features}), got {tuple(x.shape)}: reshape the input or build the "
                             "layer with the input's last dimension as in_features")
        if x.device != self.weight.device:
            raise ValueError(f"input on {x.device} but the layer's weight on {self.weight.device}: move one of "
                             f"them, e.g. x.to({str(self.weight.device)!r}) or layer.to({str(x.device)!r})")

    def _high_precision(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self.high_precision or not is_fp8_enabled():  # switched high, or fp8_autocast(enabled=False)
            return self._high_precision(x, x.dtype)
        region_recipe = get_fp8_recipe()
        if region_recipe is not None and region_recipe != self.recipe:
            raise ValueError(f"the FP8 region's recipe {region_recipe} differs from this layer's {self.recipe}: "
                             "pass the recipe given to convert_to_float8_training (or fp8_recipe=None)")
        device = x.device.type
        if device == "meta":  # shapes only: the FP8 path's output shape and dtype, nothing recorded
            return self._high_precision(x, x.dtype)
        out_dtype = autocast_dtype_in_effect(device) or x.dtype  # torch's or mpcourse's autocast
        if (x.numel() == 0 or self.out_features == 0) and not self.scaling_state:
            # Nothing to quantize (an empty batch, zero features) and no state to update: the exact result is
            # empty or the bias. Delayed scaling goes on below: its amaxes (0 for an empty tensor) take part.
            return self._high_precision(x, out_dtype)
        # (M, K), M = all leading dims; _scaled_mm needs a row-major A, so a transposed input is copied once.
        x2d = x.reshape(math.prod(x.shape[:-1]), self.in_features).contiguous()
        # with no autocast on nothing is cast: no region, whose Python mode would see each of the quantizers' ops
        region = no_autocast(device) if any_autocast_enabled(device) else contextlib.nullcontext()
        with region:
            y = self._fp8_forward(x2d, out_dtype)     # (M, N) out_dtype
        return y.reshape(*x.shape[:-1], self.out_features)

    def _fp8_forward(self, x2d: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The FP8 GEMM path for a (M, K) row-major input (``fp8_weights.Float8WeightLinear`` replaces it)."""
        if self.quantizers["input"].per_tensor:       # one FP8 copy per tensor, reused by the backward GEMMs
            return _FP8LinearFunction.apply(x2d, self.weight, self.bias, self, out_dtype, torch.is_grad_enabled())
        # copies re-quantized along each GEMM's contraction dimension; a shape the backward cannot take is refused now
        grad = torch.is_grad_enabled()
        check_backward_shapes(self.recipe, x2d.shape, self.out_features,
                              (grad and x2d.requires_grad, grad and self.weight.requires_grad))
        return BlockScaledLinearFunction.apply(x2d, self.weight, self.bias, self.quantizers, out_dtype,
                                               backward_operand(self.recipe))

    # -- checkpointing: scales and amax histories live in the extra state, one FP32 tensor -------------
    def get_extra_state(self) -> torch.Tensor:
        """(n_roles, 1 + amax_history_len) float32: row i is ``[scale, *amax_history]`` of ``ROLES[i]``."""
        if not self.scaling_state:  # CurrentScaling: no state
            return torch.zeros(0, 1, dtype=torch.float32, device=self.weight.device)
        return torch.stack([torch.cat([s.scale.reshape(1), s.amax_history]) for s in self.scaling_state.values()])

    def set_extra_state(self, state) -> None:
        if not self.scaling_state:
            return  # CurrentScaling keeps no state: a delayed-scaling checkpoint's scales are not needed
        if isinstance(state, dict):  # the earlier format: {"recipe": str, role: {"scale", "amax_history"}}
            missing = [role for role in self.scaling_state if role not in state]
            if missing:
                raise ValueError(f"checkpoint has no delayed-scaling state for {missing} (it was saved with "
                                 f"{state.get('recipe')}): convert the model with the checkpoint's recipe")
            rows = {role: state[role] for role in self.scaling_state}
        else:
            state = torch.as_tensor(state)
            if state.dim() != 2 or state.shape[0] != len(self.scaling_state):
                raise ValueError(f"checkpoint has no delayed-scaling state for this layer (its FP8 state has shape "
                                 f"{tuple(state.shape)}; it was saved with another recipe, e.g. CurrentScaling): "
                                 "convert the model with the checkpoint's recipe")
            rows = {role: {"scale": row[0], "amax_history": row[1:]} for role, row in zip(self.scaling_state, state)}
        for role, row in rows.items():  # check everything before changing anything
            self.scaling_state[role].check_state_dict(row, role)
        for role, row in rows.items():
            self.scaling_state[role].load_state_dict(row)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """As ``nn.Module``'s, but a checkpoint without FP8 state (saved before conversion) starts it fresh."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if extra_state_missing(state_dict, prefix, missing_keys):
            self._reset_scaling_state()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for s in self.scaling_state.values():  # follow the weight's device, stay FP32
            s.to(self.weight.device)
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


#: torchao's and the lessons' name for the layer (it carries every quantized recipe: FP8, MXFP8, NVFP4)
Float8Linear = QuantizedLinear


@dataclass(frozen=True)
class Float8LinearConfig:
    """torchao's ``Float8LinearConfig`` (``torchao/float8/config.py``), the fields this library supports.

    torchao's default recipe is tensorwise dynamic scaling (our ``CurrentScaling`` with ``Format.HYBRID``),
    so a config alone means that recipe.

    Fields (torchao's names and defaults):
      pad_inner_dim: bool = False              pad the GEMMs' inner dimensions to multiples of 16
      round_scales_to_power_of_2: bool = False round every scale down to a power of two
                                               (``CurrentScaling(use_power_2_scales=True)``)
    """

    pad_inner_dim: bool = False
    round_scales_to_power_of_2: bool = False

    def recipe(self) -> CurrentScaling:
        """The recipe this config means: current per-tensor scaling, power-of-two scales if asked."""
        return CurrentScaling(use_power_2_scales=self.round_scales_to_power_of_2)


def _resolve_config(config, recipe, pad_inner_dim):
    """(recipe, pad_inner_dim) from torchao's ``config`` and/or our ``recipe``/``pad_inner_dim`` keywords."""
    if config is None:
        return recipe, bool(pad_inner_dim)
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"config must be mpcourse.core.quant.Float8LinearConfig, got {type(config).__name__}")
    if pad_inner_dim is not None and bool(pad_inner_dim) != config.pad_inner_dim:
        raise ValueError(f"pad_inner_dim={pad_inner_dim} contradicts config.pad_inner_dim={config.pad_inner_dim}: "
                         "give it in one place")
    if recipe is None:
        return config.recipe(), config.pad_inner_dim
    if config.round_scales_to_power_of_2 and not (isinstance(recipe, CurrentScaling) and recipe.use_power_2_scales):
        raise ValueError(f"config.round_scales_to_power_of_2=True needs CurrentScaling(use_power_2_scales=True), "
                         f"got recipe={recipe}: drop the recipe or make it agree")
    return recipe, config.pad_inner_dim


def convert_to_float8_training(module: nn.Module, *,
                               module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                               config: Optional[Float8LinearConfig] = None,
                               recipe=None, pad_inner_dim: Optional[bool] = None) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` for a ``QuantizedLinear`` (torchao's function of this name).

    Args:
      module: the model; changed in place (a bare ``nn.Linear`` is returned converted instead; one with
              child modules raises ValueError, as torchao's function refuses it).
      module_filter_fn: ``fn(linear, fqn) -> bool``; only linears for which it returns True are swapped
              (fqn is the dotted name, e.g. "blocks.0.mlp.fc"; "" for the root). Keep the output head
              out, e.g. ``lambda m, fqn: fqn != "lm_head"``.
      config: torchao's spelling, a ``Float8LinearConfig``: without ``recipe`` it means current scaling
              (torchao's tensorwise default) and sets ``pad_inner_dim``.
      recipe: ``DelayedScaling`` (default without config) or ``CurrentScaling``, shared by all swapped layers;
              a learner's functions ride in it (``recipe.with_functions({"quantize": quantize})``).
      pad_inner_dim: passed to every ``QuantizedLinear`` (default False, or the config's).
    Returns the converted module. A linear shared by several parents is swapped once, for all of them;
    its weight and bias Parameters are kept, so an existing optimizer still updates them.
    Raises TypeError for a config of another type, ValueError where config and keywords disagree, ValueError
    where ``module_filter_fn`` names a module the model lacks (``module_filter.check_filter``, run once before
    any layer is swapped, so a refused filter leaves the model as it was).
    """
    recipe, pad_inner_dim = _resolve_config(config, recipe, pad_inner_dim)
    check_filter(module_filter_fn, module)

    def wanted(m: nn.Module, fqn: str) -> bool:
        return (isinstance(m, nn.Linear) and not isinstance(m, QuantizedLinear)
                and (module_filter_fn is None or module_filter_fn(m, fqn)))

    if wanted(module, ""):
        if len(module._modules) > 0:  # torchao refuses this too: the children would be dropped
            raise ValueError(f"cannot convert a root nn.Linear that has child modules ({list(module._modules)}): "
                             "its children would be lost. Convert the children separately, or wrap the layer in a "
                             "parent module (e.g. nn.Sequential) and keep it out with module_filter_fn")
        return QuantizedLinear.from_float(module, recipe=recipe, pad_inner_dim=pad_inner_dim)
    swapped: dict[int, nn.Module] = {}  # id(old linear) -> its replacement (shared modules)
    slots: list[tuple[nn.Module, str, int]] = []   # (parent, name, id(old linear)): set only once all are built

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):  # not named_children(): it hides aliases
            fqn = f"{prefix}.{name}" if prefix else name
            if id(child) in swapped:
                slots.append((parent, name, id(child)))
            elif wanted(child, fqn):
                swapped[id(child)] = QuantizedLinear.from_float(child, recipe=recipe, pad_inner_dim=pad_inner_dim)
                slots.append((parent, name, id(child)))
            else:
                visit(child, fqn)

    visit(module, "")           # a filter or a layer that raises here leaves the model as it was
    for parent, name, key in slots:
        setattr(parent, name, swapped[key])
    return module
