"""Graders for lesson 14 (attention in FP8, and reading the inspector): P's per-block cast and the switching rule.

Oracles: the library's rules, which their own tests hold against independent references.

* ``check_quantize_p_blocks``: ``mpcourse.core.attention.fp8_attention.quantize_p_blocks``, P as the blocked
  forward casts it (cuDNN frontend's FP8 SDPA reference, ``test/python/sdpa/fp8_ref.py``: an online softmax over
  blocks of keys, each block's unnormalized P = exp(S_blk - m) with m the running max, cast with P's one scale),
  bit for bit; ``tests/core/attention`` holds it against an ml_dtypes transcription. Constructed cases: a partial
  last block, maxima rising and falling along the keys, a first block masked whole in some rows and a row masked
  everywhere, blocks of P that underflow, scales 1, 16, 300.5, 448 and 1000 (P saturates), one block holding every
  key, one key per block, fewer queries than keys.
* ``check_switch_events``: ``mpcourse.core.autoswitch.switch_events``, the rule of Transformer Engine's
  ``AutoswitchGemm`` as the course applies it (``value > threshold``; one event per layer, its first passing record
  and rule), on planted records: values at and just past a threshold, a NaN statistic, the order of records and of
  rules, switched layers, records without the run's statistics, and the ten events of the stored autoswitch run.
"""
from __future__ import annotations

import math

import torch

from ...core.attention.fp8_attention import causal_scores, quantize_p_blocks as library_p_blocks
from ...core.autoswitch import switch_events as library_switch_events
from . import GradingError, call, verdict

NEG = float("-inf")


