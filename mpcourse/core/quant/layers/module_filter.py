"""Which linear layers compute in low precision: ``module_filter_fn`` rules for ``convert_to_float8_training``.

A filter has torchao's shape, ``fn(module, fqn) -> bool``: True converts the layer (it computes in FP8 / MXFP8 /
NVFP4), False keeps it an ``nn.Linear`` in the model's high precision. ``fqn`` is the dotted name
("blocks.4.mlp.fc"). Two rules production uses, each a plain function, and a way to combine them:

* ``edge_blocks_filter(n_blocks, first, last)``: the first ``first`` and last ``last`` transformer blocks stay
  high. NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) keeps about 16% of the linear layers of
  its 12B model in BF16, mostly those of the last blocks; torchtitan's NVFP4 Llama3-8B recipe keeps the last
  ~15% of blocks in BF16.
* ``small_gemm_filter(recipe)``: a GEMM too small to gain from low precision stays high. The thresholds are
  torchao's ``_auto_filter_for_recipe`` (pytorch/ao ``torchao/float8/float8_linear_utils.py``, from H100
  benchmarks): for a weight of shape (N, K) (out_features, in_features) the layer stays high when K or N is not a
  multiple of 16, or when (K, N) lies in one of the recipe's boxes ``K <= k_max and N <= n_max``:

      tensorwise   K <= 4096 and N <= 1024
      rowwise      N <= 2048, or K <= 1024, or (K <= 2048 and N <= 4096)

  torchao also drops a layer whose fqn *contains* any of ``filter_fqns`` (substring match); so does this rule.
* ``all_of(*filters)``: convert only where every filter says convert (e.g. "not the head" and "not the last block").

A name that matches nothing is an error, not a filter that keeps nothing: a filter built here carries
``check_model(model)``, which ``check_filter`` runs (``convert_to_float8_training`` and ``split_by_filter`` call
it once, before deciding any layer, so a refused filter leaves the model untouched). ``edge_blocks_filter``
refuses a ``container`` path that holds no numbered block of the model (and a block index at or past
``n_blocks``), naming the model's block containers; ``small_gemm_filter`` refuses an entry of ``filter_fqns``
that is a substring of no ``nn.Linear``'s fqn, naming the model's linear layers. torchao's
``_auto_filter_for_recipe`` has no such check: there an absent name (``"output"`` on a model whose head is
``"lm_head"``) converts the layer it was meant to keep high, silently. The matching itself is unchanged
(substring, torchao's), so every filter that passes the check decides each layer as torchao's does; a plain
function without ``check_model`` (torchao's own, a lambda) passes unchecked.

None of this runs a kernel: it only decides which modules ``convert_to_float8_training`` swaps.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch.nn as nn

ModuleFilter = Callable[[nn.Module, str], bool]
ModelCheck = Callable[[nn.Module], None]

#: torchao's auto-filter boxes per recipe: a (K, N) GEMM with K <= k_max and N <= n_max in any box stays high
SMALL_GEMM_BOXES: dict[str, tuple[tuple[float, float], ...]] = {
    "tensorwise": ((4096, 1024),),
    "rowwise": ((float("inf"), 2048), (1024, float("inf")), (2048, 4096)),
}
HARDWARE_MULTIPLE = 16   # FP8 tensor cores need every GEMM dim a multiple of 16 (torchao checks K and N)


def block_index(fqn: str, container: str = "blocks") -> int | None:
    """The transformer block a module belongs to: 4 for "blocks.4.mlp.fc" (``container`` names the ModuleList,
    "blocks" in the course's GPT, "layers" in torchtitan's Llama; "" for a model that is itself the list, e.g. an
    ``nn.Sequential`` of blocks: 4 for "4.mlp.fc"); None outside every block (e.g. "head")."""
    start = rf"(?:^|\.){re.escape(container)}\." if container else "^"
    m = re.search(rf"{start}(\d+)(?:\.|$)", fqn)
    return int(m.group(1)) if m else None


def summarize_fqns(fqns: Sequence[str]) -> str:
    """``fqns`` as one line, numbered siblings folded: "blocks.0.mlp.fc", ..., "blocks.4.mlp.fc" read
    "blocks.{0..4}.mlp.fc" (a non-contiguous set of indices reads "{0,2,5}"), in first-seen order."""
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        key = tuple("#" if p.isdigit() else p for p in parts)
        groups.setdefault(key, []).append(tuple(int(p) for p in parts if p.isdigit()))
    out = []
    for key, numbers in groups.items():
        values = [sorted(set(col)) for col in zip(*numbers)]
        fields = iter(str(v[0]) if len(v) == 1 else
                      f"{{{v[0]}..{v[-1]}}}" if v == list(range(v[0], v[-1] + 1)) else
                      "{" + ",".join(map(str, v)) + "}" for v in values)
        out.append(".".join(next(fields) if p == "#" else p for p in key))
    return ", ".join(out) or "none"


def linear_fqns(model: nn.Module) -> list[str]:
    """The fqns of ``model``'s ``nn.Linear`` layers, in model order (shared ones under each name)."""
    return [fqn for fqn, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear)]


