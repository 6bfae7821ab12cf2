"""What a run measures besides its losses: ``memory`` (bytes from the live tensors), ``speed`` (FLOPs per token,
FLOP/s and the fraction of the machine's peak), ``spikes`` (loss spikes in a history) and ``machine`` (which CPU
kind produced the run)."""
