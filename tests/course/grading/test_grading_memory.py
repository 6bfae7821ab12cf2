"""Lesson 11's grader: passes on a correct count, rejects planted mistakes with a hint that names each one
(master copy forgotten or in the wrong dtype, master's gradient forgotten, moments counted as one or in the
wrong dtype, .grad counted beside the recipe's FP32 gradient buffers, bits for bytes), refuses a float where the
contract says int, and turns a learner's exception into one GradingError naming the recipe. The oracle is the
live-tensor count of mpcourse.experiment.measure.memory. ``memory_yours`` (the exercise's last cell) puts the learner's
count beside real training runs' counts."""
import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.memory import KINDS, RECIPES, check_bytes_per_parameter, measured, recipe_dtypes


def size(d):
    return 0 if d is None else d.itemsize


def good(weights, grad_buffers, master, moments):
    grads = size(grad_buffers if grad_buffers is not None else weights) + size(master)
    return {"weights": size(weights), "grads": grads, "master": size(master), "optimizer": 2 * size(moments)}


def forgets_master(w, gb, m, mo):
    return {**good(w, gb, m, mo), "master": 0}


def moments_always_fp32(w, gb, m, mo):
    return {**good(w, gb, m, mo), "optimizer": 8}


def one_moment(w, gb, m, mo):
    return {**good(w, gb, m, mo), "optimizer": size(mo)}


def forgets_master_grad(w, gb, m, mo):
    return {**good(w, gb, m, mo), "grads": size(gb if gb is not None else w)}


def counts_grad_and_buffers(w, gb, m, mo):
    return {**good(w, gb, m, mo), "grads": size(w) + size(gb) + size(m)}


def ignores_buffers(w, gb, m, mo):
    return {**good(w, gb, m, mo), "grads": size(w) + size(m)}


def master_in_weights_dtype(w, gb, m, mo):
    return {**good(w, gb, m, mo), "master": size(w) if m is not None else 0}


def bits_for_bytes(w, gb, m, mo):
    return {k: 8 * v for k, v in good(w, gb, m, mo).items()}


def floats(w, gb, m, mo):                       # 4.0 for 4: equal values, the wrong type
    return {k: float(v) for k, v in good(w, gb, m, mo).items()}


def none_not_handled(w, gb, m, mo):
    return {"weights": w.itemsize, "grads": (gb or w).itemsize + m.itemsize, "master": m.itemsize,
            "optimizer": 2 * mo.itemsize}


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
    (moments_always_fp32, "two moments .exp_avg and exp_avg_sq. in float16: 2 x 2 B"),
    (one_moment, "two moments .exp_avg and exp_avg_sq. in float32: 2 x 4 B"),
    (forgets_master_grad, "master copy has its own gradient"),
    (counts_grad_and_buffers, "count the buffers only"),
    (ignores_buffers, "gradients live in its own buffers"),
    (master_in_weights_dtype, "in the master's dtype, not the weights'"),
    (bits_for_bytes, "bits"),
])
def test_planted_bugs_fail_with_their_hint(bug, hint):
    with pytest.raises(GradingError, match=hint):
        check_bytes_per_parameter(bug)


def test_a_float_for_an_int_is_refused_with_the_fix():
    """The values of ``floats`` equal the measured bytes; the contract says int (the old grader passed it)."""
    with pytest.raises(GradingError, match=r"weights should be the int 4, got 4\.0 \(float\).*dtype.itemsize is an int"):
        check_bytes_per_parameter(floats)
    with pytest.raises(GradingError, match=r"got False \(bool\)"):
        check_bytes_per_parameter(lambda *a: {**good(*a), "master": bool(good(*a)["master"])})


def test_a_learners_exception_is_one_grading_error_naming_the_recipe():
    with pytest.raises(GradingError, match=r"recipe fp32 \(weights=float32, grad_buffers=None.*raised AttributeError"):
        check_bytes_per_parameter(none_not_handled)


