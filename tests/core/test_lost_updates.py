"""The library's lost-update rule (lesson 01) against an exact oracle, and the opt-in statistic it feeds.

Oracle: the exact sum of two FP16 values as a Python float (float64: exact, their significands are 11 bits
and at most 40 binades apart), rounded once to FP16 by NumPy's float64 -> float16 conversion (``npy_double_to_half``: round to nearest,
ties to even, straight from the double, no float32 step).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mpcourse.core.lost_updates import is_update_lost, lost_update_fraction
from mpcourse.core.seams import SeamError
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.training.train import TrainConfig, train
from mpcourse.experiment.gpt.model import GPTConfig


def _oracle(w: torch.Tensor, dw: torch.Tensor) -> list[bool]:
    out = []
    for a, b in zip(w.tolist(), dw.tolist()):
        out.append(b != 0 and float(np.float64(a + b).astype(np.float16)) == a)
    return out


def test_the_rule_matches_one_exact_rounding_including_ties():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4000, generator=g) * 4).half()
    dw = (torch.randn(4000, generator=g) * torch.logspace(-8, 0, 4000, base=2.0) * 1e-2).half()
    # exact half-spacing ties on both sides of an even and an odd significand, an update FP16 flushes to zero, a zero update
    w = torch.cat([w, torch.tensor([1.0, 1.0, 1.0 + 2**-10, 1.0 + 2**-10, 2.0**-14, 3.0], dtype=torch.float16)])
    dw = torch.cat([dw, torch.tensor([2**-11, -2**-12, 2**-11, -2**-11, 2**-25, 0.0], dtype=torch.float16)])
    got = is_update_lost(w, dw)
    assert got.dtype == torch.bool and got.tolist() == _oracle(w, dw)
    assert got[-6:].tolist() == [True, True, False, False, False, False]   # the ties go to the even neighbour
    assert 0 < int(got.sum()) < len(got)                                   # the draw has both answers


def test_the_fraction_counts_through_the_given_rule_and_checks_what_it_returns():
    w = [torch.tensor([1.0, 1.0, 2.0, 8.0], dtype=torch.float16)]
    before = [w[0].float()]
    after = [before[0] + torch.tensor([2**-12, 2**-8, 0.0, 1.0])]          # lost, kept, zero, kept
    assert lost_update_fraction(w, before, after) == 0.25
    assert lost_update_fraction(w, before, after, lambda w, dw: torch.ones_like(w, dtype=torch.bool)) == 1.0
    with pytest.raises(SeamError, match="is_update_lost returned dtype torch.int64, expected torch.bool"):
        lost_update_fraction(w, before, after, lambda w, dw: torch.zeros(w.shape, dtype=torch.int64))
    with pytest.raises(SeamError, match="is_update_lost returned shape"):
        lost_update_fraction(w, before, after, lambda w, dw: (dw != 0).flatten()[:2])


TINY = TrainConfig(steps=3, batch_size=2, eval_interval=3, eval_batches=1, seed=0,
                   model=GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))


def test_a_default_run_computes_no_statistic_and_the_rule_adds_one_without_changing_training():
    corpus = load_corpus()
    plain = train("fp16-master", corpus, TINY, progress=False)
    measured = train(get_recipe("fp16-master").with_functions({"is_update_lost": is_update_lost}), corpus, TINY,
                     progress=False)
    assert all("lost_updates" not in h for h in plain.history)
    assert all(0.0 <= h["lost_updates"] <= 1.0 for h in measured.history)
    assert [h["loss"] for h in plain.history] == [h["loss"] for h in measured.history]   # it only looks


def test_a_rule_that_ignores_ties_gives_a_different_lost_updates_row():
    from mpcourse.course.yours import train_yours

    def is_update_lost(w, dw):                               # strict half-spacing test: a tie counted as kept
        a = w.float().abs()
        spacing = torch.where(a >= 2**-14, torch.exp2(torch.floor(torch.log2(a)) - 10), torch.full_like(a, 2**-24))
        return (dw != 0) & (dw.float().abs() < spacing / 2)

    lines: list[str] = []
    (c,) = train_yours({"is_update_lost": is_update_lost}, ["fp16-master"], cfg=TINY, echo=lines.append)
    assert not c.identical and "lost_updates" in c.difference, c.verdict()
    assert "lost%" in lines[0]
