"""The loss-spike rule (``mpcourse.experiment.measure.spikes``) on planted curves and on real histories.

Planted: a clean curve, a noisy but healthy one, the same with one real spike, a curve whose noise
is larger than the spike, and the pattern that broke the earlier rule (one unusually easy batch,
then an ordinary one). Real: the histories in ``tests/experiment/measure/loss_histories.json``, each with the
command that made it (a 150-step compare run, three quick seeds' two, fp32 at a too-large
learning rate), where the spikes are known from the losses themselves (see the module docstring).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from mpcourse.experiment.measure.spikes import (SPIKE_MIN_JUMP, SPIKE_SIGMAS, consensus, find_spikes, finite_losses,
                                        robust_std)

DATA = json.loads((Path(__file__).parent / "loss_histories.json").read_text())


def hist(losses):
    return [{"step": i, "loss": math.nan if x is None else x} for i, x in enumerate(losses)]


def curve(n=150, noise=0.0, seed=0, start=4.6, end=2.5):
    """A training-like curve: exponential approach from ``start`` to ``end``, log-normal batch noise."""
    rng = random.Random(seed)
    return [(end + (start - end) * math.exp(-t / 25)) * math.exp(rng.gauss(0, noise)) for t in range(n)]


def test_a_clean_curve_has_no_spike_and_no_noise():
    s = find_spikes(hist(curve()))
    assert not s.spiked and s.against == "itself"
    assert s.noise == pytest.approx(0, abs=0.01) and s.threshold == pytest.approx(1 + SPIKE_MIN_JUMP)
    assert s.jump < 1.0                                    # a falling curve is always below its running median


@pytest.mark.parametrize("seed", range(20))
def test_noisy_but_healthy_curves_are_not_flagged(seed):
    losses = curve(noise=0.04, seed=seed)                  # the measured batch noise of the 150-step run
    s = find_spikes(hist(losses))
    assert not s.spiked, (s.jump, s.jump_step, s.threshold)
    assert s.noise == pytest.approx(0.04, rel=0.3)         # the rule measures the noise it was given


@pytest.mark.parametrize("size", [1.3, 1.5, 2.0])
def test_a_real_spike_is_flagged_at_its_step(size):
    losses = curve(noise=0.04, seed=3)
    losses[90] *= size
    s = find_spikes(hist(losses))
    assert s.spike_steps == [90] and s.jump_step == 90 and s.jump == pytest.approx(size, rel=0.15)


def test_the_threshold_follows_the_noise():
    quiet, loud = curve(noise=0.02, seed=1), curve(noise=0.10, seed=1)
    for losses in (quiet, loud):
        losses[80] *= 1.4
    assert find_spikes(hist(quiet)).spike_steps == [80]
    s = find_spikes(hist(loud))                            # 1.4 is 3.4 standard deviations of 10% noise
    assert not s.spiked and s.threshold == pytest.approx(math.exp(SPIKE_SIGMAS * s.noise))


def test_an_easy_batch_then_an_ordinary_one_is_not_a_spike():
    """The earlier rule (over 1.2x the lowest loss so far) fired here on every 150-step run."""
    losses = curve(noise=0.03, seed=2)
    losses[100] *= 0.85                                    # one easy batch
    assert not find_spikes(hist(losses)).spiked


def test_a_divergence_is_not_judged_and_a_short_run_is_not_either():
    losses = curve(noise=0.04, seed=4)[:60] + [math.inf, math.nan]
    s = find_spikes(hist(losses))
    assert not s.spiked and max(finite_losses(hist(losses))) == 59
    assert find_spikes(hist([4.6, 4.3, 4.1])).against is None
    assert find_spikes(hist([4.6, math.nan])).jump is None


def test_consensus_removes_the_batch_noise():
    """Runs on the same batches share the batch noise: a 35% spike, under 5 deviations of one run's
    own 8% noise, stands out against the median of the runs."""
    batch = curve(noise=0.08, seed=5)
    rngs = [random.Random(k) for k in range(5)]
    runs = [[x * math.exp(rng.gauss(0, 0.003)) for x in batch] for rng in rngs]
    runs[2][70] *= 1.35
    expected = consensus([hist(r) for r in runs])
    on_its_own = find_spikes(hist(runs[2]))
    assert not on_its_own.spiked
    judged = [find_spikes(hist(r), expected) for r in runs]
    assert [s.spike_steps for s in judged] == [[], [], [70], [], []]
    assert all(s.against == "consensus" for s in judged)
    assert consensus([hist(r) for r in runs[:2]]) == {}   # two runs are not a consensus


def test_robust_std_ignores_outliers():
    rng = random.Random(0)
    xs = [rng.gauss(0, 1) for _ in range(2000)]
    assert robust_std(xs) == pytest.approx(1.0, rel=0.1)
    assert robust_std(xs + [100.0] * 20) == pytest.approx(robust_std(xs), rel=0.05)


def judged(name):
    entry = DATA[name]
    runs = {r: hist(losses) for r, losses in entry["runs"].items()}
    expected = consensus(list(runs.values()))
    return {r: find_spikes(h, expected) for r, h in runs.items()}


def test_the_default_run_has_no_spike():
    reports = judged("default")
    assert len(reports) == 15 and reports["fp16-pure"].jump is None           # diverged at step 1
    assert not any(s.spiked for s in reports.values())
    assert max(s.jump for s in reports.values() if s.jump) < 1.12
    alone = [find_spikes(hist(losses)) for losses in DATA["default"]["runs"].values()]
    assert not any(s.spiked for s in alone)


def test_the_quick_runs_show_the_fp8_and_sr_spikes_and_nothing_else():
    seed0, seed2 = judged("quick_seed0"), judged("quick_seed2")
    assert {r: s.spike_steps for r, s in seed0.items() if s.spiked} == {"fp8-current": [11],
                                                                       "fp8-delayed": [11, 16]}
    assert {r: s.spike_steps for r, s in seed2.items() if s.spiked} == {"bf16-pure-sr": [19],
                                                                       "fp8-current": [19],
                                                                       "fp8-delayed": [19]}
    healthy = [s.jump for rs in (seed0, seed2) for s in rs.values() if s.jump and not s.spiked]
    assert max(healthy) < 1 + SPIKE_MIN_JUMP                                  # x1.19 at most


def test_a_too_large_learning_rate_spikes_on_its_own():
    losses = DATA["fp32_lr0.03"]["runs"]["fp32"]
    s = find_spikes(hist(losses))
    assert s.against == "itself" and s.spike_steps[:1] == [7] and s.jump > 1.5
