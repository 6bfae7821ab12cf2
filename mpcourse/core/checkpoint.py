"""Checkpoint integrity: optimizer state checked against its parameters, and files with a checksum.

Two ways a resumed run goes wrong without an error (the reason this module exists):

* ``torch.optim.Optimizer.load_state_dict`` checks the number of groups and parameters, not the shapes of the
  state tensors: an ``exp_avg`` of shape (1,) or (4, 1) for a (4,) parameter loads, then broadcasts in the next
  step. `check_optimizer_state_dict` refuses that before anything is loaded.
* A truncated or bit-flipped file may still unpickle into plausible numbers. `save_checkpoint` writes a header
  with the payload's SHA-256 (FIPS 180-4) and length; `load_checkpoint` verifies both before ``torch.load``.

File layout: one ASCII line ``MPCOURSE-CHECKPOINT 1 sha256=<64 hex> bytes=<n>\\n``, then the ``torch.save`` bytes.
Writes go to a temporary file renamed into place, so a crash mid-write never leaves a half-written checkpoint
under the real name.
"""
from __future__ import annotations

import hashlib
import io
import os

import torch

MAGIC = b"MPCOURSE-CHECKPOINT"
VERSION = 1
#: optimizer state entries that hold one value per parameter element (torch.optim's elementwise states)
ELEMENTWISE_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                               "acc_delta", "sum", "grad_avg", "ax", "prev", "step_size", "exp_inf"})


class CheckpointError(ValueError):
    """A checkpoint that does not match what loads it, or a damaged checkpoint file."""


def check_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict, who: str = "optimizer") -> None:
    """Raise CheckpointError unless ``state_dict`` fits ``optimizer``: same groups and parameter counts, state only
    for known parameters, and every elementwise state tensor (``ELEMENTWISE_STATE``; any other entry the
    optimizer already holds) of its parameter's shape. Keys an optimizer class adds to its state_dict are named
    in its ``EXTRA_STATE_KEYS`` (e.g. ``LowPrecisionState``'s generator); an optimizer with a
    ``state_dict_mismatch(state_dict) -> str | None`` method (``BlockQuantizedAdamW``: state stored in another
    ``fmt`` or ``state_rule``) is asked too. Reads only; nothing is loaded."""
    extra = set(getattr(optimizer, "EXTRA_STATE_KEYS", ()))
    if not isinstance(state_dict, dict) or set(state_dict) - extra != {"state", "param_groups"}:
        raise CheckpointError(f"{who}: not an optimizer state_dict (expected the keys 'state' and 'param_groups', "
                              f"got {sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict)})")
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"])
                                               for g, s in zip(groups, saved_groups)):
        raise CheckpointError(f"{who}: the checkpoint has {[len(s['params']) for s in saved_groups]} parameters per "
                              f"group, this optimizer {[len(g['params']) for g in groups]}: build it over the same "
                              "model and parameter groups")
    params = {i: p for g, s in zip(groups, saved_groups) for i, p in zip(s["params"], g["params"])}
    for i, st in state_dict["state"].items():
        if i not in params:
            raise CheckpointError(f"{who}: state for parameter index {i}, which no parameter group lists")
        p = params[i]
        live = optimizer.state.get(p, {})
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            want = p.shape if k in ELEMENTWISE_STATE else getattr(live.get(k), "shape", None)
            if want is not None and v.shape != want:
                raise CheckpointError(f"{who}: state {k!r} of parameter {i} has shape {tuple(v.shape)}, the "
                                      f"parameter {tuple(want)}: the checkpoint belongs to another model")
    why = getattr(optimizer, "state_dict_mismatch", lambda sd: None)(state_dict)
    if why is not None:
        raise CheckpointError(f"{who}: {why}")


def save_checkpoint(obj, path) -> str:
    """``torch.save(obj)`` into ``path`` behind a header with its SHA-256; returns the hex digest."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(b"%s %d sha256=%s bytes=%d\n" % (MAGIC, VERSION, digest.encode(), len(payload)))
        f.write(payload)
    os.replace(tmp, path)
    return digest


def load_checkpoint(path, weights_only: bool = True):
    """Verify and load a file written by `save_checkpoint`; CheckpointError if it is damaged or not one."""
    with open(path, "rb") as f:
        header, payload = f.readline(), f.read()
    fields = header.split()
    try:
        ok = fields[0] == MAGIC and int(fields[1]) == VERSION
        digest = fields[2].split(b"=", 1)[1].decode() if fields[2].startswith(b"sha256=") else None
        length = int(fields[3].split(b"=", 1)[1]) if fields[3].startswith(b"bytes=") else None
    except (IndexError, ValueError):
        ok = False
    if not ok or digest is None or length is None:
        raise CheckpointError(f"{path} is not a checkpoint written by save_checkpoint (Trainer.save): its first "
                              f"line is {header[:80]!r}")
    if len(payload) != length:
        raise CheckpointError(f"{path} is truncated or padded: {len(payload)} bytes of payload, the header says "
                              f"{length}. The file is damaged: resume from an earlier checkpoint.")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise CheckpointError(f"{path} is corrupted: SHA-256 {actual} does not match the {digest} it was saved "
                              "with. Not resuming from damaged state: use an earlier checkpoint.")
    return torch.load(io.BytesIO(payload), weights_only=weights_only)


def extra_state_missing(state_dict: dict, prefix: str, missing_keys: list) -> bool:
    """For a module's ``_load_from_state_dict``: whether ``state_dict`` lacks the module's extra state (a checkpoint
    saved before the module kept one), in which case the key is taken off ``missing_keys`` (a ``strict`` load
    passes) and the caller starts its state fresh. Shared by the quantized linear layer and FP8 attention."""
    key = prefix + "_extra_state"
    if key in state_dict:
        return False
    if key in missing_keys:
        missing_keys.remove(key)
    return True
