"""``autocast``: torch.autocast's op-level cast policy, in Python, over a TorchFunctionMode.

Semantics: ``torch.autocast`` (``torch/amp/autocast_mode.py``; the casting rules of
``aten/src/ATen/autocast_mode.{h,cpp}``), torch 2.13. The tables live in ``policy.py``; the state
and the weight-cast cache in ``state.py``.

Where it sits. ``torch.autocast`` is a dispatcher key (``AutocastCPU``, ``Autocast``) placed above
autograd: it casts the inputs of a listed aten op, and autograd records the casts (``ToCopyBackward0``)
before recording the op. A ``torch.overrides.TorchFunctionMode`` also runs above autograd: it is
called with every public torch function or Tensor method before it runs, so casts made there are
recorded by autograd the same way, and the gradients come out in the same dtypes and bits.

How a Python callable is mapped to an aten op (``op_name``):

1. Functions bound in C (``torch.matmul``, ``Tensor.matmul``, ``Tensor.__matmul__`` as ``x @ w``,
   ``torch._C._nn.linear`` which is ``F.linear``, ``torch.softmax``, ``Tensor.softmax``,
   ``torch.layer_norm``, ``torch._C._nn.cross_entropy_loss``, ``torch.linalg.vector_norm``, ...) are
   generated from aten's schema and carry the aten op name as ``__name__`` ("matmul", "linear",
   "cross_entropy_loss", "linalg_vector_norm", "fft_rfft"). That name is looked up in the table of the
   inputs' device type (all overloads of a name share one policy, see ``policy.POLICY_BY_NAME``).
2. Functions written in Python (``F.softmax``, ``F.layer_norm``, ``F.cross_entropy``, ``F.dropout``,
   ``torch.norm``, ``Tensor.__rmatmul__``, ``F.multi_head_attention_forward``) are not looked up: the
   mode steps into them (``torch.overrides.redispatch_function`` with the mode still pushed) and
   applies the policy to the C-bound functions they call (``F.softmax`` -> ``Tensor.softmax``).
3. A few C-bound composites that are not registered but call a listed op inside C++
   (``nll_loss_nd`` -> ``nll_loss``; on CPU ``tensordot`` -> ``mm``) are in ``policy.COMPOSITES``;
   ``policy.KNOWN_GAPS`` lists those left alone (einsum on CPU, matrix_power, F.pad).

Eligible inputs: floating tensors of the op's device type, never float64. ``out=`` calls and in-place
methods (``add_``) are not in the tables and run unchanged. The device type whose table applies is
that of the call's first tensor (the dispatcher picks a key from all of them; same for one device).

Beyond torch's tables: ``policy.ADDITIONS`` (``torch._grouped_mm`` / ``F.grouped_mm`` take ``bmm``'s policy,
where torch.autocast lists them nowhere and a mixed-dtype call raises); ``autocast(..., course_additions=False)``
applies torch's tables alone. ``policy.py`` says why.

Refused: the RNN family (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells) raises
NotImplementedError inside an enabled region (``policy.UNSUPPORTED`` says why): torch.autocast casts
inside their C++ code, out of a Python mode's reach, and FP32 would differ silently.

Custom operators (``torch.ops.<namespace>.<op>`` outside torch's namespaces) run inside ``torch.autocast`` with the
region's dtype, so a rule registered with ``torch.library.register_autocast`` applies exactly as under
``torch.autocast``, and an op without one has its body autocast by torch's policy (a Python mode cannot see into
the body: ``_custom_op``). Limits: ``torch.is_autocast_enabled`` stays False inside this autocast (ask
``autocast_dtype_in_effect``); ``torch.utils.checkpoint`` is taught to replay this state
(``checkpoint.py``); ``torch.compile`` is untested with it: use torch.autocast there. Example::

    from mpcourse.core.autocast import autocast
    with autocast("cpu"):                 # bf16
        y = model(x)                      # linears/matmuls in bf16; layer_norm, softmax in their input dtype
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, redispatch_function

from ..learner_table import returned
from .policy import UNSUPPORTED
from .policy import (BANNED, FP32, FP32_APPEND_DTYPE, FP32_SET_OPT_DTYPE, LOWER_PRECISION_FP, PROMOTE,
                     policy_for)
from .state import STATE, _check_device_type, cached_cast

_STEP_INTO = "step_into"
_REFUSE = "refuse"                 # policy.UNSUPPORTED: the RNN family
_PY_FUNCTIONS = (types.FunctionType, types.MethodType)
_GETTER = types.MethodWrapperType     # x.shape, x.grad: property getters, never a listed op
_DUNDERS = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}
_RULES: dict = {}              # callable -> None (unlisted) | _STEP_INTO | {"cpu": policy, "cuda": policy}


def op_name(func) -> str | None:
    """The aten op name a C-bound torch callable runs (``torch.Tensor.softmax`` -> ``"softmax"``).

    The name is the callable's ``__name__`` (operator methods mapped: ``__matmul__`` -> ``matmul``,
    ``__pow__``/``__rpow__`` -> ``pow``). Returns None for callables written in Python (the mode steps
    into those instead).
    """
    if isinstance(func, _PY_FUNCTIONS):
        return None
    name = getattr(func, "__name__", None)
    return _DUNDERS.get(name, name)


def _rule(func):
    """What to do with ``func``, memoised: None (unlisted), _STEP_INTO, or a policy per device type."""
    if isinstance(func, types.MethodType):     # a bound method is a new object each time: not memoised
        return _STEP_INTO
    name = op_name(func)
    if name is None:
        rule = _STEP_INTO
    elif name in UNSUPPORTED:
        rule = {"cpu": _REFUSE, "cuda": _REFUSE}
    else:
        rule = {dev: policy_for(dev, name) for dev in ("cpu", "cuda")}
        rule = rule if any(rule.values()) else None
    _RULES[func] = rule
    return rule


def _device_type(t: torch.Tensor) -> str | None:
    if t.is_cuda:
        return "cuda"
    if t.is_cpu or t.is_mkldnn:
        return "cpu"
    return None


def _first_tensor(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b
    return None


def _eligible(a, device_type: str) -> bool:
    """``is_eligible`` of autocast_mode.h: floating, of the region's device type, not float64."""
    return (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype is not torch.float64
            and _device_type(a) == device_type)


