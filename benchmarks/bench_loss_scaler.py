"""Per-step time of mpcourse's DynamicLossScaler against torch.amp.GradScaler, measured in one run.

The step is the ``fp16-dynamic`` recipe's, identical for both except the scaler object: the compare
model (``GPTConfig()`` defaults, about 1M parameters) cast to FP16, an FP32 master copy stepped by
AdamW (``mpcourse.core.master.MasterWeights``), gradient clipping at 1.0 after unscaling::

    scaler.scale(loss).backward(); master.copy_grads_to_master(); scaler.unscale_(opt)
    clip_grad_norm_(master params, 1.0); scaler.step(opt); master.copy_master_to_model()
    scaler.update(); master.zero_grad()

Both scalers get the same configuration (init_scale 2**16, growth_interval 50) and the same batches.
(GradScaler cannot unscale FP16 gradients, so an FP16 model needs the FP32 master copy for both:
that is the fairest common ground.) The two variants are timed in interleaved repeats (ABAB...,
order alternating) so drift on a shared machine hits both alike; the ratio of the medians is the
number to read (target: <= 1.10x). A second table times only the scaler calls (unscale_, step with a
no-op optimizer, update) on the model's gradients, where any overhead would show undiluted.

    python benchmarks/bench_loss_scaler.py [--repeats 15] [--steps 3] [--threads N] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpcourse.core import emulation
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.core.emulation import tensor_cores
from mpcourse.core.master import MasterWeights, cast_model
from mpcourse.experiment.gpt.model import GPT, GPTConfig
from mpcourse.core.scaling import DynamicLossScaler

INIT_SCALE, GROWTH_INTERVAL = 2.0**16, 50


class NoOpOptimizer(torch.optim.Optimizer):
    """An optimizer whose step does nothing: isolates the scaler's own work in ``scaler.step``."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def make_scaler(kind: str, device: str):
    if kind == "mpcourse":
        return DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return torch.amp.GradScaler(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


class Setup:
    """One FP16 model + FP32 master + AdamW + a scaler of ``kind``; all setups start from the same init."""

    def __init__(self, kind: str, vocab_size: int, device: str):
        torch.manual_seed(0)
        self.model = cast_model(GPT(GPTConfig(vocab_size=vocab_size)).to(device), torch.float16)   # fp16 params
        self.master = MasterWeights(self.model, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.99), eps=1e-8)
        self.scaler = make_scaler(kind, device)

    def step(self, x, y):
        with tensor_cores():
            _, loss = self.model(x, y)                                   # fp32 ()
            self.scaler.scale(loss).backward()                           # fp16 grads of S * loss
        self.master.copy_grads_to_master()                               # fp32 master grads (scaled)
        self.scaler.unscale_(self.master.optimizer)                      # / S in fp32, inf/NaN check
        torch.nn.utils.clip_grad_norm_(self.master.master_params, 1.0)
        self.scaler.step(self.master.optimizer)                          # AdamW, or skip
        self.master.copy_master_to_model()                               # (a skipped step left the master as is)
        self.scaler.update()
        self.master.zero_grad()

    def scaler_only(self, noop, grads):
        """The scaler's calls alone, on fresh copies of one step's fp32 master gradients."""
        for m, g in zip(noop.param_groups[0]["params"], grads):
            m.grad = g.clone()
        t0 = time.perf_counter()
        self.scaler.unscale_(noop)
        self.scaler.step(noop)
        self.scaler.update()
        _sync(grads[0].device)
        return time.perf_counter() - t0


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats per variant (default 15)")
    p.add_argument("--steps", type=int, default=3, help="training steps per timed repeat (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus()
    cfg = GPTConfig(vocab_size=corpus.vocab_size)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(args.device) for t in corpus.batch("train", 16, cfg.block_size, gen))
               for _ in range(args.steps)]                               # (16, 64) int64 each
    setups = {k: Setup(k, corpus.vocab_size, args.device) for k in ("mpcourse", "torch")}
    label = {"mpcourse": "mpcourse DynamicLossScaler", "torch": "torch.amp.GradScaler"}
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads; {emulation.status()}")
    n = sum(q.numel() for q in setups["mpcourse"].model.parameters())
    print(f"compare model {n:,} params, FP16 + FP32 master AdamW, batch 16 x {cfg.block_size}; "
          f"{args.repeats} interleaved repeats x {args.steps} steps per variant")

    for s in setups.values():                                            # warm-up (lazy init, allocator)
        for x, y in batches:
            s.step(x, y)
    times = {k: [] for k in setups}
    order = list(setups)
    for r in range(args.repeats):
        for k in (order if r % 2 == 0 else order[::-1]):
            _sync(args.device)
            t0 = time.perf_counter()
            for x, y in batches:
                setups[k].step(x, y)
            _sync(args.device)
            times[k].append((time.perf_counter() - t0) / len(batches))

    # Scaler calls alone, on the gradients of one real step (fp32 master grads of the scaled loss).
    s = setups["mpcourse"]
    with tensor_cores():
        _, loss = s.model(*batches[0])
        (loss * INIT_SCALE).backward()
    s.master.copy_grads_to_master()
    grads = [m.grad.detach().clone() for m in s.master.master_params]
    s.master.zero_grad()
    only = {k: [] for k in setups}
    noops = {k: NoOpOptimizer([torch.zeros_like(g, requires_grad=True) for g in grads]) for k in setups}
    for r in range(args.repeats * 10):
        for k in (order if r % 2 == 0 else order[::-1]):
            only[k].append(setups[k].scaler_only(noops[k], grads))

    print(f"\n{'full training step':<30}{'median ms':>10}{'min ms':>9}")
    for k in setups:
        print(f"{label[k]:<30}{statistics.median(times[k]) * 1e3:>10.1f}{min(times[k]) * 1e3:>9.1f}")
    ratio = statistics.median(times["mpcourse"]) / statistics.median(times["torch"])
    per_repeat = sorted(a / b for a, b in zip(times["mpcourse"], times["torch"]))
    print(f"ratio mpcourse / torch (medians): {ratio:.3f}x  (per-repeat ratios: min {per_repeat[0]:.3f}, "
          f"median {statistics.median(per_repeat):.3f}, max {per_repeat[-1]:.3f}); target <= 1.10x: {ratio <= 1.10}")
    print(f"\n{'scaler calls only':<30}{'median ms':>10}{'min ms':>9}")
    for k in setups:
        print(f"{label[k]:<30}{statistics.median(only[k]) * 1e3:>10.3f}{min(only[k]) * 1e3:>9.3f}")
    print(f"ratio mpcourse / torch (medians): "
          f"{statistics.median(only['mpcourse']) / statistics.median(only['torch']):.3f}x")
    print(f"final scales (same decisions in both): mpcourse {setups['mpcourse'].scaler.get_scale():g}, "
          f"torch {setups['torch'].scaler.get_scale():g}")


if __name__ == "__main__":
    main()
