"""The random Hadamard transform of NVFP4's weight-gradient GEMM (TE ``NVFP4BlockScaling``, arXiv 2509.25149
section 4.2): a 16x16 orthonormal Hadamard matrix with one fixed random sign vector, applied to each 16-row group
along M of both inputs of dW = dy^T x, so outliers spread over 16 elements before the FP4 cast.

The kernel of ``rht`` is ``kernels.nvfp4_quant.rht`` (the same batched matmul with a cached matrix), equal bit for bit
(``tests/core/quant/kernels/test_quant_fastpath.py``); ``engine`` chooses between them.
"""
from __future__ import annotations

import math

import torch


def hadamard(n: int = 16) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (orthonormal), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_hadamard(n: int = 16, seed: int = 0) -> torch.Tensor:
    """H @ diag(signs): one fixed random sign vector (TE's random Hadamard transform); orthonormal."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return hadamard(n) * signs[None, :]


def check_rht_shape(x: torch.Tensor) -> None:
    if x.shape[0] % 16:
        raise ValueError(f"the 16x16 Hadamard transform needs M divisible by 16, got M = {x.shape[0]}")


def rht(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(M, K) -> (M, K) float32: ``random_hadamard(16, seed)`` applied to every 16-row group along M, as one batched
    product H @ x_g (``torch.matmul``). Its rounding is that GEMM's: the order of each 16-term sum is the BLAS
    kernel's (an ``einsum`` of the same matrices sums in another order for some shapes: K < 12 with torch 2.13's
    CPU kernels). An output element can reach 4 max |x_g| (the 16 terms' signs can line up): a group with values
    above FP32 max / 4 (about 8.5e37) may overflow to inf, which NVFP4 then decodes as NaN (``quantize_nvfp4``)."""
    check_rht_shape(x)
    M, K = x.shape
    return torch.matmul(random_hadamard(16, seed).to(x.device), x.float().reshape(M // 16, 16, K)).reshape(M, K)
