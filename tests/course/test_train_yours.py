"""Every exercise ends by training the course's GPT with the learner's functions beside the library's
(``mpcourse.course.yours.train_yours``, the cell tagged ``train-yours``). For every exercise in
``solutions/``: the cell is there, trains the recipes listed below and stores one "identical to the library's"
verdict per recipe; a planted bug in each function gives a different row or one line naming it; the shipped
exercise's stubs give one "not implemented yet" line per recipe, never a traceback. That the solution's functions
give the library's rows bit for bit is proved where the learner sees it: nbval re-runs the solution's last cell,
which asserts it (``not c.wrong``), so it is not trained a second time here.

To add a lesson: give it an entry in ``EXERCISES`` (the recipes its last cell trains, the functions those
recipes take from it, one planted bug per function), add the cell to the solution
(``from mpcourse.course.yours import train_yours`` / ``_ = train_yours(globals(), [...])``, tagged
``train-yours``, the last code cell), re-execute it and regenerate the exercises. An entry with
``missing`` set is expected to fail (xfail) until what it names exists; remove ``missing`` then (the
cell test is strict: it fails once the cell is there and ``missing`` is still set).
"""
from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
import torch

from mpcourse.experiment.learner import load_functions
from mpcourse.course.yours import YOURS_BLOCK_CONFIG, YOURS_CONFIG, YOURS_DIST_CONFIG, Comparison, train_yours

ROOT = Path(__file__).resolve().parents[2]
TAG = "train-yours"


@dataclass(frozen=True)
class Yours:
    """What an exercise's last cell trains.

    recipes: the recipes its ``train_yours`` call names, in order.
    functions: the exercise's functions those recipes use (each used by at least one of them).
    bugs: one planted bug per function: a wrong implementation with the exercise's signature.
    missing: why the entry cannot pass yet (no seam, no cell); non-empty marks its tests xfail.
    cfg: the run its cell passes as ``cfg=`` (None: ``YOURS_CONFIG``), e.g. ``YOURS_BLOCK_CONFIG``.
    nproc: the processes its cell passes as ``nproc=`` (2 for lesson 10: FSDP over spawned gloo ranks).
    cell: the function its last cell calls: ``train_yours`` (rows of recipes), ``diagnose_yours`` (lesson 12:
        verdicts on fresh runs; ``recipes`` are then its settings, and it gives one comparison for them all) or
        ``memory_yours`` (lesson 11: the learner's byte count beside each recipe's run, one comparison per recipe).
    """

    recipes: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    bugs: dict[str, Callable] = field(default_factory=dict)
    missing: str = ""
    cfg: object = None
    nproc: int = 1
    cell: str = "train_yours"

    @property
    def verdicts(self) -> int:
        """How many "identical to the library's" lines its cell prints with the solution's code."""
        return 1 if self.cell == "diagnose_yours" else len(self.recipes)


# -- planted bugs, by lesson (each keeps the exercise's signature) ---------------------------------------

def _bf16_toward_zero(x):                                  # 00: truncates instead of rounding to nearest even
    return (x.float().view(torch.int32) & -65536).view(torch.float32)


def _fp16_with_bf16_precision(x):                          # 00: keeps 8 significant bits instead of 11
    return x.to(torch.bfloat16).to(torch.float16)


def _zero_update_counted_as_lost(w, dw):                   # 01: forgets dw != 0 (a zero update is not lost)
    return (w.double() + dw.double()).half() == w


def _masters_of_zeros(model_params):                       # 02: right shapes and dtype, not a copy
    return [torch.zeros(p.shape, dtype=torch.float32, requires_grad=True) for p in model_params]


def _master_step_never_copies_down(model_params, master_params, optimizer, loss_scale):   # 02: model never moves
    for p, m in zip(model_params, master_params):
        m.grad = p.grad.float() / loss_scale
    optimizer.step()


def _scale_one_power_too_large(grad_abs_max, fmt_max=65504.0, margin=0):   # 03: S * g * 2**margin > fmt_max
    return 2.0 ** (math.floor(math.log2(fmt_max / 2**margin / grad_abs_max)) + 1)


