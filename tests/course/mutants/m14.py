"""Lesson 14's mutants: learner-plausible wrong versions of the exercise's two functions.

``quantize_p_blocks``: P referenced to the whole row's max, to the block's own max or to the max before this block;
the normalized softmax cast; blocks along the queries; the scale divided or left out; a scale of the block's own
amax (current scaling) or of each row's; E5M2; truncation, or double rounding through BF16; a non-saturating cast;
exp(S - m) unguarded (NaN in a row with no key yet), or -inf replaced by a large negative number; a block of one key
too many, blocks overlapping by one key, the last partial block dropped; dequantized values or float32 codes
returned; S changed in place; a causal mask applied again. ``switch_events``: ``>=`` for ``>``, a NaN that passes,
every passing record (or rule) an event, switched layers not skipped, rules before records, the last passing record,
a what-if read for the run, percentages, a layer done after its first record, records without ``run`` not skipped.
"""

_P_HEAD = '''def quantize_p_blocks(s, scale, block):
    tk = s.shape[-1]
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    out = []
    for start in range(0, tk, block):
        blk = s[..., start:start + block]
'''
_P_MAX = '''        m = torch.maximum(m, blk.amax(-1, keepdim=True))
'''
_P_EXP = '''        p = torch.where(m == float("-inf"), 0.0, torch.exp(blk - m))
'''
_P_CAST = '''        out.append((p * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
'''
_P_TAIL = '''    return torch.cat(out, dim=-1)
'''


def _p(head=_P_HEAD, mx=_P_MAX, ex=_P_EXP, cast=_P_CAST, tail=_P_TAIL):
    return head + mx + ex + cast + tail


def _sub(block: str, old: str, new: str) -> str:
    assert old in block, old
    return block.replace(old, new)


_P = [
    ("the whole row's max for every block", _p(mx='''        m = s.amax(-1, keepdim=True)
''')),
    ("each block's own max (no running max)", _p(mx='''        m = blk.amax(-1, keepdim=True)
''')),
    ("the max before this block (updated after the exp)", _p(
        mx="", ex=_P_EXP + "        m_next = torch.maximum(m, blk.amax(-1, keepdim=True))\n",
        cast=_P_CAST + "        m = m_next\n")),
    ("the normalized softmax over whole rows cast", '''def quantize_p_blocks(s, scale, block):
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
'''),
    ("blocks along the queries (dim -2)", '''def quantize_p_blocks(s, scale, block):
    tq = s.shape[-2]
    m = torch.full((*s.shape[:-2], 1, s.shape[-1]), float("-inf"))
    out = []
    for start in range(0, tq, block):
        blk = s[..., start:start + block, :]
        m = torch.maximum(m, blk.amax(-2, keepdim=True))
        p = torch.where(m == float("-inf"), 0.0, torch.exp(blk - m))
        out.append((p * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
    return torch.cat(out, dim=-2)
'''),
    ("the scale divides P", _p(cast=_sub(_P_CAST, "p * scale", "p / scale"))),
    ("no scale (P's own values cast)", _p(cast=_sub(_P_CAST, "p * scale", "p"))),
    ("each block scaled by its own amax (current scaling)", _p(cast='''        a = p.abs().amax()
        sc = torch.where(a > 0, 448.0 / a, torch.tensor(1.0))
        out.append((p * sc).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
''')),
    ("each row scaled by its own amax", _p(cast='''        a = p.abs().amax(-1, keepdim=True)
        sc = torch.where(a > 0, scale / a, scale)
        out.append((p * sc).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
''')),
    ("E5M2 for P", _p(cast='''        out.append((p * scale).clamp(-57344.0, 57344.0).to(torch.float8_e5m2))
''')),
    ("E5M2 rounding, E4M3 container", _p(cast='''        out.append((p * scale).clamp(-448.0, 448.0).to(torch.float8_e5m2).float().to(torch.float8_e4m3fn))
''')),
    ("truncation toward zero instead of round to nearest even", _p(cast='''        y = (p * scale).clamp(-448.0, 448.0)
        c = y.to(torch.float8_e4m3fn)
        up = c.float().abs() > y.abs()
        down = (c.view(torch.uint8) - 1).view(torch.float8_e4m3fn)
        out.append(torch.where(up, down.float(), c.float()).to(torch.float8_e4m3fn))
''')),
    ("double rounding through BF16", _p(cast='''        out.append((p * scale).clamp(-448.0, 448.0).bfloat16().to(torch.float8_e4m3fn))
''')),
    ("non-saturating cast (past 448 is NaN)", _p(cast='''        y = p * scale
        out.append(torch.where(y > 464.0, float("nan"), y).to(torch.float8_e4m3fn))
''')),
    ("exp(S - m) unguarded (NaN where a row has no key yet)", _p(ex='''        p = torch.exp(blk - m)
''')),
    ("-inf replaced by -1e4 before the max", _p(head=_sub(_P_HEAD, "        blk = s[..., start:start + block]\n",
                                                         "        blk = s[..., start:start + block].clamp(min=-1e4)\n"))),
    ("blocks of block + 1 keys", _p(head=_sub(_sub(_P_HEAD, "range(0, tk, block)", "range(0, tk, block + 1)"),
                                              "start:start + block]", "start:start + block + 1]"))),
    ("the running max peeks one key into the next block", _p(mx='''        m = torch.maximum(m, s[..., start:start + block + 1].amax(-1, keepdim=True))
''')),
    ("the last partial block dropped (left zero)", '''def quantize_p_blocks(s, scale, block):
    tk = s.shape[-1]
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    out = torch.zeros(s.shape, dtype=torch.float8_e4m3fn)
    for start in range(0, tk - block + 1, block):
        blk = s[..., start:start + block]
        m = torch.maximum(m, blk.amax(-1, keepdim=True))
        p = torch.where(m == float("-inf"), 0.0, torch.exp(blk - m))
        out[..., start:start + block] = (p * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return out
'''),
    ("dequantized values returned (float32)", _p(tail='''    return torch.cat(out, dim=-1).float() / scale
''')),
    ("codes returned as float32", _p(tail='''    return torch.cat(out, dim=-1).float()
''')),
    ("S shifted in place", _p(ex='''        blk.sub_(torch.where(m == float("-inf"), 0.0, m))
        p = torch.where(m == float("-inf"), 0.0, torch.exp(blk))
''')),
    ("a causal mask applied again", _p(head=_P_HEAD.replace(
        "    tk = s.shape[-1]\n",
        "    tk = s.shape[-1]\n    s = s.masked_fill(torch.ones(s.shape[-2], tk, dtype=torch.bool).triu(1), float('-inf'))\n"))),
]

