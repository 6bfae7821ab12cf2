"""FP32 master weights for FP16/BF16 models (`MasterWeights`), and `cast_model` (Apex O2 style casting).

Source: Micikevicius et al. 2018, "Mixed Precision Training" (ICLR 2018), section 3.1: the optimizer updates an
FP32 copy of the weights, because an update |lr * g| below |w| * 2**-11 is lost when added to an FP16 weight, and
small values (Adam's eps = 1e-8) are 0 in FP16. Apex amp O2 (apex/amp/_process_optimizer.py) is the same design:
FP16 model, FP32 master params inside the optimizer, batchnorm optionally kept in FP32 ("keep_batchnorm_fp32").

Where each dtype lives::

    model.param            fp16/bf16  forward and backward run on these          (N,) 2 bytes each
    model.param.grad       fp16/bf16  written by backward (scaled by S with a loss scaler)
    master param           fp32       what the optimizer steps: master.optimizer   (N,) 4 bytes each
    master param .grad     fp32       copied up from model.param.grad (exact), unscaled here by the scaler
    optimizer state        fp32       Adam's exp_avg / exp_avg_sq live next to the master params
    kept-FP32 model params fp32       (norms left in FP32 by cast_model) are their own master: no copy

One iteration (the "dance"; `master.step(scaler)` does the middle three lines)::

    scaler.scale(loss).backward()          # fp16 grads of S * loss on the model
    master.copy_grads_to_master()          # fp16 -> fp32 copy (exact: every fp16 value is an fp32 value)
    scaler.step(master.optimizer)          # unscale in fp32, check inf/NaN, step in fp32 (or skip)
    master.copy_master_to_model()          # fp32 -> fp16, round to nearest even (skipped step: no change)
    scaler.update()
    master.zero_grad()                     # clears model and master grads; the caller does it every iteration

To clip: `master.copy_grads_to_master(); scaler.unscale_(master.optimizer);
torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm); master.step(scaler)` (grads are not copied twice).
Checkpoints: `master.state_dict()` holds the FP32 master copy and the optimizer state; `load_state_dict` rebuilds the
master from the checkpoint (never from the FP16 model, which has lost the low bits) and writes the rounded values
into the model. Weights written into the model from outside (`model.load_state_dict(...)` alone, any in-place
write, or a `p.data = ...` assignment as `torch.nn.utils.vector_to_parameters` does) are noticed by their version
counters and storages at the next MasterWeights call that reads the master (`copy_grads_to_master`, `step`,
`step_with`, `copy_master_to_model`, `state_dict`): the master is refreshed from them (with a warning naming
`MasterWeights.load_state_dict`), so neither the next step nor a checkpoint taken then can undo the load.
Not seen: in-place writes through `p.data` (`p.data.copy_(...)`), which bypass the version counter as they bypass
autograd; write with `p.copy_(...)` under `torch.no_grad()`, as `load_state_dict` does. A load that *replaces* the
parameters (`load_state_dict(..., assign=True)`) cannot be followed (MasterWeights holds the old ones): where it knows
the model (built over the module, or `model=`), the next call refuses it, naming the load that copies.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .checkpoint import CheckpointError, check_optimizer_state_dict
from .learner_table import returned

LOW_PRECISION = (torch.float16, torch.bfloat16)
#: the exercise function that rounds a master into each low-precision model dtype (lesson 00)
ROUND_TO = {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())  # BatchNorm*/InstanceNorm* derive from _NormBase


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _run_in_fp32(module):
    """Hooks: floating inputs -> fp32, forward in fp32, floating outputs -> the first floating input's dtype."""
    if getattr(module, "_mpcourse_fp32_io", False):
        return
    module._mpcourse_fp32_io = True

    def pre_hook(mod, args, kwargs):
        dtypes = [a.dtype for a in list(args) + list(kwargs.values())
                  if isinstance(a, torch.Tensor) and a.is_floating_point()]
        mod._mpcourse_in_dtype = dtypes[0] if dtypes else None
        return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)

    def post_hook(mod, args, output):
        return output if mod._mpcourse_in_dtype is None else _cast_floats(output, mod._mpcourse_in_dtype)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(post_hook)