def _unscale_all_but_the_last(grads, scale):                # 03: one gradient left scaled
    found = False
    for g in grads[:-1]:
        found |= not bool(torch.isfinite(g).all())
        g.mul_(torch.tensor(1 / scale, dtype=torch.float32))
    return found


def _update_scale_always_backs_off(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5,
                                   growth_interval=2000):  # 04: backs off on clean steps too
    return scale * backoff_factor, 0


def _cast_args_never_casts(op_name, args, device_type, dtype):   # 05: everything stays FP32
    return tuple(args)


def _cached_cast_without_history(cache, t, to_type):        # 05: a cast autograd cannot see through
    return t.detach().to(to_type)


def _sr_never_rounds_up(x, generator):                     # 06: not stochastic: always toward zero
    return _bf16_toward_zero(x).to(torch.bfloat16)


def _kahan_drops_compensation(w, comp, update):            # 06: a plain BF16 add
    w.copy_((w.float() + update).to(torch.bfloat16))


def _scale_upside_down(amax, fp8_max, margin=0):        # 07: amax / fp8_max, the inverse scale
    return torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))


def _quantize_always_e4m3(x, scale, fp8_max):            # 07: ignores E5M2 for gradients
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def _update_most_recent(history, scale, amax, fp8_max, margin=0, algo="max"):   # 08: ignores algo="max"
    h = history.clone()
    h[0] = torch.maximum(h[0], amax)
    a = h[0].clone()
    h = torch.roll(h, -1)
    h[0] = 0.0
    new = torch.where((a > 0) & torch.isfinite(a), fp8_max / a / 2.0 ** margin, scale)
    return h, new


def _diagnose_against_the_first_loss(log):               # 12: the gap read from the first loss, not the reference
    from mpcourse.course.grading.diagnosis import reference_diagnose
    return reference_diagnose({**log, "reference_loss": log["loss"][0]})


