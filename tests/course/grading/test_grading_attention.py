"""The lesson-14 graders: the library's rules pass, and so does a transcription written here from the rule's words
(an independent oracle for the grader's cases); planted wrong versions fail with a hint naming their fault; a stub
fails as not implemented; the cases hold the edges the lesson names."""
import math

import pytest
import torch

from mpcourse.core.attention.fp8_attention import quantize_p_blocks as library_p_blocks
from mpcourse.core.autoswitch import switch_events as library_switch_events
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.attention import (check_quantize_p_blocks, check_switch_events, p_cases,
                                               switch_cases)


def p_blocks_here(s, scale, block, guard=True):   # the rule, written out again: running max, guarded exp, a cast
    tk = s.shape[-1]
    m = torch.full((*s.shape[:-1], 1), -math.inf)
    out = []
    for start in range(0, tk, block):
        blk = s[..., start:start + block]
        m = torch.maximum(m, blk.amax(-1, keepdim=True))
        p = torch.where(m == -math.inf, torch.zeros_like(blk), torch.exp(blk - m)) if guard else torch.exp(blk - m)
        out.append((p * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
    return torch.cat(out, -1)


def events_here(records, rules, switched):
    events, done = [], set(switched)
    for r in records:
        run = r["recipes"].get("run")
        if run is None or r["layer"] in done:
            continue
        for stat, threshold in rules:
            if run[stat] > threshold:
                events.append({"step": r["step"], "layer": r["layer"], "role": r["role"], "statistic": stat,
                               "value": run[stat], "threshold": threshold})
                done.add(r["layer"])
                break
    return events


def test_the_library_and_a_transcription_pass(capsys):
    check_quantize_p_blocks(lambda s, scale, block: library_p_blocks(s, scale, block).data)
    check_quantize_p_blocks(p_blocks_here)
    check_switch_events(library_switch_events)
    check_switch_events(events_here)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("PASS ") for line in out)


def test_the_cases_hold_the_edges():
    cases = p_cases()
    assert any(s.shape[-1] % block for _, s, _, block in cases)                       # a partial last block
    assert any(block >= s.shape[-1] for _, s, _, block in cases) and any(b == 1 for *_, b in cases)
    assert any(bool((s == -math.inf).all(-1).any()) for _, s, _, _ in cases)          # a row with no key
    assert {1.0, 16.0, 448.0, 1000.0} <= {scale for _, _, scale, _ in cases}
    for _, s, scale, block in cases:                                                  # every case: no NaN
        assert not library_p_blocks(s, torch.tensor(scale), block).data.float().isnan().any()
    saturated = [library_p_blocks(s, torch.tensor(sc), b).data.float().max() for _, s, sc, b in cases if sc > 448]
    assert saturated and all(float(x) == 448.0 for x in saturated)
    zero_blocks = [c for c in cases if "far below" in c[0]]
    _, s, scale, block = zero_blocks[0]
    codes = library_p_blocks(s, torch.tensor(scale), block).data.float()
    assert bool((codes[..., 16:32] == 0).all()) and bool((codes[..., 32:] == 0).all())   # all-zero blocks
    assert any(math.isnan(r["recipes"]["run"]["underflow"]) for _, recs, _, _ in switch_cases() for r in recs
               if "run" in r["recipes"])


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, scale, block: p_blocks_here(s, scale, s.shape[-1]), "whole row"),
    (lambda s, scale, block: p_blocks_here(s, 1.0 / scale, block), "the scale divides P"),
    (lambda s, scale, block: p_blocks_here(s, scale, block).float(), "torch.float8_e4m3fn"),
    (lambda s, scale, block: p_blocks_here(s, scale, block, guard=False), "NaN"),
])
def test_planted_wrong_p_blocks_fail_with_a_hint(wrong, hint):
    with pytest.raises(GradingError, match=hint):
        check_quantize_p_blocks(wrong)


@pytest.mark.parametrize("wrong, hint", [
    (lambda records, rules, switched: events_here(records, [(s, t - 1e-12) for s, t in rules], switched),
     "at the threshold"),
    (lambda records, rules, switched: events_here(records, rules, set()), "switched layer"),
    (lambda records, rules, switched: [], "event 0 expected"),
])
def test_planted_wrong_switch_events_fail(wrong, hint):
    with pytest.raises(GradingError, match=hint):
        check_switch_events(wrong)


def test_a_stub_fails_as_not_implemented():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")
    for check in (check_quantize_p_blocks, check_switch_events):
        with pytest.raises(GradingError, match="not implemented yet"):
            check(stub)
