"""Loss spikes in a training history: steps whose loss jumped far above what was expected there.

Every recipe of one ``mpcourse compare`` trains the same initial model on the same batches, so the
batch-to-batch noise of the loss (about 4% a step on the default corpus, which mixes prose, tables
and code) is shared by all the runs of a seed. A spike is judged on a series ``x`` of log losses
from which that noise is removed where possible:

* **against the consensus** (with at least 3 runs on the same batches): ``x[t] = log(loss[t] /
  median of the runs' losses at t)``, the excess over what the recipes typically got on that batch;
  one run's spike or dip does not move a median. On the default run it moves by 0.002-0.005 a step
  (the batch noise cancels); a run that is persistently above or below the others has a gap, not
  a spike;
* **on its own** (fewer runs): ``x[t] = log(loss[t])``.

The **jump** at step t is ``exp(x[t] - median(x[t-10 .. t-1]))`` (from the 5th step on, with fewer
before it): the loss over the loss expected from the 10 steps before (a running median follows the
downward trend of training and ignores one unusually easy or hard batch). The series' **noise** is
the robust standard deviation of its step-to-step changes (1.4826 x their median absolute
deviation, over sqrt 2: the per-step noise, unmoved by a few spikes and by the trend). A **spike**
is a step whose jump exceeds both ``SPIKE_SIGMAS`` = 5 noise standard deviations and
``SPIKE_MIN_JUMP`` = 25% (``threshold``): 5 standard deviations of Gaussian noise happen once in
3.5 million steps, and the 25% is set between the largest jump of a healthy run and the smallest
real spike measured on this model:

* ``--steps 150`` (150 steps x 16 x 64 characters, seed 0, 14 recipes that do not diverge): against
  the consensus the largest jump is x1.10 (``torch-amp-fp16`` and ``fp16-dynamic`` at step 12,
  after the two steps they skip), every other under x1.06; on its own a run's noise is 0.030-0.037
  and its largest jump x1.10 (5 noise deviations: x1.16-x1.20). No spike, none visible on the plot.
* ``--quick --seeds 0,1,2`` (50 steps x 8): healthy jumps up to x1.19 against the consensus
  (``bf16-pure``, seed 0, step 38: 3.02 nats on a batch where the median run got 2.53); real spikes
  from x1.28 to x1.82: seed 0 ``fp8-current`` 4.71 at step 11 (median run 3.25, x1.45) and
  ``fp8-delayed`` at steps 11 and 16 (x1.39, x1.28); seed 2 ``bf16-pure-sr``, ``fp8-current`` and
  ``fp8-delayed`` at step 19 (5.13, 5.27, 6.10 against 3.36). On its own the seed-0 ``fp8-current``
  spike is only x1.22 above its running median (the loss still falls fast there): the consensus
  is what makes a recipe's spike stand out of the batch noise.
* fp32 alone with ``--lr 0.03``: 6.44 nats at step 7, x1.75 its running median.

``tests/experiment/measure/test_spikes.py`` replays these histories (``tests/experiment/measure/loss_histories.json``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

SPIKE_WINDOW = 10      # the steps before t whose median sets the expected value at t
MIN_WINDOW = 5         # the first step judged has this many steps before it
SPIKE_SIGMAS = 5.0     # a spike: a jump over this many noise standard deviations ...
SPIKE_MIN_JUMP = 0.25  # ... and over 25%
MIN_NOISE_STEPS = 8    # fewer steps than this: the noise is not measured, SPIKE_MIN_JUMP alone decides
MIN_CONSENSUS = 3      # runs needed on a step for their median to be its consensus loss


@dataclass(frozen=True)
class SpikeReport:
    """What :func:`find_spikes` measured on one history (steps are the history's ``step`` numbers)."""
    against: str | None = None           # "consensus" or "itself"; None: too short to judge
    jump: float | None = None            # the largest jump: loss over its expected value
    jump_step: int | None = None
    noise: float | None = None           # per-step noise of the judged series (None: too few steps)
    threshold: float | None = None       # the jump that counts as a spike in this run
    spike_steps: list = field(default_factory=list)

    @property
    def spiked(self) -> bool:
        return bool(self.spike_steps)

    def to_dict(self) -> dict:
        return {"against": self.against, "jump": self.jump, "jump_step": self.jump_step, "noise": self.noise,
                "threshold": self.threshold, "spike_steps": list(self.spike_steps)}


def robust_std(xs: list[float]) -> float:
    """1.4826 x the median absolute deviation: the standard deviation for Gaussian data, unmoved by outliers."""
    med = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - med) for x in xs)


def finite_losses(history: list[dict]) -> dict[int, float]:
    """``{step: loss}`` up to the first non-finite (or non-positive) loss: after it the run has diverged."""
    out = {}
    for h in history:
        loss = h["loss"]
        if loss is None or not math.isfinite(loss) or loss <= 0:
            break
        out[h["step"]] = float(loss)
    return out


def consensus(histories: list[list[dict]]) -> dict[int, float]:
    """``{step: median loss}`` over the runs (histories on the same batches) finite at that step, for
    the steps where at least ``MIN_CONSENSUS`` are."""
    per_step: dict[int, list[float]] = {}
    for h in histories:
        for step, loss in finite_losses(h).items():
            per_step.setdefault(step, []).append(loss)
    return {s: statistics.median(v) for s, v in per_step.items() if len(v) >= MIN_CONSENSUS}


def find_spikes(history: list[dict], expected: dict[int, float] | None = None) -> SpikeReport:
    """Spikes in ``history`` (records with ``step`` and ``loss``), judged against ``expected`` (the
    :func:`consensus` of runs on the same batches) where it covers every step ``history`` has, else
    on the run's own losses. Stops at the first non-finite loss (a divergence is not a spike)."""
    losses = finite_losses(history)
    against = "consensus" if losses and expected and all(s in expected for s in losses) else "itself"
    steps = list(losses)
    x = [math.log(losses[s] / expected[s]) if against == "consensus" else math.log(losses[s]) for s in steps]
    jumps = {i: x[i] - statistics.median(x[max(0, i - SPIKE_WINDOW):i]) for i in range(MIN_WINDOW, len(x))}
    if not jumps:
        return SpikeReport()
    diffs = [b - a for a, b in zip(x, x[1:])]
    noise = robust_std(diffs) / math.sqrt(2) if len(diffs) >= MIN_NOISE_STEPS else None
    limit = max(SPIKE_SIGMAS * (noise or 0.0), math.log1p(SPIKE_MIN_JUMP))
    top = max(jumps, key=jumps.get)
    return SpikeReport(against=against, jump=math.exp(jumps[top]), jump_step=steps[top], noise=noise,
                       threshold=math.exp(limit), spike_steps=[steps[i] for i, j in jumps.items() if j > limit])
