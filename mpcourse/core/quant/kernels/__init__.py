"""The kernels: faster passes that give the same bits as a rule, each naming the rule it equals.

``fastpath``: fused torch paths (one ATen call where the rule takes several); ``fused``: compiled numba passes
for CPU tensors. A kernel imports rules (to name and reuse them), never a layer or the engine; ``quant.backend`` is
the one place that chooses between the rules and their kernels (``backend.choose``: ``RULES`` or ``KERNELS``; the
library's switch, ``mpcourse.core.kernels_switch``, ``MPCOURSE_FUSED=0``: the rules everywhere), and no layer
imports a kernel.
``fastpath`` chooses between numba and its torch bodies once, at import (``fastpath.COMPILED``).
"""


def in_use() -> str:
    """Which passes this process's quantizers take, as ``results.json`` records it: "numba" (``fused``'s compiled
    passes: numba imported and the switch on), "torch" (``fastpath``'s torch bodies: no numba) or "rules"
    (``MPCOURSE_FUSED=0``). The same bits every way; not the same temporaries, so a step's peak bytes differ."""
    from ...kernels_switch import ENABLED
    from .fastpath import COMPILED

    return "numba" if COMPILED else ("torch" if ENABLED else "rules")

