"""The kernels: faster passes that give the same bits as a rule, each naming the rule it equals.

Torch kernels, by concern (each calls a compiled pass where one takes the input):
``per_tensor`` (the amax and the saturating FP8 downcast), ``upcast`` (the FP8 upcasts, the block-scaled
dequantization and the per-tensor FP8 GEMM on a CPU), ``blocks`` (FP32-scaled FP8 blocks and MX), ``e2m1`` (E2M1
rounding) and ``nvfp4_quant`` (NVFP4's quantizer, scale levels and random Hadamard transform).
Compiled passes (numba, CPU tensors): ``loops`` holds every compiled loop, ``fp8_passes`` and ``nvfp4_passes`` hand
them tensors' memory, and ``jit`` decides once, at import, whether they run at all (``jit.COMPILED``) and per call
whether a tensor fits them (``jit.takes``).
A kernel imports rules (to name and reuse them), never a layer or the engine; ``quant.backend`` is the one place that
chooses between the rules and their kernels (``backend.choose``: ``RULES`` or ``KERNELS``; the library's switch,
``mpcourse.core.kernels_switch``, ``MPCOURSE_FUSED=0``: the rules everywhere), and no layer imports a kernel.
"""


def in_use() -> str:
    """Which passes this process's quantizers take, as ``results.json`` records it: "numba" (the compiled passes:
    numba imported and the switch on), "torch" (the kernels' torch bodies: no numba) or "rules"
    (``MPCOURSE_FUSED=0``). The same bits every way; not the same temporaries, so a step's peak bytes differ."""
    from ...kernels_switch import ENABLED
    from .jit import COMPILED

    return "numba" if COMPILED else ("torch" if ENABLED else "rules")