def block_containers(model: nn.Module) -> dict[str, list[int]]:
    """{container path: its block indices}: every module of ``model`` with children named by integers
    (a ModuleList, a Sequential, torchtitan's ModuleDict of layers), e.g. {"blocks": [0, 1, 2, 3, 4]}; "" where
    the model itself is one (an ``nn.Sequential`` of blocks)."""
    out = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        idx = sorted(int(n) for n in m._modules if n.isdigit())
        if idx:
            out[fqn] = idx
    return out


def edge_blocks_filter(n_blocks: int, first: int = 0, last: int = 1, container: str = "blocks") -> ModuleFilter:
    """Filter keeping the linears of the first ``first`` and last ``last`` of ``n_blocks`` blocks high (False);
    every other linear, inside a block or not, is converted (True). ``first = last = 0`` keeps nothing high.

    ``container`` is the dotted path of the blocks' ModuleList ("blocks", "layers", "model.layers"; "" where the
    model itself is the list, an ``nn.Sequential`` of blocks). Its
    ``check_model`` refuses a model where ``container`` holds no numbered block, or holds a block numbered
    ``n_blocks`` or more (fewer blocks than ``n_blocks`` pass: a pipeline stage holds some of the blocks, under
    their global numbers)."""
    counts = {"n_blocks": n_blocks, "first": first, "last": last}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in counts.values()):
        got = ", ".join(f"{k}={v!r}" for k, v in counts.items())
        raise TypeError(f"edge_blocks_filter: n_blocks, first and last must be ints (block counts; not bool, not "
                        f"float), got {got}")
    if not isinstance(container, str):
        raise TypeError("edge_blocks_filter: container must be a string, the dotted path of the blocks' ModuleList "
                        f"('blocks', 'layers', 'model.layers'; '' for a model that is the list), got {container!r}")
    if n_blocks < 1 or first < 0 or last < 0:
        raise ValueError(f"need n_blocks >= 1 and first, last >= 0; got n_blocks={n_blocks}, first={first}, "
                         f"last={last}")

    def convert(module: nn.Module, fqn: str) -> bool:
        i = block_index(fqn, container)
        return i is None or first <= i < n_blocks - last

    def check_model(model: nn.Module) -> None:
        found = [i for fqn, _ in model.named_modules(remove_duplicate=False)
                 if (i := block_index(fqn, container)) is not None]
        if not found:
            have = ", ".join(f"{path!r} ({len(idx)} blocks)" for path, idx in block_containers(model).items())
            raise ValueError(f"edge_blocks_filter: container {container!r} matches no module of the model; its "
                             f"block containers are: {have or 'none'}. Pass container= one of them")
        if max(found) >= n_blocks:
            raise ValueError(f"edge_blocks_filter: n_blocks={n_blocks}, but the model's {container!r} holds "
                             f"block {max(found)}: pass n_blocks={max(found) + 1} (len of the container)")
    convert.check_model = check_model
    return convert


