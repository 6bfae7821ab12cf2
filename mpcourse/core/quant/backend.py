"""The one backend choice: every step a quantizer or a quantized GEMM runs, as one object, chosen once and passed.

A ``Backend`` names each step (``backend.amax``, ``backend.cast``, ``backend.scaled_mm``, ...) and holds, for all of
them, either the library's rules (``RULES``: the plain functions of ``rules/`` the lessons teach) or the kernels that
equal them bit for bit (``KERNELS``: the modules of ``kernels/``, which hand CPU tensors to the compiled passes where
numba runs, each kernel named after its rule). ``choose(kernels=None)`` is where the choice is made: ``kernels`` if a
caller gives it, else the library's switch (``mpcourse.core.kernels_switch``: ``MPCOURSE_FUSED=0`` binds the rules
everywhere, read once at import; ``kernels_switch.flags(...)`` for a block). The engine passes the chosen object to
every quantizer it builds (``quantizer.backend``) and the layers hand their quantizers' to the GEMMs, as MiniTorch
chooses one ``TensorBackend`` and passes it.

    step                  rule                            kernel
    amax                  tensor.compute_amax             per_tensor.compute_amax
    cast                  tensor.to_float8                per_tensor.to_float8
    scaled_mm             tensor.scaled_mm                upcast.cpu_scaled_mm        the per-tensor FP8 GEMM on a CPU
    fp8_to_float32        tensor.fp8_to_float32           upcast.fp8_to_float32       its upcast (the backward GEMMs')
    quantize_fp32_scaled  blockwise.quantize_fp32_scaled  blocks.quantize_fp32_scaled
    quantize_mx           mx.quantize_mx                  blocks.quantize_mx
    block_amax            scaled.block_amax               blocks.block_amax
    encode_mx             mx.encode_mx                    blocks.encode_mx_exponents
    quantize_nvfp4        nvfp4.quantize_nvfp4            nvfp4_quant.quantize_nvfp4
    encode_nvfp4          nvfp4.encode_nvfp4              nvfp4_quant.encode_nvfp4
    rht                   hadamard.rht                    nvfp4_quant.rht
    dequantize            ScaledTensor.dequantize         upcast.dequantize           the block-scaled GEMM's emulation

Both give the same bits (``tests/core/quant/kernels/``); only the speed differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .. import kernels_switch
from .kernels import blocks, nvfp4_quant, per_tensor, upcast
from .rules import blockwise, hadamard, mx, nvfp4, scaled, tensor
from .rules.scaled import ScaledTensor


@dataclass(frozen=True)
class Backend:
    """Every step of the quantizers and the quantized GEMMs, each by its name (see the module docstring)."""

    kernels: bool                     # True: the kernels; False: the rules
    amax: Callable                    # x -> amax () fp32
    cast: Callable                    # (x, fp8_format, scale) -> Float8Tensor
    scaled_mm: Callable               # (a, b, scale_a, scale_b, out_dtype) -> (M, N): torch._scaled_mm on a CPU
    fp8_to_float32: Callable          # (data, scale=None) -> float32
    quantize_fp32_scaled: Callable    # (x, block, elem, ...) -> ScaledTensor, FP32 scales
    quantize_mx: Callable             # (x, block, elem, scale_rule) -> ScaledTensor, E8M0 scales
    block_amax: Callable              # (x, block) -> (M/r, K/c) fp32
    encode_mx: Callable               # (x, block, elem, amax, exponents) -> ScaledTensor
    quantize_nvfp4: Callable          # (x, block, rounding=...) -> ScaledTensor, E2M1 with two scale levels
    encode_nvfp4: Callable            # (x, block, t, s, rounding, generator) -> ScaledTensor
    rht: Callable                     # (x, seed) -> x times NVFP4's random Hadamard transform
    dequantize: Callable              # (ScaledTensor, dtype) -> tensor

    def __repr__(self) -> str:
        return f"Backend({'kernels' if self.kernels else 'rules'})"


RULES = Backend(kernels=False, amax=tensor.compute_amax, cast=tensor.to_float8, scaled_mm=tensor.scaled_mm,
                fp8_to_float32=tensor.fp8_to_float32, quantize_fp32_scaled=blockwise.quantize_fp32_scaled,
                quantize_mx=mx.quantize_mx, block_amax=scaled.block_amax, encode_mx=mx.encode_mx,
                quantize_nvfp4=nvfp4.quantize_nvfp4, encode_nvfp4=nvfp4.encode_nvfp4, rht=hadamard.rht,
                dequantize=ScaledTensor.dequantize)
KERNELS = Backend(kernels=True, amax=per_tensor.compute_amax, cast=per_tensor.to_float8,
                  scaled_mm=upcast.cpu_scaled_mm, fp8_to_float32=upcast.fp8_to_float32,
                  quantize_fp32_scaled=blocks.quantize_fp32_scaled, quantize_mx=blocks.quantize_mx,
                  block_amax=blocks.block_amax, encode_mx=blocks.encode_mx_exponents,
                  quantize_nvfp4=nvfp4_quant.quantize_nvfp4, encode_nvfp4=nvfp4_quant.encode_nvfp4,
                  rht=nvfp4_quant.rht, dequantize=upcast.dequantize)


def choose(kernels: Optional[bool] = None) -> Backend:
    """The backend a quantizer or a GEMM built now takes: ``KERNELS`` or ``RULES``, as ``kernels`` says (None:
    the library's switch, ``kernels_switch.enabled()``). The one place the choice is made."""
    return KERNELS if kernels_switch.enabled(kernels) else RULES
