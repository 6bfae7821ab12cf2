"""The break-even, measured: one linear layer's training GEMMs in a lower format, casts included, against the same
GEMMs in the higher format, over a sweep of M (tokens), K and N (the layer's width), all in one run.

    python benchmarks/breakeven_sweep.py [--out notebooks/data/11/breakeven-sweep.json] [--repeats 7] [--threads 1]

Per shape (x: M x K, W: N x K, output gradient g: M x N) it times what ``mpcourse.core.breakeven.linear_times``
models: the three GEMMs of a forward + backward (y = x W^T, dx = g W, dW = g^T x)

    high   the three GEMMs in the higher format, inputs already in it
    low    the casts of x, W and g into the lower format, then the three GEMMs in it
    cast   the casts alone (so the share of the casts is measured too)

and stores ``high / low`` (> 1: the lower format pays, casts included). Which pair is measured depends on the
machine (``pair`` in the JSON):

    CPU    FP32 against BF16 (``torch.mm`` in BF16: native on a CPU with BF16 units, avx512_bf16 / amx_bf16;
           elsewhere oneDNN's own conversion, which is slower than FP32, and the sweep then says so)
    CUDA   BF16 against FP8 E4M3 with tensorwise scales (amax, scale, cast; ``torch._scaled_mm``, the native FP8
           GEMM of Hopper and later), the pair of ``breakeven.H100_TORCHAO``

Timing: best of ``--repeats`` runs, the high and the low variant interleaved in every repeat so that both see
the same load (the machine may be shared: read ratios, not absolute times). The JSON also holds the
machine record (``mpcourse.experiment.measure.machine.describe``) and the constants a break-even model of this
machine needs (``model_chip``: the two GEMM rates and the casts' bandwidth at the largest shape, the cost of
a one-element cast), all measured in the same run. Under three minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpcourse.experiment.measure import machine  # noqa: E402

TOKENS = (32, 128, 512, 2048)                 # M
WIDTHS = (128, 256, 512, 1024, 2048)          # K = N


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def cpu_pair(M, K, N, device):
    """(high, low, cast) callables for FP32 vs BF16 on the CPU."""
    x, w, g = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)        # fp32

    def high():
        x @ w.t(); g @ w; g.t() @ x                                           # (M,N) (M,K) (N,K) fp32

    def cast():
        return x.bfloat16(), w.bfloat16(), g.bfloat16()                       # bf16 (M,K) (N,K) (M,N)

    def low():
        xb, wb, gb = cast()
        xb @ wb.t(); gb @ wb; gb.t() @ xb                                     # bf16 out, fp32 accumulation
    return high, low, cast


def cuda_pair(M, K, N, device):
    """(high, low, cast) callables for BF16 vs FP8 E4M3 tensorwise on CUDA (torch._scaled_mm)."""
    f8 = torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    x, w, g = (torch.randn(*s, device=device, dtype=torch.bfloat16) for s in ((M, K), (N, K), (M, N)))

    def q(t):                                                                 # amax, scale, cast (one layout)
        s = fmax / t.abs().amax().float().clamp(min=1e-12)
        return (t.float() * s).to(f8), s.reciprocal()

    def high():
        x @ w.t(); g @ w; g.t() @ x

    def cast():
        xq, sx = q(x); wq, sw = q(w); gq, sg = q(g)
        wtq, _ = q(w.t().contiguous()); xtq, _ = q(x.t().contiguous()); gtq, _ = q(g.t().contiguous())
        return xq, sx, wq, sw, gq, sg, wtq, xtq, gtq

    def low():
        xq, sx, wq, sw, gq, sg, wtq, xtq, gtq = cast()
        # _scaled_mm wants its second operand column-major: B = (row-major copy of B^T).t()
        torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)        # (M,N)
        torch._scaled_mm(gq, wtq.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)       # (M,K)
        torch._scaled_mm(gtq, xtq.t(), scale_a=sg, scale_b=sx, out_dtype=torch.bfloat16)      # (N,K)
    return high, low, cast


def measure(M, K, N, device, repeats) -> dict:
    make = cuda_pair if device.type == "cuda" else cpu_pair
    high, low, cast = make(M, K, N, device)
    high(); low(); cast()                                                    # warm-up
    best = {"high": float("inf"), "low": float("inf"), "cast": float("inf")}
    for _ in range(repeats):
        for name, fn in (("high", high), ("low", low), ("cast", cast)):
            best[name] = min(best[name], _timed(fn, device))
    return {"M": M, "K": K, "N": N, **{f"{k}_s": v for k, v in best.items()},
            "speedup": best["high"] / best["low"], "cast_share": best["cast"] / best["low"]}


def tiny_kernel_s(device, repeats) -> float:
    """The time of a one-element cast: the fixed cost of a kernel (launch, dispatch) on this machine."""
    tiny = torch.randn(1, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    low = torch.bfloat16 if device.type == "cpu" else torch.float8_e4m3fn
    return min(_timed(lambda: tiny.to(low), device) for _ in range(max(repeats, 20)))


def model_chip(rows: list[dict], kernel_s: float, cpu: bool) -> dict:
    """This machine's constants for ``breakeven.linear_times``, all from the sweep's own measurements: the two
    GEMM rates and the casts' bandwidth at the largest shape (so the model meets the measurement there), and
    the fixed cost of a kernel (``tiny_kernel_s``)."""
    r = max(rows, key=lambda r: r["M"] * r["K"] * r["N"])
    gemm_flops = 3 * 2.0 * r["M"] * r["K"] * r["N"]
    high_bytes, low_bytes = (4, 2) if cpu else (2, 1)
    # bytes each input element moves, as breakeven.linear_times counts them: CPU read + write once (no amax, one
    # layout); CUDA an amax read, then read + write of two FP8 layouts (its defaults)
    per_element = high_bytes + low_bytes if cpu else 2 * high_bytes + 2 * low_bytes
    moved = (r["M"] * r["K"] + r["N"] * r["K"] + r["M"] * r["N"]) * per_element
    return {"high_flops": gemm_flops / r["high_s"], "low_flops": gemm_flops / (r["low_s"] - r["cast_s"]),
            "mem_bw": moved / r["cast_s"], "min_kernel_s": kernel_s,
            "high_bytes": high_bytes, "low_bytes": low_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "notebooks" / "data" / "11" / "breakeven-sweep.json"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: on a shared machine a descheduled thread stalls every GEMM)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    device = torch.device(a.device)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    torch.set_num_threads(a.threads)
    if device.type == "cuda" and not hasattr(torch, "_scaled_mm"):
        p.error("this torch has no torch._scaled_mm (native FP8 GEMM); run with --device cpu")
    t0 = time.perf_counter()
    rows = []
    for C in WIDTHS:
        for M in TOKENS:
            rows.append(measure(M, C, C, device, a.repeats))
            r = rows[-1]
            print(f"M {M:5}  K=N {C:5}  speedup {r['speedup']:5.2f}x  casts {r['cast_share']:5.1%} of the low time",
                  flush=True)
    record = {
        "command": "python benchmarks/breakeven_sweep.py",
        "pair": ["float32", "bfloat16"] if device.type == "cpu" else ["bfloat16", "float8_e4m3fn"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "machine": machine.describe(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "platform": platform.platform(), "repeats": a.repeats, "tokens": list(TOKENS), "widths": list(WIDTHS),
        "model_chip": model_chip(rows, tiny_kernel_s(device, a.repeats), device.type == "cpu"), "rows": rows,
    }
    record["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    print(f"wrote {out} ({len(rows)} shapes, {record['seconds']:.0f} s, {machine.summary(record['machine'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
