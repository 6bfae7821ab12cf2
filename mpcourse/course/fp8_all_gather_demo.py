"""Lesson 10's FP8 all-gather experiment, on two gloo ranks spawned from the notebook (a spawned process imports
its worker function, so it lives here).

``run(width, steps)`` trains a small MLP of two ``Float8Linear`` layers (current scaling, with biases) under
FSDP2 twice: all-gathering the FP32 weights and casting after the gather, then with
``mpcourse.core.quant.layers.fsdp_fp8.enable_fp8_all_gather`` (each rank casts its shard with the whole weight's scale).
It returns, per way, the loss history and the bytes this rank sent into FSDP2's all-gathers per step
(``mpcourse.experiment.parallel.data_parallel.AllGatherLog``, counted at FSDP2's all-gather).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

WORLD = 2


def _train(width: int, steps: int, fp8_all_gather: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    from mpcourse.core.quant import CurrentScaling, Float8Linear, autocast
    from mpcourse.core.quant.layers.fsdp_fp8 import enable_fp8_all_gather
    from mpcourse.experiment.parallel.data_parallel import AllGatherLog, counting_all_gather

    # FSDP2 warns that the root's output is a view (Float8Linear reshapes its (M, N) result); nothing here
    # modifies it in place, which is what the warning is about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.manual_seed(0)
    recipe = CurrentScaling()
    model = torch.nn.Sequential(Float8Linear(width, width, recipe=recipe), torch.nn.GELU(),
                                Float8Linear(width, width, recipe=recipe))
    if fp8_all_gather:
        enable_fp8_all_gather(model)
    log = AllGatherLog(model)
    for layer in model[::2]:
        layer.all_gather_record = log.fp8_pending
        fully_shard(layer)
    fully_shard(model)
    for m in (model[0], model[2], model):
        m.set_custom_all_gather(counting_all_gather(log))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(dist.get_rank()))   # this rank's rows
    losses = []
    for _ in range(steps):
        with autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / WORLD)                                  # the mean over the ranks
    return {"losses": losses, "bytes": log.per_step(steps)}


def both_ways(width: int, steps: int) -> dict:
    """On each rank: {"fp32" | "fp8": {"losses", "bytes"}}, the FP32 gather first."""
    return {way: _train(width, steps, way == "fp8") for way in ("fp32", "fp8")}


def run(width: int = 256, steps: int = 3) -> list[dict]:
    """[rank 0's, rank 1's] {"fp32" | "fp8": {"losses", "bytes"}}, on ranks spawned by ``distributed_demos.run``."""
    from .distributed_demos import run as run_on_ranks

    return run_on_ranks(both_ways, WORLD, width, steps)
