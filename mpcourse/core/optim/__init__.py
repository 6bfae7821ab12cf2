"""Optimizer state in fewer bits (lesson 11): AdamW whose moments are stored below FP32, one module per format.

* ``state``: ``LowPrecisionState``, AdamW moments stored in BF16, rounded to nearest or stochastically
  (DeepSeek-V3's BF16 moments, arXiv 2412.19437 section 3.3.3).
* ``fp8`` and ``int8``: the block-quantized codes of torchao's ``AdamWFp8`` (E4M3, one FP32 scale per block) and
  ``AdamW8bit`` (Dettmers et al. 2021's dynamic map, arXiv 2110.02861), as plain rules.
* ``blockwise``: ``BlockQuantizedAdamW``, the AdamW step over either storage (``adamw_step``), its second-moment
  rule (``state_rule``) and what its checkpoints record.
* ``shards``: the same blocks over FSDP2's row shards (each block's scale the whole tensor's).
* ``moment_decay``: the measurements lesson 11 reads (how a stored second moment decays when gradients stop).
"""
