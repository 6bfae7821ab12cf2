"""The learner's functions: one table of every function an exercise asks for, and where they meet the library.

Every exercise (``solutions/NN_*.ipynb``, ``exercises/`` generated from it) has the learner write functions; the
library can run those in place of its own (``mpcourse compare --with NOTEBOOK``, ``train_yours``). This module
is the one statement of what they are: ``EXERCISE_FUNCTIONS`` maps each function's name to the lesson that
teaches it, its signature as the exercise states it (the library calls it with that many arguments, in that
order), and the check on what it returns (a ``mpcourse.core.seams.returned_*`` function; None where the library
never calls it: ``decode``, ``diagnose``, ...). ``tests/core/test_learner_table.py`` holds the table to the
solution notebooks: every function defined in a ``### BEGIN SOLUTION`` block is in it, with that lesson and
signature, and nothing else is.

The three places:

* ``learner_functions(namespace, names)``: the one filter. From a notebook's ``globals()``, or the definitions
  ``mpcourse.experiment.learner.load_functions`` read from one, the callables named in the table (restricted
  to ``names``: what a recipe accepts); the library's own functions, imported into a notebook, are left out.
* ``check_overrides(overrides, accepts, who)``: the one check, where a recipe is built (a TrainingRecipe, a
  quantization recipe made with ``functions=``): an unknown name, a name the recipe does not accept, or a function that
  cannot be called as the table's signature says stop with one line (``OverrideRefused``) naming the fix.
  What passes comes back as ``CheckedFunctions``, a read-only mapping that says it was checked: a quantization
  recipe takes one checked for it as it is, so a TrainingRecipe's functions are checked once on their way to a
  quantizer.
* ``returned(name, ...)``: at run time, what the learner's function returned, by its table entry's check
  (``SeamError`` naming the function and the fix).

Which names a recipe accepts is said once per recipe, by the recipe: a TrainingRecipe's ``OVERRIDABLE``
(``mpcourse.experiment.recipes``), a quantization recipe class's ``TAKES`` (``mpcourse.core.quant.recipe``); both are
written with ``exercise_names(...)``, which refuses a name that is not in the table.
"""
from __future__ import annotations

import ast
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

from . import seams


class OverrideRefused(ValueError):
    """A learner's function the library cannot take: an unknown name, one the recipe does not accept, or a
    signature the library cannot call. The message is one line naming the fix."""


@dataclass(frozen=True)
class ExerciseFunction:
    """One exercise function: ``name``, the ``lesson`` that teaches it ("00" .. "14"), its ``signature`` as the
    exercise's ``def`` states it, and ``returned``: the ``seams.returned_*`` check of what it returns when the
    library calls it (None: the library never calls it; a class's entry is its ``class`` line)."""

    name: str
    lesson: str
    signature: str
    returned: Optional[Callable] = None

    @property
    def parameters(self) -> tuple[str, ...]:
        """The parameters' names, in order (none for a class): the library passes that many, positionally."""
        if self.signature.startswith("class "):
            return ()
        node = ast.parse(f"def {self.signature}:\n    pass").body[0]
        return tuple(a.arg for a in (*node.args.posonlyargs, *node.args.args))

    def call(self) -> str:
        """How the library calls it: ``name(p1, p2, ...)`` (a class: its ``class`` line)."""
        if self.signature.startswith("class "):
            return self.signature
        return f"{self.name}({', '.join(self.parameters)})"


_T = "torch.Tensor"