def _cast(a, to_type, device_type):
    if isinstance(a, torch.Tensor):
        if a.dtype is not to_type and _eligible(a, device_type):
            return cached_cast(a, to_type, device_type)
        return a
    if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
        return type(a)(_cast(b, to_type, device_type) for b in a)       # a TensorList (cat, stack)
    return a


def _cast_all(args, kwargs, to_type, device_type):
    # Last argument first, as torch's compiled wrapper happens to evaluate its argument pack (GCC: right
    # to left). The order changes no value; it only makes the aten-level trace identical to torch's.
    kwargs = dict(reversed([(k, _cast(v, to_type, device_type)) for k, v in reversed(kwargs.items())]))
    args = tuple(reversed([_cast(a, to_type, device_type) for a in reversed(args)]))
    return args, kwargs


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, torch.Tensor))


def _promote_type(args, kwargs, device_type):
    """``promote_type`` of autocast_mode.h: FP32 if any eligible input is FP32, else the low dtype."""
    low = STATE.dtype[device_type]
    to_type = low
    for t in _tensors(args, kwargs):
        if not _eligible(t, device_type):
            continue
        if t.dtype is torch.float32:
            to_type = torch.float32
        elif t.dtype is not low:
            raise RuntimeError(
                f"autocast promote: inputs mix {t.dtype} with the region's {low}; autocast only promotes "
                f"between {low} and float32. Cast the inputs to one dtype before the call.")
    return to_type


