"""Quantization recipes as configuration: Transformer Engine's (and torchao's) fields and defaults, nothing else.

Matches ``transformer_engine/common/recipe/__init__.py`` (``Format``, ``Recipe``, ``DelayedScaling``,
``Float8CurrentScaling``), read at NVIDIA/TransformerEngine commit d0067d0. As in TE, a recipe only says *what*
to do: ``mpcourse.core.quant.engine`` builds each layer's quantizers from it (TE's ``RecipeState.create``), the
rules live in ``tensor`` (per tensor), ``delayed`` (the delayed-scaling update), ``blockwise``, ``mx`` and ``nvfp4``.
The finer-grained recipes (``BlockRecipe``) are in ``block_recipes``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, ClassVar, NamedTuple, Optional, Union

from ..learner_table import CheckedFunctions, check_overrides, exercise_names
from .rules.tensor import fp8_max


class _FormatHelper(NamedTuple):
    fwd: str  # format of activations and weights (forward-pass tensors)
    bwd: str  # format of gradients (backward-pass tensors)


class Format(Enum):
    """FP8 formats of a recipe (TE ``Format``): which format the forward and the backward tensors use.

    E4M3:   E4M3 everywhere (max 448 forward and backward).
    E5M2:   E5M2 everywhere (max 57344); refused by the recipes, as TE refuses it.
    HYBRID: E4M3 forward (precision for activations and weights), E5M2 backward (range for gradients).
    """

    E4M3 = _FormatHelper("e4m3", "e4m3")
    E5M2 = _FormatHelper("e5m2", "e5m2")
    HYBRID = _FormatHelper("e4m3", "e5m2")

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    @property
    def fwd(self) -> str:
        return self.value.fwd

    @property
    def bwd(self) -> str:
        return self.value.bwd

    @property
    def max_fwd(self) -> float:
        return fp8_max(self.value.fwd)

    @property
    def max_bwd(self) -> float:
        return fp8_max(self.value.bwd)


def _check_format(fp8_format) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be Format.E4M3 or Format.HYBRID, got {fp8_format!r}")
    if fp8_format is Format.E5M2:
        raise ValueError("Pure E5M2 training is not supported (as in Transformer Engine): E5M2's 2 mantissa "
                         "bits are too coarse for weights and activations. Use Format.HYBRID (E4M3 forward, "
                         "E5M2 gradients) or Format.E4M3.")


@dataclass(frozen=True)
class QuantizationRecipe:
    """Base of every quantization recipe (TE ``Recipe``, the alias below): a frozen dataclass of fields, no behaviour.
    (The other recipe of the course, ``mpcourse.experiment.recipes.TrainingRecipe``, is a whole training run's
    precision: it may hold one of these for its linear layers.)

    ``functions``: a learner's functions, {exercise's name: function}, that this recipe's quantizers call in place of
    the library's rules (keyword only, default none). They ride in the recipe as Transformer Engine's recipes hold
    their callables as fields (``CustomRecipe.qfactory``; ``DelayedScaling.amax_compute_algo``), so nothing else
    carries them: a layer, ``convert_to_float8_training`` and the engine read ``recipe.functions``. They are
    checked once, here, where the recipe is made (``check_functions``: the names its class ``TAKES``, their
    signatures, ``refusal``); equality, hashing and ``repr`` ignore them (a recipe is its fields).
    """

    #: the learner's functions (names from ``mpcourse.core.learner_table``) a recipe of this class takes: the one
    #: statement of it (a TrainingRecipe built on such a recipe takes the same, ``mpcourse.experiment.recipes``)
    TAKES: ClassVar[tuple[str, ...]] = ()
    functions: Mapping[str, Callable] = field(default=None, compare=False, repr=False, kw_only=True)

    def __post_init__(self):
        object.__setattr__(self, "functions", check_functions(self, self.functions))

    def refusal(self, name: str) -> Optional[str]:
        """Why the learner's ``name``, which this class ``TAKES``, cannot follow this recipe's fields (the lesson's
        rule is one setting of them), or None."""
        return None

    def with_functions(self, functions: Optional[Mapping[str, Callable]]) -> "Recipe":
        """This recipe with a learner's ``functions`` in place of the library's (checked: ``OverrideRefused``, a
        ValueError naming the fix)."""
        return dataclasses.replace(self, functions=functions)


Recipe = QuantizationRecipe   # Transformer Engine's name


def recipe_classes() -> list[type]:
    """Every dataclass subclass of ``Recipe`` defined so far, in definition order (``BlockRecipe`` is a base)."""
    seen, todo = [], list(QuantizationRecipe.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if not cls.__name__.startswith("_") and cls not in seen and "__dataclass_fields__" in vars(cls):
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


#: a recipe's ``functions`` when it has none (checked: there is nothing to check)
NO_FUNCTIONS = check_overrides(None, (), "a recipe")


def check_functions(recipe: Recipe, functions: Optional[Mapping[str, Callable]]) -> CheckedFunctions:
    """A learner's ``functions`` for ``recipe``, checked (``learner_table.check_overrides``: the names the recipe's
    class ``TAKES``, their signatures, the recipe's ``refusal``): ``OverrideRefused``, a ValueError, naming the
    fix. A ``CheckedFunctions`` already checked for an equal recipe (a TrainingRecipe's: ``checked_overrides``) is
    taken as it is where every name is one this class takes and ``refusal`` refuses none: checked once."""
    if not functions:                  # none: nothing to check (every recipe without a learner's functions)
        return NO_FUNCTIONS
    takes = type(recipe).TAKES
    if (isinstance(functions, CheckedFunctions) and functions.checked_for == recipe
            and all(name in takes and recipe.refusal(name) is None for name in functions)):
        return functions
    return check_overrides(functions, takes, type(recipe).__name__, refuse=recipe.refusal,
                           takers=lambda name: [c.__name__ for c in recipe_classes() if name in c.TAKES],
                           checked_for=recipe)


def check_recipe(recipe, arg: str = "recipe") -> None:
    """TypeError unless ``recipe`` is a recipe object (None passes); a name (``"mxfp8"``) is told to build one."""
    if recipe is None or isinstance(recipe, Recipe):
        return
    hint = f"not the name {recipe!r}: " if isinstance(recipe, str) else f"got {recipe!r}: "
    raise TypeError(f"{arg} must be a recipe object, {hint}pass an instance of one of {recipe_names()} "
                    "(e.g. MXFP8BlockScaling())")


def recipe_names() -> str:
    """The recipes there are, for error messages: every dataclass subclass of ``Recipe`` defined so far."""
    return ", ".join(cls.__name__ for cls in recipe_classes())


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from the amax history of earlier steps (TE ``DelayedScaling``).

    Fields (TE's names and defaults):
      margin: int = 0                     scale = (fp8_max / amax) / 2**margin
      fp8_format: Format = Format.HYBRID  E4M3 forward, E5M2 gradients; Format.E5M2 raises ValueError
      amax_history_len: int = 1024        length L of each tensor's amax window
      amax_compute_algo: "max" | "most_recent" | Callable[[history (L,)], amax ()] = "max"
      scaling_factor_compute_algo: None | Callable[[amax, scale, fp8_max, recipe], scale] = None
      reduce_amax: bool = True            all-reduce amaxes with MAX over ranks before each update
    A learner's ``quantize`` (lesson 07) and ``update`` (lesson 08) ride in ``functions`` (``TAKES``).
    Raises ValueError / TypeError for values TE rejects.
    """

    TAKES = exercise_names("quantize", "update")   # lessons 07 and 08

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True

    def __post_init__(self):
        _check_format(self.fp8_format)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"margin must be an int, got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        super().__post_init__()

    def refusal(self, name: str) -> Optional[str]:
        if name == "update" and (callable(self.amax_compute_algo) or self.scaling_factor_compute_algo):
            return ("update is lesson 08's update (amax_compute_algo 'max' or 'most_recent', the library's scale "
                    "rule): drop the callable amax_compute_algo / scaling_factor_compute_algo")
        return None


@dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Current ("just-in-time") per-tensor scaling: every cast takes its scale from the tensor itself.

    TE ``Float8CurrentScaling`` (``Float8CurrentScaling`` below is the same class); torchao's default
    tensorwise dynamic scaling. No state survives between steps.
    Fields: fp8_format (Format.HYBRID; Format.E5M2 raises ValueError), use_power_2_scales (False: round
    each scale down to a power of two), amax_epsilon (0.0: floor for the amax).
    A learner's lesson 07 ``compute_scale`` and ``quantize`` ride in ``functions`` (``TAKES``).
    """

    TAKES = exercise_names("compute_scale", "quantize")   # lesson 07

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")
        super().__post_init__()


Float8CurrentScaling = CurrentScaling  # Transformer Engine's name for the same recipe

ROLES = ("input", "weight", "grad_output")  # the three tensors an FP8 linear layer quantizes


def fp8_format_for(recipe, role: str) -> str:
    """Format of one tensor role under ``recipe``: forward format for "input"/"weight", backward for "grad_output"."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return recipe.fp8_format.bwd if role == "grad_output" else recipe.fp8_format.fwd
