"""Block-scaled GEMMs: ``torch.nn.functional.scaled_mm`` where the device takes the scaling, else an emulation.

``scaled_gemm(a, b)`` computes ``dequant(a) @ dequant(b)`` for ``ScaledTensor`` operands a (M, K) and b (K, N),
each with its scales in blocks along K (the contraction dimension). Which path runs:

* ``F.scaled_mm`` (torch >= 2.10, ``ScalingType``) when both operands map onto one of its scalings and the
  device runs it: ``TensorWise`` x ``TensorWise`` and ``RowWise`` x ``RowWise`` on a CPU (torch 2.13,
  measured: it upcasts to FP32 and its output equals dequantize-then-FP32-GEMM bit for bit, so ``auto`` runs
  the faster emulation there and ``route="native"`` the real call);
  ``BlockWise1x128`` x ``BlockWise128x128`` also on Hopper (SM 9.0); MX (``BlockWise1x32``) and NVFP4
  (``BlockWise1x16``) need Blackwell and are not wired here (no such GPU to test on).
* otherwise the emulation: every block of each operand multiplied by its own scale in FP32, then one FP32
  GEMM, so the result *is* dequantize-then-FP32-GEMM (equal bit for bit by construction, on every machine).

The emulation dequantizes each operand with the step ``dequantize`` of its backend (the rule
``ScaledTensor.dequantize`` or its kernel ``kernels.upcast.dequantize``), unless the quantizer kept its float32 copy:
the layers pass their quantizers' ``backend`` (``scaled_gemm(..., backend=)``); a caller that passes none gets the
one the library chooses now (``backend.choose()``).

The emulation rounds like an FP32 GEMM, not like a tensor core. Real FP8 tensor cores on Hopper with
``use_fast_accum=True`` keep only about 14 bits of the running sum (DeepSeek-V3 technical report,
arXiv 2412.19437, section 3.3.2); DeepSeek-V3 therefore copies the partial sums to FP32 registers every
N_C = 128 elements of K. ``accumulator_model_gemm`` models that: see its docstring, and lesson 10.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...formats import NumberFormat, round_to
from ..backend import Backend, choose
from ..rules.scaled import ScaledTensor

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scaling_kind(a: ScaledTensor, b: ScaledTensor) -> Optional[str]:
    """The ``F.ScalingType`` pair that describes (a, b), as "TensorWise", "RowWise", "BlockWise" or None."""
    (M, K), N = a.shape, b.shape[1]
    if a.scale_inv.dtype != torch.float32 or b.scale_inv.dtype != torch.float32:
        return None   # MX (E8M0) / NVFP4 (E4M3 scales): Blackwell only
    if a.block == (M, K) and b.block == (K, N):
        return "TensorWise"
    if a.block == (1, K) and b.block == (K, 1):
        return "RowWise"
    if a.block == (1, 128) and b.block == (128, 128):
        return "BlockWise"
    return None


def native_supported(kind: Optional[str], device: torch.device) -> bool:
    """Whether ``F.scaled_mm`` runs ``kind`` on ``device`` (CPU: TensorWise and RowWise; SM 9.0: BlockWise too)."""
    if kind is None:
        return False
    if device.type == "cpu":
        return kind in ("TensorWise", "RowWise")
    if device.type == "cuda" and torch.version.hip is None:
        cap = torch.cuda.get_device_capability(device)
        return cap >= (8, 9) and (kind != "BlockWise" or cap[0] == 9)
    return False


def emulated_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype = torch.float32, *,
                  backend: Optional[Backend] = None) -> torch.Tensor:
    """dequant(a) @ dequant(b) in FP32, rounded once to out_dtype: (M, K) @ (K, N) -> (M, N). Each operand is
    dequantized by ``backend.dequantize`` where no float32 copy was kept (a layer passes its quantizers' backend;
    None: ``backend.choose()``)."""
    backend = choose() if backend is None else backend
    return (_fp32(backend, a) @ _fp32(backend, b)).to(out_dtype)


def _fp32(backend: Backend, a: ScaledTensor) -> torch.Tensor:
    """``a.dequantize_fp32()``: the copy kept at quantization, else ``backend.dequantize`` (the same bits)."""
    return a.dequantized if a.dequantized is not None else backend.dequantize(a, torch.float32)


def _native(a: ScaledTensor, b: ScaledTensor, kind: str, out_dtype, use_fast_accum: bool) -> torch.Tensor:
    st = F.ScalingType
    if kind == "TensorWise":
        sa, sb, ra, rb = a.scale_inv.reshape(()), b.scale_inv.reshape(()), st.TensorWise, st.TensorWise
    elif kind == "RowWise":
        sa, sb = a.scale_inv.flatten().clone()[:, None], b.scale_inv.flatten().clone()[None, :]  # (M,1), (1,N)
        ra = rb = st.RowWise
    else:  # 1x128 activations (M, K/128) outer-dim-major; 128x128 weight blocks (K/128, N/128)
        sa, sb = a.scale_inv.t().contiguous().t(), b.scale_inv
        ra, rb = st.BlockWise1x128, st.BlockWise128x128
    b_data = b.data if b.data.t().is_contiguous() else b.data.t().contiguous().t()   # column-major
    return F.scaled_mm(a.data.contiguous(), b_data, sa, ra, sb, rb, output_dtype=out_dtype,
                       use_fast_accum=use_fast_accum)


def scaled_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype = torch.float32, *,
                use_fast_accum: bool = False, route: str = "auto", backend: Optional[Backend] = None
                ) -> torch.Tensor:
    """``a @ b`` for block-scaled operands: (M, K) @ (K, N) -> (M, N) ``out_dtype``.

    a's blocks and b's blocks must each lie along K (e.g. a 1x128 / 1x32 / 1x16 / 128x128 a, and b the
    transpose of such a tensor). route: "auto" (F.scaled_mm where a GPU supports the scaling, else the
    emulation, which on a CPU is what F.scaled_mm computes there, bit for bit, only faster),
    "emulate" or "native" (RuntimeError where the device does not take this scaling).
    backend: the rules or the kernels, whose ``dequantize`` the emulation uses (a layer passes its quantizers';
    None: ``backend.choose()``, see the module docstring).
    """
    backend = choose() if backend is None else backend
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_gemm needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.elem_format == "e5m2" and b.elem_format == "e5m2":
        raise ValueError("FP8 GEMMs refuse E5M2 x E5M2: at least one operand must be E4M3")
    kind = scaling_kind(a, b)
    native = native_supported(kind, a.data.device)
    if route == "native" and not native:
        raise RuntimeError(f"F.scaled_mm does not run {kind or 'this scaling'} on {a.data.device}: "
                           "use route='emulate' (or 'auto')")
    if route not in ("auto", "emulate", "native"):
        raise ValueError(f"route must be 'auto', 'emulate' or 'native', got {route!r}")
    # On a CPU F.scaled_mm upcasts to FP32 as the emulation does (equal bit for bit, tested) but with torch's slow
    # element-by-element FP8 upcast: "auto" takes the emulation there.
    if native and (route == "native" or (route == "auto" and a.data.device.type != "cpu")):
        return _native(a, b, kind, out_dtype, use_fast_accum)
    return emulated_gemm(a, b, out_dtype, backend=backend)


def accumulator_format(mantissa_bits: int) -> NumberFormat:
    """An FP32-range format with ``mantissa_bits`` stored bits, the model of a narrow tensor-core accumulator."""
    m = mantissa_bits
    return NumberFormat(f"acc{m}", 8, m, 127, (2 - 2.0 ** -m) * 2.0 ** 127, 2.0 ** -126, 2.0 ** (-126 - m), 2.0 ** -m,
                  True, None, 9 + m, "exponent all ones, mantissa != 0")


def accumulator_model_gemm(a: torch.Tensor, b: torch.Tensor, *, mantissa_bits: int = 13,
                           promote_every: Optional[int] = 128, chunk: int = 32) -> torch.Tensor:
    """A model of a low-precision GEMM accumulator: (M, K) @ (K, N) float32 operands -> (M, N) float32.

    The running sum is kept in a format with FP32's range and ``mantissa_bits`` stored mantissa bits (13:
    14 significant bits, DeepSeek-V3's measurement of Hopper's FP8 accumulation), truncated (rounded toward
    zero) after every ``chunk`` products (one tensor-core MMA adds a chunk of K at a time; each chunk's own
    sum is exact-ish FP32). With ``promote_every`` (N_C = 128 in DeepSeek-V3) the narrow sum is added into an
    FP32 accumulator and restarted every ``promote_every`` elements of K; None never promotes.
    A model, not a bit-exact replica of any GPU: it reproduces the error's growth with K.
    """
    fmt = accumulator_format(mantissa_bits)
    M, K = a.shape
    if promote_every is not None and promote_every % chunk:
        raise ValueError(f"promote_every ({promote_every}) must be a multiple of chunk ({chunk})")
    total = torch.zeros(M, b.shape[1], dtype=torch.float32)
    acc = torch.zeros_like(total)
    for k0 in range(0, K, chunk):
        acc = round_to(acc + a[:, k0:k0 + chunk] @ b[k0:k0 + chunk], fmt, rounding="toward_zero")
        if promote_every is not None and (k0 + chunk) % promote_every == 0:
            total, acc = total + acc, torch.zeros_like(acc)
    return total + acc
