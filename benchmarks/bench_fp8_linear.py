"""FP8 linear layer against BF16 ``nn.Linear`` (and torchao's ``Float8Linear`` when installed): forward + backward.

For M = K = N in {1024, 4096, 8192} on a CUDA GPU, times one forward + backward of a bias-free linear
layer with BF16 input, output and weights, and prints TFLOP/s, the ratio to BF16 and the fraction of the
chip's dense peak (BF16 peak for the BF16 row, FP8 peak for the FP8 rows). One forward + backward is three
GEMMs of 2*M*K*N FLOPs each (forward, input gradient, weight gradient); the FP8 rows' time includes their
amax, scale and cast work, as a training step pays it.

Every FP8 recipe the library has is measured: the ``fp8_recipe`` of each ``fp8-*`` recipe in the
``mpcourse compare`` registry, plus any other recipe class exported by ``mpcourse.core.quant`` that
``Float8Linear`` accepts with its defaults (``fp8_recipes()``), so a new recipe is picked up without
editing this file.

Dense peaks used (NVIDIA data sheets, SXM parts): H100 / H200 989 TFLOP/s BF16, 1979 FP8; L4 121 / 242;
L40S 362 / 733. Another GPU prints no fraction.

    python benchmarks/bench_fp8_linear.py                      # GPU: 1024, 4096, 8192; CPU: one small shape
    python benchmarks/bench_fp8_linear.py --recipe fp8-delayed --compile --sizes 8192

Eager mode runs every amax/scale/cast as separate kernels, which costs a few memory passes per tensor;
``--compile`` (torch.compile) fuses them, as torchao's published numbers do. On a CPU it measures the CPU
(torch._scaled_mm is computed in FP32 there): the numbers say nothing about a GPU.
``benchmarks/gpu_suite.py`` runs this sweep (eager and compiled) as part of one GPU session.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout

from mpcourse.core import quant  # noqa: E402
from mpcourse.core.quant import Float8Linear, fp8_autocast  # noqa: E402

PEAKS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0), "L40S": (362.0, 733.0), "L4": (121.0, 242.0)}


def peaks(device: torch.device):
    """(BF16, FP8) dense TFLOP/s of this GPU, or (None, None)."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAKS.items():
        if key in name:
            return value
    return None, None


def _accepted(recipe) -> bool:
    try:
        with torch.device("meta"):
            Float8Linear(16, 16, bias=False, recipe=recipe)
        return True
    except (TypeError, ValueError):
        return False


def fp8_recipes() -> dict:
    """{name: recipe instance}: the registry's ``fp8-*`` recipes, then other recipe classes of the quant package."""
    found: dict = {}
    try:
        from mpcourse.experiment.recipes import RECIPES
        for name, cls in RECIPES.items():
            recipe = getattr(cls, "fp8_recipe", None)
            if name.startswith("fp8") and recipe is not None and _accepted(recipe):
                found[name] = recipe
    except Exception as e:  # the registry failed to import: fall back to the quant package alone
        print(f"(recipe registry unavailable: {type(e).__name__}: {e})")
    covered = {type(r) for r in found.values()}
    for attr in quant.__all__:
        cls = getattr(quant, attr)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls not in covered:
            try:
                recipe = cls()
            except Exception:
                continue
            if _accepted(recipe):
                found[cls.__name__] = recipe
                covered.add(cls)
    return found


def time_fwd_bwd(module: nn.Module, x: torch.Tensor, iters: int, warmup: int, fp8_region: bool) -> float:
    """Median seconds of one forward + backward (the region exits per step, as in training)."""
    def step():
        if fp8_region:
            with fp8_autocast():
                y = module(x)
        else:
            y = module(x)
        y.backward(torch.ones_like(y))

    for _ in range(warmup):
        step()
    times = []
    cuda = x.device.type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def torchao_linear(base: nn.Linear):
    """torchao's Float8Linear (tensorwise) with a copy of ``base``'s weight, in an nn.Sequential; or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        config = Float8LinearConfig(emulate=base.weight.device.type != "cuda")
        return convert_to_float8_training(nn.Sequential(copy.deepcopy(base)), config=config)
    except Exception as e:  # ImportError, or a torchao built for another torch
        print(f"(torchao unavailable, its row is skipped: {type(e).__name__}: {e}; "
              "`pip install --no-deps torchao` adds it)")
        return None


def candidates(n: int, device: torch.device, recipes: dict, compile_: bool, backend: str = "inductor",
               with_torchao: bool = True, dynamic: bool | None = None):
    """(label, module, is_fp8, inside fp8_autocast) for BF16, every recipe in ``recipes``, and torchao;
    ``compile_``: each module under ``torch.compile(backend=backend, dynamic=dynamic)``."""
    base = nn.Linear(n, n, bias=False, device=device, dtype=torch.bfloat16)
    rows = [("bf16 nn.Linear", base, False, False)]
    for name, recipe in recipes.items():
        rows.append((f"mpcourse Float8Linear ({name})", Float8Linear.from_float(base, recipe=recipe), True, True))
    ao = torchao_linear(base) if with_torchao else None
    if ao is not None:
        rows.append(("torchao Float8Linear (tensorwise)", ao, True, False))
    if compile_:
        rows = [(label + " +compile", torch.compile(m, backend=backend, dynamic=dynamic), fp8, region)
                for label, m, fp8, region in rows]
    return rows


def main(argv=None):
    recipes = fp8_recipes()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", help="M = K = N values (default: 1024 4096 8192 on GPU, "
                                                            "256 on CPU)")
    parser.add_argument("--recipe", choices=["all", *recipes], default="all")
    parser.add_argument("--compile", action="store_true", help="torch.compile every module (fuses the casts)")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    if args.recipe != "all":
        recipes = {args.recipe: recipes[args.recipe]}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device.type == "cpu"
    sizes = args.sizes or ([256] if cpu else [1024, 4096, 8192])
    iters = args.iters or (3 if cpu else 20)
    bf16_peak, fp8_peak = peaks(device)
    if cpu:
        print("No CUDA GPU: measuring the CPU (torch._scaled_mm upcasts to FP32 here). These numbers are "
              "CPU numbers, not tensor-core numbers; run on a GPU of compute capability 8.9+ for those.")
    else:
        print(f"GPU: {torch.cuda.get_device_name(device)}, dense peaks used: BF16 {bf16_peak}, FP8 {fp8_peak} TFLOP/s")
    print(f"{'M=K=N':>6}  {'implementation':<44} {'ms':>9} {'TFLOP/s':>9} {'x BF16':>7} {'of peak':>8}")
    for n in sizes:
        torch.manual_seed(0)
        x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
        flops = 3 * 2 * n ** 3
        bf16_s = None
        for label, module, is_fp8, region in candidates(n, device, recipes, args.compile):
            secs = time_fwd_bwd(module, x, iters, warmup=1 if cpu else 5, fp8_region=region)
            bf16_s = secs if bf16_s is None else bf16_s
            tflops = flops / secs / 1e12
            peak = fp8_peak if is_fp8 else bf16_peak
            frac = f"{tflops / peak:8.1%}" if peak else f"{'-':>8}"
            print(f"{n:>6}  {label:<44} {secs * 1e3:9.3f} {tflops:9.3f} {bf16_s / secs:7.2f} {frac}")


if __name__ == "__main__":
    main()
