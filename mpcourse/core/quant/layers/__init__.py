"""What a model holds and calls: the FP8 GEMMs, the linear layers, FP8 weights, FSDP2's FP8 all-gather hooks
and the filters that pick which layers convert.

``gemm`` (one per-tensor FP8 GEMM through ``torch._scaled_mm``) and ``block_gemm`` (block-scaled GEMMs),
``linear`` (``QuantizedLinear`` and ``convert_to_float8_training``) and ``block_linear`` (its autograd function
under a finer-grained recipe), ``fp8_weights`` (weights held only in FP8), ``fsdp_fp8`` (FP8 all-gather under
FSDP2), ``module_filter`` (which layers stay high). Layers take their quantizers and kernels from the engine.
"""
