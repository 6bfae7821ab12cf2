"""The library proper: the mixed-precision pieces, each small enough to read.

* ``formats``: number formats (FP32, TF32, FP16, BF16, FP8 E4M3/E5M2), rounding, decoding.
* ``emulation``: tensor-core emulation of BF16/FP16 matmuls on CPUs without such units.
* ``master``: FP32 master weights for FP16/BF16 models (Apex O2 semantics).
* ``scaling``: static and dynamic loss scaling (``torch.amp.GradScaler``'s API; DeepSpeed hysteresis).
* ``autocast``: the op-level cast policy of ``torch.autocast``, per device type.
* ``bf16``: stochastic rounding and Kahan-compensated BF16 updates.
* ``learner_table``, ``seams``: the learner's exercise functions (lesson, signature) and the checks on them,
  where a recipe takes them and on what they return.
* ``quant``: scaled low-precision tensors (FP8 per tensor; finer granularities), Transformer
  Engine's scaling recipes, the scaled GEMM and the FP8 linear layer.

Nothing here imports ``mpcourse.experiment`` or ``mpcourse.course``
(``tests/test_layout.py`` checks it).
"""
