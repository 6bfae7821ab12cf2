"""One prepared GPU session: GPU-marked tests, FP8 GEMM and linear-layer rates, a GPT training step, in a budget.

A lent GPU is scarce (one H200 for about 15 minutes, start-up included), so everything that needs one runs
from this one command, in this order, each section skipped when the budget left is too small for it:

1. ``env``: torch, CUDA, the GPU and its capability.
2. ``tests``: ``pytest -m gpu tests`` in a subprocess (whatever GPU-marked tests exist: the CUDA autocast
   tables against ``torch.autocast("cuda")``, the GradScaler trajectory on CUDA, the FP8 GEMM / layer tests
   on CUDA), without nbval (``-o addopts=``) and past modules that fail to import there; the JUnit XML is
   parsed into counts and failures.
3. ``gemm``: the chip's measured BF16 GEMM rate (the practical ceiling for every row below) and the raw FP8
   ``torch._scaled_mm`` rates (tensorwise, with and without fast accumulation; rowwise; blockwise 1x128 x
   128x128 through ``torch.nn.functional.scaled_mm`` where this torch has it), on random data.
4. ``linear``: forward + backward of ``Float8Linear`` for every FP8 recipe the library has
   (``bench_fp8_linear.fp8_recipes()``) and torchao's ``Float8Linear`` when importable, against BF16
   ``nn.Linear``, at M = K = N in {1024, 4096, 8192}, eager; TFLOP/s, ratio to BF16, fraction of the dense
   peak (989 BF16 / 1979 FP8 TFLOP/s on an H100/H200) and of the measured BF16 ceiling.
5. ``train``: one training step of the GPT (n_embd 2048, 4 layers, 8192 tokens a step) for fp32,
   bf16-autocast, torch-amp-bf16 and every ``fp8-*`` recipe (and each FP8 recipe inside
   ``torch.autocast(bfloat16)``, as TE is usually run on GPUs).
6. ``linear_compile``: section 4 under ``torch.compile``, largest size first (compilation is slow).

Results go to ``$OUT/gpu_suite.json`` and ``$OUT/gpu_suite.md`` (``$OUT`` defaults to ``./gpu-out``),
rewritten after every row, so a run stopped early still leaves what it measured; a watchdog writes and
exits at the budget plus 30 s whatever is running. Timing: CUDA events around each region after warm-up,
the median of the timed repeats (``benchmarks/bench_fp8_linear.time_fwd_bwd``).

    python benchmarks/gpu_suite.py                  # on the GPU machine (default budget 480 s)
    bash benchmarks/gpu_suite.sh --budget-s 420     # the same, unbuffered, with a log in $OUT
    python benchmarks/gpu_suite.py --dry-run        # tiny shapes on the CPU in seconds (also automatic
                                                    # when no CUDA GPU is found); CPU numbers mean nothing

The GPU run's shapes and repeats are ``GPU_PLAN``; the dry run's (``DRY_PLAN``) only go through every code path
once: one size, one training step a recipe, torch.compile with the "eager" backend and static shapes, the
pytest subprocess without the installed plugins.

Runs from a plain copy of the repository (it puts the repository on ``sys.path``), needs no nbval, no
torchao and no network.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import bench_fp8_linear as bench  # noqa: E402

# Every shape, repeat count and per-row budget of a run, the GPU run and the CPU dry run side by side. The dry run
# only has to go through every code path once, as cheaply as it can: its numbers mean nothing.
GPU_PLAN = dict(
    sizes=(1024, 4096, 8192),                     # M = K = N of the linear sweep
    gemm_n=8192, gemm_iters=10, gemm_warmup=3,
    linear_iters=20, linear_warmup=5, linear_row_s=15, compile_row_s=60,
    compile_backend="inductor", compile_dynamic=None,  # torch.compile's default (dynamic shapes after a recompile)
    gpt=dict(n_embd=2048, n_head=16, n_layer=4, block_size=512, batch=16),   # vocab: the corpus's
    train_iters=3, train_warmup=2, train_row_s=25,
    train_autocast_rows=None,                     # every fp8-* recipe also inside torch.autocast(bf16)
    pytest_plugins=True,                          # the installed pytest plugins load as usual
)
DRY_PLAN = dict(
    sizes=(128,),        # the smallest size every granularity takes (1x128 tiles, 128x128 blocks)
    gemm_n=128, gemm_iters=3, gemm_warmup=1,
    linear_iters=1, linear_warmup=1, linear_row_s=5, compile_row_s=5,   # two calls: the second hits the cache
    compile_backend="eager",  # dynamo's trace of every recipe, not the C++ compiler
    compile_dynamic=False,    # static shapes: tracing the recompiles with symbolic shapes took half the time
    gpt=dict(n_embd=128, n_head=2, n_layer=1, block_size=16, batch=8),  # 128 tokens, widths of 128: every
                                                                        # block recipe fits
    train_iters=1, train_warmup=0, train_row_s=5,  # one step a recipe: the trainer's first (memory-counting) step
    train_autocast_rows=1,    # the wrapper's path once: the first fp8-* recipe inside torch.autocast(bf16)
    pytest_plugins=False,     # PYTEST_DISABLE_PLUGIN_AUTOLOAD=1: importing nbval, hypothesis, ... took most of it
)
TRAIN_RECIPES = ("fp32", "bf16-autocast", "torch-amp-bf16")  # then every fp8-* recipe of the registry


class Suite:
    """The results dict, the clock, and the two output files (rewritten after every row)."""

    def __init__(self, out_dir: str, budget_s: float, dry_run: bool, device: torch.device):
        self.out_dir, self.budget_s, self.dry_run, self.device = out_dir, budget_s, dry_run, device
        self.t0 = time.monotonic()
        self.lock = threading.RLock()
        os.makedirs(out_dir, exist_ok=True)
        self.results = {"meta": {"budget_s": budget_s, "dry_run": dry_run, "device": str(device),
                                 "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "complete": False, "skipped_sections": [], "errors": []},
                        "env": {}, "tests": {}, "gemm": [], "linear": [], "train": [], "linear_compile": []}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def add(self, section: str, row: dict) -> None:
        with self.lock:
            self.results[section].append(row)
        self.write()

    @contextlib.contextmanager
    def section(self, name: str, needs_s: float):
        """Run the body if ``needs_s`` seconds are left, record an exception instead of dying."""
        if self.remaining() < needs_s:
            print(f"[{self.elapsed():6.1f}s] skip {name}: {self.remaining():.0f} s left, needs {needs_s:.0f}")
            self.results["meta"]["skipped_sections"].append(name)
            self.write()
            yield False
            return
        print(f"[{self.elapsed():6.1f}s] {name}", flush=True)
        try:
            yield True
        except Exception as e:
            msg = f"{name}: {type(e).__name__}: {e}"
            print("  ERROR", msg, "\n", traceback.format_exc(limit=4), flush=True)
            self.results["meta"]["errors"].append(msg[:2000])
        self.write()

    def write(self, complete: bool = False, stopped: str | None = None) -> None:
        with self.lock:
            meta = self.results["meta"]
            meta["elapsed_s"] = round(self.elapsed(), 1)
            meta["complete"] = complete
            if stopped:
                meta["stopped"] = stopped
            text = json.dumps(self.results, indent=1, default=str)
            md = to_markdown(self.results)
        for name, content in (("gpu_suite.json", text), ("gpu_suite.md", md)):
            path = os.path.join(self.out_dir, name)
            with open(path + ".tmp", "w") as f:
                f.write(content)
            os.replace(path + ".tmp", path)


# -- timing helpers -----------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, iters: int, warmup: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# -- sections -----------------------------------------------------------------------------------------------

def section_env(suite: Suite) -> None:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpus": os.cpu_count()}
    if suite.device.type == "cuda":
        p = torch.cuda.get_device_properties(suite.device)
        env.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(suite.device)),
                   sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2 ** 30, 1))
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["commit"] = None
    env["fp8_recipes"] = list(bench.fp8_recipes())
    suite.results["env"] = env
    print("  ", env)


def parse_junit(path: str) -> dict:
    """Counts and the failing/erroring test ids with the first line of their message."""
    root = ET.parse(path).getroot()
    counts = dict(tests=0, passed=0, failures=0, errors=0, skipped=0)
    failed = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                if child.tag != "skipped":
                    msg = (child.get("message") or child.text or "").strip().splitlines()
                    failed.append(f"{case.get('classname')}::{case.get('name')} [{child.tag}] "
                                  f"{msg[0][:300] if msg else ''}")
        counts[{"passed": "passed", "failure": "failures", "error": "errors", "skipped": "skipped"}[outcome]] += 1
    counts["failed_tests"] = failed
    return counts


def section_tests(suite: Suite, paths: list, timeout_s: float, plugins: bool = True) -> None:
    """``plugins=False``: without the installed pytest plugins (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``)."""
    xml = os.path.join(suite.out_dir, "gpu_tests.xml")
    # -o addopts= drops the project's nbval options; a test module whose imports are missing on the GPU
    # machine (nbformat for the notebook tests) must not stop the GPU-marked tests of the other modules.
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={xml}", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if not plugins:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    t0 = time.monotonic()
    info = {"command": ("" if plugins else "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ") + " ".join(cmd[1:]),
            "timeout_s": round(timeout_s)}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        info["returncode"] = proc.returncode
        info["tail"] = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        info["returncode"] = "timeout"
        info["tail"] = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                        else (e.stdout or ""))[-3000:]
    info["seconds"] = round(time.monotonic() - t0, 1)
    if os.path.exists(xml):
        info.update(parse_junit(xml))
    suite.results["tests"] = info
    print(f"   pytest -m gpu: rc={info['returncode']} " +
          ", ".join(f"{k}={info.get(k)}" for k in ("tests", "passed", "failures", "errors", "skipped")))
    for line in info.get("failed_tests", [])[:20]:
        print("    ", line)


def _randn_fp8(shape, device, dtype, gen):
    return (torch.randn(shape, device=device, generator=gen) * 2).to(dtype)


def section_gemm(suite: Suite, n: int, iters: int, warmup: int) -> None:
    device = suite.device
    gen = torch.Generator(device=device).manual_seed(0)
    flops = 2 * n ** 3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    secs = time_fn(lambda: a @ b, device, iters, warmup)
    suite.results["meta"]["bf16_ceiling_tflops"] = flops / secs / 1e12
    suite.add("gemm", dict(kind="bf16 torch.matmul (ceiling)", n=n, ms=secs * 1e3, tflops=flops / secs / 1e12))
    a8 = _randn_fp8((n, n), device, torch.float8_e4m3fn, gen)  # (M, K) row-major
    b8 = _randn_fp8((n, n), device, torch.float8_e4m3fn, gen).t()  # (K, N) column-major
    one = torch.ones((), device=device)
    variants = [
        ("fp8 _scaled_mm tensorwise, fast accum", lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)),
        ("fp8 _scaled_mm tensorwise", lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
        ("fp8 _scaled_mm rowwise", lambda: torch._scaled_mm(
            a8, b8, scale_a=torch.ones(n, 1, device=device), scale_b=torch.ones(1, n, device=device),
            out_dtype=torch.bfloat16)),
    ]
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and n % 128 == 0:
        # DeepSeek-V3's blockwise scaling: A's scales per 1x128 block (M, K/128), B's per 128x128 (K/128, N/128).
        # Which scale layouts this torch/cuBLAS takes is not documented per version: try each, keep the first.
        st, kb = F.ScalingType, n // 128
        layouts = {"sa M-major": torch.ones(kb, n, device=device).t(), "sa K-major": torch.ones(n, kb, device=device)}
        layouts_b = {"sb row-major": torch.ones(kb, kb, device=device),
                     "sb col-major": torch.ones(kb, kb, device=device).t().contiguous().t()}
        chosen, errors = None, []
        for (la, sa), (lb, sb) in ((x, y) for x in layouts.items() for y in layouts_b.items()):
            try:
                F.scaled_mm(a8, b8, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)
                chosen = (f"{la}, {lb}", sa, sb)
                break
            except Exception as e:
                errors.append(f"{la}, {lb}: {type(e).__name__}: {' '.join(str(e).split())[:600]}")
        if chosen is None:
            suite.add("gemm", dict(kind="fp8 F.scaled_mm blockwise 1x128 x 128x128", n=n, error=" / ".join(errors)))
        else:
            label, sa, sb = chosen
            variants.append((f"fp8 F.scaled_mm blockwise 1x128 x 128x128 ({label})", lambda: F.scaled_mm(
                a8, b8, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)))
    for kind, fn in variants:
        try:
            secs = time_fn(fn, device, iters, warmup)
            suite.add("gemm", dict(kind=kind, n=n, ms=secs * 1e3, tflops=flops / secs / 1e12))
        except Exception as e:  # an unsupported scaling mode on this device/torch: recorded, not fatal
            suite.add("gemm", dict(kind=kind, n=n, error=f"{type(e).__name__}: {str(e)[:300]}"))
    for row in suite.results["gemm"]:
        print(f"   {row['kind']:<46} n={n}: " + (f"{row['tflops']:8.1f} TFLOP/s" if "tflops" in row else row["error"]))


def linear_rows(suite: Suite, section: str, sizes, compile_: bool, iters: int, warmup: int,
                per_row_s: float, backend: str, dynamic: bool | None = None) -> None:
    device = suite.device
    bf16_peak, fp8_peak = bench.peaks(device)
    recipes = bench.fp8_recipes()
    for n in sizes:
        torch.manual_seed(0)
        x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
        flops = 3 * 2 * n ** 3
        bf16_s, y_ref = None, None
        rows = bench.candidates(n, device, recipes, compile_, backend, dynamic=dynamic)
        for label, module, is_fp8, region in rows:
            if suite.remaining() < per_row_s:
                print(f"   budget: stop {section} before {label} at n={n}")
                suite.results["meta"]["skipped_sections"].append(f"{section}: {label} n={n} and later")
                return
            row = dict(n=n, impl=label, compile=compile_)
            try:
                t0 = time.monotonic()
                secs = bench.time_fwd_bwd(module, x, iters, warmup=warmup, fp8_region=region)
                rel_err = None
                if not compile_:  # sanity of the numbers: relative error against the BF16 layer (a no_grad call
                    with torch.no_grad():  # of a compiled module would compile it once more)
                        y = module(x).float()
                    y_ref = y if y_ref is None else y_ref
                    rel_err = float((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30))
                tflops = flops / secs / 1e12
                bf16_s = secs if bf16_s is None else bf16_s
                peak = fp8_peak if is_fp8 else bf16_peak
                ceiling = suite.results["meta"].get("bf16_ceiling_tflops")
                row.update(ms=secs * 1e3, tflops=tflops, x_bf16=bf16_s / secs,
                           frac_peak=tflops / peak if peak else None,
                           frac_bf16_ceiling=tflops / ceiling if ceiling else None,
                           rel_err_vs_bf16=rel_err,
                           wall_s=round(time.monotonic() - t0, 1))
                print(f"   {n:>5} {label:<54} {secs * 1e3:9.3f} ms {tflops:8.1f} TFLOP/s x{bf16_s / secs:5.2f}")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"   {n:>5} {label:<54} ERROR {row['error'][:200]}")
            suite.add(section, row)
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()


def train_step_rows(suite: Suite, cfg: dict, iters: int, warmup: int, per_row_s: float,
                    autocast_rows: int | None = None) -> None:
    """ms per training step of the course's GPT for each recipe: the trainer's own step
    (``Trainer.train_step``: one batch of the embedded corpus, forward in the recipe's context, backward, the
    recipe's step, zero_grad), timed after ``warmup`` steps; ``+ torch.autocast(bf16)`` rows wrap the forward
    in BF16 autocast as TE is usually run on GPUs (the first ``autocast_rows`` fp8 recipes; None: all). Each
    step reads its loss back (the trainer's record), so a CUDA step ends synchronised."""
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.gpt.model import GPTConfig
    from mpcourse.experiment.recipes import RECIPES
    from mpcourse.experiment.training.train import TrainConfig, Trainer

    class AutocastTrainer(Trainer):
        def forward_loss(self, x, y):
            with torch.autocast(self.cfg.device, dtype=torch.bfloat16):
                return super().forward_loss(x, y)

    device = suite.device
    corpus = load_corpus()
    batch = cfg["batch"]
    gcfg = GPTConfig(**{k: v for k, v in cfg.items() if k not in ("batch", "vocab_size")})
    names = [n for n in TRAIN_RECIPES if n in RECIPES] + [n for n in RECIPES if n.startswith("fp8")]
    amp_names = [n for n in names if n.startswith("fp8")][:autocast_rows]
    variants = [(n, False) for n in names] + [(n, True) for n in amp_names]
    tokens = batch * gcfg.block_size
    tcfg = TrainConfig(steps=warmup + iters + 1, batch_size=batch, eval_interval=10 ** 9, model=gcfg,
                       device=device.type)
    suite.results["meta"]["train_config"] = dict(cfg, tokens_per_step=tokens)
    for name, with_amp in variants:
        label = name + (" + torch.autocast(bf16)" if with_amp else "")
        if suite.remaining() < per_row_s:
            suite.results["meta"]["skipped_sections"].append(f"train: {label} and later")
            return
        row = dict(recipe=label)
        try:
            trainer = (AutocastTrainer if with_amp else Trainer)(name, corpus, tcfg)
            row["params"] = trainer.recipe.model.num_params()
            losses = []

            def step():
                losses.append(trainer.train_step()["loss"])

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            secs = time_fn(step, device, iters, warmup)
            row.update(ms=secs * 1e3, tokens_per_s=tokens / secs, loss_first=losses[0],
                       loss_last=losses[-1], finite=all(math.isfinite(v) for v in losses))
            if device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
            print(f"   {label:<40} {secs * 1e3:9.1f} ms/step {tokens / secs:12.0f} tok/s loss {row['loss_last']:.3f}")
            del trainer
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"   {label:<40} ERROR {row['error'][:200]}")
        suite.add("train", row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in suite.results["train"] if r["recipe"] == "fp32" and "ms" in r), None)
    for r in suite.results["train"]:
        if base and "ms" in r:
            r["x_fp32"] = base["ms"] / r["ms"]