def cast_model(model: nn.Module, dtype=torch.float16, keep_fp32=None, cast_inputs=True) -> nn.Module:
    """Cast `model` in place to `dtype` (fp16/bf16), keeping chosen modules in FP32 (Apex O2 semantics).

    keep_fp32: None (cast everything), a module class or tuple of classes (e.g. `NORM_TYPES`, or
        `(nn.LayerNorm,)`, Apex's keep_batchnorm_fp32), or a predicate `module -> bool`. A kept module and its
        whole subtree are made FP32; its floating inputs are cast to FP32 and its outputs back to the input
        dtype (the norm computes its statistics in FP32, the next layer gets `dtype`).
    cast_inputs: as Apex O2, cast the model's floating inputs to `dtype` (integer token ids are untouched).
    Parameters keep their identity (`p.data` is replaced), so do this before building optimizers.
    Returns the model. Raises ValueError for a dtype that is not fp16/bf16.
    """
    if dtype not in LOW_PRECISION:
        raise ValueError(f"cast_model casts to torch.float16 or torch.bfloat16, got {dtype}")
    if keep_fp32 is None:
        keep = lambda m: False  # noqa: E731
    elif isinstance(keep_fp32, (type, tuple)):
        keep = lambda m: isinstance(m, keep_fp32)  # noqa: E731
    else:
        keep = keep_fp32

    def visit(module):
        if keep(module):
            module.float()          # the subtree stays (or becomes) fp32
            _run_in_fp32(module)
            return
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(module, name, b.to(dtype))
        for child in module.children():
            visit(child)

    visit(model)
    if cast_inputs and not getattr(model, "_mpcourse_cast_inputs", False):
        model._mpcourse_cast_inputs = True
        model.register_forward_pre_hook(
            lambda mod, args, kwargs: (_cast_floats(args, dtype), _cast_floats(kwargs, dtype)), with_kwargs=True)
    return model


