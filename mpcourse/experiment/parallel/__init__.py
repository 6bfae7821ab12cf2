"""Runs over several processes (``torch.distributed`` on gloo): ``data_parallel`` (a recipe made DDP or FSDP2),
``distributed`` (``mpcourse compare --nproc N``: ranks, rendezvous, the data-parallel trainer), ``dist_checkpoint``
(save and resume with ``torch.distributed.checkpoint``) and ``reduce_precision`` (FP32 against BF16 gradient
reduction on the same FSDP2 run)."""