_S_HEAD = '''def switch_events(records, rules, switched):
    events, done = [], set(switched)
    for r in records:
        run = r["recipes"].get("run")
        if run is None or r["layer"] in done:
            continue
        for statistic, threshold in rules:
            if run[statistic] > threshold:
'''
_S_EVENT = '''                events.append({"step": r["step"], "layer": r["layer"], "role": r["role"],
                               "statistic": statistic, "value": run[statistic], "threshold": threshold})
                done.add(r["layer"])
                break
    return events
'''


def _s(head=_S_HEAD, event=_S_EVENT):
    return head + event


_S = [
    (">= for >", _s(head=_sub(_S_HEAD, "run[statistic] > threshold", "run[statistic] >= threshold"))),
    ("a NaN passes (not value <= threshold)",
     _s(head=_sub(_S_HEAD, "run[statistic] > threshold", "not run[statistic] <= threshold"))),
    ("every passing record an event (no done set)", _s(event=_sub(_S_EVENT, "                done.add(r[\"layer\"])\n", ""))),
    ("every passing rule an event", _s(event=_sub(_S_EVENT, "                break\n", ""))),
    ("switched layers not skipped", _s(head=_sub(_S_HEAD, "done = [], set(switched)", "done = [], set()"))),
    ("rules before records", '''def switch_events(records, rules, switched):
    events, done = [], set(switched)
    for statistic, threshold in rules:
        for r in records:
            run = r["recipes"].get("run")
            if run is None or r["layer"] in done:
                continue
            if run[statistic] > threshold:
                events.append({"step": r["step"], "layer": r["layer"], "role": r["role"],
                               "statistic": statistic, "value": run[statistic], "threshold": threshold})
                done.add(r["layer"])
    return events
'''),
    ("the last passing record of a layer", '''def switch_events(records, rules, switched):
    last = {}
    for r in records:
        run = r["recipes"].get("run")
        if run is None or r["layer"] in switched:
            continue
        for statistic, threshold in rules:
            if run[statistic] > threshold:
                last[r["layer"]] = {"step": r["step"], "layer": r["layer"], "role": r["role"],
                                    "statistic": statistic, "value": run[statistic], "threshold": threshold}
                break
    return list(last.values())
'''),
    ("the first recipe's statistics read for the run's",
     _s(head=_sub(_S_HEAD, 'run = r["recipes"].get("run")', 'run = next(iter(r["recipes"].values()), None)'))),
    ("the value read as a percentage", _s(head=_sub(_S_HEAD, "run[statistic] > threshold", "run[statistic] * 100 > threshold"))),
    ("a layer done after its first record, passing or not", '''def switch_events(records, rules, switched):
    events, done = [], set(switched)
    for r in records:
        run = r["recipes"].get("run")
        if run is None or r["layer"] in done:
            continue
        done.add(r["layer"])
        for statistic, threshold in rules:
            if run[statistic] > threshold:
                events.append({"step": r["step"], "layer": r["layer"], "role": r["role"],
                               "statistic": statistic, "value": run[statistic], "threshold": threshold})
                break
    return events
'''),
    ("records without run not skipped", _s(head=_sub(_S_HEAD, 'r["recipes"].get("run")', 'r["recipes"]["run"]'))),
    ("events sorted by layer name", _s(event=_sub(_S_EVENT, "    return events\n",
                                                  '    return sorted(events, key=lambda e: e["layer"])\n'))),
    ("the threshold stored as the event's value", _s(event=_sub(_S_EVENT, '"value": run[statistic]', '"value": threshold'))),
]

MUTANTS = {"quantize_p_blocks": _P, "switch_events": _S}
