"""The inspector's pictures of FP8 attention: a heat map of every attention tensor under every recipe, and the
histogram of the widest one (``mpcourse.core.inspect`` draws the linear layers'; the records come from
``mpcourse.core.attention.inspected``, roles ``ATTENTION_ROLES``).

``plot_attention_recipes(records, path)``: one panel per pass (forward Q, K, V, P, O; backward dO, P_bwd, dP, dQ,
dK, dV), a row per (attention layer, tensor), a column per recipe ("run" first: the layer's own casts), each cell the
mean over the inspected steps of one statistic (default underflow), as a percentage. ``plot_attention_histogram``:
``plot_binades`` of the last inspected step's attention tensor with the widest dynamic range.
"""
from __future__ import annotations

from .attention.inspected import ATTENTION_ROLES, FORWARD_NAMES
from .inspect import plot_binades, plot_recipe_heatmap

PASSES = {"forward": tuple(FORWARD_NAMES.values()),
          "backward": tuple(r for r in ATTENTION_ROLES if r not in FORWARD_NAMES.values())}


def attention_records(records: list[dict]) -> list[dict]:
    """The records of FP8 attention's tensors."""
    return [r for r in records if r["role"] in ATTENTION_ROLES]


def by_pass(records: list[dict]) -> list[dict]:
    """The attention records relabelled for ``plot_recipe_heatmap``: role = the pass, layer = "layer tensor"."""
    return [{**r, "layer": f"{r['layer']} {r['role']}", "role": p}
            for r in attention_records(records) for p, roles in PASSES.items() if r["role"] in roles]


def plot_attention_recipes(records: list[dict], path, kind: str = "underflow") -> bool:
    """Save the attention heat map (module docstring); False (nothing written) when there are no attention records."""
    rows = by_pass(records)
    if not rows:
        return False
    plot_recipe_heatmap(rows, path, kind, roles=tuple(PASSES))
    return True


def plot_attention_histogram(records: list[dict], path) -> bool:
    """Save the binade histogram of the last inspected step's widest attention tensor; False when there is none."""
    rs = attention_records(records)
    if not rs:
        return False
    last = [r for r in rs if r["step"] == rs[-1]["step"] and "binades" in r]
    if not last:
        return False
    plot_binades(max(last, key=lambda r: r["dynamic_range_binades"]), path)
    return True
