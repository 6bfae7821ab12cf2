"""Grader for lesson 11 (memory): the bytes per parameter a recipe's state holds, from the dtypes it keeps.

* ``check_bytes_per_parameter(fn)``: ``fn(weights, grad_buffers, master, moments)`` returns the bytes per
  parameter of the state one training step holds after ``optimizer.step()`` and before ``zero_grad()``, by
  kind: ``{"weights", "grads", "master", "optimizer"}``, each a Python ``int`` (a dtype argument is a
  ``torch.dtype`` or None for "none kept"; the contract is in the exercise's docstring).

Oracle: the bytes counted from the live tensors of a real step (``mpcourse.experiment.measure.memory.measure_step`` on
a one-block GPT, each storage once), divided by the number of parameters, for the recipes of ``RECIPES``:
FP32, pure FP16 and pure BF16, FP16/BF16 with an FP32 master copy, BF16 moments with an FP32 master
(DeepSeek-V3's choice) and FP8 compute (``fp8-current``: FP32 state, FP8 copies outside the state). The
dtypes each recipe keeps are read from the recipe built for the measurement (``recipe_dtypes``: its
parameters, its master copy, its optimizer's moments, its gradient buffers), not written down by hand; lesson
11's last exercise cell (``mpcourse.course.memory_yours``) reads them the same way from real training runs.

What is checked, in order, per recipe: the function returns (does not raise), a ``dict`` with exactly the four
keys, every value an ``int`` (not a float such as ``4.0``, not a bool, not a tensor: bytes of a dtype are
whole, ``dtype.itemsize``), and every value equal to the measured bytes. On the first mismatch the hint names
the usual fault: the master copy forgotten or counted in the weights' dtype, the master's gradient forgotten,
the moments counted as one, in FP32 or in the wrong dtype, the model's own ``.grad`` counted beside the
buffers that replace it (or the buffers ignored), bits counted for bytes.
"""
from __future__ import annotations

import functools

import torch

from . import GradingError, call, verdict

RECIPES = ("fp32", "fp16-pure", "bf16-pure", "fp16-master", "bf16-master", "bf16-master-bf16-moments", "fp8-current")
KINDS = ("weights", "grads", "master", "optimizer")


def _dtype(kind: str, ts) -> torch.dtype | None:
    """The one dtype of the tensors of ``kind`` (None for none). ValueError naming the dtypes if they differ."""
    dts = {t.dtype for t in ts}
    if len(dts) > 1:
        raise ValueError(f"the recipe keeps its {kind} in several dtypes ({', '.join(sorted(map(str, dts)))}): "
                         "bytes_per_parameter's rule takes one dtype per kind; choose a recipe that keeps one")
    return next(iter(dts), None)


def recipe_dtypes(recipe) -> dict:
    """The dtypes a built recipe keeps, as the exercise's arguments: {"weights", "grad_buffers", "master",
    "moments"} (None where it keeps none): its model's parameters, the gradient buffers its optimizer reads
    instead of ``.grad`` (``optimizer.grads``), the optimizer's parameters that are not the model's (the master
    copy), and AdamW's ``exp_avg`` / ``exp_avg_sq``. Read after ``step()`` and before ``zero_grad()`` (the moments
    and buffers exist then). ValueError if one kind mixes dtypes (``fp8-delayed-fp8-weights``: FP8 and FP32
    weights; ``fp8-moments``: FP8 codes and FP32 moments)."""
    params = list(recipe.model.parameters())
    opt_params = [p for g in recipe.optimizer.param_groups for p in g["params"]]
    model_ids = {id(p) for p in params}
    master = [p for p in opt_params if id(p) not in model_ids]
    moments = [v for p in opt_params for k, v in recipe.optimizer.state.get(p, {}).items()
               if k in ("exp_avg", "exp_avg_sq")]
    buffers = [g for g in getattr(recipe.optimizer, "grads", []) if isinstance(g, torch.Tensor)]
    return {"weights": _dtype("weights", params), "grad_buffers": _dtype("gradient buffers", buffers),
            "master": _dtype("master copy", master), "moments": _dtype("moments", moments)}