#: every function an exercise asks for, by name, in lesson order
EXERCISE_FUNCTIONS: dict[str, ExerciseFunction] = {f.name: f for f in (
    ExerciseFunction("decode", "00", "decode(bits: int, exponent_bits: int, mantissa_bits: int) -> float"),
    ExerciseFunction("round_to_bf16", "00", f"round_to_bf16(x: {_T}) -> {_T}", seams.returned_rounded),
    ExerciseFunction("round_to_fp16", "00", f"round_to_fp16(x: {_T}) -> {_T}", seams.returned_rounded),
    ExerciseFunction("fp16_fate", "01", f"fp16_fate(x: {_T}) -> {_T}"),
    ExerciseFunction("is_update_lost", "01", f"is_update_lost(w: {_T}, dw: {_T}) -> {_T}", seams.returned_mask),
    ExerciseFunction("make_master", "02", f"make_master(model_params: list[{_T}]) -> list[{_T}]",
                     seams.returned_masters),
    ExerciseFunction("master_step", "02", f"master_step(model_params: list[{_T}], master_params: list[{_T}], "
                     "optimizer: torch.optim.Optimizer, loss_scale: float) -> None", seams.returned_master_step),
    ExerciseFunction("choose_loss_scale", "03", "choose_loss_scale(grad_abs_max: float, fmt_max: float = 65504.0, "
                     "margin: int = 0) -> float", seams.returned_loss_scale),
    ExerciseFunction("unscale_grads_", "03", "unscale_grads_(grads: list, scale: float) -> bool", seams.returned_flag),
    ExerciseFunction("update_scale", "04", "update_scale(scale: float, growth_tracker: int, found_inf: bool, "
                     "growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple",
                     seams.returned_update_scale),
    ExerciseFunction("scaled_step", "04", f"scaled_step(loss: {_T}, optimizer: torch.optim.Optimizer, state: dict, "
                     "max_norm: float = 1.0, growth_factor: float = 2.0, backoff_factor: float = 0.5, "
                     "growth_interval: int = 2000) -> bool"),
    ExerciseFunction("cast_args", "05", "cast_args(op_name: str, args: tuple, device_type: str, dtype: torch.dtype) "
                     "-> tuple", seams.returned_cast_args),
    ExerciseFunction("MiniAutocast", "05", "class MiniAutocast(TorchFunctionMode)"),
    ExerciseFunction("cached_cast", "05", f"cached_cast(cache: dict, t: {_T}, to_type: torch.dtype) -> {_T}",
                     seams.returned_cast),
    ExerciseFunction("stochastic_round_bf16", "06", f"stochastic_round_bf16(x: {_T}, generator: torch.Generator) "
                     f"-> {_T}", seams.returned_rounded),
    ExerciseFunction("kahan_add_", "06", f"kahan_add_(w: {_T}, comp: {_T}, update: {_T}) -> None",
                     seams.returned_kahan_add),
    ExerciseFunction("compute_scale", "07", f"compute_scale(amax: {_T}, fp8_max: float, margin: int = 0) -> {_T}",
                     seams.returned_scale),
    ExerciseFunction("quantize", "07", f"quantize(x: {_T}, scale: {_T}, fp8_max: float) -> {_T}", seams.returned_fp8),
    ExerciseFunction("update", "08", f"update(history: {_T}, scale: {_T}, amax: {_T}, fp8_max: float, margin: int = 0, "
                     "algo: str = 'max')", seams.returned_delayed_update),
    ExerciseFunction("block_quantize", "09", f"block_quantize(x: {_T}, block)", seams.returned_block_scaled),
    ExerciseFunction("columnwise_quantize", "09", f"columnwise_quantize(x: {_T})"),
    ExerciseFunction("mx_shared_exponent", "09", f"mx_shared_exponent(amax: {_T}, elem: str) -> {_T}",
                     seams.returned_exponents),
    ExerciseFunction("mx_quantize", "09", f"mx_quantize(x: {_T})"),
    ExerciseFunction("mx_dequantize", "09", f"mx_dequantize(scale: {_T}, data: {_T}) -> {_T}"),
    ExerciseFunction("nvfp4_scales", "09", f"nvfp4_scales(x: {_T})", seams.returned_nvfp4_scales),
    ExerciseFunction("all_reduce_found_inf_", "10", f"all_reduce_found_inf_(found_inf: {_T}, group=None) -> {_T}",
                     seams.returned_found_inf),
    ExerciseFunction("distributed_skip_step_", "10", f"distributed_skip_step_(optimizer, scale: {_T}, "
                     f"growth_tracker: {_T}, group=None, growth_factor: float = 2.0, backoff_factor: float = 0.5, "
                     f"growth_interval: int = 2000) -> {_T}"),
    ExerciseFunction("bytes_per_parameter", "11",
                     "bytes_per_parameter(weights, grad_buffers, master, moments) -> dict"),
    ExerciseFunction("diagnose", "12", "diagnose(log: dict) -> str"),
    ExerciseFunction("pad_token_groups", "13", f"pad_token_groups(x: {_T}, counts: {_T}, alignment: int) -> tuple",
                     seams.returned_padded_groups),
    ExerciseFunction("unpad_token_groups", "13", f"unpad_token_groups(y: {_T}, counts: {_T}, alignment: int) -> {_T}",
                     seams.returned_unpadded_groups),
    ExerciseFunction("group_scales", "13", f"group_scales(t: {_T}, offs: {_T}) -> {_T}", seams.returned_group_scales),
    ExerciseFunction("quantize_p_blocks", "14", f"quantize_p_blocks(s: {_T}, scale: {_T}, block: int) -> {_T}"),
    ExerciseFunction("switch_events", "14", "switch_events(records: list, rules: list, switched: set = frozenset()) -> list"),
)}


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(name, list(EXERCISE_FUNCTIONS), n=1)
    return f"{name} is not one of the exercises' functions" + (f" (did you mean {close[0]}?)" if close else "")


