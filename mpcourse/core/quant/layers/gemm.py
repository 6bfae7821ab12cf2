"""One FP8 GEMM through ``torch._scaled_mm``, with the rules that function imposes checked up front.

``torch._scaled_mm(A, B, scale_a, scale_b, out_dtype)`` computes ``(A * scale_a) @ (B * scale_b)``
with FP8 operands and one rounding to ``out_dtype`` (FP32 accumulation on CPUs, and on GPUs with
``use_fast_accum=False``; with ``use_fast_accum=True`` Hopper's FP8 tensor cores keep only about 14 bits of the
running sum, DeepSeek-V3 report arXiv 2412.19437 section 3.3.2, modelled by ``block_gemm.accumulator_model_gemm``);
the scales are the
*dequantization* (inverse) scales, float32 tensors of one element (per-tensor scaling).
Its rules (PyTorch ``aten/src/ATen/native/cuda/Blas.cpp``; torchao ``float8/float8_ops.py``):

* CUDA: compute capability 8.9+ (Ada, Hopper, Blackwell: FP8 tensor cores); A row-major,
  B column-major; ``A.size(1)``, ``B.size(0)``, ``B.size(1)`` divisible by 16; not both operands E5M2.
* CPU (measured on torch 2.13): any shape, any layout, also E5M2 x E5M2, out_dtype float32, bfloat16,
  float16 (or FP8). It upcasts both operands to FP32, multiplies by the scales and runs the FP32 GEMM,
  so its result equals ``(float32(A) * scale_a) @ (float32(B) * scale_b)`` rounded to out_dtype, bit for bit.
  On a CPU ``fp8_gemm`` computes exactly that itself, with the step ``scaled_mm`` of its backend: the
  rule ``rules.tensor.scaled_mm``, or its kernel ``kernels.upcast.cpu_scaled_mm`` (torch's element-by-element FP8 upcast
  replaced by a read of the codes as FP16 bits, many times faster; ``tests/core/quant/kernels/test_quant_fastpath.py``
  checks it equals ``torch._scaled_mm`` bit for bit); on a GPU it calls ``torch._scaled_mm``.

Policies here:
* The layout rule and "at least one E4M3 operand" are enforced on every device, so code that runs on
  the CPU also runs on a GPU.
* The divisible-by-16 rule applies on CUDA only. There a shape that breaks it raises ValueError unless
  ``pad_inner_dim=True`` (torchao's ``Float8LinearConfig.pad_inner_dim``), which zero-pads the operands
  to multiples of 16 and slices the result back: the padding adds zero products, so the result is
  unchanged. ``pad_inner_dim=True`` pads on the CPU too (the tests use that to check the padded path).
* A CUDA GPU below 8.9, a ROCm GPU or another device type raises RuntimeError naming the fix.

``fp8_linear_backward_gemms`` runs a linear layer's two backward GEMMs (dx = dy @ W, dW = dy^T @ x) as two
``fp8_gemm`` calls, with the layout copies ``_scaled_mm`` needs; on a CPU it computes the same bits with each
operand upcast once (the FP32 copy of dy serves both GEMMs) and none of those copies.

Which functions run on a CPU (the rule or its kernel) is not this module's choice: the layers pass their
quantizers' ``backend`` (``fp8_gemm(..., backend=)``, ``fp8_linear_backward_gemms(..., backend=)``); a caller that
passes none (a lesson's cell) gets the one the library chooses now (``backend.choose()``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import Backend, choose
from ..rules.tensor import Float8Tensor

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 16  # cuBLASLt FP8 GEMMs need these dimensions in multiples of 16


def fp8_gemm_support_error(device_type: str, capability: tuple[int, int] | None = None,
                           is_hip: bool = False) -> str | None:
    """Why FP8 GEMMs cannot run on this device, or None if they can (pure function, testable anywhere)."""
    if device_type == "cpu":
        return None
    if device_type == "cuda" and is_hip:
        return ("FP8 linear layers here target NVIDIA's float8_e4m3fn/float8_e5m2 GEMMs; this ROCm GPU uses "
                "the *fnuz FP8 variants. Train in BF16 instead, or run on the CPU.")
    if device_type == "cuda":
        if capability is not None and tuple(capability) >= (8, 9):
            return None
        return (f"FP8 GEMMs need tensor cores of compute capability 8.9 or newer (Ada, Hopper, Blackwell: "
                f"L4, L40, RTX 40xx, H100, H200, B200); this GPU has {capability}. Use a BF16 recipe on this "
                "GPU, or run the FP8 recipe on the CPU, where torch._scaled_mm is computed in FP32.")
    return f"no FP8 GEMM path for device type {device_type!r}: use 'cpu' or a CUDA GPU of compute capability 8.9+"


def check_fp8_gemm_supported(device: torch.device) -> None:
    """Raise RuntimeError (with the fix) if FP8 GEMMs cannot run on ``device``."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    error = fp8_gemm_support_error(device.type, capability, is_hip=torch.version.hip is not None)
    if error is not None:
        raise RuntimeError(error)


