"""Token grouping (mpcourse.core.experts.grouping) against a per-token Python loop and torchao 0.18's reference
``torch_pad_token_groups`` / ``torch_unpad_token_groups`` (the pure-PyTorch path of its MoE padding)."""
import warnings

import pytest
import torch

from mpcourse.core.experts import ALIGNMENT, group_tokens, pad_groups, token_groups, unpad_groups


def _torchao_quant():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao.prototype.moe_training.kernels.mxfp8.quant")


COUNTS = [[3, 0, 5, 2], [0, 0, 0, 7], [16, 32, 1, 0, 31], [0, 0], [1]]


def loop_index(counts, alignment):
    """The padded row of every token, one Python step per token (the oracle of the vectorised row map)."""
    out, start = [], 0
    for c in counts:
        out += [start + i for i in range(c)]
        start += -(-c // alignment) * alignment
    return out


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("alignment", [1, 4, 8, 16, 32, 128])
def test_row_map_and_offsets_match_a_loop_over_tokens(counts, alignment):
    g = token_groups(torch.tensor(counts), alignment)
    assert g.index.tolist() == loop_index(counts, alignment)
    assert g.offs.dtype == g.padded_offs.dtype == torch.int32
    assert g.offs.tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert all(int(o) % alignment == 0 for o in g.padded_offs)
    assert g.real_rows.sum().item() == sum(counts) and g.rows == int(g.padded_offs[-1])


def test_group_tokens_is_a_stable_sort_by_expert():
    ids = torch.tensor([2, 0, 2, 1, 0, 2, 2, 3, 0])
    order, counts = group_tokens(ids, 5)
    assert counts.tolist() == [3, 1, 4, 1, 0]
    assert order.tolist() == [i for e in range(5) for i in range(len(ids)) if ids[i] == e]
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        group_tokens(ids, 3)


@pytest.mark.parametrize("counts", COUNTS[:4])
@pytest.mark.parametrize("alignment", [16, 32])
def test_padding_matches_torchao_torch_pad_token_groups(counts, alignment):
    quant = _torchao_quant()
    x = torch.randn(sum(counts), 8) + 1.0                          # no zero entry: padding is the only zero
    g = token_groups(torch.tensor(counts), alignment)
    want, want_starts, want_ends = quant.torch_pad_token_groups(x, g.offs, alignment)
    assert torch.equal(g.padded_offs, want_ends) and torch.equal(g.padded_starts, want_starts.long())
    got = pad_groups(x, g)
    assert torch.equal(got, want[: g.rows]) and not want[g.rows:].any()   # torchao allocates an upper bound
    back = quant.torch_unpad_token_groups(want, g.offs, want_starts, sum(counts), alignment)
    assert torch.equal(unpad_groups(got, g), back) and torch.equal(back, x)


def test_padding_rows_are_exactly_zero_and_get_zero_gradients():
    g = token_groups(torch.tensor([3, 0, 5, 2]), 8, rows=40)            # 8 rows past the last group too
    x = torch.full((10, 4), float("nan")).requires_grad_(True)         # a NaN token never reaches a padding row
    p = pad_groups(x, g)
    assert not p[~g.real_rows].any() and torch.isnan(p[g.real_rows]).all()
    y = torch.randn(40, 4).requires_grad_(True)
    unpad_groups(y, g).backward(torch.full((10, 4), float("inf")))
    assert not y.grad[~g.real_rows].any() and torch.isinf(y.grad[g.real_rows]).all()
    p.backward(torch.ones(40, 4))
    assert torch.equal(x.grad, torch.ones(10, 4))                      # each token's own row, nothing else


def test_alignments_are_the_published_ones():
    """torchtitan ``set_token_group_alignment_size_m``: BF16 8, FP8 16, MXFP8 32; 1x128 tiles need 128 (DeepGEMM)."""
    assert (ALIGNMENT["bf16"], ALIGNMENT["fp8-rowwise"], ALIGNMENT["mxfp8"], ALIGNMENT["fp8-block"]) == (8, 16, 32, 128)


def test_bad_groups_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="counts must be"):
        token_groups(torch.tensor([3, -1]), 8)
    with pytest.raises(ValueError, match="alignment must be"):
        token_groups(torch.tensor([3, 1]), 0)
    with pytest.raises(ValueError, match="rows >= 16"):
        token_groups(torch.tensor([3, 1]), 8, rows=10)
    g = token_groups(torch.tensor([3, 1]), 8)
    with pytest.raises(ValueError, match="hold 4 tokens"):
        pad_groups(torch.zeros(5, 2), g)
    with pytest.raises(ValueError, match="padded groups have 16"):
        unpad_groups(torch.zeros(4, 2), g)
