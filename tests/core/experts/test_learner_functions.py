"""Lesson 13's functions ride in the FP8 region's recipe to the MoE layer (``recipe.functions``): the layer pads
its groups with a learner's ``pad_token_groups`` / ``unpad_token_groups`` and the rowwise grouped GEMM's backward
takes its weight-gradient scales from a learner's ``group_scales``. The library's own functions, given as the
learner's, change no bit; a wrong one changes the gradients or stops with one line naming it (``SeamError``)."""
import inspect

import pytest
import torch

from mpcourse.core import quant
from mpcourse.core.experts import group_colwise_scales, pad_token_groups, unpad_token_groups
from mpcourse.core.experts.layer import MoEFeedForward
from mpcourse.core.seams import SeamError


def _grads(recipe):
    torch.manual_seed(0)
    m = MoEFeedForward(128, 128, 4, top_k=2)
    x = torch.randn(2, 37, 128, requires_grad=True)
    with quant.autocast(enabled=True, recipe=recipe):
        m(x).square().sum().backward()
    return [x.grad] + [p.grad for p in (m.router, m.w_in, m.w_out)]


def _same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("recipe", [quant.Float8RowwiseScaling(), quant.Float8BlockScaling(), quant.MXFP8BlockScaling()],
                         ids=lambda r: type(r).__name__)
def test_the_librarys_functions_given_as_the_learners_change_no_bit_and_are_called(recipe):
    called = []

    def spy(name, fn):
        def wrapped(*args):
            called.append(name)
            return fn(*args)
        wrapped.__signature__ = inspect.signature(fn)             # the signature the library checks
        return wrapped

    functions = {"pad_token_groups": spy("pad", pad_token_groups), "unpad_token_groups": spy("unpad", unpad_token_groups)}
    if isinstance(recipe, quant.Float8RowwiseScaling):
        functions["group_scales"] = spy("scales", group_colwise_scales)
    assert _same(_grads(recipe.with_functions(functions)), _grads(recipe))
    assert {"pad", "unpad"} <= set(called)
    assert ("scales" in called) == isinstance(recipe, quant.Float8RowwiseScaling)


def test_a_wrong_group_scales_changes_the_weight_gradient_only():
    def rounded_up(t, offs):
        return group_colwise_scales(t, offs) * 2

    mine, lib = _grads(quant.Float8RowwiseScaling(functions={"group_scales": rounded_up})), _grads(quant.Float8RowwiseScaling())
    assert torch.equal(mine[0], lib[0]) and not torch.equal(mine[2], lib[2])


def test_a_wrong_padding_is_one_line_naming_it():
    def unpadded_ends(x, counts, alignment):
        padded, _ = pad_token_groups(x, counts, alignment)
        return padded, torch.cumsum(counts, 0).int()

    with pytest.raises(SeamError, match="pad_token_groups returned group ends"):
        _grads(quant.Float8RowwiseScaling(functions={"pad_token_groups": unpadded_ends}))


def test_group_scales_is_refused_where_the_recipe_does_not_round_to_powers_of_two():
    with pytest.raises(ValueError, match="round_scales_to_power_of_2=True"):
        quant.Float8RowwiseScaling(round_scales_to_power_of_2=False, functions={"group_scales": group_colwise_scales})