def _dtype_given(args, kwargs) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _recast(a, o, device_type):
    """The argument ``a`` in the dtype a given ``cast_args`` chose for it (``o``, checked equal to ``a.to(o.dtype)``
    by ``seams.returned_cast_args``): an eligible tensor cast through the weight-cast cache, as ``_cast`` casts it,
    so a weight used twice is still cast once; anything else as ``cast_args`` returned it."""
    if isinstance(a, torch.Tensor) and isinstance(o, torch.Tensor) and o.dtype is not a.dtype \
            and _eligible(a, device_type):
        return cached_cast(a, o.dtype, device_type)
    if isinstance(a, (list, tuple)) and isinstance(o, (list, tuple)):
        return type(a)(_recast(b, p, device_type) for b, p in zip(a, o))
    return o


def _cast_all_given(func, args, kwargs, device_type):
    """The casts of a ``cast_args`` given to ``autocast`` (lesson 05's signature): it sees the positional
    arguments followed by the keyword arguments' values, as one tuple."""
    values = (*args, *kwargs.values())
    out = returned("cast_args", values, STATE.cast_args(op_name(func), values, device_type, STATE.dtype[device_type]),
                   (STATE.dtype[device_type], torch.float32))
    out = [_recast(a, o, device_type) for a, o in zip(values, out)]
    return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):]))


def _apply(policy, func, args, kwargs, device_type):
    """Run ``func`` under ``policy`` (see policy.py); ``device_type``'s region is enabled."""
    if STATE.cast_args is not None and policy in (LOWER_PRECISION_FP, FP32, PROMOTE):
        args, kwargs = _cast_all_given(func, args, kwargs, device_type)
    elif policy == LOWER_PRECISION_FP:
        args, kwargs = _cast_all(args, kwargs, STATE.dtype[device_type], device_type)
    elif policy == FP32:
        args, kwargs = _cast_all(args, kwargs, torch.float32, device_type)
    elif policy == PROMOTE:
        args, kwargs = _cast_all(args, kwargs, _promote_type(args, kwargs, device_type), device_type)
    elif policy in (FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE) and not _dtype_given(args, kwargs):
        first = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if _eligible(first, device_type):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == FP32_APPEND_DTYPE and isinstance(first, torch.Tensor):
            kwargs = {**kwargs, "dtype": first.dtype}
    elif policy == _REFUSE:
        if any(_eligible(t, device_type) for t in _tensors(args, kwargs)):
            raise NotImplementedError(
                f"torch.{op_name(func)} (nn.LSTM/GRU/RNN and their cells) under mpcourse.core.autocast: "
                f"torch.autocast casts inside this op's C++ implementation, which this Python autocast "
                f"cannot reach, so the results would differ silently. Run the RNN under "
                f"torch.autocast({device_type!r}), or inside autocast({device_type!r}, enabled=False) in FP32.")
    elif policy == BANNED:
        raise RuntimeError(
            f"{op_name(func)} is unsafe to autocast on {device_type} (torch.autocast refuses it too): it "
            "takes probabilities, usually a sigmoid's output, whose logs near 0 and 1 lose precision in "
            "FP16. Fuse the sigmoid and the loss: F.binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss).")
    return func(*args, **kwargs)


