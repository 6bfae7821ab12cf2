"""Shared test setup: deterministic threads and seeds; tensor-core emulation off unless a test asks."""
import os

import pytest
import torch

# At most 2 threads; under pytest-xdist (`-n N`) the cores are shared among the N workers (each worker
# running 2 threads on a 2-core machine would only make them wait for each other).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    """Say up front which torch release the exact autocast-table tests need (they skip on others)."""
    import re

    from mpcourse.core.autocast import policy
    m = re.match(r"(\d+\.\d+)", torch.__version__)
    line = (f"mpcourse: torch {torch.__version__}; the exact autocast-table tests were checked against "
            f"torch {policy.TORCH_VERSION}")
    if not m or m.group(1) != policy.TORCH_VERSION:
        line += (f" -- on this torch they are SKIPPED (reasons listed at the end); install torch=="
                 f"{policy.TORCH_VERSION}.* to run them")
    return line