def exercise_names(*names: str) -> tuple[str, ...]:
    """``names`` as a tuple, each checked to be in the table: how a recipe states the names it accepts
    (``OVERRIDABLE = exercise_names("round_to_bf16", "make_master")``). ValueError for one that is not."""
    for name in names:
        if name not in EXERCISE_FUNCTIONS:
            raise ValueError(f"{_unknown(name)}: a recipe accepts names from mpcourse.core.learner_table")
    return tuple(names)


def learner_functions(namespace: Mapping[str, object], names: Optional[Iterable[str]] = None) -> dict[str, Callable]:
    """The learner's exercise functions in ``namespace`` (a notebook's ``globals()``, or the definitions
    ``mpcourse.experiment.learner.load_functions`` read from one): the callables named in the table, in table
    order, or only those in ``names`` (e.g. a recipe's ``OVERRIDABLE``), in that order. The library's own
    functions (imported into a notebook from ``mpcourse``) are not the learner's: left out. Never raises for what
    the namespace holds: a wrong function is refused where a recipe is built (``check_overrides``)."""
    wanted = list(EXERCISE_FUNCTIONS) if names is None else list(exercise_names(*names))
    found = {name: namespace.get(name) for name in wanted}
    return {name: fn for name, fn in found.items()
            if callable(fn) and not str(getattr(fn, "__module__", "") or "").startswith("mpcourse.")}


def check_signature(name: str, fn: Callable) -> None:
    """``OverrideRefused`` unless ``fn`` can be called as the library calls the exercise function ``name``:
    positionally, one argument per parameter of the table's signature (defaults, ``*args`` and extra parameters
    with defaults are fine). A callable whose signature cannot be read (a builtin) is let through."""
    entry = EXERCISE_FUNCTIONS[name]
    if not entry.parameters:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*entry.parameters)
    except TypeError:
        raise OverrideRefused(f"your {name}{sig} cannot be called as the library calls it, {entry.call()} (lesson "
                              f"{entry.lesson}'s signature: def {entry.signature}): give it those parameters, "
                              "in that order") from None


_MADE_BY_CHECK = object()     # only check_overrides (and CheckedFunctions.wrapped) make a CheckedFunctions


class CheckedFunctions(Mapping):
    """A learner's functions as ``check_overrides`` passed them: {exercise's name: function}, read-only, and the
    record that they were checked: ``who`` they were checked for, and ``checked_for``, the configuration the check
    depended on (the quantization recipe whose names and fields they were checked against; None: none given). A
    quantization recipe takes one checked for it as it is and checks anything else (a plain dict): a
    TrainingRecipe's functions are checked once on their way to a quantizer.

    Made only by ``check_overrides`` (TypeError otherwise) and by ``wrapped``; a mapping like any other (``in``,
    ``get``, ``**``, ``==`` a dict), without item or attribute assignment."""

    __slots__ = ("_functions", "who", "checked_for")

    def __init__(self, functions: Mapping[str, Callable], who: str, checked_for: object = None, *,
                 _made_by: object = None):
        if _made_by is not _MADE_BY_CHECK:
            raise TypeError("CheckedFunctions are made by mpcourse.core.learner_table.check_overrides: pass the "
                            "functions through it (or hand a plain dict to the recipe or the layer, which check it)")
        object.__setattr__(self, "_functions", MappingProxyType(dict(functions)))
        object.__setattr__(self, "who", who)
        object.__setattr__(self, "checked_for", checked_for)

    def __getitem__(self, name: str) -> Callable:
        return self._functions[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)

    def __setattr__(self, name, value):
        raise AttributeError("CheckedFunctions is read-only: check a new mapping with check_overrides")

    __delattr__ = __setattr__

    def __reduce__(self):          # copy.deepcopy of a model that holds them: the same checked functions
        return _checked, (dict(self._functions), self.who, self.checked_for)

    def __repr__(self) -> str:
        return f"CheckedFunctions({dict(self._functions)!r}, checked for {self.who})"

    def wrapped(self, wrap: Callable[[str, Callable], Callable]) -> "CheckedFunctions":
        """Each function replaced by ``wrap(name, fn)``, still checked: ``wrap`` must keep ``fn``'s signature
        (``functools.wraps``), e.g. a guard that turns what the function raises into an error naming it."""
        return _checked({name: wrap(name, fn) for name, fn in self._functions.items()}, self.who, self.checked_for)


