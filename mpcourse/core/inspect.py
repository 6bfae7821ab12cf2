"""A numerics inspector: per layer and tensor role, where each format would underflow or overflow.

``tensor_stats(t)`` summarises one tensor: amax, the smallest nonzero magnitude, the dynamic range in
binades (log2 amax - log2 min nonzero, as Transformer Engine's debug API ``nvdlfw_inspect`` reports it),
a histogram of log2|x| by binade (``binades``), and for every format the library knows (``mpcourse.core.formats``:
FP16, BF16, E4M3, E5M2) the fractions of the nonzero elements that, once multiplied by that format's scale and
rounded to nearest even, would

    underflow   become 0                        |y| <= min_subnormal / 2 (the tie rounds to even: 0)
    subnormal   land subnormal                  min_subnormal / 2 < |y| < min_normal - min_subnormal / 2
    overflow    overflow or saturate            |y| > max (inf in FP16/BF16/E5M2, clamped in E4M3)

with y = x * scale. The scale is the one a recipe would use: ``loss_scale`` for FP16/BF16 (pass the
loss scale for gradients, 1 otherwise) and FP8 per-tensor current scaling for E4M3/E5M2 (``fp8_max /
amax``, TE ``Float8CurrentScaling``), or fixed scales you pass. Every format is reported whatever the run
uses, the "what-if" statistics of TE's debug API. The rule is computed from thresholds; the tests check
it against torch's own casts.

The block formats and every recipe's quantizer (``mpcourse.core.inspect_quant``): each GEMM operand (activation,
weight, output gradient) is also quantized by the engine's own quantizer of every recipe in ``WHAT_IFS``
(per-tensor FP8, rowwise, 1x128 / 128x128 blocks, MXFP8 E4M3 / E5M2 with E8M0 scales under RCEIL and floor,
NVFP4 with its two scale levels) and, where the layer quantizes, by the layer's own quantizer ("run": the run's
statistics, a delayed scale included); a record's ``recipes`` holds for each its underflow, saturation, block
dynamic range, MSE and relative error (``inspect_quant.quantized_stats`` defines each, with TE's as its source),
``skipped`` says why a recipe could not take the tensor (a block that does not divide its shape).

``Inspector(model, every=N)`` hooks every ``nn.Linear`` (FP8 layers included) and records, on every N-th
step, the stats of its input activation, weight, output gradient and weight gradient. Off unless built;
``remove()`` takes the hooks out. ``observe(layer, role, tensor, as_role=..., own=...)`` records any other tensor
the same way: the extension point for tensors that are not a linear layer's (FP8 attention's Q, K, V, P, O, dO, dP:
a module calls it with its own quantizer of each; ``FP8DotProductAttention`` does, for every tensor it casts,
``mpcourse.core.attention.inspected``). ``to_json`` writes the log; ``plot_heatmap`` (layer x step, one fraction of
one role in one format or recipe), ``plot_recipe_heatmap`` (layer x recipe, per role) and ``plot_histogram`` /
``plot_binades`` (one tensor's log2|x| against a format's range) draw it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from .attention.inspected import ATTENTION_ROLES
from .attention.layer import attention_layers
from .formats import FORMATS
from .inspect_quant import QUANTIZER_ROLE, STATISTICS, WHAT_IFS, WhatIfQuantizers, run_quantizer

INSPECT_FORMATS = ("fp16", "bf16", "e4m3", "e5m2")
ROLES = ("activation", "weight", "output_grad", "weight_grad")
FP8 = ("e4m3", "e5m2")
ALL_WHAT_IFS = tuple(WHAT_IFS)


def format_scale(name: str, amax: float, loss_scale: float = 1.0) -> float:
    """The scale a recipe would multiply by before casting to format ``name``: current per-tensor scaling
    (fp8_max / amax; 1 for a zero or non-finite amax, TE's rule) for FP8, ``loss_scale`` otherwise."""
    if name in FP8:
        return FORMATS[name].max / amax if amax > 0 and math.isfinite(amax) else 1.0
    return loss_scale


def binades(a: torch.Tensor, amin: float) -> dict:
    """{"lo": k0, "counts": [n_k0, n_k0+1, ...]}: how many of the magnitudes ``a`` (>= 0, finite) have
    floor(log2|x|) = k, from the binade of ``amin`` (their smallest nonzero; 0: none, lo 0 and no counts) to the
    highest; zeros are not counted. Exact: the binade is the FP32 exponent field where every nonzero is normal,
    else ``frexp``'s."""
    if amin == 0:
        return {"lo": 0, "counts": []}
    lo = math.frexp(amin)[1] - 1                                     # floor(log2 amin)
    if amin >= FORMATS["fp32"].min_normal:                          # the exponent field: e - 127, zeros at e = 0
        idx = (a.view(torch.int32) >> 23) - (126 + lo)               # binade - lo + 1; zeros land <= 0
    else:
        idx = torch.where(a > 0, torch.frexp(a).exponent - lo, 0)    # frexp's exponent is floor(log2 a) + 1
    return {"lo": lo, "counts": torch.bincount(idx.clamp(min=0).reshape(-1))[1:].tolist()}


def _count(mask: torch.Tensor) -> int:
    return int(torch.count_nonzero(mask))            # a bool tensor's sum() is far slower on a CPU


@torch.no_grad()
def tensor_stats(t: torch.Tensor, formats=INSPECT_FORMATS, *, loss_scale: float = 1.0,
                 scales: dict[str, float] | None = None) -> dict:
    """Stats of ``t`` (any float dtype; computed in FP32). ``scales`` overrides ``format_scale`` per format.
    Fractions are of the nonzero finite elements (0.0 when there are none)."""
    a = t.detach().float().abs().reshape(-1)                         # (numel,) fp32
    nonfinite = 0
    if a.numel() and not bool(torch.isfinite(a.amax())):           # an inf or NaN: count it, then read it as 0
        finite = torch.isfinite(a)
        nonfinite = a.numel() - _count(finite)
        a = torch.where(finite, a, 0.0)
    n_nz = _count(a)
    amax = float(a.amax()) if a.numel() else 0.0
    amin = float(torch.where(a > 0, a, math.inf).amin()) if n_nz else 0.0
    out = {"numel": t.numel(), "nonfinite": nonfinite, "zeros": a.numel() - nonfinite - n_nz, "amax": amax,
           "min_nonzero": amin,
           "dynamic_range_binades": math.log2(amax) - math.log2(amin) if n_nz else 0.0,
           "binades": binades(a, amin), "formats": {}}
    n, zeros = max(n_nz, 1), a.numel() - n_nz                       # zeros here: the nonfinite ones too
    for name in formats:
        f = FORMATS[name]
        s = (scales or {}).get(name, format_scale(name, amax, loss_scale))
        y = a * s                                                    # zeros stay 0 (s is finite)
        half = f.min_subnormal / 2
        flushed = _count(y <= half)                                  # the zeros too
        out["formats"][name] = {
            "scale": s,
            "underflow": (flushed - zeros) / n,
            "subnormal": (_count(y < f.min_normal - half) - flushed) / n,     # half < |y| < min_normal - half
            "overflow": _count(y > f.max) / n,
        }
    return out


def _weight(layer: nn.Module) -> torch.Tensor:
    """The high-precision weight a layer trains: its FP32 master where it stores the weight in FP8
    (``mpcourse.core.quant.Float8WeightLinear``: the gradient goes there), else ``layer.weight``."""
    master = getattr(layer, "master_weight", None)
    return layer.weight if master is None else master


class Inspector:
    """Hooks on every ``nn.Linear`` of ``model`` recording ``tensor_stats`` of each role every ``every`` steps.

    Call ``set_step(step)`` before each training step's forward (the training loop does). ``records`` is a
    list of {"step", "layer", "role", **tensor_stats, "recipes", "skipped"}. ``loss_scale`` (a float or a callable
    returning the current one) is applied to the FP16/BF16 what-if of the two gradient roles, which carry it.
    ``what_ifs``: the recipes of ``inspect_quant.WHAT_IFS`` each GEMM operand is also quantized with (default all;
    () for none); ``run``: also the layer's own quantizer's statistics, as "run" (default True); ``roles``: which of
    ``ROLES`` to record (default all); ``summary=False`` leaves ``tensor_stats`` out of the records (a reader of
    ``recipes`` alone, as ``mpcourse.core.autoswitch``, pays for nothing else). The output
    gradient is recorded before the layer's backward uses it (a backward pre-hook), so "run" reads the delayed
    scale that backward casts with. Recording draws no random number from the run's stream.

    ``attention`` (default True): also every tensor each ``FP8DotProductAttention`` casts, recorded under the
    attention module's name with the roles ``ATTENTION_ROLES`` (Q, K, V, P, O, dO, P_bwd, dP, dQ, dK, dV; the
    table in ``mpcourse.core.attention.inspected``), "run" being the layer's own cast of each.
    """

    def __init__(self, model: nn.Module, every: int = 10, formats=INSPECT_FORMATS, loss_scale=1.0,
                 what_ifs=ALL_WHAT_IFS, run: bool = True, roles=ROLES, summary: bool = True, attention: bool = True):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not set(roles) <= set(ROLES):
            raise ValueError(f"roles must be among {ROLES}, got {tuple(roles)}")
        self.roles, self.summary = tuple(roles), summary
        self.every, self.formats, self.loss_scale = every, tuple(formats), loss_scale
        self.quantizers, self.run = WhatIfQuantizers(tuple(what_ifs)), run
        self.records: list[dict] = []
        self.step = 0
        self._handles: dict[str, list] = {}
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name, m in self.layers.items():
            self._hook(name, m)
        self.attention = attention_layers(model) if attention else {}
        for name, m in self.attention.items():
            m.observer = self._attn(name)
            self._handles[name] = [_Unobserve(m)]

    def _hook(self, name: str, m: nn.Module) -> None:
        hs = []
        if {"activation", "weight"} & set(self.roles):
            hs.append(m.register_forward_pre_hook(self._fwd(name)))
        if "output_grad" in self.roles:
            hs.append(m.register_full_backward_pre_hook(self._bwd(name)))
        if "weight_grad" in self.roles:
            hs.append(_weight(m).register_post_accumulate_grad_hook(self._wgrad(name)))
        self._handles[name] = hs

    @property
    def active(self) -> bool:
        """Record on this step? (Forward hooks also need grad mode: evaluation records nothing; backward
        hooks run with grad mode off, by autograd's design.)"""
        return self.step % self.every == 0

    def set_step(self, step: int) -> None:
        self.step = step

    def _scale(self) -> float:
        return float(self.loss_scale() if callable(self.loss_scale) else self.loss_scale)

    def observe(self, layer: str, role: str, t: torch.Tensor, loss_scale: float = 1.0, module=None,
                as_role: str | None = None, own=None) -> dict:
        """Record ``t`` as ``role`` of ``layer`` on the current step and return the record: ``tensor_stats`` and,
        where the tensor is a GEMM operand, every what-if recipe's statistics and its own quantizer's ("run").
        The hooks call it; so can code that holds other tensors, the extension point for tensors that are no
        linear layer's (e.g. FP8 attention's Q, K, V, P, O, dO, dP):

            as_role  the quantizer role the what-ifs quantize it as, "input" (a forward operand: E4M3 under
                     HYBRID) or "grad_output" (a gradient: E5M2); default ``QUANTIZER_ROLE[role]``, none: no
                     what-if. The tensor is read as (-1, last dim), blocks along its last dimension: pass it with
                     its GEMM's contraction dimension last (V^T for P @ V).
            own      the quantizer that cast it in training (its statistics are "run"); default
                     ``run_quantizer(module, as_role)``: a linear layer's own."""
        rec = {"step": self.step, "layer": layer, "role": role,
               **(tensor_stats(t, self.formats, loss_scale=loss_scale) if self.summary else {}),
               "recipes": {}, "skipped": {}}
        qrole = as_role if as_role is not None else QUANTIZER_ROLE.get(role)
        if qrole is not None:
            if own is None and self.run and module is not None:
                own = run_quantizer(module, qrole)
            rec["recipes"], rec["skipped"] = self.quantizers.stats(t, qrole, own if self.run else None)
        self.records.append(rec)
        return rec

    def _fwd(self, name):
        def hook(module, args):
            if self.active and torch.is_grad_enabled():
                if "activation" in self.roles:
                    self.observe(name, "activation", args[0], module=module)
                if "weight" in self.roles:
                    self.observe(name, "weight", _weight(module), module=module)
        return hook

    def _bwd(self, name):
        def hook(module, grad_output):
            if self.active and grad_output[0] is not None:
                self.observe(name, "output_grad", grad_output[0], self._scale(), module=module)
        return hook

    def _attn(self, name):
        def observer(role, t, as_role, own):
            if self.active:
                self.observe(name, role, t, as_role=as_role, own=own if self.run else None)
        return observer

    def _wgrad(self, name):
        def hook(param):
            if self.active and param.grad is not None:
                self.observe(name, "weight_grad", param.grad, self._scale())
        return hook

    def stop(self, name: str) -> None:
        """Record layer ``name`` no more (its hooks out)."""
        for h in self._handles.pop(name, []):
            h.remove()

    def remove(self) -> None:
        for hs in self._handles.values():
            for h in hs:
                h.remove()
        self._handles = {}

    def log(self, **extra) -> dict:
        """The JSON log: every, formats, roles, attention_roles (those of FP8 attention, where watched), what_ifs
        (name: what it is), statistics, records, and ``extra``."""
        return {"every": self.every, "formats": list(self.formats), "roles": list(ROLES),
                "attention_roles": list(ATTENTION_ROLES) if self.attention else [],
                "what_ifs": {n: WHAT_IFS[n].description for n in self.quantizers.names},
                "statistics": list(STATISTICS), "records": self.records, **extra}

    def to_json(self, path: str | Path, **extra) -> None:
        """Write ``log(**extra)`` (strict JSON: no NaN appears in records)."""
        Path(path).write_text(json.dumps(self.log(**extra), indent=0, allow_nan=False))


class _Unobserve:
    """The handle of an attention layer's observer: ``remove()`` takes it off."""

    def __init__(self, module):
        self.module = module

    def remove(self) -> None:
        self.module.observer = None


def _value(r: dict, fmt: str, kind: str) -> float:
    """A record's ``kind`` fraction under ``fmt``: an element format of ``formats`` or a recipe of ``recipes``
    (NaN where the record has neither: a recipe that skipped the tensor, a role no recipe quantizes)."""
    entry = r["formats"].get(fmt) or r.get("recipes", {}).get(fmt)
    return float("nan") if entry is None or kind not in entry else float(entry[kind])


def underflow_grid(records: list[dict], role: str, fmt: str, kind: str = "underflow"):
    """(layers, steps, grid) with grid[i][j] the ``kind`` fraction of ``role`` in ``fmt`` (an element format or a
    recipe of the record's ``recipes``) at layer i, step j (NaN where there is none)."""
    rs = [r for r in records if r["role"] == role]
    layers = [n for n in dict.fromkeys(r["layer"] for r in records) if any(r["layer"] == n for r in rs)]  # model order
    steps = sorted({r["step"] for r in rs})
    grid = [[float("nan")] * len(steps) for _ in layers]
    for r in rs:
        grid[layers.index(r["layer"])][steps.index(r["step"])] = _value(r, fmt, kind)
    return layers, steps, grid


def plot_heatmap(records: list[dict], path, role: str = "output_grad", fmt: str = "fp16", kind: str = "underflow"):
    """Save a layer x step heat map of the ``kind`` fraction of ``role`` in ``fmt``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, steps, grid = underflow_grid(records, role, fmt, kind)
    fig, ax = plt.subplots(figsize=(max(6, len(steps) * 0.35 + 3), 0.3 * len(layers) + 1.8))
    im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0,
                   vmax=max((v for row in grid for v in row if v == v), default=0.0) or 1.0)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xticks(range(len(steps)), steps, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(f"fraction of nonzero {role} that would {kind} in {fmt}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_histogram(t: torch.Tensor, path, fmt: str = "fp16", scale: float = 1.0, title: str = ""):
    """Save a histogram of log2|x * scale| of ``t``'s nonzero elements with ``fmt``'s range marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = (t.detach().float().abs().flatten() * scale)
    a = a[(a > 0) & torch.isfinite(a)]
    f = FORMATS[fmt]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(torch.log2(a).numpy(), bins=120, color="tab:blue", alpha=0.8)
    for x, lab, c in ((math.log2(f.min_subnormal / 2), "flush to 0 below", "tab:red"),
                      (math.log2(f.min_normal), "min normal", "tab:orange"), (math.log2(f.max), "max", "tab:red")):
        ax.axvline(x, color=c, ls="--", lw=1)
        ax.text(x, ax.get_ylim()[1] * 0.95, f" {lab}", color=c, fontsize=8, rotation=90, va="top")
    ax.set_xlabel(f"log2 |x|{' x scale' if scale != 1 else ''}")
    ax.set_ylabel("elements")
    ax.set_title(title or f"{fmt} range against the tensor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe_grid(records: list[dict], role: str, kind: str = "underflow"):
    """(layers, recipes, grid) with grid[i][j] the mean over the inspected steps of the ``kind`` statistic of
    ``role`` at layer i under recipe j ("run" first where there is one, then ``WHAT_IFS``' order; NaN where the
    recipe skipped the tensor)."""
    rs = [r for r in records if r["role"] == role]
    layers = list(dict.fromkeys(r["layer"] for r in rs))
    seen = {n for r in rs for n in r.get("recipes", {})}
    names = [n for n in ("run",) + ALL_WHAT_IFS if n in seen]
    grid = []
    for layer in layers:
        row = []
        for n in names:
            vals = [r["recipes"][n][kind] for r in rs if r["layer"] == layer and n in r.get("recipes", {})]
            row.append(sum(vals) / len(vals) if vals else float("nan"))
        grid.append(row)
    return layers, names, grid


def plot_recipe_heatmap(records: list[dict], path, kind: str = "underflow", roles=("activation", "weight", "output_grad")):
    """Save one layer x recipe heat map per role of the ``kind`` statistic (mean over the inspected steps), each
    cell written as a percentage: which recipe would lose what, where."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(role, *recipe_grid(records, role, kind)) for role in roles]
    panels = [p for p in panels if p[1] and p[2]]
    if not panels:
        return
    n_layers = max(len(p[1]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.3 * n_layers + 2.2), squeeze=False)
    for ax, (role, layers, names, grid) in zip(axes[0], panels):
        ax.imshow(grid, aspect="auto", cmap="magma", vmin=0,
                  vmax=max((v for row in grid for v in row if v == v), default=0.0) or 1.0)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "n/a" if v != v else f"{100 * v:.1f}", ha="center", va="center", fontsize=5.5,
                        color="tab:gray" if v != v else "w")
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_xticks(range(len(names)), names, fontsize=6, rotation=45, ha="right")
        ax.set_title(f"{role}: {kind} (%)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_binades(record: dict, path, formats=("fp16", "e4m3", "e5m2", "e2m1")):
    """Save the histogram of one record's log2|x| (its ``binades``) with each format's window marked: FP16 in
    absolute terms (times the record's FP16 scale), the FP8 and FP4 element formats under per-tensor scaling
    (amax mapped to the format's max): values left of a window's edge flush to zero."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = record["binades"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([b["lo"] + i + 0.5 for i in range(len(b["counts"]))], b["counts"], width=1.0, color="tab:blue", alpha=0.8)
    amax = record["amax"]
    colors = iter(["tab:red", "tab:orange", "tab:green", "tab:purple", "tab:brown"])
    for fmt in formats:
        f, c = FORMATS[fmt], next(colors)
        if fmt in record["formats"] and fmt not in FP8:
            edge = f.min_subnormal / 2 / record["formats"][fmt]["scale"]
        elif amax > 0:
            edge = amax * (f.min_subnormal / 2) / f.max
        else:
            continue
        ax.axvline(math.log2(edge), color=c, ls="--", lw=1, label=f"{fmt}: flush to 0 below")
    ax.set_xlabel("log2 |x|")
    ax.set_ylabel("elements")
    ax.legend(fontsize=7)
    ax.set_title(f"step {record['step']}, {record['layer']}, {record['role']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Which layers a low-precision recipe hurts most: quantize one layer at a time against FP32 on the same batch
# ----------------------------------------------------------------------------------------------------------
def relative_error(test: torch.Tensor, ref: torch.Tensor) -> float:
    """||test - ref|| / ||ref|| (Frobenius, FP32); 0 when both are zero."""
    ref, test = ref.detach().float(), test.detach().float()
    den = float(ref.norm())
    num = float((test - ref).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _run(model: nn.Module, loss_fn, layers, context, seed: int) -> tuple[float, dict, dict]:
    """One forward (in ``context``) and backward of ``loss_fn(model)``: (loss, {param name: grad}, {fqn: output of
    each of ``layers``}). The backward runs outside ``context``, as TE requires of its quantized region."""
    outs = {}

    def keep(fqn):
        def hook(module, args, y):          # returns None: the output goes on unchanged
            outs.setdefault(fqn, y.detach())
        return hook
    hooks = [model.get_submodule(f).register_forward_hook(keep(f)) for f in layers]
    torch.manual_seed(seed)                            # the recipe's random draws (SR): the same in every run
    model.zero_grad(set_to_none=True)
    with context():
        loss = loss_fn(model)
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, outs


def layer_sensitivity(model: nn.Module, loss_fn, layers, quantize_only, context=None, seed: int = 0) -> list[dict]:
    """Rank ``layers`` (fqns of ``nn.Linear`` in ``model``) by how much quantizing *that layer alone* changes a
    training step against FP32 on the same batch, the measurement behind choosing which layers stay high.

    ``loss_fn(model) -> loss`` runs one batch (fix the batch in it); ``quantize_only(model, fqn)`` converts the one
    layer (e.g. ``convert_to_float8_training`` with ``module_filter_fn=lambda m, f: f == fqn``); ``context()`` is
    the recipe's forward region (default none). ``model`` is not changed: each layer runs on a deep copy.

    Returns one dict per layer, largest ``grad_error`` first:
        output_error   relative error of the layer's own output (its input is the FP32 one: nothing upstream changed)
        weight_grad_error   relative error of the layer's weight gradient
        grad_error     relative error of all parameter gradients together (what the optimizer step sees)
        loss_delta     |loss - FP32 loss|
    """
    import copy
    import contextlib

    context = context or contextlib.nullcontext
    layers = list(layers)
    ref_loss, ref_grads, ref_ys = _run(copy.deepcopy(model), loss_fn, layers, contextlib.nullcontext, seed)
    names = list(ref_grads)
    flat = (lambda g: torch.cat([g[n].float().flatten() for n in names]))       # (P,) every gradient at once
    rows = []
    for fqn in layers:
        q_model = quantize_only(copy.deepcopy(model), fqn)
        q_loss, q_grads, q_ys = _run(q_model, loss_fn, [fqn], context, seed)
        rows.append({"layer": fqn, "output_error": relative_error(q_ys[fqn], ref_ys[fqn]),
                     "weight_grad_error": relative_error(q_grads[f"{fqn}.weight"], ref_grads[f"{fqn}.weight"]),
                     "grad_error": relative_error(flat(q_grads), flat(ref_grads)),
                     "loss_delta": abs(q_loss - ref_loss)})
    return sorted(rows, key=lambda r: -r["grad_error"])