def _scores(seed: int, b: int, h: int, tq: int, tk: int, sharp: float = 1.0, causal: bool = True) -> torch.Tensor:
    """(b, h, tq, tk) float32 scores Q K^T / sqrt(d) of random Q, K (d = 16), -inf above the diagonal if causal."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, tq, 16, generator=g) * sharp, torch.randn(b, h, tk, 16, generator=g)
    return causal_scores(q, k, 0.25, causal)


def p_cases() -> list[tuple[str, torch.Tensor, float, int]]:
    """(what, S, scale, block) of every case."""
    g = torch.Generator().manual_seed(7)
    rising = torch.linspace(-6.0, 6.0, 50).expand(2, 1, 6, 50) + torch.randn(2, 1, 6, 50, generator=g)
    falling = rising.flip(-1).contiguous()
    masked = _scores(3, 1, 2, 40, 40, sharp=2.0)
    masked[0, 0, 20:, :17] = NEG                              # rows 20..39 of head 0: their first block is all -inf
    masked[0, 1, 9, :] = NEG                                  # a row with no key at all
    deep = _scores(4, 1, 1, 24, 40, causal=False)
    deep[..., 16:32] -= 30.0                                  # a block far below the max: P flushes to 0 in FP8
    deep[..., 32:] -= 200.0                                   # ... or already in the FP32 exp
    return [
        ("causal scores, 40 keys in blocks of 16 (the last block holds 8)", _scores(0, 2, 3, 40, 40), 448.0, 16),
        ("scores rising along the keys (the running max grows block by block)", rising.contiguous(), 448.0, 16),
        ("scores falling along the keys (the first block holds every row's max)", falling, 448.0, 16),
        ("a first block masked whole in some rows, one row masked everywhere", masked, 448.0, 16),
        ("blocks far below the row's max (all zero after the cast, or after exp)", deep, 448.0, 16),
        ("scale 16 (cuDNN's fixed P scale in MXFP8 attention)", _scores(1, 1, 2, 40, 40, sharp=3.0), 16.0, 16),
        ("scale 1 (P's own values cast)", _scores(1, 1, 2, 40, 40, sharp=3.0), 1.0, 16),
        ("scale 300.5 (not a power of two)", _scores(2, 1, 2, 33, 33), 300.5, 8),
        ("scale 1000 (P past 448 / 1000 saturates to 448)", _scores(2, 1, 2, 33, 33), 1000.0, 8),
        ("one block holding every key (128 > 40 keys)", _scores(5, 1, 2, 40, 40, sharp=2.0), 448.0, 128),
        ("one key per block", _scores(6, 1, 1, 12, 12, sharp=2.0), 448.0, 1),
        ("5 queries, 37 keys, not causal", _scores(8, 2, 1, 5, 37, sharp=2.0, causal=False), 448.0, 16),
    ]


def _code(x: torch.Tensor, scale: float) -> float:
    return float((x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float())


def _p_hint(s: torch.Tensor, i: tuple, block: int, scale: float, got: float) -> str:
    """What a wrong code at index ``i`` most likely came from."""
    *lead, r, c = i
    row = s[tuple(lead)][r]                                          # (tk,) this query's scores
    end = min((c // block + 1) * block, row.numel())
    m_run = row[:end].max()
    if math.isnan(got):
        return ("NaN: exp(S - m) with S = m = -inf (a row with no key so far) is NaN; P is 0 there. Use "
                "torch.where(m == -inf, 0, exp(S - m))")
    if row[c] == NEG:
        return "S is -inf here (a masked key): P is 0, its code 0"
    x = row[c]
    if got == 0.0 and c >= (row.numel() // block) * block:
        return (f"key {c} is in the last block, keys {(row.numel() // block) * block}..{row.numel() - 1}, shorter "
                f"than {block}: it is a block too (range(0, Tk, block), the slice stops at Tk)")
    for what, ref in (("the max of the whole row (the blocked forward only knows the keys up to the end of this "
                       "block: the running max)", row.max()),
                      ("the max of this block alone (the running max also carries the earlier blocks')",
                       row[(c // block) * block:end].max())):
        if ref != m_run and got == _code(torch.exp(x - ref), scale):
            return f"P was referenced to {what}"
    if got == _code(torch.exp(x - m_run) / scale, 1.0):
        return "the scale divides P here: FP8 code = P * scale (scale_inv = 1 / scale undoes it)"
    if got == _code(torch.exp(x - m_run), 1.0):
        return "P was cast without its scale: code = fp8(clamp(P * scale, -448, 448))"
    return ("block b of a row holds fp8(clamp(exp(S - m_b) * scale, -448, 448)), m_b the max of the row's keys "
            "from 0 to the end of block b, one FP32 product, E4M3 round to nearest even")


def check_quantize_p_blocks(fn) -> None:
    """Grade ``fn(s: (..., Tq, Tk) float32, scale: () float32, block: int) -> (..., Tq, Tk) float8_e4m3fn``, bit for
    bit the library's ``quantize_p_blocks``."""
    n = 0
    for what, s, scale, block in p_cases():
        want = library_p_blocks(s, torch.tensor(scale), block).data
        s_in = s.clone()
        got = call("quantize_p_blocks", fn, s_in, torch.tensor(scale), block)
        if not isinstance(got, torch.Tensor):
            raise GradingError(f"FAIL quantize_p_blocks on {what}: return a torch.Tensor of FP8 codes, got "
                               f"{type(got).__name__}")
        if not (torch.equal(s_in.isnan(), s.isnan()) and torch.equal(s_in.nan_to_num(), s.nan_to_num())):
            raise GradingError(f"FAIL quantize_p_blocks on {what}: your function changed S in place; compute on a "
                               "new tensor (S is read again by the backward)")
        if got.dtype != torch.float8_e4m3fn:
            raise GradingError(f"FAIL quantize_p_blocks on {what}: return the FP8 codes as torch.float8_e4m3fn (what "
                               f"the P @ V product reads; its descale is 1 / scale), got {got.dtype}")
        if tuple(got.shape) != tuple(s.shape):
            raise GradingError(f"FAIL quantize_p_blocks on {what}: expected shape {tuple(s.shape)} (every key, every "
                               f"block side by side, the last one partial), got {tuple(got.shape)}")
        g32, w32 = got.float(), want.float()
        if bool(g32.isnan().any()):
            i = tuple(g32.isnan().nonzero()[0].tolist())
            raise GradingError(f"FAIL quantize_p_blocks on {what}: a NaN code at {i}; "
                               + _p_hint(s, i, block, scale, float("nan")))
        bad = g32.view(torch.int32) != w32.view(torch.int32)
        if bool(bad.any()):
            i = tuple(bad.nonzero()[0].tolist())
            raise GradingError(
                f"FAIL quantize_p_blocks on {what} (scale {scale:g}, blocks of {block}): {int(bad.sum())} of "
                f"{bad.numel()} codes differ.\n  first: index {i} (key {i[-1]}, block {i[-1] // block}), "
                f"S = {float(s[i]):.6g}: expected {float(w32[i])!r}, got {float(g32[i])!r}\n  hint: "
                + _p_hint(s, i, block, scale, float(g32[i])))
        n += 1
    verdict("quantize_p_blocks", f"{n} cases (partial last blocks, rising and falling maxima, masked blocks and rows, "
                                 "scales 1 to 1000) agree bit for bit with the library's blocked P cast")


# ------------------------------------------------------------------------------------------ the switching rule
def _rec(step: int, layer: str, role: str, run=None, **what_ifs) -> dict:
    recipes = dict(what_ifs)
    if run is not None:
        recipes["run"] = run
    return {"step": step, "layer": layer, "role": role, "recipes": recipes}


