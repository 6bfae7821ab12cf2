"""Rowwise FP8's weight-gradient scales per expert group (``group_scales.group_colwise_scales``) against the
dense rule run on each group alone (``blockwise.quantize_fp32_scaled(t_e, (-1, 1), "e4m3", power_2_scale=True)``),
and lesson 13's padding with the exercise's signature against ``pad_groups`` / ``unpad_groups``."""
import pytest
import torch

from mpcourse.core.experts import (group_colwise_scales, pad_groups, pad_token_groups, token_groups, unpad_groups,
                                   unpad_token_groups)
from mpcourse.core.quant.rules.blockwise import quantize_fp32_scaled


def _per_group(t, counts):
    ends = torch.cumsum(torch.tensor(counts), 0).tolist()
    rows = []
    for start, end in zip([0] + ends, ends):
        rows.append(quantize_fp32_scaled(t[start:end], (-1, 1), "e4m3", power_2_scale=True).scale_inv.reciprocal())
    return torch.cat(rows)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 1], [16, 16], [7]])
def test_scales_are_the_dense_rule_on_each_group_alone(counts):
    g = torch.Generator().manual_seed(sum(counts))
    t = torch.randn(sum(counts), 6, generator=g) * torch.logspace(-38, 30, 6)
    if sum(counts) > 2:
        t[1, 0], t[2, 1] = float("nan"), float("inf")
        t[:, 2] = 0.0
    offs = torch.cumsum(torch.tensor(counts), 0).int()
    got = group_colwise_scales(t, offs)
    assert got.dtype == torch.float32 and got.shape == (len(counts), 6)
    assert torch.equal(got, _per_group(t, counts))
    assert torch.isfinite(got).all() and (got > 0).all()


def test_a_nan_in_one_group_leaves_the_others_and_an_empty_group_gets_one():
    t = torch.ones(6, 2)
    clean = group_colwise_scales(t, torch.tensor([2, 2, 6], dtype=torch.int32))
    t[0, 0] = float("nan")
    dirty = group_colwise_scales(t, torch.tensor([2, 2, 6], dtype=torch.int32))
    assert dirty[0, 0] == 1.0 and torch.equal(dirty[1:], clean[1:]) and torch.equal(dirty[1], torch.ones(2))
    assert clean[0, 0] == 256.0                                     # 448 / 1 rounded down to a power of two


@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_the_exercise_signatures_are_the_library_padding(alignment):
    counts = torch.tensor([3, 0, 5, 16])
    x = torch.randn(24, 5, dtype=torch.bfloat16)
    groups = token_groups(counts, alignment)
    padded, offs = pad_token_groups(x, counts, alignment)
    assert torch.equal(padded, pad_groups(x, groups)) and torch.equal(offs, groups.padded_offs)
    assert offs.dtype == torch.int32 and padded.dtype == torch.bfloat16
    assert torch.equal(unpad_token_groups(padded, counts, alignment), x)
    assert torch.equal(unpad_token_groups(padded, counts, alignment), unpad_groups(padded, groups))
