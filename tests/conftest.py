"""Shared test setup: deterministic threads and seeds; tensor-core emulation off unless a test asks."""
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