def is_row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_contiguous()


def is_column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.t().is_contiguous()


def _pad_to(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D FP8 tensor to (rows, cols), keeping its layout (row- or column-major)."""
    if data.shape == (rows, cols):
        return data
    if is_row_major(data):
        out = torch.zeros(rows, cols, dtype=data.dtype, device=data.device)
        out[: data.shape[0], : data.shape[1]].copy_(data)
        return out
    out = torch.zeros(cols, rows, dtype=data.dtype, device=data.device)  # storage of the column-major result
    out[: data.shape[1], : data.shape[0]].copy_(data.t())
    return out.t()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, *, pad_inner_dim: bool = False,
             use_fast_accum: bool = False, backend: Optional[Backend] = None) -> torch.Tensor:
    """``a @ b`` for FP8 operands through ``torch._scaled_mm``: (M, K) @ (K, N) -> (M, N) ``out_dtype``; on a CPU
    through ``backend.scaled_mm`` (the rule ``tensor.scaled_mm`` or its kernel).

    Args:
      a: (M, K) Float8Tensor, row-major (``a.data.is_contiguous()``).
      b: (K, N) Float8Tensor, column-major (``b.data.t().is_contiguous()``), e.g. ``w8.t()`` of a row-major
         (N, K) weight. At least one of a, b must be E4M3.
      out_dtype: torch.float32, torch.bfloat16 or torch.float16.
      pad_inner_dim: zero-pad dimensions to multiples of 16 (needed on CUDA for shapes that are not).
      use_fast_accum: cuBLAS fast accumulation (torchao uses it for the forward GEMM); ignored on CPU. On
         Hopper it trades the FP32 accumulator for a ~14-bit one (see the module docstring).
      backend: the rules or the kernels (a layer passes its quantizers'; None: ``backend.choose()``).
    Returns ``(dequant(a) @ dequant(b))``, rounded once to out_dtype: accumulated in FP32 on CPU (and on GPUs
    without fast accumulation), so there the only error is the operands' cast.
    Raises ValueError for bad operands or shapes, RuntimeError for a device without FP8 GEMMs.
    """
    backend = choose() if backend is None else backend
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if a.fp8_format == "e5m2" and b.fp8_format == "e5m2":
        raise ValueError("torch._scaled_mm refuses E5M2 x E5M2 on GPUs: at least one operand must be E4M3 "
                         "(use Format.HYBRID or Format.E4M3)")
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_gemm needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if not is_row_major(a.data):
        raise ValueError("the first _scaled_mm operand must be row-major: pass a.data.contiguous()")
    if not is_column_major(b.data):
        raise ValueError("the second _scaled_mm operand must be column-major: pass x.t().contiguous().t() "
                         "or the .t() view of a row-major tensor")
    if a.data.device != b.data.device:
        raise ValueError(f"operands on different devices: {a.data.device} and {b.data.device}")
    device = a.data.device
    check_fp8_gemm_supported(device)

    (M, K), N = a.shape, b.shape[1]
    a_data, b_data = a.data, b.data
    misaligned = any(n % ALIGN for n in (K, N))
    if misaligned and device.type == "cuda" and not pad_inner_dim:
        raise ValueError(f"torch._scaled_mm on CUDA needs K and N divisible by 16, got (M, K, N) = {(M, K, N)}. "
                         "Pad the batch/sequence/feature sizes to multiples of 16, or pass pad_inner_dim=True "
                         "(QuantizedLinear(..., pad_inner_dim=True)) to zero-pad inside the GEMM.")
    if pad_inner_dim and (misaligned or M % ALIGN):
        # Zero rows/columns contribute zero products: the sliced result is unchanged.
        a_data = _pad_to(a_data, _round_up(M), _round_up(K))  # (M', K') row-major
        b_data = _pad_to(b_data, _round_up(K), _round_up(N))  # (K', N') column-major
    if device.type == "cpu":  # what _scaled_mm computes on a CPU: the rule tensor.scaled_mm or its kernel
        out = backend.scaled_mm(a_data, b_data, a.scale_inv, b.scale_inv, out_dtype)  # (M', N') out_dtype
    else:
        out = torch._scaled_mm(a_data, b_data, scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype,
                               use_fast_accum=use_fast_accum)  # (M', N') out_dtype
    if out.shape != (M, N):
        out = out[:M, :N].contiguous()  # drop the padding
    return out


def fp8_linear_backward_gemms(g8: Float8Tensor, w8: Float8Tensor, x8: Float8Tensor, x_dtype: torch.dtype,
                              w_dtype: torch.dtype, *, need_dx: bool = True, need_dw: bool = True,
                              pad_inner_dim: bool = False, backend: Optional[Backend] = None
                              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The two backward GEMMs of y = x @ W^T: (dx, dw), each None where not needed.

    Args:
      g8: (M, N) Float8Tensor, the output gradient dy, row-major (E5M2 under HYBRID).
      w8: (N, K) Float8Tensor, the weight, row-major (E4M3).
      x8: (M, K) Float8Tensor, the input, row-major (E4M3).
      x_dtype, w_dtype: dtypes of dx (M, K) and dW (N, K).
      need_dx, need_dw: which gradients to compute.
      pad_inner_dim: as for ``fp8_gemm``.
      backend: the rules or the kernels (the layer's quantizers'; None: ``backend.choose()``).
    The rule is two ``fp8_gemm`` calls: dx = dy @ W (W copied to column-major) and dW = dy^T @ x (dy^T copied
    to row-major, x to column-major). On a CPU without padding it computes what those calls compute there
    (``tensor.scaled_mm``: row-major FP32 operands float32(code) * scale_inv, one FP32 GEMM, one rounding)
    without the layout copies of W and x (row-major already), each operand upcast by ``backend.fp8_to_float32``
    (the rule ``tensor.fp8_to_float32`` or its kernel): the row-major dy^T is made by transposing dy's
    1-byte codes and upcasting those (each element the same product; a transposing copy of the FP32 copy moves 4x
    the bytes and cost about 4x the time, 1024 x 512, one thread). Equal bit for bit
    (``tests/core/quant/kernels/test_quant_fastpath.py``). E5M2 x E5M2
    (which ``fp8_gemm`` refuses) always takes the rule, so it raises as on a GPU.
    """
    backend = choose() if backend is None else backend
    upcast = backend.fp8_to_float32
    dx = dw = None
    if (g8.data.device.type == "cpu" and not pad_inner_dim
            and not (g8.fp8_format == "e5m2" == w8.fp8_format)):
        if need_dx:
            g = upcast(g8.data, g8.scale_inv)                                                        # (M, N) fp32
            dx = torch.mm(g, upcast(w8.data, w8.scale_inv)).to(x_dtype)                              # (M, K)
            del g                                                            # not needed by the dW GEMM
        if need_dw:
            g_t = upcast(g8.data.t().contiguous(), g8.scale_inv)             # (N, M) fp32 row-major dy^T
            dw = torch.mm(g_t, upcast(x8.data, x8.scale_inv)).to(w_dtype)                            # (N, K)
        return dx, dw
    if need_dx:
        w_col = Float8Tensor(w8.data.t().contiguous().t(), w8.scale_inv)       # (N, K) column-major
        dx = fp8_gemm(g8, w_col, x_dtype, pad_inner_dim=pad_inner_dim, backend=backend)     # (M, K) x dtype
    if need_dw:
        g_t = Float8Tensor(g8.data.t().contiguous(), g8.scale_inv)             # (N, M) row-major
        x_col = Float8Tensor(x8.data.t().contiguous().t(), x8.scale_inv)       # (M, K) column-major
        dw = fp8_gemm(g_t, x_col, w_dtype, pad_inner_dim=pad_inner_dim, backend=backend)    # (N, K) weight dtype
    return dx, dw
