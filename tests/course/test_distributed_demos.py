"""Lesson 10's workers on 4 gloo ranks (the notebook runs them on 2): the bytes each rank holds are ZeRO's counts,
sharding changes no weight, and a reduction's error stays within the first-order rounding bound.

Oracles: ZeRO's arithmetic (Rajbhandari et al. 2020, §3.1 and §5: 16, 2 + 2 + 12/N, 2 + (2 + 12)/N, 16/N bytes
per parameter per rank); DDP's weights after the same step; the recursive-summation bound (Higham 2002, §4.2):
a cast then a sum of N terms errs by at most N u times the sum of the magnitudes (N - 1 when the cast is exact).
"""
import pytest
import torch
import torch.distributed as dist

from mpcourse.course import distributed_demos as demos

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]


def test_sharding_holds_zeros_counts_and_changes_no_weight():
    world = 4
    res = demos.run(demos.sharding, world)
    zero = {"ddp": 16, "zero1": 2 + 2 + 12 / world, "zero2": 2 + (2 + 12) / world, "fsdp2": 16 / world}
    for r in res:
        for layout, want in zero.items():
            got = r[layout]["bytes"]
            assert sum(got.values()) / r[layout]["n_params"] == want, (layout, got)
        for layout in ("zero1", "zero2"):          # the same arithmetic, partitioned: bit for bit
            assert torch.equal(r[layout]["weights"], res[0]["ddp"]["weights"]), layout
        assert not r["fsdp2"]["bytes"]["weights"]     # FSDP2 keeps no BF16 copy between steps


@pytest.mark.parametrize("world", [2, 4])
def test_reduction_error_within_the_rounding_bound(world):
    res = demos.run(demos.reduce, world, ("fp32", "bf16"))
    u = {"fp32": 2.0**-24, "bf16": 2.0**-8}
    roundings = {"fp32": world - 1, "bf16": world}     # the FP32 cast of FP32 gradients rounds nothing
    for name in ("fp32", "bf16"):
        r = res[0][name]["max_vs_magnitudes"] / u[name]
        assert r <= roundings[name] * (1 + u[name]) ** world, (name, r)
        assert r > 0.5                                  # it does round: a bound that is nearly reached
