"""The compiled NVFP4 passes for CPU tensors (``loops``' E2M1 loops and MT19937 engine), each equal bit for bit to a rule.

* ``quantize_e2m1(x, block, mult, dequant, draws)``: ``nvfp4.encode_nvfp4``'s element step (E2M1 to nearest even,
  or stochastically from the rule's own random draws ``torch.randint(0, 2**62)``, drawn in torch) and the float32
  copy ``ScaledTensor.dequantize`` forms.
* ``quantize_e2m1_drawing(x, block, mult, dequant, generator)``: the same with the rule's draws made inside the
  loop, row by row, from the generator's own MT19937 state (torch's ``at::mt19937``, read and written back
  through ``get_state`` / ``set_state``): the same integers as ``torch.randint(0, 2**62, x.shape)`` and the
  generator left where that call leaves it (``draws62`` is that draw alone; checked against torch once per
  process, else the draws come from ``torch.randint``). torch's draw (two engine outputs, a 64-bit modulo, an
  (M, K) int64 tensor written and read back) costs about 4 ns per element here; in the loop about 0.5 ns.
  Sources: PyTorch ``aten/src/ATen/core/MT19937RNGEngine.h`` (the engine), ``aten/src/ATen/CPUGeneratorImpl.cpp``
  (``random64``: first output in the high word; the state's byte layout), ``aten/src/ATen/native/cpu/
  DistributionTemplates.h`` (``random_from_to_kernel``: one ``random64() % range`` per element, serially).
* ``nvfp4_scale_pass(amax_b, tensor_amax, course)``: ``nvfp4.two_level_scales``' two scale levels and
  ``nvfp4.encode_multipliers``' per-block encode and decode multipliers in one pass over the block amaxes, where
  the rule takes a dozen small torch ops and torch's element-by-element E4M3 upcast.

Called by ``nvfp4_quant`` where ``jit.takes`` says a tensor fits. ``tests/core/quant/kernels/test_quant_fused.py``
checks each against its rule.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .jit import AVAILABLE, check_grid, np_view

if AVAILABLE:
    from . import loops


def quantize_e2m1(x: torch.Tensor, block: tuple[int, int], mult: torch.Tensor, dequant: torch.Tensor,
                  draws: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (M, K) E2M1 values in a float8_e4m3fn container, float32 copy): ``round_e2m1(x * mult)`` per block,
    to nearest even, or stochastically with ``draws`` ((M, K) int64 from ``torch.randint(0, 2**62, ...)``, as the
    rule draws them), and the copy float32(data) * dequant. x: (M, K) float32 on the CPU; mult, dequant:
    (M/r, K/c) float32."""
    x = x.detach().contiguous()
    M, K = x.shape
    r, c = block
    codes = torch.empty(M, K, dtype=torch.uint8)
    out = torch.empty(M, K, dtype=torch.float32)
    check_grid(x, block, mult, dequant)
    if draws is not None and draws.numel() != M * K:
        raise ValueError(f"{draws.numel()} random draws for {M * K} elements")
    kernel = loops.e2m1_nearest if draws is None else loops.e2m1_stochastic
    d = torch.zeros(1, 1, dtype=torch.int64) if draws is None else draws.reshape(M, K).contiguous()
    mult, dequant = mult.float().contiguous(), dequant.float().contiguous()   # locals, alive for np_view's views
    none = torch.zeros(1, dtype=torch.int64)
    kernel(np_view(x), r, c, np_view(mult), np_view(dequant), np_view(d), np_view(none), np_view(none), np_view(codes), np_view(out))
    return codes.view(torch.float8_e4m3fn), out