def test_stub_and_bad_return():
    def stub(*a):
        raise NotImplementedError
    with pytest.raises(GradingError, match="not implemented yet"):
        check_bytes_per_parameter(stub)
    with pytest.raises(GradingError, match="exactly the keys"):
        check_bytes_per_parameter(lambda *a: [2, 4])
    with pytest.raises(GradingError, match="exactly the keys"):
        check_bytes_per_parameter(lambda *a: {**good(*a), "total": sum(good(*a).values())})


def test_recipe_dtypes_reads_a_built_recipe():
    """What the exercise's arguments are, read from recipes whose dtypes the course states: pure BF16 keeps FP32
    gradient buffers, the master recipes an FP32 master, pure FP16 everything in FP16 (after one step, when the
    moments exist); a recipe with one kind in two dtypes is refused, naming the kind."""
    expect = {"fp16-pure": (torch.float16, None, None, torch.float16),
              "bf16-pure": (torch.bfloat16, torch.float32, None, torch.bfloat16),
              "fp16-master": (torch.float16, None, torch.float32, torch.float32),
              "fp8-current": (torch.float32, None, None, torch.float32)}
    for name, dts in expect.items():
        assert tuple(measured(name)[0][k] for k in ("weights", "grad_buffers", "master", "moments")) == dts, name
    with pytest.raises(ValueError, match="keeps its weights in several dtypes .torch.float32, torch.float8_e4m3fn."):
        measured("fp8-delayed-fp8-weights")
    assert callable(recipe_dtypes)


# -- memory_yours: the learner's count beside real runs ------------------------------------------------------

def test_memory_yours_agrees_with_the_runs_for_the_correct_count():
    from mpcourse.course.memory_yours import memory_yours

    lines = []
    comps = memory_yours({"bytes_per_parameter": good}, ["bf16-pure-kahan", "bf16-master-bf16-moments-sr"],
                         echo=lines.append)
    assert [c.identical for c in comps] == [True, True] and not any(c.wrong for c in comps)
    assert comps[0].measured == {"weights": 2.0, "grads": 4.0, "master": 0.0, "optimizer": 4.0}
    assert comps[0].run.bytes_per_param["extra"] == 2.0                 # the Kahan buffer: outside the rule
    assert comps[1].dtypes["master"] == torch.float32 and comps[1].measured["grads"] == 6.0
    assert lines[0].count("identical to the library's count") == 2 and "Traceback" not in lines[0]


@pytest.mark.parametrize("fn,words,wrong", [
    (counts_grad_and_buffers, "differs from the library's: first at grads: yours 6, the run's 4", True),
    (floats, "returned {'weights': 2.0", True),
    (none_not_handled, "raised AttributeError", True),
    (lambda *a: (_ for _ in ()).throw(NotImplementedError()), "is not implemented yet (it raises NotImplementedError)",
     False),
])
def test_memory_yours_names_a_wrong_count_in_one_line(fn, words, wrong):
    from mpcourse.course.memory_yours import memory_yours

    (c,) = memory_yours({"bytes_per_parameter": fn}, ["bf16-pure-kahan"], echo=None)
    assert not c.identical and c.wrong is wrong and words in c.verdict(), c.verdict()
    assert c.verdict().startswith("bf16-pure-kahan [yours]: ")


def test_memory_yours_refuses_bad_arguments_before_training():
    from mpcourse.course.memory_yours import memory_yours

    with pytest.raises(ValueError, match="non-empty list"):
        memory_yours({}, "bf16-pure")
    with pytest.raises(KeyError, match="unknown recipe"):
        memory_yours({}, ["bf16-pur"])
    (c,) = memory_yours({}, ["bf16-pure-kahan"], echo=None)
    assert c.yours is None and "defines no function bytes_per_parameter" in c.message and not c.wrong
    assert set(c.measured) == set(KINDS)