# -- report -------------------------------------------------------------------------------------------------

def _f(v, fmt="{:.2f}"):
    if v is None:
        return "-"
    return fmt.format(v) if isinstance(v, (int, float)) else str(v)


def _cell(text: str, limit: int = 120) -> str:
    """One markdown table cell: no newlines or pipes."""
    return " ".join(str(text).split()).replace("|", "/")[:limit]


def to_markdown(res: dict) -> str:
    meta, env = res["meta"], res["env"]
    out = ["# GPU suite results", "",
           f"Device: {env.get('gpu', meta['device'])} (capability {env.get('capability')}), torch {env.get('torch')}, "
           f"CUDA {env.get('cuda')}; commit {env.get('commit')}; dry run: {meta['dry_run']}; "
           f"complete: {meta['complete']} after {meta.get('elapsed_s')} s of a {meta['budget_s']} s budget.", ""]
    if meta["dry_run"]:
        out += ["**Dry run (CPU, tiny shapes): these numbers say nothing about a GPU.**", ""]
    t = res["tests"]
    if t:
        out += ["## GPU-marked tests", "", f"`{t.get('command')}`: return code {t.get('returncode')}, "
                f"{t.get('tests')} tests, {t.get('passed')} passed, {t.get('failures')} failed, {t.get('errors')} "
                f"errors, {t.get('skipped')} skipped ({t.get('seconds')} s).", ""]
        out += [f"- {_cell(line, 400)}" for line in t.get("failed_tests", [])] + [""]
    if res["gemm"]:
        out += ["## GEMM rates (random data)", "", "| GEMM | n | ms | TFLOP/s |", "|---|---:|---:|---:|"]
        out += [f"| {r['kind']} | {r['n']} | {_f(r.get('ms'), '{:.3f}')} | {_f(r.get('tflops'), '{:.1f}')} |"
                if "error" not in r else f"| {r['kind']} | {r['n']} | error | {_cell(r['error'])} |"
                for r in res["gemm"]]
        out.append("")
    for section, title in (("linear", "Linear layer forward + backward, eager"),
                           ("linear_compile", "Linear layer forward + backward, torch.compile")):
        rows = res[section]
        if not rows:
            continue
        out += [f"## {title}", "", "Peaks: 989 TFLOP/s BF16, 1979 FP8 (dense); ceiling: the measured BF16 GEMM rate.", "",
                "| M=K=N | implementation | ms | TFLOP/s | x BF16 | of peak | of BF16 ceiling | rel. err vs BF16 |",
                "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "error" in r:
                out.append(f"| {r['n']} | {r['impl']} | error | {_cell(r['error'])} | | | | |")
            else:
                out.append(f"| {r['n']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['x_bf16']:.2f} | "
                           f"{_f(r['frac_peak'], '{:.1%}')} | {_f(r['frac_bf16_ceiling'], '{:.1%}')} | "
                           f"{_f(r['rel_err_vs_bf16'], '{:.2e}')} |")
        out.append("")
    if res["train"]:
        out += ["## GPT training step", "", f"Config: {meta.get('train_config')}", "",
                "| recipe | ms/step | tokens/s | x fp32 | loss (last) | finite | peak GiB |",
                "|---|---:|---:|---:|---:|---|---:|"]
        for r in res["train"]:
            if "error" in r:
                out.append(f"| {r['recipe']} | error | {_cell(r['error'])} | | | | |")
            else:
                out.append(f"| {r['recipe']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {_f(r.get('x_fp32'))} | "
                           f"{r['loss_last']:.3f} | {r['finite']} | {_f(r.get('peak_mem_gib'))} |")
        out.append("")
    if meta["skipped_sections"] or meta["errors"]:
        out += ["## Skipped and errors", ""] + [f"- skipped: {s}" for s in meta["skipped_sections"]]
        out += [f"- error: {_cell(e, 300)}" for e in meta["errors"]] + [""]
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop by itself after this many seconds")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-out", help="output folder (default $OUT or "
                                                                                  "./gpu-out)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    parser.add_argument("--sizes", type=int, nargs="*", help="M = K = N of the linear sweep")
    parser.add_argument("--tests-path", nargs="*", default=["tests"], help="what pytest -m gpu collects")
    parser.add_argument("--tests-timeout-s", type=float, default=180.0)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["tests", "gemm", "linear", "train", "linear_compile"])
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("No CUDA GPU found: running the dry run (tiny shapes on the CPU).")
    dry = not cuda
    device = torch.device("cuda" if cuda else "cpu")
    suite = Suite(args.out, args.budget_s, dry, device)
    plan = DRY_PLAN if dry else GPU_PLAN
    sizes = args.sizes or plan["sizes"]

    def watchdog():
        print(f"[{suite.elapsed():6.1f}s] budget watchdog: writing partial results and exiting", flush=True)
        try:
            suite.write(stopped="watchdog")
        finally:
            os._exit(3)
    timer = threading.Timer(args.budget_s + 30.0, watchdog)
    timer.daemon = True
    timer.start()

    with suite.section("env", 0) as ok:
        if ok:
            section_env(suite)
    if "tests" not in args.skip:
        with suite.section("tests", 30) as ok:
            if ok:
                section_tests(suite, args.tests_path, min(args.tests_timeout_s, max(10.0, suite.remaining() - 120)),
                              plugins=plan["pytest_plugins"])
    if "gemm" not in args.skip:
        with suite.section("gemm", 15) as ok:
            if ok:
                section_gemm(suite, plan["gemm_n"], iters=plan["gemm_iters"], warmup=plan["gemm_warmup"])
    if "linear" not in args.skip:
        with suite.section("linear", 20) as ok:
            if ok:
                linear_rows(suite, "linear", sizes, False, plan["linear_iters"], plan["linear_warmup"],
                            per_row_s=plan["linear_row_s"], backend=plan["compile_backend"])
    if "train" not in args.skip:
        with suite.section("train", 30) as ok:
            if ok:
                train_step_rows(suite, plan["gpt"], iters=plan["train_iters"], warmup=plan["train_warmup"],
                                per_row_s=plan["train_row_s"], autocast_rows=plan["train_autocast_rows"])
    if "linear_compile" not in args.skip:
        with suite.section("linear_compile", 30) as ok:
            if ok:
                linear_rows(suite, "linear_compile", sorted(sizes, reverse=True), True, plan["linear_iters"],
                            plan["linear_warmup"], per_row_s=plan["compile_row_s"], backend=plan["compile_backend"],
                            dynamic=plan["compile_dynamic"])
    timer.cancel()
    suite.write(complete=True)
    print(f"[{suite.elapsed():6.1f}s] done: {os.path.join(args.out, 'gpu_suite.md')}")
    print(to_markdown(suite.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