def is_small_gemm(k: int, n: int, recipe: str = "tensorwise") -> bool:
    """torchao's auto-filter rule: does a GEMM with inner dim K and output dim N stay high precision?
    k and n are positive ints (a weight's in_features and out_features); TypeError / ValueError otherwise."""
    for v in (k, n):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"is_small_gemm: k and n are a GEMM's sizes, positive ints (not bool, not float), got "
                            f"k={k!r}, n={n!r}")
        if v < 1:
            raise ValueError(f"is_small_gemm: k and n are a GEMM's sizes, positive ints, got k={k!r}, n={n!r}")
    if recipe not in SMALL_GEMM_BOXES:
        raise ValueError(f"unknown recipe {recipe!r} for the small-GEMM rule: use one of {sorted(SMALL_GEMM_BOXES)}")
    if k % HARDWARE_MULTIPLE or n % HARDWARE_MULTIPLE:
        return True
    return any(k <= k_max and n <= n_max for k_max, n_max in SMALL_GEMM_BOXES[recipe])


def small_gemm_filter(recipe: str = "tensorwise", filter_fqns: Sequence[str] = ()) -> ModuleFilter:
    """Filter converting an ``nn.Linear`` unless ``is_small_gemm`` (weight (N, K)) or its fqn contains one of
    ``filter_fqns``: torchao's ``_auto_filter_for_recipe(recipe, filter_fqns)``, decision for decision.

    Its ``check_model`` refuses an entry of ``filter_fqns`` contained in no ``nn.Linear``'s fqn of the model (it
    would keep nothing high). ``filter_fqns`` is a list of non-empty names: a bare string is refused (torchao would
    match its characters one by one), and so is an empty name (torchao would keep every layer high)."""
    is_small_gemm(16, 16, recipe)                     # an unknown recipe fails here, not at the first layer
    if isinstance(filter_fqns, str):
        raise TypeError(f"filter_fqns must be a list of names, got the string {filter_fqns!r}: "
                        f"pass [{filter_fqns!r}]")
    filter_fqns = tuple(filter_fqns)
    if any(not isinstance(f, str) or not f for f in filter_fqns):
        raise ValueError(f"filter_fqns holds {filter_fqns!r}: every entry must be a non-empty name (an empty one is "
                         "contained in every fqn and would keep every layer high)")

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        n, k = module.weight.shape                    # (out_features N, in_features K)
        return not is_small_gemm(k, n, recipe)

    def check_model(model: nn.Module) -> None:
        linears = linear_fqns(model)
        for name in filter_fqns:
            if not any(name in fqn for fqn in linears):
                raise ValueError(f"small_gemm_filter: filter_fqns names {name!r}, which matches no nn.Linear of "
                                 f"the model; its nn.Linear layers are: {summarize_fqns(linears)}")
    convert.check_model = check_model
    return convert


def all_of(*filters: ModuleFilter) -> ModuleFilter:
    """Filter converting a module only where every one of ``filters`` converts it; its ``check_model`` runs
    each filter's. Each filter is a callable ``(module, fqn) -> bool`` (TypeError otherwise), and there is at least
    one (ValueError: with none, every layer would be converted)."""
    if not filters:
        raise ValueError("all_of needs at least one filter: with none it would convert every layer (pass the "
                         "filters, e.g. all_of(not_the_head, edge_blocks_filter(n_blocks)))")
    for f in filters:
        if not callable(f):
            raise TypeError(f"all_of takes module filters, callables (module, fqn) -> bool, got "
                            f"{type(f).__name__} {f!r}")
    def convert(module: nn.Module, fqn: str) -> bool:
        return all(f(module, fqn) for f in filters)

    def check_model(model: nn.Module) -> None:
        for f in filters:
            check_filter(f, model)
    convert.check_model = check_model
    return convert


def check_filter(module_filter: ModuleFilter | None, model: nn.Module) -> None:
    """Run ``module_filter``'s ``check_model(model)`` where it has one: ValueError naming what the model has
    when the filter names a module or container ``model`` lacks. Nothing for a filter without one, or None."""
    check: ModelCheck | None = getattr(module_filter, "check_model", None)
    if check is not None:
        check(model)


def split_by_filter(model: nn.Module, module_filter: ModuleFilter) -> tuple[list[str], list[str]]:
    """(converted, kept high): the fqns of ``model``'s ``nn.Linear`` layers that ``module_filter`` would convert
    and keep, in model order. What a filter does, shown before converting anything (``check_filter`` first)."""
    check_filter(module_filter, model)
    names = [(fqn, module_filter(m, fqn)) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [f for f, c in names if c], [f for f, c in names if not c]
