"""Low-precision optimizer state resumes bit for bit, or is refused in words that are true.

What the stored numbers mean travels with them. ``BlockQuantizedAdamW`` records ``fmt``, ``state_rule`` and
``block_size`` in every param group: ``torch.save`` keeps a whole state_dict, ``torch.distributed.checkpoint``
keeps only its 'state' and 'param_groups' (a top-level key was dropped, and a missing rule used to read as
torchao's: an fp8-moments checkpoint was refused by its own run, and following the advice would have read stored
sqrt(v) as v). ``LowPrecisionState`` with stochastic rounding keeps its generators. The DCP side, on two ranks, is
tests/experiment/parallel/test_checkpoint_distributed.py.

The oracle is the run that was never interrupted: the same ops on the same inputs, so no tolerance. A state_dict
that does not say how its moments are stored is refused (never read under a guessed rule), and one stored otherwise
than the loading optimizer stores is refused naming both.
"""
import copy
import io

import pytest
import torch

from mpcourse.core.checkpoint import CheckpointError, check_optimizer_state_dict
from mpcourse.core.optim.blockwise import STORAGE_KEYS, BlockQuantizedAdamW
from mpcourse.core.optim.state import LowPrecisionState

SHAPES = [(64, 128), (48,), (4096,)]          # quantized, FP32 moments (small), quantized 1-D
STEPS, K = 6, 3


def _grads(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * 10.0 ** (-t % 4) for s in SHAPES] for t in range(STEPS)]


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _steps(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.dim() else t


def _same(opt_a, params_a, opt_b, params_b):
    for a, b in zip(params_a, params_b):
        assert torch.equal(_bits(a.detach()), _bits(b.detach()))
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert set(sa) == set(sb)
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])), k


def _trip(sd, keep):
    """``sd`` after a checkpoint: ``torch.save`` bytes read back, or only what DCP's get/set_state_dict keep."""
    if keep == "state and param_groups":
        return copy.deepcopy({"state": sd["state"], "param_groups": sd["param_groups"]})
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _quantized(fmt="fp8", state_rule="sqrt-nonzero", block_size=256, steps=K):
    params = _params()
    opt = BlockQuantizedAdamW(params, lr=1e-2, fmt=fmt, state_rule=state_rule, block_size=block_size)
    _steps(opt, params, _grads()[:steps])
    return params, opt


@pytest.mark.parametrize("keep", ["torch.save", "state and param_groups"])
@pytest.mark.parametrize("fmt,rule,block_size", [("fp8", "sqrt-nonzero", 256), ("int8", "sqrt-nonzero", 256),
                                                 ("fp8", "torchao", 128), ("int8", "torchao", 256)])
def test_resume_is_bit_for_bit(fmt, rule, block_size, keep):
    """Save after K steps, load into a fresh optimizer, go on: weights, codes and scales as the run that was never
    interrupted. Only 'state' and 'param_groups' kept (what DCP keeps): the default rule used to be refused."""
    straight, opt = _quantized(fmt, rule, block_size, steps=STEPS)
    params, first = _quantized(fmt, rule, block_size)
    sd = _trip(first.state_dict(), keep)
    assert all(g[k] == v for g in sd["param_groups"] for k, v in first.storage().items())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = BlockQuantizedAdamW(resumed, lr=1e-2, fmt=fmt, state_rule=rule, block_size=block_size)
    check_optimizer_state_dict(again, sd)
    again.load_state_dict(sd)
    _steps(again, resumed, _grads()[K:])
    _same(opt, straight, again, resumed)
    assert all(g[k] == v for g in again.state_dict()["param_groups"] for k, v in again.storage().items())


@pytest.mark.parametrize("key,saved,here", [("fmt", "int8", "fp8"), ("state_rule", "torchao", "sqrt-nonzero"),
                                            ("state_rule", "sqrt-nonzero", "torchao"), ("block_size", 128, 256)])
def test_another_storage_is_refused_naming_both(key, saved, here):
    """Codes read in another format, sqrt(v) read as v (or v as sqrt(v)), or requantized in other blocks: refused
    before anything loads (a state of another block size used to load, then continue in other blocks)."""
    kw = {"fmt": "fp8", "state_rule": "sqrt-nonzero", "block_size": 256}
    _, opt = _quantized(**{**kw, key: saved})
    fresh = BlockQuantizedAdamW(_params(), lr=1e-2, **{**kw, key: here})
    msg = (rf"stored with {key}={saved!r} and this optimizer uses {key}={here!r}: "
           rf"build BlockQuantizedAdamW\(\.\.\., {key}={saved!r}\) to load it")
    with pytest.raises(CheckpointError, match=msg):
        check_optimizer_state_dict(fresh, opt.state_dict())
    with pytest.raises(ValueError, match=msg):
        fresh.load_state_dict(_trip(opt.state_dict(), "state and param_groups"))
    assert not fresh.state and fresh.storage()[key] == here


@pytest.mark.parametrize("rule", ["sqrt-nonzero", "torchao"])
def test_a_state_that_does_not_record_its_rule_is_refused(rule):
    """What a DCP checkpoint of an older version holds: codes and scales, no record. A missing rule used to read as
    torchao's: a torchao-rule optimizer loaded it whatever it held (a sqrt(v) read as v). Now refused, naming what
    to do, under either rule."""
    _, opt = _quantized(state_rule=rule)
    sd = opt.state_dict()
    old = {"state": sd["state"], "param_groups": [{k: v for k, v in g.items() if k not in STORAGE_KEYS}
                                                  for g in sd["param_groups"]]}
    msg = (r"does not record its state_rule, so its exp_avg_sq codes may stand for v .* Not guessing: resume it "
           r"with the mpcourse version that wrote it, or start the run again")
    for here in ("sqrt-nonzero", "torchao"):
        fresh = BlockQuantizedAdamW(_params(), lr=1e-2, state_rule=here)
        with pytest.raises(ValueError, match=msg):
            fresh.load_state_dict(old)
        with pytest.raises(CheckpointError, match=msg):
            check_optimizer_state_dict(fresh, old)
        assert not fresh.state


