"""mpcourse: mixed-precision training (FP16, BF16, FP8) from first principles.

Modules: ``formats`` (number formats, rounding), ``emulation`` (tensor-core emulation on CPU),
``master`` (FP32 master weights), ``scaling`` (static and dynamic loss scaling), ``autocast``
(the op-level cast policy), ``bf16`` (stochastic rounding and Kahan-compensated BF16 updates),
``fp8`` (scaled casts, delayed/current scaling, the FP8 linear layer), ``data`` and ``model``
(the corpus and the GPT), ``recipes`` and ``train`` (precision recipes and the training loop),
``compare`` (the main job), ``grading`` and ``course`` (graders shared by tests and notebooks;
exercises generated from solutions).
"""
__version__ = "0.1.0"
