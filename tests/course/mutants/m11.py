"""Lesson 11's mutants: learner-plausible wrong versions of ``bytes_per_parameter(weights, grad_buffers, master,
moments)``.

Each is the solution's rule with one mistake a learner makes: a kind forgotten (the master copy, its gradient),
counted twice (the model's ``.grad`` beside the buffers that replace it, the master inside the weights or the
optimizer state), counted in the wrong dtype (gradients always FP32, or in the weights' dtype when the recipe keeps
buffers; the master in the weights' dtype; the moments in FP32, in the weights' or the master's dtype), AdamW's two
moments as one, bits for bytes, BF16 taken for a 4-byte format, the contract's types broken (``4.0`` for ``4``, a
float, a tensor, a tuple, a key renamed or added) and None not handled.
"""

_HEAD = "def bytes_per_parameter(weights, grad_buffers, master, moments):\n"
_SIZE = "    size = lambda d: 0 if d is None else d.itemsize\n"
_GRADS = "    grads = size(grad_buffers if grad_buffers is not None else weights) + size(master)\n"
_RETURN = ('    return {"weights": size(weights), "grads": grads, "master": size(master), '
           '"optimizer": 2 * size(moments)}\n')


def _rule(size=_SIZE, grads=_GRADS, ret=_RETURN) -> str:
    return _HEAD + size + grads + ret


def _sub(block: str, old: str, new: str) -> str:
    assert old in block, old
    return block.replace(old, new)


MUTANTS = {"bytes_per_parameter": [
    # -- the master copy
    ("forgets the master copy", _rule(ret=_sub(_RETURN, '"master": size(master)', '"master": 0'))),
    ("master copy in the weights' dtype", _rule(ret=_sub(
        _RETURN, '"master": size(master)', '"master": size(weights) if master is not None else 0'))),
    ("master counted inside the weights too", _rule(ret=_sub(
        _RETURN, '"weights": size(weights)', '"weights": size(weights) + size(master)'))),
    ("master counted as optimizer state too", _rule(ret=_sub(
        _RETURN, '"optimizer": 2 * size(moments)', '"optimizer": 2 * size(moments) + size(master)'))),
    # -- the gradients
    ("forgets the master's gradient", _rule(grads=_sub(_GRADS, " + size(master)", ""))),
    ("master's gradient in the weights' dtype", _rule(grads=_sub(
        _GRADS, "+ size(master)", "+ (size(weights) if master is not None else 0)"))),
    ("gradients always FP32", _rule(grads="    grads = 4 + size(master)\n")),
    ("gradients in the weights' dtype, buffers ignored", _rule(grads=_sub(
        _GRADS, "size(grad_buffers if grad_buffers is not None else weights)", "size(weights)"))),
    (".grad counted beside the buffers that replace it", _rule(grads=_sub(
        _GRADS, "size(grad_buffers if grad_buffers is not None else weights)", "size(weights) + size(grad_buffers)"))),
    ("gradient buffers counted in the weights", _rule(ret=_sub(
        _RETURN, '"weights": size(weights)', '"weights": size(weights) + size(grad_buffers)'))),
    # -- AdamW's moments
    ("two moments counted as one", _rule(ret=_sub(_RETURN, "2 * size(moments)", "size(moments)"))),
    ("moments always FP32", _rule(ret=_sub(_RETURN, "2 * size(moments)", "8"))),
    ("moments in the weights' dtype", _rule(ret=_sub(_RETURN, "2 * size(moments)", "2 * size(weights)"))),
    ("moments in the master's dtype when there is one", _rule(ret=_sub(
        _RETURN, "2 * size(moments)", "2 * size(master if master is not None else moments)"))),
    # -- bytes of a dtype
    ("bits for bytes (torch.finfo(d).bits)", _rule(
        size="    size = lambda d: 0 if d is None else torch.finfo(d).bits\n")),
    ("bits / 8: 4.0 for 4", _rule(size="    size = lambda d: 0 if d is None else torch.finfo(d).bits / 8\n")),
    ("BF16 taken for a 4-byte format (a table without it)", _rule(
        size="    size = lambda d: 0 if d is None else {torch.float32: 4, torch.float16: 2}.get(d, 4)\n")),
    ("None not handled", _rule(size="    size = lambda d: d.itemsize\n")),
    # -- the contract's types and keys
    ("every count a float", _rule(size="    size = lambda d: 0.0 if d is None else float(d.itemsize)\n")),
    ("counts as 0-d tensors", _rule(ret='''    return {k: torch.tensor(v) for k, v in {"weights": size(weights), "grads": grads, "master": size(master),
            "optimizer": 2 * size(moments)}.items()}
''')),
    ("a tuple in the docstring's order", _rule(ret="    return size(weights), grads, size(master), 2 * size(moments)\n")),
    ("key 'optim' for 'optimizer'", _rule(ret=_sub(_RETURN, '"optimizer":', '"optim":'))),
    ("an extra key 'total'", _rule(ret='''    out = {"weights": size(weights), "grads": grads, "master": size(master), "optimizer": 2 * size(moments)}
    out["total"] = sum(out.values())
    return out
''')),
    ("returns the total only", _rule(ret="    return size(weights) + grads + size(master) + 2 * size(moments)\n")),
]}