def quantize_e2m1_drawing(x: torch.Tensor, block: tuple[int, int], mult: torch.Tensor, dequant: torch.Tensor,
                          generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_e2m1(x, block, mult, dequant, torch.randint(0, 2**62, x.shape, generator=generator))``, the same
    bits and the generator left in the same state, without the (M, K) int64 tensor of draws: the kernel draws
    each row's integers itself from the generator's MT19937 state (``generator`` None: torch's default CPU
    generator), as torch's CPU ``randint`` forms them: per element, in row-major order, two engine outputs
    (first << 32 | second) reduced mod 2^62 (``draws62``, checked against torch once per process). Where that
    check fails (another torch's state layout) or the generator is not a CPU one, the draws come from
    ``torch.randint``. The generator's state is read before and written back after the kernel (nothing else may
    draw from it meanwhile; torch's ``randint`` holds its lock instead)."""
    gen = torch.default_generator if generator is None else generator
    if not _mt_matches_torch() or gen.device.type != "cpu":
        draws = torch.randint(0, 2 ** 62, x.shape, generator=generator)
        return quantize_e2m1(x, block, mult, dequant, draws)
    x = x.detach().contiguous()
    M, K = x.shape
    r, c = block
    check_grid(x, block, mult, dequant)
    codes = torch.empty(M, K, dtype=torch.uint8)
    out = torch.empty(M, K, dtype=torch.float32)
    mult, dequant = mult.float().contiguous(), dequant.float().contiguous()   # locals, alive for np_view's views
    none = torch.zeros(1, 1, dtype=torch.int64)
    _with_mt_state(gen, lambda words, pos: loops.e2m1_drawing(np_view(x), r, c, np_view(mult), np_view(dequant), np_view(none),
                                                          words, pos, np_view(codes), np_view(out)))
    return codes.view(torch.float8_e4m3fn), out


# torch's CPU generator state (``CPUGeneratorImplState``, aten/src/ATen/CPUGeneratorImpl.cpp), a byte tensor:
# the_initial_seed (uint64, byte 0), left (int32, byte 8), seeded (int32, byte 12), next (uint64, byte 16), the 624
# MT19937 words each widened to uint64 (bytes 24 to 5015), then the normal distributions' caches (left as they are)
_STATE_BYTES, _LEFT, _NEXT, _WORDS = 5056, 8, 16, 24


def _with_mt_state(gen: torch.Generator, fn) -> None:
    """fn(words (624,) int64, pos (left, next) int64), NumPy arrays, on ``gen``'s MT19937 state, which fn advances in
    place; the advanced state is set back into ``gen``."""
    state = gen.get_state()
    if state.numel() != _STATE_BYTES:
        raise RuntimeError(f"a CPU generator state of {state.numel()} bytes, not {_STATE_BYTES}")
    b = np_view(state)                                            # (5056,) uint8 view of the state's bytes
    left, nxt = b[_LEFT:_LEFT + 4].view(np.int32), b[_NEXT:_NEXT + 8].view(np.int64)
    pos = np.array([left[0], nxt[0]], dtype=np.int64)
    fn(b[_WORDS:_WORDS + 624 * 8].view(np.int64), pos)
    left[0], nxt[0] = pos[0], pos[1]
    gen.set_state(state)


def draws62(n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``torch.randint(0, 2**62, (n,), generator=generator)`` (int64), drawn by ``loops.mt_words`` from the generator's
    state, which is advanced as torch advances it. For the check below and the tests."""
    gen = torch.default_generator if generator is None else generator
    w = np.empty(2 * n, dtype=np.uint32)

    def fill(words, pos):
        s = words.astype(np.uint32)                  # 32-bit working copy
        loops.mt_words(s, pos, w)
        words[:] = s
    _with_mt_state(gen, fill)
    hi, lo = torch.from_numpy(w.astype(np.int64)).reshape(n, 2).unbind(1)
    return ((hi & 0x3FFFFFFF) << 32) | lo


_MT_CHECKED: list = []


def _mt_matches_torch() -> bool:
    """Whether ``draws62`` gives ``torch.randint(0, 2**62)``'s integers and leaves the generator in torch's state,
    on a fresh generator across two twists and their boundaries (checked once per process)."""
    if not _MT_CHECKED:
        ok = True
        try:
            ours, theirs = torch.Generator().manual_seed(20250), torch.Generator().manual_seed(20250)
            for n in (1, 311, 1, 700, 5):             # 312 draws end exactly at the first twist's 624 words
                ok = ok and torch.equal(draws62(n, ours), torch.randint(0, 2 ** 62, (n,), generator=theirs))
            ok = ok and torch.equal(ours.get_state(), theirs.get_state())
        except (RuntimeError, ValueError):
            ok = False
        _MT_CHECKED.append(ok)
    return _MT_CHECKED[0]


def nvfp4_scale_pass(amax_b: torch.Tensor, tensor_amax: Optional[torch.Tensor] = None, course: bool = True):
    """``nvfp4_quant.nvfp4_block_scales``: (t () float32, s (M/r, K/c) float8_e4m3fn, recip, mult (M/r, K/c) float32)
    from non-empty float32 CPU block amaxes ``amax_b`` in one pass: the tensor decode scale t from max(amax_b) (or
    ``tensor_amax``, a checked one-element float32 tensor), floored at 2^-126 if ``course``; the block scales
    s = e4m3(clamp((amax_b / 6) / t', 2^-6, 448)) with t' = t if t > 0 else 1; recip = ((1 / t') / pre) / float32(s);
    mult = float32(s) * t. With ``course`` and t below 2^-121: pre = 2^6 (else 1), and a block whose (amax_b / 6) / t'
    is below 2^-6 gets s = 0, recip = 0, mult = 0 (``nvfp4.encode_multipliers``). Each an FP32 operation rounded
    once, as the rule's torch ops round it."""
    a = amax_b.detach().float().contiguous()
    codes = torch.empty(a.shape, dtype=torch.uint8)
    recip, mult = torch.empty_like(a), torch.empty_like(a)
    t = torch.empty(1, dtype=torch.float32)
    given = torch.zeros(1) if tensor_amax is None else tensor_amax.detach().float().reshape(1).contiguous()
    loops.nvfp4_scale_loop(np_view(a.view(-1)), np_view(given), tensor_amax is not None, bool(course), np_view(t), np_view(codes.view(-1)),
                  np_view(recip.view(-1)), np_view(mult.view(-1)))
    return t.reshape(()), codes.view(torch.float8_e4m3fn), recip, mult