class AutocastMode(TorchFunctionMode):
    """The TorchFunctionMode that applies the policy; pushed by the outermost ``autocast`` region.

    PyTorch pops a mode while its ``__torch_function__`` runs, so the casts and the final call made
    here are not intercepted again.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        enabled = STATE.enabled
        if not (enabled["cpu"] or enabled["cuda"]) or type(func) is _GETTER:
            return func(*args, **kwargs)              # nothing to do, or a property getter (x.shape)
        if isinstance(func, _CUSTOM_OP_TYPES) and _namespace(func) not in _TORCH_NAMESPACES:
            return _custom_op(func, args, kwargs, enabled)
        rule = _RULES.get(func, False)
        if rule is False:
            rule = _rule(func)
        if rule is None or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        if rule is _STEP_INTO:
            with self:                     # keep the policy on for the calls made inside
                return redispatch_function(func, types, args, kwargs)
        t = _first_tensor(args, kwargs)
        device_type = None if t is None else _device_type(t)
        policy = rule.get(device_type) if enabled.get(device_type) else None
        if policy is None or (not STATE.course_additions and policy is not _REFUSE
                              and policy_for(device_type, op_name(func), course_additions=False) is None):
            return func(*args, **kwargs)              # unlisted, or a course addition with torch's tables asked for
        return _apply(policy, func, args, kwargs, device_type)


# Custom operators (``torch.library.custom_op`` / ``Library.define``, any namespace but torch's own): their
# autocast rule lives in the dispatcher (``torch.library.register_autocast`` registers an Autocast kernel that
# casts the inputs to its dtype and runs the op with autocast off; without one the op's body is autocast op by op).
# A Python mode cannot read that rule, and the op's body runs below the mode (its aten calls are not seen), so the
# call is made inside ``torch.autocast`` with this region's dtype: torch's dispatcher applies the op's own rule,
# or, without one, torch's policy (the tables this package mirrors) to the op's body.
_CUSTOM_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "_dtensor", "inductor"})


def _namespace(op) -> str:
    name = op.name() if isinstance(op, torch._ops.OpOverload) else op._qualified_op_name
    return name.split("::", 1)[0]


def _custom_op(op, args, kwargs, enabled):
    t = _first_tensor(args, kwargs)
    device_type = None if t is None else _device_type(t)
    if device_type is None or not enabled.get(device_type):
        return op(*args, **kwargs)
    with torch.autocast(device_type, dtype=STATE.dtype[device_type], cache_enabled=False):
        return op(*args, **kwargs)


@contextlib.contextmanager
def no_autocast(device_type: str):
    """A region where neither ``torch.autocast`` nor this package's ``autocast`` casts ``device_type``.

    For library code that computes its own dtypes (an FP8 GEMM) and must not be cast by either.
    """
    with torch.autocast(device_type, enabled=False), autocast(device_type, enabled=False):
        yield


class autocast:
    """Context manager and decorator with ``torch.autocast``'s meaning, implemented in Python.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (ValueError otherwise): which tensors the region casts.
        dtype: the lower-precision dtype; None = the current one (``get_autocast_dtype``: bf16 on CPU,
            fp16 on CUDA unless an enclosing region set another). CPU accepts bf16 and fp16; another
            dtype warns and disables the region, as torch.autocast does.
        enabled: False makes a region where nothing is cast (it still counts for nesting).
        cache_enabled: cache casts of FP32 weights inside the region; None = keep the current
            setting (True by default), as torch.autocast does.
        cast_args: optional, lesson 05's ``cast_args(op_name, args, device_type, dtype) -> args`` in place of
            the library's casts for the lower-precision, FP32 and promote policies: it gets the call's
            positional arguments then its keyword arguments' values as one tuple, and decides each one's
            dtype (checked by ``mpcourse.core.seams.returned_cast_args``: same values, cast exactly); eligible
            tensors are then cast through the weight-cast cache as the library casts them. None = keep the
            enclosing region's (the library's by default).
        cached_cast: optional, lesson 05's ``cached_cast(cache, t, to_type) -> tensor`` in place of the
            library's weight-cast cache, given a dict that lives until the outermost region exits; what it
            returns is checked (``seams.returned_cast``: dtype, shape, a cast of the current value, autograd
            history). Called for every cast of an eligible tensor while ``cache_enabled``. None = keep the
            enclosing region's.
        course_additions: apply the course's additions to torch's tables (``policy.ADDITIONS``: the grouped GEMM
            ``torch._grouped_mm`` in ``bmm``'s policy), the default; False: torch's tables alone, as
            ``torch.autocast`` (a mixed-dtype grouped GEMM then raises there too). None = keep the enclosing
            region's.

    Raises:
        ValueError: ``device_type`` is not a string or not "cpu"/"cuda".
        TypeError: ``dtype`` is not a torch.dtype, or ``course_additions`` not a bool or None.
        RuntimeError: ``torch.autocast`` is active for the same device type (the two would cast
            twice; exit one), or CUDA bf16 on a GPU without bf16 support.

    "cuda" on a machine without CUDA warns and disables the region (torch.autocast does the same).
    State is thread-local; a new thread starts outside any region. Source: torch/amp/autocast_mode.py.
    """

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None, *, cast_args=None, cached_cast=None,
                 course_additions: bool | None = None):
        if not isinstance(device_type, str):
            raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
        _check_device_type(device_type)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
        self.device = device_type
        self.fast_dtype = STATE.dtype[device_type] if dtype is None else dtype
        self._cache_enabled = STATE.cache_enabled if cache_enabled is None else bool(cache_enabled)
        for fname, f in (("cast_args", cast_args), ("cached_cast", cached_cast)):
            if f is not None and not callable(f):
                raise TypeError(f"{fname} must be a function with lesson 05's signature, got {f!r}")
        self._cast_args = STATE.cast_args if cast_args is None else cast_args
        self._cached_cast = STATE.cached_cast if cached_cast is None else cached_cast
        if course_additions is not None and not isinstance(course_additions, bool):
            raise TypeError(f"course_additions must be True, False or None, got {course_additions!r}")
        self._course_additions = course_additions
        if enabled and device_type == "cuda":
            if not torch.cuda.is_available():
                warnings.warn("CUDA is not available. Disabling mpcourse autocast.", stacklevel=2)
                enabled = False
            elif self.fast_dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise RuntimeError("Current CUDA Device does not support bfloat16. Please switch dtype to float16.")
        elif enabled and self.fast_dtype not in (torch.bfloat16, torch.float16):
            warnings.warn(f"In CPU autocast, but the target dtype {self.fast_dtype} is not supported. "
                          "Disabling autocast. CPU autocast supports torch.bfloat16 and torch.float16.",
                          stacklevel=2)
            enabled = False
        self._enabled = bool(enabled)
        self._saved: list = []

    def __enter__(self):
        if torch.is_autocast_enabled(self.device):
            raise RuntimeError(f"torch.autocast({self.device!r}) is active: mpcourse.core.autocast would cast a "
                               "second time. Use one of the two for a region, not both.")
        st, dev = STATE, self.device
        self._saved.append((st.enabled[dev], st.dtype[dev], st.cache_enabled, st.cast_args, st.cached_cast,
                            st.course_additions))
        st.enabled[dev], st.dtype[dev], st.cache_enabled = self._enabled, self.fast_dtype, self._cache_enabled
        st.cast_args, st.cached_cast = self._cast_args, self._cached_cast
        if self._course_additions is not None:
            st.course_additions = self._course_additions
        st.nesting += 1
        if st.mode is None:
            st.mode = AutocastMode()
            st.mode.__enter__()                   # push onto this thread's torch-function mode stack
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        st, dev = STATE, self.device
        st.nesting -= 1
        if st.nesting == 0:
            st.cache.clear()                      # casts must not outlive the outermost region
            st.given_cache.clear()
            mode, st.mode = st.mode, None
            if _get_current_function_mode() is not mode:
                raise RuntimeError("a TorchFunctionMode entered inside mpcourse.core.autocast is still "
                                   "active at the region's exit; exit it inside the region")
            mode.__exit__(exc_type, exc_val, exc_tb)
        (st.enabled[dev], st.dtype[dev], st.cache_enabled, st.cast_args, st.cached_cast,
         st.course_additions) = self._saved.pop()
        return False

    def _copy(self) -> "autocast":
        new = object.__new__(autocast)
        new.__dict__.update(self.__dict__, _saved=[])
        return new

    def __call__(self, func):
        """Decorator use: ``@autocast("cpu")``; each call runs in a fresh region (thread-safe)."""
        @functools.wraps(func)
        def decorate_autocast(*args, **kwargs):
            with self._copy():
                return func(*args, **kwargs)
        return decorate_autocast
