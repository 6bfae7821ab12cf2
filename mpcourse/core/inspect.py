"""A numerics inspector: per layer and tensor role, where each format would underflow or overflow.

``tensor_stats(t)`` summarises one tensor: amax, the smallest nonzero magnitude, the dynamic range in
binades (log2 amax - log2 min nonzero, as Transformer Engine's debug API ``nvdlfw_inspect`` reports it),
and for every format the library knows (``mpcourse.core.formats``: FP16, BF16, E4M3, E5M2) the
fractions of the nonzero elements that, once multiplied by that format's scale and rounded to nearest
even, would

    underflow   become 0                        |y| <= min_subnormal / 2 (the tie rounds to even: 0)
    subnormal   land subnormal                  min_subnormal / 2 < |y| < min_normal - min_subnormal / 2
    overflow    overflow or saturate            |y| > max (inf in FP16/BF16/E5M2, clamped in E4M3)

with y = x * scale. The scale is the one a recipe would use: ``loss_scale`` for FP16/BF16 (pass the
loss scale for gradients, 1 otherwise) and FP8 per-tensor current scaling for E4M3/E5M2 (``fp8_max /
amax``, TE ``Float8CurrentScaling``), or fixed scales you pass. Every format is reported whatever the run
uses, the "what-if" statistics of TE's debug API. The rule is computed from thresholds; the tests check
it against torch's own casts.

``Inspector(model, every=N)`` hooks every ``nn.Linear`` (FP8 layers included) and records, on every N-th
step, the stats of its input activation, weight, output gradient and weight gradient. Off unless built;
``remove()`` takes the hooks out. ``to_json`` writes the log; ``plot_heatmap`` (layer x step, underflow
fraction of one role in one format) and ``plot_histogram`` (one tensor's log2|x| against a format's
range) draw it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from .formats import FORMATS

INSPECT_FORMATS = ("fp16", "bf16", "e4m3", "e5m2")
ROLES = ("activation", "weight", "output_grad", "weight_grad")
FP8 = ("e4m3", "e5m2")


def format_scale(name: str, amax: float, loss_scale: float = 1.0) -> float:
    """The scale a recipe would multiply by before casting to format ``name``: current per-tensor scaling
    (fp8_max / amax; 1 for a zero or non-finite amax, TE's rule) for FP8, ``loss_scale`` otherwise."""
    if name in FP8:
        return FORMATS[name].max / amax if amax > 0 and math.isfinite(amax) else 1.0
    return loss_scale


@torch.no_grad()
def tensor_stats(t: torch.Tensor, formats=INSPECT_FORMATS, *, loss_scale: float = 1.0,
                 scales: dict[str, float] | None = None) -> dict:
    """Stats of ``t`` (any float dtype; computed in FP32). ``scales`` overrides ``format_scale`` per format.
    Fractions are of the nonzero finite elements (0.0 when there are none)."""
    a = t.detach().float().abs().flatten()
    finite = torch.isfinite(a)
    nonfinite = int((~finite).sum())
    a = a[finite]
    nz = a[a > 0]
    amax = float(a.max()) if a.numel() else 0.0
    amin = float(nz.min()) if nz.numel() else 0.0
    out = {"numel": t.numel(), "nonfinite": nonfinite, "zeros": int(a.numel() - nz.numel()), "amax": amax,
           "min_nonzero": amin,
           "dynamic_range_binades": math.log2(amax) - math.log2(amin) if nz.numel() else 0.0, "formats": {}}
    n = max(nz.numel(), 1)
    for name in formats:
        f = FORMATS[name]
        s = (scales or {}).get(name, format_scale(name, amax, loss_scale))
        y = nz * s
        half = f.min_subnormal / 2
        out["formats"][name] = {
            "scale": s,
            "underflow": float((y <= half).sum()) / n,
            "subnormal": float(((y > half) & (y < f.min_normal - half)).sum()) / n,
            "overflow": float((y > f.max).sum()) / n,
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
    list of {"step", "layer", "role", **tensor_stats}. ``loss_scale`` (a float or a callable returning the
    current one) is applied to the FP16/BF16 what-if of the two gradient roles, which carry it.
    """

    def __init__(self, model: nn.Module, every: int = 10, formats=INSPECT_FORMATS, loss_scale=1.0):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.formats, self.loss_scale = every, tuple(formats), loss_scale
        self.records: list[dict] = []
        self.step = 0
        self._handles = []
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name, m in self.layers.items():
            self._handles.append(m.register_forward_pre_hook(self._fwd(name)))
            self._handles.append(m.register_full_backward_hook(self._bwd(name)))
            self._handles.append(_weight(m).register_post_accumulate_grad_hook(self._wgrad(name)))

    @property
    def active(self) -> bool:
        """Record on this step? (Forward hooks also need grad mode: evaluation records nothing; backward
        hooks run with grad mode off, by autograd's design.)"""
        return self.step % self.every == 0

    def set_step(self, step: int) -> None:
        self.step = step

    def _scale(self) -> float:
        return float(self.loss_scale() if callable(self.loss_scale) else self.loss_scale)

    def _record(self, layer, role, t, loss_scale=1.0):
        self.records.append({"step": self.step, "layer": layer, "role": role,
                             **tensor_stats(t, self.formats, loss_scale=loss_scale)})

    def _fwd(self, name):
        def hook(module, args):
            if self.active and torch.is_grad_enabled():
                self._record(name, "activation", args[0])
                self._record(name, "weight", _weight(module))
        return hook

    def _bwd(self, name):
        def hook(module, grad_input, grad_output):
            if self.active and grad_output[0] is not None:
                self._record(name, "output_grad", grad_output[0], self._scale())
        return hook

    def _wgrad(self, name):
        def hook(param):
            if self.active and param.grad is not None:
                self._record(name, "weight_grad", param.grad, self._scale())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def to_json(self, path: str | Path) -> None:
        """Write ``{"every", "formats", "roles", "records"}`` (strict JSON: no NaN appears in records)."""
        Path(path).write_text(json.dumps({"every": self.every, "formats": list(self.formats), "roles": list(ROLES),
                                          "records": self.records}, indent=0, allow_nan=False))


def underflow_grid(records: list[dict], role: str, fmt: str, kind: str = "underflow"):
    """(layers, steps, grid) with grid[i][j] the ``kind`` fraction of ``role`` in ``fmt`` at layer i, step j."""
    rs = [r for r in records if r["role"] == role]
    layers = [n for n in dict.fromkeys(r["layer"] for r in records) if any(r["layer"] == n for r in rs)]  # model order
    steps = sorted({r["step"] for r in rs})
    grid = [[float("nan")] * len(steps) for _ in layers]
    for r in rs:
        grid[layers.index(r["layer"])][steps.index(r["step"])] = r["formats"][fmt][kind]
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