def stored_events_records() -> list[dict]:
    """Step 0 of the stored autoswitch run's planted model (per-tensor current scaling): each block's ``attn.qkv``
    and ``mlp.fc`` read an input whose 126 ordinary channels of 128 flush (underflow 126/128), the rest do not."""
    out = []
    for b in range(5):
        for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
            under = 0.984375 if name in ("attn.qkv", "mlp.fc") else 0.0
            for role, u in (("activation", under), ("weight", 0.0 if under == 0 else 0.015625)):
                out.append(_rec(0, f"blocks.{b}.{name}", role, {"underflow": u, "rel_error": 0.04},
                                mxfp8={"underflow": 0.0, "rel_error": 0.03}))
    return out + [_rec(0, "head", "activation", None, mxfp8={"underflow": 0.9, "rel_error": 0.9})]


def switch_cases() -> list[tuple[str, list, list, set]]:
    """(what, records, rules, switched) of every case."""
    u, r = "underflow", "rel_error"
    nan = float("nan")
    return [
        ("a value at the threshold and one just past it",
         [_rec(4, "a", "activation", {u: 0.05, r: 0.0}), _rec(4, "b", "activation", {u: 0.0500001, r: 0.0})],
         [(u, 0.05)], set()),
        ("a NaN statistic", [_rec(2, "a", "weight", {u: nan, r: 0.1}), _rec(2, "b", "weight", {u: 0.2, r: nan})],
         [(u, 0.1), (r, 0.05)], set()),
        ("two rules passing on one record (the first rule in the rules' order)",
         [_rec(1, "a", "activation", {u: 0.5, r: 0.5})], [(r, 0.1), (u, 0.1)], set()),
        ("the layer's second record passes, its first does not",
         [_rec(7, "a", "activation", {u: 0.01, r: 0.0}), _rec(7, "a", "weight", {u: 0.3, r: 0.0})],
         [(u, 0.05)], set()),
        ("a layer passing on two records (one event: the first)",
         [_rec(0, "a", "weight", {u: 0.2, r: 0.0}), _rec(0, "b", "activation", {u: 0.0, r: 0.0}),
          _rec(0, "a", "output_grad", {u: 0.9, r: 0.0})], [(u, 0.05)], set()),
        ("records before rules (the first record that passes any rule)",
         [_rec(5, "a", "activation", {u: 0.0, r: 0.4}), _rec(5, "a", "weight", {u: 0.3, r: 0.0})],
         [(u, 0.05), (r, 0.3)], set()),
        ("a switched layer is skipped",
         [_rec(9, "a", "activation", {u: 0.9, r: 0.0}), _rec(9, "b", "activation", {u: 0.9, r: 0.0})],
         [(u, 0.05)], {"a"}),
        ("records without the run's own statistics (what-ifs only) are skipped",
         [_rec(3, "head", "activation", None, **{"fp8-current": {u: 0.9, r: 0.9}}),
          _rec(3, "a", "activation", {u: 0.01, r: 0.0}, mxfp8={u: 0.9, r: 0.9})], [(u, 0.05)], set()),
        ("fractions, not percentages", [_rec(1, "a", "activation", {u: 0.01, r: 0.0})], [(u, 0.05)], set()),
        ("the backward's records, last layer first (events in recording order)",
         [_rec(6, "blocks.1.mlp.fc", "output_grad", {u: 0.3, r: 0.0}),
          _rec(6, "blocks.0.mlp.fc", "output_grad", {u: 0.4, r: 0.0})], [(u, 0.05)], set()),
        ("no record at all", [], [(u, 0.05)], set()),
        ("the stored run's step 0 (every block's attn.qkv and mlp.fc)", stored_events_records(), [(u, 0.05)], set()),
    ]


def _event_text(e) -> str:
    return "none" if e is None else ", ".join(f"{k}={e.get(k)!r}" for k in ("layer", "role", "statistic", "value"))


def check_switch_events(fn) -> None:
    """Grade ``fn(records, rules, switched) -> [event, ...]`` against the library's ``switch_events``."""
    keys = ("step", "layer", "role", "statistic", "value", "threshold")
    for what, records, rules, switched in switch_cases():
        want = library_switch_events(records, rules, switched)
        got = call("switch_events", fn, [dict(r) for r in records], list(rules), set(switched))
        if not isinstance(got, list) or not all(isinstance(e, dict) for e in got):
            raise GradingError(f"FAIL switch_events on {what}: return a list of event dicts, got {type(got).__name__}")
        for k, (g, w) in enumerate(zip(got + [None] * len(want), want + [None] * len(got))):
            if g is None and w is None:
                break
            if g is None or w is None or any(g.get(key) != w[key] for key in keys):
                hint = ("one event per layer: its first record, in recording order, on which a rule passes "
                        "(value > threshold, strictly; a NaN passes nothing), with the first passing rule in the "
                        "rules' order; skip switched layers and records without recipes['run']")
                raise GradingError(f"FAIL switch_events on {what}: event {k} expected [{_event_text(w)}], got "
                                   f"[{_event_text(g)}]\n  hint: {hint}")
    verdict("switch_events", f"{len(switch_cases())} cases (thresholds, NaN, record and rule order, switched layers, "
                             "the stored run's step 0) agree with the library's rule")
