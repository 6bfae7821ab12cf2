"""Lesson 11's grader: passes on a correct count, rejects planted mistakes with a hint that names each one
(master copy forgotten, master's gradient forgotten, moments counted in FP32, .grad counted beside the
recipe's FP32 gradient buffers). The oracle is the live-tensor count of mpcourse.experiment.memory."""
import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.memory import RECIPES, check_bytes_per_parameter, measured


def size(d):
    return 0 if d is None else d.itemsize


def good(weights, grad_buffers, master, moments):
    grads = size(grad_buffers if grad_buffers is not None else weights) + size(master)
    return {"weights": size(weights), "grads": grads, "master": size(master), "optimizer": 2 * size(moments)}


def forgets_master(w, gb, m, mo):
    return {**good(w, gb, m, mo), "master": 0}


def moments_always_fp32(w, gb, m, mo):
    return {**good(w, gb, m, mo), "optimizer": 8}


def forgets_master_grad(w, gb, m, mo):
    return {**good(w, gb, m, mo), "grads": size(gb if gb is not None else w)}


def counts_grad_and_buffers(w, gb, m, mo):
    return {**good(w, gb, m, mo), "grads": size(w) + size(gb) + size(m)}


def test_correct_count_passes(capsys):
    check_bytes_per_parameter(good)
    assert capsys.readouterr().out.startswith(f"PASS bytes_per_parameter: {len(RECIPES)} recipes")


def test_oracle_is_the_live_count_not_a_table():
    """The measured bytes agree with the dtypes the recipes keep (a sanity check of the oracle itself)."""
    dt, b = measured("bf16-master-bf16-moments")
    assert dt == {"weights": torch.bfloat16, "grad_buffers": None, "master": torch.float32, "moments": torch.bfloat16}
    assert b == {"weights": 2.0, "grads": 6.0, "master": 4.0, "optimizer": 4.0}
    assert measured("bf16-pure")[1]["grads"] == 4.0          # FP32 buffers, the BF16 .grad dropped


@pytest.mark.parametrize("bug,hint", [
    (forgets_master, "keeps a master copy"),
    (moments_always_fp32, "keeps AdamW.s two moments in float16: 2 x 2 B, not 2 x 4"),
    (forgets_master_grad, "master copy has its own gradient"),
    (counts_grad_and_buffers, "count the buffers only"),
])
def test_planted_bugs_fail_with_their_hint(bug, hint):
    with pytest.raises(GradingError, match=hint):
        check_bytes_per_parameter(bug)


def test_stub_and_bad_return():
    def stub(*a):
        raise NotImplementedError
    with pytest.raises(GradingError, match="not implemented yet"):
        check_bytes_per_parameter(stub)
    with pytest.raises(GradingError, match="exactly the keys"):
        check_bytes_per_parameter(lambda *a: [2, 4])