def _block_scale_not_power_of_2(x, block):              # 10: keeps the mantissa of 448 / amax
    M, K = x.shape
    r, c = block
    v = x.reshape(M // r, r, K // c, c)
    amax = v.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    data = (v * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(M, K)
    return data, scale.reciprocal()


def _mx_exponent_off_by_one(amax, elem):                 # 10: emax of E4M3 taken as 7
    emax = {"e4m3": 7, "e5m2": 15, "e2m1": 2}[elem]
    e = ((amax.view(torch.int32).long() >> 23) & 0xFF) - 127
    return (e - emax).clamp(-127, 127)


def _nvfp4_tensor_scale_without_6(x):                    # 10: t = amax / 448, forgetting E2M1's max
    M, K = x.shape
    t = x.abs().amax() / 448.0
    amax_b = x.reshape(M, K // 16, 16).abs().amax(dim=2)
    return t, ((amax_b / 6.0) / t).clamp(2.0 ** -6, 448.0).to(torch.float8_e4m3fn)


def _tokens_at_the_end_of_their_slot(x, counts, alignment):   # 13: padding rows before each group's tokens
    sizes = (counts + alignment - 1) // alignment * alignment
    ends = torch.cumsum(sizes, 0)
    shift = ends - torch.cumsum(counts, 0)
    rows = torch.arange(x.shape[0]) + torch.repeat_interleave(shift, counts)
    return x.new_zeros(int(ends[-1]), *x.shape[1:]).index_copy(0, rows, x), ends.int()


def _unpad_the_first_rows(y, counts, alignment):            # 13: the first sum(counts) rows, padding included
    return y[:int(counts.sum())]


def _group_scale_rounded_up(t, offs):                      # 13: ceil(log2) for floor(log2): one power too large
    from mpcourse.core.experts import group_colwise_scales
    s = group_colwise_scales(t, offs, power_2_scale=False)
    return torch.exp2(torch.ceil(torch.log2(s)))


def _forgets_to_return(found_inf, group=None):             # 11: reduces in place but returns None
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def _bytes_one_moment(weights, grad_buffers, master, moments):   # 11: AdamW's two moments counted as one
    size = lambda d: 0 if d is None else d.itemsize               # noqa: E731
    return {"weights": size(weights), "grads": size(grad_buffers if grad_buffers is not None else weights)
            + size(master), "master": size(master), "optimizer": size(moments)}


# -- the registry: one entry per solution notebook (keep a comment line between entries) -----------------

EXERCISES: dict[str, Yours] = {
    "00_number_formats": Yours(
        recipes=("fp16-master", "bf16-master", "bf16-pure"), functions=("round_to_fp16", "round_to_bf16"),
        bugs={"round_to_fp16": _fp16_with_bf16_precision, "round_to_bf16": _bf16_toward_zero}),
    # --
    "01_why_fp16_breaks": Yours(
        recipes=("fp16-master",), functions=("is_update_lost",),
        bugs={"is_update_lost": _zero_update_counted_as_lost}),
    # --
    "02_master_weights": Yours(
        recipes=("fp16-master", "bf16-master"), functions=("make_master", "master_step"),
        bugs={"make_master": _masters_of_zeros, "master_step": _master_step_never_copies_down}),
    # --
    "03_static_loss_scaling": Yours(
        recipes=("fp16-static",), functions=("choose_loss_scale", "unscale_grads_"),
        bugs={"choose_loss_scale": _scale_one_power_too_large, "unscale_grads_": _unscale_all_but_the_last}),
    # --
    "04_dynamic_loss_scaling": Yours(
        recipes=("fp16-dynamic",), functions=("update_scale",), bugs={"update_scale": _update_scale_always_backs_off}),
    # --
    "05_autocast": Yours(
        recipes=("bf16-autocast",), functions=("cast_args", "cached_cast"),
        bugs={"cast_args": _cast_args_never_casts, "cached_cast": _cached_cast_without_history}),
    # --
    "06_bf16_training": Yours(
        recipes=("bf16-pure-sr", "bf16-pure-kahan"), functions=("stochastic_round_bf16", "kahan_add_"),
        bugs={"stochastic_round_bf16": _sr_never_rounds_up, "kahan_add_": _kahan_drops_compensation}),
    # --
    "07_fp8_formats_and_scaling": Yours(
        recipes=("fp8-current",), functions=("compute_scale", "quantize"),
        bugs={"compute_scale": _scale_upside_down, "quantize": _quantize_always_e4m3}),
    # --
    "08_delayed_scaling": Yours(recipes=("fp8-delayed",), functions=("update",), bugs={"update": _update_most_recent}),
    # --
    "11_memory_speed_ablations": Yours(
        recipes=("torch-amp-bf16", "bf16-pure-kahan", "bf16-master-bf16-moments-sr", "fp8-delayed"),
        functions=("bytes_per_parameter",), bugs={"bytes_per_parameter": _bytes_one_moment},
        cell="memory_yours"),
    # --
    "12_capstone": Yours(
        recipes=("underflow", "healthy", "overflow", "optimizer"), functions=("diagnose",),
        bugs={"diagnose": _diagnose_against_the_first_loss}, cell="diagnose_yours"),
    # --
    "09_finer_grained_scaling": Yours(
        recipes=("fp8-block", "mxfp8-floor", "nvfp4"), functions=("block_quantize", "mx_shared_exponent", "nvfp4_scales"),
        bugs={"block_quantize": _block_scale_not_power_of_2, "mx_shared_exponent": _mx_exponent_off_by_one,
              "nvfp4_scales": _nvfp4_tensor_scale_without_6}, cfg=YOURS_BLOCK_CONFIG),
    # --
    "13_experts": Yours(
        recipes=("moe-fp8-rowwise", "moe-fp8-block", "moe-mxfp8"),
        functions=("pad_token_groups", "unpad_token_groups", "group_scales"),
        bugs={"pad_token_groups": _tokens_at_the_end_of_their_slot, "unpad_token_groups": _unpad_the_first_rows,
              "group_scales": _group_scale_rounded_up}, cfg=YOURS_BLOCK_CONFIG),
    "14_fp8_attention": Yours(
        functions=("quantize_p_blocks", "switch_events"),
        missing="the fp8-attention recipe takes no learner function (FP8DotProductAttention has no --with seam): "
                "the exercise ends with its check cells"),
    # --
    "10_beyond_one_machine": Yours(
        recipes=("fp16-dynamic",), functions=("all_reduce_found_inf_",),
        bugs={"all_reduce_found_inf_": _forgets_to_return}, cfg=YOURS_DIST_CONFIG, nproc=2),
}


# -- helpers --------------------------------------------------------------------------------------------

SOLUTIONS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))


def _entry(stem: str) -> Yours:
    assert stem in EXERCISES, (f"solutions/{stem}.ipynb has no entry in EXERCISES (tests/course/test_train_yours.py): "
                               "add the recipes its train-yours cell trains")
    return EXERCISES[stem]


def _params(with_bugs: bool = False):
    out = []
    for stem in SOLUTIONS:
        e = EXERCISES.get(stem, Yours())
        marks = [pytest.mark.xfail(reason=e.missing, strict=False)] if e.missing or not e.recipes else []
        if with_bugs:
            out += [pytest.param(stem, fn, id=f"{stem}-{fn}", marks=marks) for fn in (e.bugs or {"-": None})]
        else:
            out.append(pytest.param(stem, id=stem, marks=marks))
    return out


def _last_code_cell(nb):
    return [c for c in nb.cells if c.cell_type == "code"][-1]


def _called_recipes(source: str, cell: str = "train_yours") -> tuple[str, ...]:
    """The recipe names of the ``train_yours(globals(), [...])`` call in a cell (a literal list or tuple)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == cell:
            assert len(node.args) >= 2 and isinstance(node.args[0], ast.Call) and \
                getattr(node.args[0].func, "id", "") == "globals", f"call {cell}(globals(), [recipes])"
            return tuple(ast.literal_eval(node.args[1]))
    raise AssertionError(f"the train-yours cell does not call {cell}(globals(), [...])")


_LIBRARY_RUNS: dict = {}          # the library's runs under YOURS_CONFIG, shared by every test here
_BLOCK_RUNS: dict = {}            # the same under YOURS_BLOCK_CONFIG


def _train(namespace, recipes, cfg=None, nproc=1, cell="train_yours") -> tuple[list[Comparison], list[str]]:
    lines: list[str] = []
    if cell == "diagnose_yours":  # lesson 12: the learner's diagnose on fresh runs (made once per process)
        from mpcourse.course.diagnose_yours import diagnose_yours
        return diagnose_yours(namespace, recipes, echo=lines.append), lines
    if cell == "memory_yours":    # lesson 11: the learner's count beside real runs' (trained once per process)
        from mpcourse.course.memory_yours import memory_yours
        return memory_yours(namespace, recipes, echo=lines.append), lines
    if nproc > 1:                 # spawned ranks: no cache (both rows come from one job)
        return train_yours(namespace, recipes, cfg=cfg, echo=lines.append, nproc=nproc), lines
    runs = _BLOCK_RUNS if cfg is YOURS_BLOCK_CONFIG else _LIBRARY_RUNS
    assert cfg in (None, YOURS_BLOCK_CONFIG), "cache the library's runs of a new cfg apart"
    return train_yours(namespace, recipes, cfg=cfg, echo=lines.append, library_runs=runs), lines


# -- the tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", [pytest.param(s, id=s, marks=[pytest.mark.xfail(reason=EXERCISES[s].missing,
                                                                                 strict=True)]
                                               if EXERCISES.get(s, Yours()).missing else [])
                                  for s in SOLUTIONS])
def test_every_exercise_ends_with_a_train_yours_cell_on_its_recipes(stem):
    e = _entry(stem)
    for folder in ("solutions", "exercises"):
        nb = nbformat.read(ROOT / folder / f"{stem}.ipynb", as_version=4)
        tagged = [c for c in nb.cells if TAG in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{folder}/{stem}.ipynb needs exactly one cell tagged {TAG!r} (has {len(tagged)})"
        assert tagged[0] is _last_code_cell(nb), f"{folder}/{stem}.ipynb: the {TAG} cell must be the last code cell"
        assert _called_recipes(tagged[0].source, e.cell) == e.recipes, "the cell's recipes differ from EXERCISES[stem]"
    out = "".join(o.get("text", "") for o in tagged_solution_outputs(stem))
    assert out.count("identical to the library's") == e.verdicts, out
    assert set(e.bugs) == set(e.functions), "give one planted bug per function"


def tagged_solution_outputs(stem):
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    return next(c for c in nb.cells if TAG in c.metadata.get("tags", [])).outputs


@pytest.mark.slow                                  # trains the course's GPT: the library's rows and yours
@pytest.mark.parametrize("stem,fn", _params(with_bugs=True))
def test_a_planted_bug_gives_a_different_row_or_a_line_naming_it(stem, fn):
    e = _entry(stem)
    assert e.bugs, "no planted bugs listed for this exercise"
    namespace = {**load_functions(ROOT / "solutions" / f"{stem}.ipynb"), fn: e.bugs[fn]}
    comps, lines = _train(namespace, e.recipes, e.cfg, e.nproc, e.cell)
    hit = [c for c in comps if fn in c.used]
    assert hit, f"no recipe of {e.recipes} uses {fn}"
    used = {n for c in comps for n in c.used}
    assert used <= set(e.functions), f"the recipes use {sorted(used)}, the entry lists {sorted(e.functions)}"
    for c in hit:
        assert not c.identical, f"{c.recipe}: the planted bug in {fn} trained the library's row bit for bit"
        if c.yours is None:
            assert fn in c.message, c.message
        else:
            assert "differs from the library's: first at" in c.verdict() or "final" in c.verdict()
    assert "Traceback" not in lines[0]


@pytest.mark.slow                                  # trains the course's GPT: the library's rows and yours
@pytest.mark.parametrize("stem", _params())
def test_the_shipped_exercise_says_not_implemented_in_one_line_per_recipe(stem):
    e = _entry(stem)
    assert e.recipes, "no recipes listed for this exercise"
    comps, lines = _train(load_functions(ROOT / "exercises" / f"{stem}.ipynb"), e.recipes, e.cfg, e.nproc, e.cell)
    for c in comps:
        assert c.yours is None and "is not implemented yet (it raises NotImplementedError)" in c.message, c.verdict()
        assert c.verdict().startswith(f"{c.recipe} [yours]: your ")
    assert "Traceback" not in lines[0]


def test_the_comparison_is_exact_and_says_where_it_differs():
    from dataclasses import replace

    run = _LIBRARY_RUNS.get("bf16-pure") or _train({}, ["bf16-pure"])[0][0].library
    h = [dict(r) for r in run.history]
    h[3]["loss"] = math.nextafter(h[3]["loss"], math.inf)           # one ulp at step 3
    c = Comparison("bf16-pure", ("round_to_bf16",), run, replace(run, recipe="bf16-pure [yours]", history=h))
    assert not c.identical and c.difference.startswith("first at step 3, loss ")
    nan = replace(run, final_val_loss=math.nan)
    assert Comparison("x", (), nan, replace(nan)).identical                # NaN equals NaN: same divergence


def test_bad_arguments_are_refused_before_training():
    with pytest.raises(ValueError, match="non-empty list"):
        train_yours({}, "bf16-pure")
    with pytest.raises(KeyError, match="unknown recipe"):
        train_yours({}, ["bf16-pur"])


@pytest.mark.parametrize("result,words", [
    (lambda x: x.to(torch.bfloat16).flatten(), "round_to_bf16 returned shape"),       # caught by the seam's check
    (lambda x: torch.empty_like(x, device="meta"), "training with your round_to_bf16 failed: "),   # further down
])
def test_a_function_that_breaks_the_run_is_one_line_naming_it(result, words):
    def round_to_bf16(x):
        return result(x)
    comps, lines = _train({"round_to_bf16": round_to_bf16}, ["bf16-master"])
    assert comps[0].yours is None and words in comps[0].message, comps[0].message
    verdict = lines[0].splitlines()[-1]
    assert verdict.startswith("bf16-master [yours]: ") and words in verdict and "Traceback" not in lines[0]

