"""The amax all-reduce of delayed scaling over two gloo ranks on the CPU.

TE (``transformer_engine/pytorch/quantization.py`` ``reduce_and_update_fp8_tensors``): with
``reduce_amax=True`` and torch.distributed initialized, the amaxes are all-reduced with MAX before the
update, so every rank gets the same scales; with ``reduce_amax=False`` each rank keeps its own.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mpcourse.core.quant import DelayedScaling, Float8Linear, fp8_autocast

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        out = {}
        for reduce_amax in (True, False):
            torch.manual_seed(0)
            recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
            layer = Float8Linear(16, 16, bias=False, recipe=recipe)
            x = torch.full((4, 16), 2.0 * (rank + 1))  # rank 0: amax 2, rank 1: amax 4
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.backward(torch.full_like(y, 1.0 + rank))  # gradient amax 1 and 2
            out[reduce_amax] = {r: s.state_dict() for r, s in layer.scaling_state.items()}
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_amax_all_reduce_over_two_ranks():
    with tempfile.TemporaryDirectory() as d:  # one spawn for both settings: starting ranks is the slow part
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        states = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(2)]
    scales = {flag: [(float(s[flag]["input"]["scale"]), float(s[flag]["grad_output"]["scale"])) for s in states]
              for flag in (True, False)}
    assert scales[True] == [(112.0, 28672.0)] * 2  # reduce_amax: 448 / max(2, 4) and 57344 / max(1, 2) on both
    assert scales[False] == [(224.0, 57344.0), (112.0, 28672.0)]  # each rank its own amax
