"""What the launcher told this process: torchrun's environment, read without importing torch.

``torchrun --nproc-per-node N -m mpcourse compare ...`` starts N processes and gives each ``RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torch ``distributed/run.py``; the elastic agent sets them
before it starts a worker). ``mpcourse compare`` checks its flags against ``WORLD_SIZE`` there, as it checks them
against ``--nproc``, so that a run torchrun starts is refused with the same one line, before any process group.

A refusal under torchrun (``say_once``): every rank reaches the same verdict (the same flags, the same
``WORLD_SIZE``); rank 0 prints the line and every rank writes it into its torchelastic error file
(``TORCHELASTIC_ERROR_FILE``, which the agent sets per worker and reads back when the worker exits non-zero:
``torch/distributed/elastic/multiprocessing/errors``; the object has the shape its
``ErrorHandler.record_exception`` writes), so the agent's failure report shows that line where it would otherwise
show "To enable traceback see ...". The agent's own report and exit status (1) are torchrun's.
"""
from __future__ import annotations

import json
import os
import sys
import time

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (``torch.distributed.run``) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launcher_world_size() -> int | None:
    """The number of processes torchrun started (``WORLD_SIZE``, every node's), or None outside torchrun."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None


def launcher_rank() -> int:
    """This process's rank under torchrun (``RANK``); 0 outside torchrun."""
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def say_once(line: str) -> None:
    """Print ``line`` on stderr, once for the whole job: here, or on rank 0 of a torchrun job (every rank then
    writes it into its torchelastic error file; see the module docstring)."""
    if launcher_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE) if launched_by_torchrun() else None
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:                     # the report then says what it says without it
            pass
