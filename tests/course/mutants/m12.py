"""Lesson 12's mutants: learner-plausible wrong versions of ``diagnose(log)``.

Each is the solution's rule with one mistake a learner makes: a statistic read the wrong way (the worst step for
the mean, the mean for the worst step, the last step), a gap taken absolute, against the final loss, from the
last training loss or in both directions, a threshold tie, a percentage read as a fraction, the steps before the
dying one miscounted (off by one on either end, counted from 1), inf tested where None also means NaN, a skipped
step's inf counted as overflow, the questions asked in the wrong order, a cause outside CAUSES.
"""

_HEAD = '''def diagnose(log):
    n = len(log["loss"])
'''

_SCALE = '''    if log["loss_scale"][0] is not None and sum(log["skipped"]) > n / 2:
        return "scale_too_high"
'''

_DEATH = '''    bad = next((i for i, v in enumerate(log["loss"]) if v is None), None)
    if bad is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(bad)):
            return "gradient_overflow"
        if any(log["weight_amax"][j] is None for j in range(bad)):
            return "optimizer_state"
        return "forward_overflow"
'''

_SPIKE = '''    if max((s for s in log["fp8_saturated"] if s is not None), default=0.0) > 0.01:
        return "fp8_amax_spike"
'''

_UNDER = '''    gap = log["final_train_loss"] / log["reference_loss"] - 1
    if gap > 0.04 and sum(log["grad_zero_fraction"]) / n > 0.1:
        return "gradient_underflow"
    return "healthy"
'''


def _rule(scale=_SCALE, death=_DEATH, spike=_SPIKE, under=_UNDER, order=("scale", "death", "spike", "under")):
    parts = {"scale": scale, "death": death, "spike": spike, "under": under}
    return _HEAD + "".join(parts[p] for p in order)


def _sub(block: str, old: str, new: str) -> str:
    assert old in block, old
    return block.replace(old, new)


MUTANTS = {"diagnose": [
    # -- the zero fraction: the mean over all n steps is meant
    ("worst step's zero fraction for the mean", _rule(under=_sub(
        _UNDER, 'sum(log["grad_zero_fraction"]) / n', 'max(log["grad_zero_fraction"])'))),
    ("last step's zero fraction for the mean", _rule(under=_sub(
        _UNDER, 'sum(log["grad_zero_fraction"]) / n', 'log["grad_zero_fraction"][-1]'))),
    ("zero threshold read as a percentage (10 for 0.1)", _rule(under=_sub(_UNDER, "> 0.1:", "> 10:"))),
    # -- the gap: relative to the reference, from final_train_loss, above only
    ("absolute gap final - reference > 0.04", _rule(under=_sub(
        _UNDER, 'log["final_train_loss"] / log["reference_loss"] - 1', 'log["final_train_loss"] - log["reference_loss"]'))),
    ("absolute gap with a threshold tuned to 4% of 2.5 (0.1)", _rule(under=_sub(_sub(
        _UNDER, 'log["final_train_loss"] / log["reference_loss"] - 1', 'log["final_train_loss"] - log["reference_loss"]'),
        "gap > 0.04", "gap > 0.1"))),
    ("gap relative to the final loss, not the reference", _rule(under=_sub(
        _UNDER, 'log["final_train_loss"] / log["reference_loss"] - 1',
        '(log["final_train_loss"] - log["reference_loss"]) / log["final_train_loss"]'))),
    ("gap from the last training loss, not final_train_loss", _rule(under=_sub(
        _UNDER, 'log["final_train_loss"] / log["reference_loss"]', 'log["loss"][-1] / log["reference_loss"]'))),
    ("gap in either direction (abs)", _rule(under=_sub(_UNDER, "gap > 0.04", "abs(gap) > 0.04"))),
    ("gap threshold read as a percentage (4 for 0.04)", _rule(under=_sub(_UNDER, "gap > 0.04", "gap > 4"))),
    ("gap from the first training loss, not the reference", _rule(under=_sub(
        _UNDER, 'log["final_train_loss"] / log["reference_loss"]', 'log["final_train_loss"] / log["loss"][0]'))),
    # -- the saturated fraction: the largest step, more than 1%
    ("mean saturated fraction for the worst step", _rule(spike='''    sat = [s for s in log["fp8_saturated"] if s is not None]
    if sat and sum(sat) / len(sat) > 0.01:
        return "fp8_amax_spike"
''')),
    ("saturated >= 1% (a tie counts)", _rule(spike=_sub(_SPIKE, "> 0.01", ">= 0.01"))),
    ("saturation threshold read as a percentage (1 for 0.01)", _rule(spike=_sub(_SPIKE, "> 0.01", "> 1"))),
    ("any saturated element is a spike", _rule(spike=_sub(_SPIKE, "> 0.01", "> 0"))),
    # -- skipped steps: more than half, with a scaler
    ("half the steps skipped counts (>=)", _rule(scale=_sub(_SCALE, "> n / 2", ">= n / 2"))),
    ("integer half (n // 2)", _rule(scale=_sub(_SCALE, "> n / 2", ">= n // 2"))),
    ("a falling scale read as too high", _rule(scale='''    if log["loss_scale"][0] is not None and (sum(log["skipped"]) > n / 2
                                             or log["loss_scale"][-1] < log["loss_scale"][0]):
        return "scale_too_high"
''')),
    # -- the dying step k: the steps before it are 0 .. k-1
    ("gradients read up to and including the dying step", _rule(death=_sub(
        _DEATH, 'not log["skipped"][j] for j in range(bad)', 'not log["skipped"][j] for j in range(bad + 1)'))),
    ("weights read up to and including the dying step", _rule(death=_sub(
        _DEATH, 'log["weight_amax"][j] is None for j in range(bad)', 'log["weight_amax"][j] is None for j in range(bad + 1)'))),
    ("steps counted from 1 (step 0 never read)", _rule(death=_DEATH.replace("range(bad)", "range(1, bad)"))),
    ("the step just before the dying one never read", _rule(death=_DEATH.replace("range(bad)", "range(bad - 1)"))),
    ("a skipped step's inf gradient counted as overflow", _rule(death=_sub(
        _DEATH, 'log["grad_amax"][j] is None and not log["skipped"][j]', 'log["grad_amax"][j] is None'))),
    ("inf tested, not None (None is inf OR NaN)", _rule(death='''    import math
    losses = [math.nan if v is None else v for v in log["loss"]]
    bad = next((i for i, v in enumerate(losses) if math.isinf(v)), None)
    if bad is not None:
        if any(log["grad_amax"][j] is None and not log["skipped"][j] for j in range(bad)):
            return "gradient_overflow"
        if any(log["weight_amax"][j] is None for j in range(bad)):
            return "optimizer_state"
        return "forward_overflow"
    if log["final_train_loss"] is None:
        return "forward_overflow"
''')),
    ("gradient inf compared with float('inf') (None never equals it)", _rule(death=_sub(
        _DEATH, 'log["grad_amax"][j] is None and', 'log["grad_amax"][j] == float("inf") and'))),
    # -- the order of the questions
    ("saturation asked before the death", _rule(order=("scale", "spike", "death", "under"))),
    # -- a cause outside CAUSES
    ("returns 'amax_spike'", _rule(spike=_sub(_SPIKE, 'return "fp8_amax_spike"', 'return "amax_spike"'))),
    ("returns 'underflow'", _rule(under=_sub(_UNDER, 'return "gradient_underflow"', 'return "underflow"'))),
]}
