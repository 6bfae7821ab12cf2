"""Exhaustive check of the compiled FP8 casts (``mpcourse.core.quant.kernels.fp8_passes``) against torch's own casts.

Every one of the 2^32 FP32 bit patterns is cast to E4M3 and to E5M2 by ``fp8_passes.quantize_fp8`` (one block, scale
1) and by torch (``y.clamp(-max, max).to(dtype)``, the quantizers' rule), in chunks of 2^27; the codes must be
equal byte for byte (NaN inputs: a NaN code on both sides), and the kernel's FP32 copy must be the code's value.
Also every code of both formats through ``fp8_passes.dequantize_fp8`` against torch's upcast. About 7 minutes per
format on one CPU core; ``tests/core/quant/kernels/test_quant_fused.py`` keeps the cases that matter (every midpoint, its
neighbours, the specials, random patterns) for CI.

    python benchmarks/check_fused_casts.py

Run on this tree (2-core AMD EPYC, torch 2.13 CPU, numba 0.68.1): 0 mismatches for E4M3 and for E5M2, and all
256 codes of each format decoded as torch decodes them.
"""
from __future__ import annotations

import time

import torch

from mpcourse.core.formats import FORMATS
from mpcourse.core.quant.kernels import fp8_passes, jit


def main() -> None:
    if not jit.AVAILABLE:
        raise SystemExit("numba is not importable (or MPCOURSE_FUSED=0): nothing to check")
    one = torch.ones(1, 1)
    for name in ("e4m3", "e5m2"):
        dtype, top = FORMATS[name].torch_dtype, FORMATS[name].max
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(1, 256)
        ref, got = codes.float(), fp8_passes.dequantize_fp8(codes, (1, 256), one)
        nan = torch.isnan(ref)
        decoded = torch.equal(nan, torch.isnan(got)) and torch.equal(ref.view(torch.int32)[~nan],
                                                                     got.view(torch.int32)[~nan])
        print(f"{name}: all 256 codes decoded as torch decodes them: {decoded}", flush=True)
        bad, start_t = 0, time.time()
        for start in range(0, 2 ** 32, 2 ** 27):
            y = torch.arange(start, start + 2 ** 27, dtype=torch.int64).to(torch.int32).view(torch.float32)[None]
            want = y.clamp(-top, top).to(dtype).view(torch.uint8)                 # torch's saturating cast
            data, copy = fp8_passes.quantize_fp8(y, (1, y.shape[1]), one, False, one, name)
            data = data.view(torch.uint8)
            nan_in = torch.isnan(y)
            bad += int(((want != data) & ~nan_in).sum())                          # numbers: the same byte
            bad += int((~torch.isnan(data.view(dtype).float()[nan_in])).sum())   # NaN: a NaN code
            value = want.view(dtype).float()
            bad += int((~(torch.isnan(value) | (value.view(torch.int32) == copy.view(torch.int32)))).sum())
        print(f"{name}: all 2^32 FP32 bit patterns: {bad} mismatches ({time.time() - start_t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
