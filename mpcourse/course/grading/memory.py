"""Grader for lesson 11 (memory): the bytes per parameter a recipe's state holds, from the dtypes it keeps.

* ``check_bytes_per_parameter(fn)``: ``fn(weights, grad_buffers, master, moments)`` returns the bytes per
  parameter of the state one training step holds after ``optimizer.step()`` and before ``zero_grad()``, by
  kind: ``{"weights", "grads", "master", "optimizer"}`` (a dtype argument is a ``torch.dtype`` or None for
  "none kept"; the contract is in the exercise's docstring).

Oracle: the bytes counted from the live tensors of a real step (``mpcourse.experiment.memory.measure_step`` on
a one-block GPT, each storage once), divided by the number of parameters, for the recipes of ``RECIPES``:
FP32, pure FP16 and pure BF16, FP16/BF16 with an FP32 master copy, BF16 moments with an FP32 master
(DeepSeek-V3's choice) and FP8 compute (``fp8-current``: FP32 state, FP8 copies outside the state). The
dtypes each recipe keeps are read from the recipe built for the measurement (its parameters, its master
copy, its optimizer's moments, its gradient buffers), not written down by hand. On the first mismatch the
hint names the usual fault: the master copy forgotten, the master's gradient forgotten, the moments counted
in FP32 when the recipe keeps them in 16 bits, the model's own ``.grad`` counted beside the buffers that
replace it.
"""
from __future__ import annotations

import functools

import torch

from . import GradingError, call, verdict

RECIPES = ("fp32", "fp16-pure", "bf16-pure", "fp16-master", "bf16-master", "bf16-master-bf16-moments", "fp8-current")
KINDS = ("weights", "grads", "master", "optimizer")


def _dtype(ts):
    """The one dtype of a list of tensors (None for an empty list)."""
    dts = {t.dtype for t in ts}
    assert len(dts) <= 1, f"mixed dtypes {dts}"
    return next(iter(dts), None)


@functools.lru_cache(maxsize=None)
def measured(name: str) -> tuple[dict, dict]:
    """(the dtypes recipe ``name`` keeps, its bytes per parameter measured from live tensors) on a 1-block GPT."""
    from mpcourse.core.emulation import tensor_cores
    from mpcourse.experiment.data import load_corpus
    from mpcourse.experiment.memory import measure_step
    from mpcourse.experiment.model import GPT, GPTConfig
    from mpcourse.experiment.recipes import OptimConfig, get_recipe

    corpus = load_corpus(None)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, n_layer=1, n_embd=32, n_head=2, block_size=16)
    x, y = corpus.batch("train", 4, cfg.block_size, torch.Generator().manual_seed(0))     # (4, 16) int64
    torch.manual_seed(0)
    recipe = get_recipe(name)(GPT(cfg), OptimConfig())
    with tensor_cores():
        _, _, mem = measure_step(recipe, x, y, track_peak=False)
    params = list(recipe.model.parameters())
    opt_params = [p for g in recipe.optimizer.param_groups for p in g["params"]]
    model_ids = {id(p) for p in params}
    master = [p for p in opt_params if id(p) not in model_ids]
    moments = [v for p in opt_params for k, v in recipe.optimizer.state.get(p, {}).items()
               if k in ("exp_avg", "exp_avg_sq")]
    buffers = [g for g in getattr(recipe.optimizer, "grads", []) if isinstance(g, torch.Tensor)]
    dtypes = {"weights": _dtype(params), "grad_buffers": _dtype(buffers), "master": _dtype(master),
              "moments": _dtype(moments)}
    return dtypes, {k: v for k, v in mem.bytes_per_param().items() if k in KINDS}


def _hint(got: dict, want: dict, dt: dict) -> str:
    size = lambda d: d.itemsize if d is not None else 0                         # noqa: E731
    if want["master"] and not got.get("master"):
        return "the recipe keeps a master copy: count its weights (one copy in the master's dtype)"
    if got.get("optimizer") == 8 and want["optimizer"] == 4:
        return (f"this recipe keeps AdamW's two moments in {str(dt['moments']).replace('torch.', '')}: "
                f"2 x {size(dt['moments'])} B, not 2 x 4")
    if want["master"] and got.get("grads") == want["grads"] - size(dt["master"]):
        return ("the master copy has its own gradient (in the master's dtype), alive beside the model's "
                ".grad until zero_grad()")
    if dt["grad_buffers"] and got.get("grads") == want["grads"] + size(dt["weights"]):
        return ("this recipe accumulates the gradients into its own buffers and drops the model's .grad: "
                "count the buffers only")
    return "compare each kind with the docstring's contract: which tensors are alive after step()?"


def check_bytes_per_parameter(fn) -> None:
    """Grade ``fn(weights, grad_buffers, master, moments) -> {"weights", "grads", "master", "optimizer"}``.

    Raises:
        GradingError: not a dict of the four kinds, or a kind differs from the bytes measured from live tensors.
    """
    name = "bytes_per_parameter"
    for recipe in RECIPES:
        dt, want = measured(recipe)
        got = call(name, fn, dt["weights"], dt["grad_buffers"], dt["master"], dt["moments"])
        if not isinstance(got, dict) or set(got) != set(KINDS):
            raise GradingError(f"FAIL {name}: return a dict with exactly the keys {KINDS}, got "
                               f"{sorted(got) if isinstance(got, dict) else type(got).__name__}")
        for k in KINDS:
            if not isinstance(got[k], (int, float)) or abs(got[k] - want[k]) > 1e-6:
                args = ", ".join(f"{a}={str(v).replace('torch.', '')}" for a, v in dt.items())
                raise GradingError(f"FAIL {name}: recipe {recipe} ({args}): {k} should be {want[k]:g} B per "
                                   f"parameter (measured from the live tensors), got {got[k]}. Hint: "
                                   f"{_hint(got, want, dt)}.")
    verdict(name, f"{len(RECIPES)} recipes, every kind equal to the bytes measured from live tensors")
