"""The kernels: faster passes that give the same bits as a rule, each naming the rule it equals.

``fastpath``: fused torch paths (one ATen call where the rule takes several); ``fused``: compiled numba passes
for CPU tensors. A kernel imports rules (to name and reuse them), never a layer or the engine; ``quant.backend`` is
the one place that chooses between the rules and their kernels (``backend.choose``: ``RULES`` or ``KERNELS``; the
library's switch, ``mpcourse.core.kernels_switch``, ``MPCOURSE_FUSED=0``: the rules everywhere), and no layer
imports a kernel.
``fastpath`` chooses between numba and its torch bodies once, at import (``fastpath.COMPILED``).
"""