def test_a_one_process_state_dict_of_the_previous_format_loads_by_what_it_records():
    """A ``Trainer.save`` file of the previous version: the rule as a top-level key (true: torch.save kept it), no
    record in the groups. It loads when the rule, the fmt its codes' dtype shows and the block size its codes per
    scale show are this optimizer's, and resumes bit for bit; otherwise refused naming both."""
    straight, opt = _quantized("int8", "torchao", 128, steps=STEPS)
    params, first = _quantized("int8", "torchao", 128)
    sd = first.state_dict()
    legacy = {"state": sd["state"], "state_rule": "torchao",
              "param_groups": [{k: v for k, v in g.items() if k not in STORAGE_KEYS} for g in sd["param_groups"]]}
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = BlockQuantizedAdamW(resumed, lr=1e-2, fmt="int8", state_rule="torchao", block_size=128)
    check_optimizer_state_dict(again, legacy)
    again.load_state_dict(legacy)
    _steps(again, resumed, _grads()[K:])
    _same(opt, straight, again, resumed)
    same = dict(fmt="int8", state_rule="torchao", block_size=128)
    for kw, msg in [(dict(block_size=256), "block_size=128 and this optimizer uses block_size=256"),
                    (dict(fmt="fp8"), "fmt='int8' and this optimizer uses fmt='fp8'"),
                    (dict(state_rule="sqrt-nonzero"), "state_rule='torchao' and this optimizer uses "
                                                      "state_rule='sqrt-nonzero'")]:
        with pytest.raises(ValueError, match=msg):
            BlockQuantizedAdamW(_params(), **{**same, **kw}).load_state_dict(legacy)


def test_nothing_quantized_has_nothing_to_misread():
    """Moments of parameters under 4096 elements are stored in the parameter's dtype under every rule: such a
    state_dict loads without a record."""
    p = torch.nn.Parameter(torch.randn(48))
    opt = BlockQuantizedAdamW([p], lr=1e-2)
    p.grad = torch.randn(48)
    opt.step()
    sd = opt.state_dict()
    bare = {"state": sd["state"], "param_groups": [{k: v for k, v in g.items() if k not in STORAGE_KEYS}
                                                   for g in sd["param_groups"]]}
    fresh = BlockQuantizedAdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-2, state_rule="torchao")
    fresh.load_state_dict(bare)
    assert fresh.param_groups[0]["state_rule"] == "torchao"          # the record is the optimizer's again


def test_the_storage_is_the_optimizers_not_a_groups():
    with pytest.raises(ValueError, match=r"state_rule is set for the whole optimizer .* build one BlockQuantizedAdamW"):
        BlockQuantizedAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "state_rule": "torchao"}])
    opt = BlockQuantizedAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "block_size": 256}])
    assert opt.param_groups[0]["block_size"] == 256


# -- LowPrecisionState: BF16 moments, rounded to nearest or stochastically -------------------------------------------
def _low(rounding="stochastic", dtype=torch.bfloat16, steps=K):
    params = _params()
    opt = LowPrecisionState(torch.optim.AdamW, dtype, rounding=rounding, seed=3)(params, lr=1e-2)
    _steps(opt, params, _grads()[:steps])
    return params, opt


def test_stochastic_state_without_its_generator_is_refused_or_waits_for_it():
    """torch.distributed.checkpoint's set_state_dict hands the optimizer 'state' and 'param_groups' only: loaded,
    the optimizer refuses to step (its draws would not continue the run) until the saved generators are set; the
    checked path refuses at once. With them, the run goes on bit for bit."""
    straight, opt = _low(steps=STEPS)
    params, first = _low()
    sd = first.state_dict()
    bare = _trip(sd, "state and param_groups")
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = type(first)(resumed, lr=1e-2)
    with pytest.raises(CheckpointError, match="holds no stochastic-rounding generator"):
        check_optimizer_state_dict(again, bare)
    again.load_state_dict(bare)
    resumed[0].grad = torch.zeros_like(resumed[0])
    with pytest.raises(RuntimeError, match=r"without the stochastic-rounding generator .* call load_rng_state"):
        again.step()
    again.load_rng_state(first.rng_state())
    _steps(again, resumed, _grads()[K:])
    _same(opt, straight, again, resumed)


@pytest.mark.parametrize("saved,here,msg", [
    (dict(dtype=torch.bfloat16), dict(dtype=torch.float16), "stored in torch.bfloat16 and this optimizer keeps it "
                                                            "in torch.float16"),
    (dict(rounding="stochastic"), dict(rounding="nearest"), "saved with rounding='stochastic' .* this optimizer uses "
                                                            "rounding='nearest'"),
    (dict(rounding="nearest"), dict(rounding="stochastic"), "holds no stochastic-rounding generator .* rounding="
                                                            "'nearest'"),
])
def test_low_precision_state_of_another_kind_is_refused_naming_both(saved, here, msg):
    _, opt = _low(**saved)
    fresh = _low(**here, steps=0)[1]
    with pytest.raises(CheckpointError, match=msg):
        check_optimizer_state_dict(fresh, opt.state_dict())
    if "dtype" in saved or saved.get("rounding") == "stochastic":
        with pytest.raises(ValueError, match=msg):
            fresh.load_state_dict(opt.state_dict())
    assert not fresh.state
