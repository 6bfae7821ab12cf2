"""Memory savers: AdamW's moments stored blockwise in 8 bits (FP8 or dynamic 8-bit codes), FP32 everywhere else.

* ``fp8-moments``: FP32 model, gradients and AdamW arithmetic; both moments stored between steps as
  blockwise-scaled E4M3 (blocks of 256, scale = amax / 448), as torchao's ``AdamWFp8``
  (``mpcourse.core.optim.blockwise.BlockQuantizedAdamW(fmt="fp8")``, rule in ``mpcourse.core.optim.fp8``).
* ``int8-moments``: the same with 8-bit dynamic-tree codes (signed map for the first moment, unsigned for the
  second, absmax per block of 256), as torchao's ``AdamW8bit`` and Dettmers et al. 2021 (arXiv 2110.02861)
  (``fmt="int8"``, rule in ``mpcourse.core.optim.int8``).

Both store the second moment by the course's rule (``state_rule="sqrt-nonzero"``): ``sqrt(v)`` in place of ``v``,
and never 0 for a positive value, in the same bytes. torchao stores ``v`` itself and can store it as 0 under a
surviving first moment; a coordinate whose gradient then stops (a rare token's embedding row) steps
``lr * m / eps``, thousands of times ``lr`` (``mpcourse.core.optim.blockwise`` has the measurements).
``BlockQuantizedAdamW(state_rule="torchao")`` is torchao's storage bit for bit.

Under FSDP2 (``--parallel fsdp``) each rank steps its rows and the blocks stay the whole tensor's
(``mpcourse.core.optim.shards``); a checkpoint records how the moments are stored (fmt, rule, block size) and a
resume under another storage, or from a state that does not say, is refused.

FP32 weights keep the comparison with ``fp32`` about the state alone (``bf16-master-bf16-moments`` also changes
the model's dtype). Tensors under 4096 elements (norms, biases) keep FP32 moments, as torchao.

Bytes per parameter (``memory()``, after the step, before ``zero_grad``)::

    recipe         weights   grads    AdamW state                                  total
    fp32           fp32 4    fp32 4   fp32 8                                       16
    fp8-moments    fp32 4    fp32 4   2 x (1 + 4/256) where quantized, else 8     ~10.1
    int8-moments   the same bytes as fp8-moments
"""
from __future__ import annotations

from mpcourse.core.optim.blockwise import BlockQuantizedAdamW
from .base import TrainingRecipe, register


class _BlockMoments(TrainingRecipe):
    fmt = "fp8"
    state_rule = "sqrt-nonzero"           # the course's second-moment storage; "torchao" is torchao's, bit for bit

    def make_optimizer(self, params):
        o = self.optim
        return BlockQuantizedAdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                   fmt=self.fmt, state_rule=self.state_rule)


@register
class FP8Moments(_BlockMoments):
    name = "fp8-moments"
    description = ("FP32 weights, AdamW moments stored as blockwise-scaled FP8 E4M3 (blocks of 256, as torchao's "
                   "AdamWFp8; v stored as sqrt(v), never 0 for a positive v)")
    fmt = "fp8"


@register
class Int8Moments(_BlockMoments):
    name = "int8-moments"
    description = ("FP32 weights, AdamW moments stored as 8-bit blockwise dynamic codes (Dettmers et al. 2021, as "
                   "torchao's AdamW8bit; v stored as sqrt(v), never 0 for a positive v)")
    fmt = "int8"
