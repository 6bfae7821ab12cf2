"""Memory of one training step, counted from the live tensors: the one place that does it.

For any recipe (``mpcourse.experiment.recipes``), ``measure_step`` wraps the training loop's own step
(``mpcourse.experiment.recipes.step.training_step``, the call ``Trainer.train_step`` makes) and reports the bytes held,
by kind:

    weights       the model's parameters (a tied head counted once)
    grads         every gradient alive after ``step()``: ``param.grad`` of model and master params, and
                  a recipe's own gradient buffers (``TrainingRecipe.memory_tensors()['grads']``)
    master        optimizer parameters that are not model parameters (the FP32 master copy)
    optimizer     optimizer state tensors (Adam's two moments; scalar step counters not counted)
    extra         recipe state outside those: FP8 scales and amax histories, Kahan compensation
    activations   tensors autograd saved for backward (``torch.autograd.graph.saved_tensors_hooks``),
                  parameters excluded
    fp8_cache     the FP8 copies of weights an FP8 layer saves for its backward GEMM (counted out of
                  ``activations``: they are weight-sized, not token-sized); none where the weight is stored in
                  FP8 (``Float8WeightLinear``: the saved weight is the parameter itself, counted in ``weights``)
    peak          the most bytes alive at once during the step, state included (CPU: a
                  ``TorchDispatchMode`` that follows every storage an op returns until it is freed;
                  CUDA: ``torch.cuda.max_memory_allocated``)

Every kind is the sum of distinct *storages* (``untyped_storage().nbytes()``), each counted once and in
the first kind of the list above that holds it, so views and shared tensors are never counted twice.

Why count tensors, not formulas: "FP8 saves memory" is a claim about tensors that exist. Transformer
Engine's docs measure a 1024x1024 ``Linear`` at 6.00 MB in BF16 and 6.02 MB with FP8 compute (the
high-precision weights stay, the FP8 copies are added); torchao reports Llama3-8B peak memory 47.65 GB
(BF16) vs 47.77 GB (FP8). Savings come from FP8 activations saved for backward, FP8 weights
(TE ``quantized_model_init``; recipe ``fp8-delayed-fp8-weights``: the module's weight shrinks, but its FP32 master
is a new copy) and low-precision optimizer state (DeepSeek-V3, arXiv 2412.19437 s3.3).
The CPU peak tracker follows the idea of ``torch.distributed._tools.mem_tracker.MemTracker`` (weak
references to storages from a dispatch mode); the tests use that class as the oracle.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..recipes.held import KINDS, STATE_KINDS, state_tensors, storage_of, tensors_in
from ..recipes.step import training_step


class SavedTensors:
    """Context collecting the tensors autograd saves for backward (the activations of a step).

    The parameters of ``model`` are never counted here; they are read at pack time, since under FSDP2 the
    parameters a forward uses are the all-gathered ones, not the shards held between steps. ``storages`` maps storage address ->
    bytes; ``fp8_weight_copies`` the addresses of weight copies FP8 layers saved (see ``measure_step``).
    """

    def __init__(self, model):
        self.model = model
        self.storages: dict[int, int] = {}
        self.fp8_weight_copies: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        st = storage_of(t)
        params = {s.data_ptr() for s in map(storage_of, self.model.parameters()) if s is not None}
        if st is not None and st.data_ptr() not in params:
            self.storages[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def split(self) -> dict[str, int]:
        """{"activations": bytes, "fp8_cache": bytes} of what was saved."""
        cache = sum(n for p, n in self.storages.items() if p in self.fp8_weight_copies)
        return {"activations": sum(self.storages.values()) - cache, "fp8_cache": cache}


class PeakTracker(TorchDispatchMode):
    """Peak bytes alive during a region on CPU (or any device): every storage an op reads or returns is
    followed through a weak reference until it is freed; ``baseline`` tensors (alive before) count from the
    start. ``live_bytes()`` now, ``peak`` the maximum after any op."""

    def __init__(self, baseline=()):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in baseline:
            self._add(t)
        self.peak = self.live_bytes()

    def _add(self, t) -> bool:
        """Follow t's storage; True if it was not followed yet (the live total grew)."""
        st = storage_of(t)
        if st is None:
            return False
        key = st.data_ptr()
        old = self.live.get(key)
        if old is None or old[0].expired():
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            return True
        return False

    def live_bytes(self) -> int:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            del self.live[k]
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tensors_in((args, kwargs, out)):
            grew |= self._add(t)
        if grew:   # between additions storages only die, so the peak is reached right after an addition
            self.peak = max(self.peak, self.live_bytes())
        return out