def make_master(model_params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rule of the master copy (lesson 02's signature): one FP32 leaf per FP16/BF16 parameter, an exact copy
    (every FP16 and BF16 value is an FP32 value), requires_grad, sharing no memory with the model.
    ``MasterWeights`` builds its masters with it (or with a function of this signature, ``make_master=``)."""
    return [nn.Parameter(p.detach().float()) for p in model_params]      # (shape of p) fp32


_library_make_master = make_master      # MasterWeights' keyword of the same name shadows it there


@torch.no_grad()
def master_step(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                optimizer: torch.optim.Optimizer, loss_scale: float) -> None:
    """The rule of one step through FP32 masters (lesson 02's signature), unfused: every master's grad :=
    its model param's grad (FP16/BF16 -> FP32, exact) times float32(1 / loss_scale); ``optimizer.step()``;
    every model param := its master rounded to nearest even. ``MasterWeights.copy_grads_to_master`` and
    ``copy_master_to_model`` are the same three lines with the loss scaler's fused unscale and inf check;
    ``MasterWeights.step_with`` runs a function of this signature in their place."""
    inv_scale = torch.tensor(loss_scale, dtype=torch.float64).reciprocal().float()   # fp32 (), 1/S rounded once
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float() * inv_scale            # (shape) fp32
    optimizer.step()
    for p, m in zip(model_params, master_params):
        p.copy_(m)                                                                  # fp32 -> fp16/bf16, nearest even


class _BeforeStep:
    """An optimizer whose ``step()`` first calls ``hook()`` (e.g. clip the master grads); all else delegated."""

    def __init__(self, optimizer, hook):
        self._optimizer, self._hook = optimizer, hook

    def step(self, closure=None):
        self._hook()
        return self._optimizer.step() if closure is None else self._optimizer.step(closure)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def _param_groups(params):
    """nn.Module | iterable of tensors | list of dicts -> list of param-group dicts (as torch optimizers)."""
    if isinstance(params, nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    params = list(params)
    if not params:
        raise ValueError("MasterWeights got no parameters (all frozen? pass the trainable ones).")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for g in params:
        ps = g["params"]
        groups.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return groups


class MasterWeights:
    """An FP32 master copy of a low-precision model's parameters and an optimizer that steps it.

    Args:
        params: an nn.Module (its parameters with requires_grad), an iterable of parameters, or a list of
            param-group dicts (options such as lr are kept per group, as torch.optim).
        optimizer_cls: any torch.optim.Optimizer class (or callable `(param_groups, **kw) -> Optimizer`),
            built over the FP32 master params.
        round_to_model: optional fn(fp32 tensor) -> the same values rounded to the model dtype (float32 or that
            dtype), used by copy_master_to_model in place of the cast; None (default): the cast.
        make_master: optional fn(list of FP16/BF16 params) -> list of their FP32 masters (lesson 02's signature),
            called once per param group, checked by ``learner_table.returned`` (``seams.returned_masters``);
            None: ``make_master``.
        model: the nn.Module whose parameters ``params`` are (default: ``params`` itself when it is a module), so
            that a load which *replaces* them (``model.load_state_dict(sd, assign=True)``) is refused at the next
            step instead of leaving MasterWeights to step the old, detached parameters; None: not checked.
        **optimizer_kwargs: passed to optimizer_cls (lr, eps, weight_decay, ...).
    FP16/BF16 params get an FP32 master (a copy, exact); FP32/FP64 params (e.g. norms kept by `cast_model`)
    are their own master and are stepped in place. Attributes: `optimizer`, `model_params`, `master_params`
    (aligned lists). Raises ValueError for non-floating or non-leaf params.
    """

    def __init__(self, params, optimizer_cls=torch.optim.SGD, *, round_to_model=None, make_master=None,
                 model: nn.Module | None = None, **optimizer_kwargs):
        self._module = params if model is None and isinstance(params, nn.Module) else model
        self.model_params, self.master_params, master_groups, seen = [], [], [], set()
        for group in _param_groups(params):
            for p in group["params"]:
                if not (isinstance(p, torch.Tensor) and p.is_floating_point() and p.is_leaf):
                    raise ValueError("MasterWeights needs floating-point leaf parameters (model.parameters()).")
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in MasterWeights' params; list each once.")
                seen.add(id(p))
            low = [p for p in group["params"] if p.dtype in LOW_PRECISION]
            if make_master is None:
                copies = _library_make_master(low)
            else:
                copies = returned("make_master", low, make_master(low))
            copies = iter(copies)
            # (shape of p) fp32: a new leaf for fp16/bf16 params, the param itself otherwise
            masters = [next(copies) if p.dtype in LOW_PRECISION else p for p in group["params"]]
            self.model_params += group["params"]
            self.master_params += masters
            master_groups.append({**group, "params": masters})
        self.optimizer = optimizer_cls(master_groups, **optimizer_kwargs)
        self._grads_copied = False
        self.round_to_model = round_to_model     # fn(fp32 tensor) -> its values rounded to the model dtype
        self._record_versions()

    def _record_versions(self):
        """Remember each model param's version counter (bumped by every in-place write, e.g. load_state_dict) and
        its storage (replaced by a ``p.data = ...`` assignment, which leaves the counter alone)."""
        self._versions = [(p._version, p.data_ptr()) for p in self.model_params]

    @torch.no_grad()
    def _refresh_if_model_changed(self) -> None:
        """If a model param was written since MasterWeights last wrote it, its master := that param (fp32).
        RuntimeError if the model's parameters were replaced by other tensors (a load with ``assign=True``)."""
        self._check_not_replaced()
        changed = [i for i, (p, v) in enumerate(zip(self.model_params, self._versions))
                   if (p._version, p.data_ptr()) != v and self.master_params[i] is not p]
        for i in changed:
            self.master_params[i].copy_(self.model_params[i])  # fp16/bf16 -> fp32, exact
        if changed:
            warnings.warn(f"{len(changed)} model parameter(s) were changed outside MasterWeights (e.g. "
                          "model.load_state_dict): their FP32 master copy was refreshed from the model, so the next "
                          "step starts from the loaded weights. To resume a run exactly (the master's low bits and "
                          "the optimizer state), save and load MasterWeights.state_dict() with "
                          "MasterWeights.load_state_dict.", stacklevel=3)
        self._record_versions()

    def _check_not_replaced(self) -> None:
        if self._module is None:
            return
        live = {id(p) for p in self._module.parameters()}
        gone = sum(id(p) not in live for p in self.model_params)
        if gone:
            raise RuntimeError(f"{gone} parameter(s) MasterWeights steps are no longer the model's: they were replaced "
                               "(model.load_state_dict(..., assign=True), or a new nn.Parameter set on a module), so "
                               "the loaded weights would never train. Load with model.load_state_dict(state) without "
                               "assign (it copies into the parameters; MasterWeights then refreshes its master), or "
                               "MasterWeights.load_state_dict for a full resume, or build MasterWeights again over "
                               "the model.")

    def parameters(self):
        """The FP32 master params (e.g. for torch.nn.utils.clip_grad_norm_ after scaler.unscale_)."""
        return iter(self.master_params)

    def _pairs(self):
        return ((p, m) for p, m in zip(self.model_params, self.master_params) if m is not p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model grads (fp16) and master grads (fp32). Call it every iteration, also after a skipped
        step: a skipped step leaves inf/NaN grads behind."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._grads_copied = False

    @torch.no_grad()
    def copy_grads_to_master(self, inv_scale=None) -> None:
        """master.grad (fp32) := model.grad (fp16/bf16), exactly; then * inv_scale if given (a float or an fp32
        tensor ()). No inf/NaN check here: the loss scaler does it (prefer `scaler.unscale_` to inv_scale).
        A model param without grad leaves its master without grad. Weights written into the model from outside
        since the last step (a model-only load) are copied into the master first."""
        self._refresh_if_model_changed()
        for p, m in zip(self.model_params, self.master_params):
            if m is not p:
                if p.grad is None:
                    m.grad = None
                    continue
                if m.grad is None:
                    m.grad = torch.empty_like(m)     # (shape) fp32
                m.grad.copy_(p.grad)                 # fp16 -> fp32, exact
            if inv_scale is not None and m.grad is not None:
                m.grad.mul_(inv_scale)
        self._grads_copied = True

    @torch.no_grad()
    def copy_master_to_model(self, *, refresh: bool = True) -> None:
        """model.param (fp16/bf16) := master (fp32) rounded to nearest even, by ``round_to_model`` when one
        was given (lesson 00's ``round_to_fp16`` / ``round_to_bf16``, by the model's dtype; checked by
        ``learner_table.returned``). Weights written into the model from outside since the last step are copied
        into the master first (so this writes them back unchanged); ``refresh=False`` skips that, for a caller
        that has just loaded the master itself from a checkpoint (the model follows the master)."""
        if refresh:
            self._refresh_if_model_changed()
        for p, m in self._pairs():
            if self.round_to_model is None:
                p.copy_(m)                           # fp32 -> fp16/bf16, nearest even (fused cast)
            else:
                p.copy_(returned(ROUND_TO[p.dtype], m, self.round_to_model(m.detach()), p.dtype))
        self._record_versions()

    def step_with(self, master_step, loss_scale: float = 1.0, before_step=None) -> None:
        """One step by ``master_step(model_params, master_params, optimizer, loss_scale)`` (lesson 02's signature)
        in place of ``copy_grads_to_master`` / ``optimizer.step()`` / ``copy_master_to_model``: it gets the FP16/BF16
        params and their masters (kept-FP32 params, their own master, are left to the optimizer) and an
        optimizer whose ``step()`` first calls ``before_step()`` (e.g. clip the master grads) when given. No loss
        scaler is involved (no inf check, no skip): ``loss_scale`` is the factor the loss was multiplied by.
        Raises ``SeamError`` (``seams.returned_master_step``) if the function changed a model param's dtype or shape
        (write with ``p.copy_``)."""
        self._refresh_if_model_changed()
        pairs = list(self._pairs())
        model, masters = [p for p, _ in pairs], [m for _, m in pairs]
        kinds = [(p.dtype, p.shape) for p in model]
        optimizer = self.optimizer if before_step is None else _BeforeStep(self.optimizer, before_step)
        returned("master_step", model, kinds, master_step(model, masters, optimizer, loss_scale))
        self._grads_copied = False
        self._record_versions()

    def step(self, scaler=None):
        """copy_grads_to_master() (unless already done this iteration), then `scaler.step(self.optimizer)` (or
        `self.optimizer.step()` without a scaler), then copy_master_to_model() unless the scaler skipped.
        Works with mpcourse loss scalers and torch.amp.GradScaler. Returns what the step returns (None if
        skipped). The caller still calls scaler.update() and zero_grad()."""
        if not self._grads_copied:
            self.copy_grads_to_master()
        else:
            self._refresh_if_model_changed()
        if scaler is None:
            retval, skipped = self.optimizer.step(), False
        else:
            retval = scaler.step(self.optimizer)
            skipped = getattr(scaler, "last_step_skipped", False)  # GradScaler: unknown -> copy (harmless)
        if not skipped:
            self.copy_master_to_model(refresh=False)
        self._grads_copied = False
        return retval

    def state_dict(self) -> dict:
        """{"master_params": [fp32 tensors, in order], "optimizer": optimizer.state_dict()}. Tensors are shared
        with the live master (as torch's state_dicts): torch.save or copy.deepcopy it before training on. Weights
        written into the model from outside since the last step are copied into the master first."""
        self._refresh_if_model_changed()
        return {"master_params": [m.detach() for m in self.master_params],
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Rebuild the master from the checkpoint (not from the model), load the optimizer state, and write the
        rounded master into the model params. Everything is checked before anything changes: CheckpointError
        (a ValueError) for other keys, another number of params, a shape mismatch (master or optimizer state)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"master_params", "optimizer"}:
            raise CheckpointError("not a MasterWeights state_dict: expected the keys 'master_params' and "
                                  f"'optimizer', got {sorted(state_dict) if isinstance(state_dict, dict) else state_dict}")
        saved = state_dict["master_params"]
        if len(saved) != len(self.master_params):
            raise CheckpointError(f"checkpoint has {len(saved)} master params, this MasterWeights has "
                                  f"{len(self.master_params)}: build it over the same model and param groups.")
        for i, (m, s) in enumerate(zip(self.master_params, saved)):
            if not isinstance(s, torch.Tensor) or s.shape != m.shape:
                raise CheckpointError(f"master param {i}: checkpoint shape {tuple(getattr(s, 'shape', ()))} != "
                                      f"{tuple(m.shape)}")
        check_optimizer_state_dict(self.optimizer, state_dict["optimizer"], "MasterWeights optimizer")
        for m, s in zip(self.master_params, saved):
            m.copy_(s)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.copy_master_to_model(refresh=False)        # the checkpoint's master wins over whatever the model holds
