"""Regression cases for BF16 rounding and Kahan-compensated updates, each with the right value.

The arithmetic facts behind them: BF16 keeps 8 significant bits (7 stored), so the step after 1.0 is 2**-7 =
0.0078125 and the step after 256 is 2; nearest rounding cancels an update below half a step (Zamirai et al.
2020, "Revisiting BFloat16 Training"); stochastic rounding is unbiased (Gupta et al. 2015) and a
Kahan-compensated update keeps what the weight could not take (Zamirai et al. 2020, Algorithm 2). Oracles:
torch's own BF16 arithmetic and casts, FP64 sums, the binomial distribution.
"""
import math

import torch

from mpcourse.core.bf16 import BF16Optimizer, kahan_add_, stochastic_round_bf16
from mpcourse.core.formats import round_to
from mpcourse.core.master import MasterWeights


def bf16(v):
    return torch.tensor(v, dtype=torch.bfloat16)


def test_small_updates_are_swamped_in_bf16():
    assert float(bf16(1.0) + 1e-3) == 1.0                     # 1e-3 < half of 2**-7
    assert float(bf16(256.0) + 1) == 256.0                    # 257 is a tie between 256 and 258: even wins
    assert float(bf16(1.0) + 0.004) == 1.0078125              # 0.004 > 2**-8: rounds up one step
    # the library's rounding agrees with torch's arithmetic
    assert round_to(torch.tensor([1 + 1e-3, 257.0, 1.004]), "bf16").tolist() == [1.0, 256.0, 1.0078125]


def test_fp32_master_keeps_ten_small_updates():
    w = torch.nn.Parameter(bf16([1.0]))
    master = MasterWeights([w], torch.optim.SGD, lr=1e-3)
    naive = bf16([1.0])
    for _ in range(10):
        w.grad = bf16([-1.0])                                  # SGD step: +1e-3
        master.step()
        master.zero_grad()
        naive = naive + 1e-3
    assert abs(float(master.master_params[0].detach()) - 1.01) < 1e-6  # fp32: 1.0099999904632568
    assert float(w.detach()) == 1.0078125                      # the bf16 model holds the nearest value
    assert float(naive) == 1.0                                 # without the master: all ten lost


def test_stochastic_rounding_of_1_plus_1e3():
    x = torch.tensor(1 + 1e-3)                                 # fp32 1.00100004673
    lo, hi = 1.0, float(torch.nextafter(bf16(1.0), bf16(2.0)))  # torch's neighbours: 1.0, 1.0078125
    p = (float(x) - lo) / (hi - lo)
    assert abs(p - 0.128) < 1e-5
    n = 10_000
    r = stochastic_round_bf16(torch.full((n,), float(x)), torch.Generator().manual_seed(0)).double()
    assert set(r.unique().tolist()) == {lo, hi}
    sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)             # std of the mean of n draws: 2.6e-5
    assert abs(float(r.mean()) - 1.001) < 3 * sigma
    assert abs(float((r == hi).double().mean()) - 0.128) < 3 * math.sqrt(p * (1 - p) / n)


def test_sum_of_512_ones():
    ones = torch.ones(512, dtype=torch.bfloat16)
    assert float(ones.sum(dtype=torch.float32)) == 512.0      # accumulated in fp32
    acc = bf16(0.0)
    for v in ones:
        acc = acc + v                                          # accumulated in bf16, rounding each time
    assert float(acc) == 256.0                                 # stalls: 256 + 1 = 256


def test_kahan_ten_updates_of_1e3():
    w, comp = bf16([1.0]), bf16([0.0])
    for _ in range(10):
        kahan_add_(w, comp, torch.tensor([1e-3]))
    assert float(w) == 1.0078125
    assert abs(float(comp) - 0.0021875) < 5e-5                 # bf16 comp: 0.0022125 here
    assert abs(float(w) + float(comp) - 1.01) < 5e-5
    # the same through the optimizer wrapper (SGD, lr 1e-3, gradient -1)
    p = torch.nn.Parameter(bf16([1.0]))
    opt = BF16Optimizer(torch.optim.SGD([p], lr=1e-3), rounding="nearest", kahan=True)
    for _ in range(10):
        p.grad = bf16([-1.0])
        opt.step()
        opt.zero_grad()
    assert float(p.detach()) == 1.0078125 and abs(float(p.detach()) + float(opt.comp[0]) - 1.01) < 5e-5


def test_300_gradient_micro_batches():
    w = torch.nn.Parameter(bf16([0.5]))
    for _ in range(300):
        (w * 1.0).sum().backward()                             # gradient 1.0, accumulated by autograd in bf16
    assert w.grad.dtype == torch.bfloat16 and float(w.grad) == 256.0
    w.grad = None
    opt = BF16Optimizer(torch.optim.SGD([w], lr=0.0))
    for _ in range(300):
        (w * 1.0).sum().backward()
        opt.accumulate_grads()                                 # into the fp32 buffer
    assert opt.grads[0].dtype == torch.float32 and float(opt.grads[0]) == 300.0
