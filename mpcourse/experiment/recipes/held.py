"""What a recipe holds, by kind, counted from its live tensors: ``state_tensors(recipe)`` and ``count_bytes``.

The bytes a recipe holds between steps (weights, gradients, master copy, optimizer state, extra state) are a
property of the recipe, as nanoGPT's ``GPT.estimate_mfu`` lives on the model it measures:
``TrainingRecipe.memory()`` returns ``count_bytes(state_tensors(self))`` and a sharded recipe counts its own shards
(``mpcourse.experiment.parallel.data_parallel``). ``mpcourse.experiment.measure.memory.measure_step`` adds what one
step holds on top (activations, the FP8 weight copies, the peak) with the same counter, so each storage is counted
once across all kinds (``KINDS`` order: the first kind that holds a storage counts it).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

KINDS = ("weights", "grads", "master", "optimizer", "extra", "fp8_cache", "activations")
STATE_KINDS = ("weights", "grads", "master", "optimizer", "extra")


def storage_of(t: torch.Tensor):
    """The tensor's untyped storage (a DTensor's local shard's, a wrapper subclass's first inner tensor's, e.g.
    ``fsdp_fp8.FP8AllGatherWeight``'s FP32 weight), or None for an empty one / no storage."""
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    try:
        st = t.untyped_storage()
        return st if st.nbytes() and st.data_ptr() else None
    except (RuntimeError, NotImplementedError):     # a wrapper without storage of its own
        return None


def tensors_in(obj):
    """Every tensor in a nested structure of lists, tuples and dicts."""
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def state_tensors(recipe) -> dict[str, list[torch.Tensor]]:
    """The live state of a recipe by kind (``STATE_KINDS``), as tensors (counted by ``count_bytes``)."""
    model_params = list(recipe.model.parameters())
    model_ids = {id(p) for p in model_params}
    opt = recipe.optimizer
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    own = recipe.memory_tensors()
    unknown = set(own) - {"grads", "extra"}
    if unknown:
        raise ValueError(f"memory_tensors() kinds must be 'grads' or 'extra', got {sorted(unknown)}")
    grads = [p.grad for p in model_params + opt_params if p.grad is not None]
    return {
        "weights": model_params,
        "grads": grads + list(own.get("grads", [])),
        "master": [p for p in opt_params if id(p) not in model_ids],
        "optimizer": [v for s in opt.state.values() for v in tensors_in(s) if v.dim() > 0],  # not step counters
        "extra": list(own.get("extra", [])),
    }


def count_bytes(by_kind: dict[str, list[torch.Tensor]], seen: set | None = None) -> dict[str, int]:
    """Bytes per kind, each distinct storage once, in the first kind (in ``KINDS`` order) that holds it.
    ``seen`` (storage addresses already counted elsewhere) is updated."""
    seen = set() if seen is None else seen
    out = {}
    for kind in [k for k in KINDS if k in by_kind] + [k for k in by_kind if k not in KINDS]:
        total = 0
        for t in by_kind[kind]:
            st = storage_of(t)
            if st is not None and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        out[kind] = total
    return out
