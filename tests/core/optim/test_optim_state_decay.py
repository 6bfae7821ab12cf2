"""The second moment's decay over a quiet run, stored in BF16 (nearest, stochastic), FP8 and 8-bit blockwise
(``mpcourse.core.optim.moment_decay.second_moment_ratio``), against FP32 ``torch.optim.AdamW`` run side by side.

Oracles: FP32 AdamW on the same gradients (inside the function), ``ml_dtypes.bfloat16`` for why the nearest BF16
value stalls, and the closed form ``0.999 ** -quiet`` for how far it stalls."""
import ml_dtypes
import numpy as np
import pytest
import torch

from mpcourse.core.optim.moment_decay import STORAGES, second_moment_ratio

QUIET = 500
KW = dict(loud_steps=20, quiet_steps=QUIET, numel=4096)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)                     # thousands of tiny steps: threads only add overhead
    yield
    torch.set_num_threads(n)


def test_why_nearest_bf16_stalls_with_ml_dtypes():
    """Every BF16 value in [1, 2) times 0.999 rounds back to itself (ml_dtypes' round to nearest even)."""
    v = (1 + np.arange(128) / 128).astype(ml_dtypes.bfloat16)          # every BF16 value in [1, 2)
    decayed = (v.astype(np.float32) * np.float32(0.999)).astype(ml_dtypes.bfloat16)
    assert (decayed == v).all()
    # at beta2 = 0.99 (a change of 2**-6.6, over half a BF16 step) it does decay
    assert (((v.astype(np.float32) * np.float32(0.99)).astype(ml_dtypes.bfloat16)) < v).all()


def test_fp32_is_the_reference():
    assert second_moment_ratio("fp32", **KW) == 1.0


def test_nearest_bf16_second_moment_stalls():
    r = second_moment_ratio("bf16", **KW)
    assert r == pytest.approx(0.999 ** -QUIET, rel=0.02)                 # ~1.65: v never decayed
    assert second_moment_ratio("bf16", loud_steps=20, quiet_steps=0, numel=4096) == pytest.approx(1.0, abs=0.01)


def test_stochastic_bf16_decays_as_fp32_in_expectation():
    ratios = [second_moment_ratio("bf16-sr", seed=s, **KW) for s in (0, 1)]
    assert all(r == pytest.approx(1.0, abs=0.01) for r in ratios)
    assert ratios[0] != ratios[1]                                        # really random: the seed matters


@pytest.mark.parametrize("storage, tol", [("fp8", 0.03), ("int8", 0.01)])
def test_blockwise_scale_carries_the_decay(storage, tol):
    """The block's FP32 scale decays with the block; the codes need not move."""
    assert second_moment_ratio(storage, **KW) == pytest.approx(1.0, abs=tol)


def test_a_planted_stall_is_detected():
    """beta2 = 0.99 decays even in nearest BF16: the function reports it (not a hard-coded 1.65)."""
    assert second_moment_ratio("bf16", beta2=0.99, loud_steps=20, quiet_steps=100, numel=4096) < 1.3


def test_unknown_storage_names_the_choices():
    with pytest.raises(ValueError, match="storage must be one of"):
        second_moment_ratio("fp4")
    assert STORAGES == ("fp32", "bf16", "bf16-sr", "fp8", "int8")