def _checked(functions: Mapping[str, Callable], who: str, checked_for: object = None) -> CheckedFunctions:
    return CheckedFunctions(functions, who, checked_for, _made_by=_MADE_BY_CHECK)


def check_overrides(overrides: Optional[Mapping[str, Callable]], accepts: Sequence[str], who: str, *,
                    takers: Optional[Callable[[str], Sequence[str]]] = None,
                    refuse: Optional[Callable[[str], Optional[str]]] = None,
                    checked_for: object = None) -> CheckedFunctions:
    """The learner's functions handed to ``who`` (e.g. "recipe 'fp16-dynamic'"), which accepts the names
    ``accepts``, as a ``CheckedFunctions`` (empty for None) recording ``checked_for``. ``OverrideRefused`` (one
    line) for a name not in the table (with the closest one), a name ``who`` does not accept (naming what it takes,
    and ``takers(name)``: who does), a value that is not a function, or a function that cannot be called with the
    table's parameters. ``refuse(name)``: a reason of ``who``'s own to refuse a name it accepts (the quant engine:
    a recipe field the lesson's rule does not follow), or None."""
    overrides = dict(overrides or {})
    unknown = [n for n in overrides if n not in EXERCISE_FUNCTIONS]
    if unknown:
        raise OverrideRefused(f"{_unknown(unknown[0])}; {who} takes {', '.join(accepts) or 'none'}")
    refused = [n for n in overrides if n not in accepts]
    if refused:
        elsewhere = [f"{n} (lesson {EXERCISE_FUNCTIONS[n].lesson}) goes to {', '.join(takers(n))}"
                     for n in refused if takers is not None and takers(n)]
        raise OverrideRefused(f"{who} cannot use {', '.join(refused)}: it takes {', '.join(accepts) or 'none'}"
                              + (f"; {'; '.join(elsewhere)}" if elsewhere else ""))
    for name, fn in overrides.items():
        if not callable(fn):
            raise OverrideRefused(f"{name} must be a function (def {EXERCISE_FUNCTIONS[name].signature}), got "
                                  f"{type(fn).__name__}")
        check_signature(name, fn)
        why = refuse(name) if refuse is not None else None
        if why:
            raise OverrideRefused(why)
    return _checked(overrides, who, checked_for)


class OverrideError(RuntimeError):
    """A learner's function raised while the library ran it: the message names it and what it raised."""

    def __init__(self, name: str, error: BaseException):
        what = "is not implemented yet (it raises NotImplementedError)" if isinstance(error, NotImplementedError) \
            else f"raised {type(error).__name__}: {error}"
        super().__init__(f"your {name} {what}")
        self.name, self.error = name, error


def guarded(name: str, fn: Callable) -> Callable:
    """``fn`` whose exceptions become one ``OverrideError`` naming ``name`` (no traceback from deep inside): what
    a recipe wraps each of a learner's functions in, where it is built (``CheckedFunctions.wrapped``), so the step
    that calls it goes from the library to the learner's code and back, and nowhere else."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OverrideError:
            raise
        except Exception as e:                                        # the learner's bug, whatever it is
            raise OverrideError(name, e) from None
    return call


def returned(name: str, *args, **kwargs):
    """What the learner's ``name`` returned, checked by its table entry's ``seams.returned_*`` (arguments after the
    name as that check takes them) and given back in the form the library uses; ``SeamError`` naming ``name``."""
    check = EXERCISE_FUNCTIONS[name].returned
    if check is None:
        raise ValueError(f"{name} has no check on what it returns: the library does not call it")
    return check(name, *args, **kwargs)
