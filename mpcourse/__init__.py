"""mpcourse: mixed-precision training (FP16, BF16, FP8) from first principles.

Modules: ``formats`` (number formats, rounding), ``emulation`` (tensor-core emulation on CPU),
``data`` and ``model`` (the corpus and the GPT), ``recipes`` and ``train`` (precision recipes and the
training loop), ``compare`` (the main job), ``grading`` (checks shared by tests and notebooks).
"""
__version__ = "0.1.0"
