"""The rules of quantized training, one plain function each: what the lessons teach and import.

Per tensor (``tensor``: amax -> scale -> saturating cast, lesson 07; ``delayed``: the amax history and the scale
update, lesson 08) and per block (``scaled``: the container and its block helpers; ``blockwise``: FP32 block
scales, lesson 09; ``mx``: OCP MX with E8M0 scales; ``nvfp4``: E2M1 with E4M3 block scales and an FP32 tensor
scale; ``hadamard``: NVFP4's random Hadamard transform). A rule imports only ``mpcourse.core.formats`` and other
rules: never a kernel (``..kernels``), a layer (``..layers``), the engine or a recipe.
"""