@dataclass
class StepMemory:
    """Bytes held by one training step, by kind (see the module docstring); ``peak`` includes the state."""

    weights: int
    grads: int
    master: int
    optimizer: int
    extra: int
    activations: int
    fp8_cache: int
    peak: int
    n_params: int

    def bytes_per_param(self) -> dict[str, float]:
        """The state kinds (``STATE_KINDS``) divided by the number of parameters."""
        return {k: getattr(self, k) / self.n_params for k in STATE_KINDS}

    @property
    def state(self) -> int:
        """Model and optimizer state: weights + grads + master + optimizer + extra."""
        return sum(getattr(self, k) for k in STATE_KINDS)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (*KINDS, "peak", "n_params")}


@contextlib.contextmanager
def _mark_fp8_weight_copies(model, saved: SavedTensors):
    """Record the storages of the FP8 weight copies that FP8 layers quantize in this region."""
    from mpcourse.core.quant import QuantizedLinear

    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]

    def wrap(layer):
        inner = type(layer)._quantize.__get__(layer)

        def quantize(role, x, record):
            q = inner(role, x, record)
            if role == "weight":
                saved.fp8_weight_copies.update(st.data_ptr() for st in map(storage_of, (q.data, q.scale_inv))
                                               if st is not None)
            return q
        return quantize

    for m in layers:
        m._quantize = wrap(m)                      # an instance attribute shadows the method
    try:
        yield
    finally:
        for m in layers:
            del m._quantize


@contextlib.contextmanager
def _counting_forward(model, saved: SavedTensors):
    """The region around the forward in which saved tensors and FP8 weight copies are counted."""
    with saved, _mark_fp8_weight_copies(model, saved):
        yield


def measure_step(recipe, x: torch.Tensor, y: torch.Tensor, *, track_peak: bool = True, forward_loss=None,
                 after_backward=None, after_step=None):
    """Run one training step of ``recipe`` on batch ``(x, y)`` (``step.training_step``: forward, backward,
    ``step()``; not ``zero_grad``) and count its memory. Returns ``(loss, StepResult, StepMemory)``.

    ``forward_loss(x, y) -> loss`` replaces ``recipe.model(x, y)[1]`` (the trainer passes its own, e.g.
    a data-parallel one); ``after_backward(recipe)`` and ``after_step(recipe, result)`` are the
    trainer's hooks, run at the same points as in every other step.

    The state is counted after ``step()`` and before ``zero_grad()``, when gradients, master copy and
    optimizer state are all alive. Call it inside ``tensor_cores()`` as the training loop does. On CUDA
    the peak is ``torch.cuda.max_memory_allocated`` over the step (reset first); elsewhere the
    ``PeakTracker`` (``track_peak=False`` skips it: the peak is then reported as 0).
    """
    model = recipe.model
    params = list(model.parameters())
    cuda = params[0].is_cuda
    before = state_tensors(recipe)
    baseline = [t for ts in before.values() for t in ts] + list(model.buffers()) + [x, y]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tracker = contextlib.nullcontext()
    else:
        tracker = PeakTracker(baseline) if track_peak else contextlib.nullcontext()
    saved = SavedTensors(model)
    forward_loss = forward_loss or (lambda x, y: model(x, y)[1])
    with tracker:
        loss, result = training_step(recipe, x, y, forward_loss, forward_region=_counting_forward(model, saved),
                                     after_backward=after_backward, after_step=after_step)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = tracker.peak if track_peak else 0
    state = recipe.memory()                 # the recipe's own accounting (a sharded recipe counts its shards)
    mem = StepMemory(**state, **saved.split(), peak=peak, n_params=sum(p.numel() for p in params))
    return loss, result, mem