@functools.lru_cache(maxsize=None)
def measured(name: str) -> tuple[dict, dict]:
    """(the dtypes recipe ``name`` keeps, its bytes per parameter measured from live tensors) on a 1-block GPT."""
    from mpcourse.core.emulation import tensor_cores
    from mpcourse.experiment.gpt.data import load_corpus
    from mpcourse.experiment.measure.memory import measure_step
    from mpcourse.experiment.gpt.model import GPT, GPTConfig
    from mpcourse.experiment.recipes import OptimConfig, get_recipe

    corpus = load_corpus(None)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, n_layer=1, n_embd=32, n_head=2, block_size=16)
    x, y = corpus.batch("train", 4, cfg.block_size, torch.Generator().manual_seed(0))     # (4, 16) int64
    torch.manual_seed(0)
    recipe = get_recipe(name)(GPT(cfg), OptimConfig())
    with tensor_cores():
        _, _, mem = measure_step(recipe, x, y, track_peak=False)
    return recipe_dtypes(recipe), {k: v for k, v in mem.bytes_per_param().items() if k in KINDS}


def _hint(got: dict, want: dict, dt: dict) -> str:
    size = lambda d: d.itemsize if d is not None else 0                         # noqa: E731
    w, gb, m, mo = (size(dt[k]) for k in ("weights", "grad_buffers", "master", "moments"))
    if any(got[k] == 8 * want[k] and want[k] for k in KINDS):
        return "a dtype's size in bytes is dtype.itemsize (torch.finfo(dtype).bits counts bits)"
    if want["master"] and not got["master"]:
        return "the recipe keeps a master copy: count its weights (one copy in the master's dtype)"
    if want["master"] and got["master"] == w != m:
        return "the master copy is in the master's dtype, not the weights'"
    if want["master"] and got["weights"] == w + m:
        return "the master copy is its own kind, \"master\": \"weights\" is the model's parameters only"
    if got["optimizer"] != want["optimizer"]:
        return (f"this recipe keeps AdamW's two moments (exp_avg and exp_avg_sq) in "
                f"{str(dt['moments']).replace('torch.', '')}: 2 x {mo} B, whatever the weights' or the master's "
                "dtype")
    if want["master"] and got["grads"] == want["grads"] - m:
        return ("the master copy has its own gradient (in the master's dtype), alive beside the model's "
                ".grad until zero_grad()")
    if gb and got["grads"] == want["grads"] + w:
        return ("this recipe accumulates the gradients into its own buffers and drops the model's .grad: "
                "count the buffers only")
    if gb and got["grads"] == want["grads"] - gb + w:
        return ("this recipe's gradients live in its own buffers (grad_buffers' dtype), not in the model's "
                ".grad")
    if got["grads"] != want["grads"]:
        return ("a gradient has its parameter's dtype (the model's .grad in the weights' dtype, the master's "
                "in the master's), unless the recipe keeps gradient buffers")
    return "compare each kind with the docstring's contract: which tensors are alive after step()?"


def _args(dt: dict) -> str:
    return ", ".join(f"{a}={str(v).replace('torch.', '')}" for a, v in dt.items())


def check_bytes_per_parameter(fn) -> None:
    """Grade ``fn(weights, grad_buffers, master, moments) -> {"weights", "grads", "master", "optimizer"}``.

    Raises:
        GradingError: ``fn`` raised, did not return a dict of the four kinds, returned a value that is not an
            int, or a kind differs from the bytes measured from live tensors (the first such recipe and kind).
    """
    name = "bytes_per_parameter"
    for recipe in RECIPES:
        dt, want = measured(recipe)
        try:
            got = call(name, fn, dt["weights"], dt["grad_buffers"], dt["master"], dt["moments"])
        except GradingError:
            raise
        except Exception as e:                             # the learner's code: one line naming the case
            first = str(e).splitlines()[0] if str(e) else ""
            raise GradingError(f"FAIL {name}: recipe {recipe} ({_args(dt)}) raised {type(e).__name__}: {first}. "
                               "Hint: an argument is None where the recipe keeps no such tensor; it counts "
                               "0 bytes.") from None
        if not isinstance(got, dict) or set(got) != set(KINDS):
            raise GradingError(f"FAIL {name}: return a dict with exactly the keys {KINDS}, got "
                               f"{sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__}")
        for k in KINDS:
            if type(got[k]) is not int:
                raise GradingError(f"FAIL {name}: recipe {recipe} ({_args(dt)}): {k} should be the int "
                                   f"{int(want[k])}, got {got[k]!r} ({type(got[k]).__name__}). Hint: bytes of a "
                                   "dtype are whole: dtype.itemsize is an int; keep them ints (no float(), "
                                   "no / 8).")
        for k in KINDS:
            if got[k] != want[k]:
                raise GradingError(f"FAIL {name}: recipe {recipe} ({_args(dt)}): {k} should be {want[k]:g} B per "
                                   f"parameter (measured from the live tensors), got {got[k]}. Hint: "
                                   f"{_hint(got, want, dt)}.")
    verdict(name, f"{len(RECIPES)} recipes, every kind an int equal to the bytes measured from live tensors")
