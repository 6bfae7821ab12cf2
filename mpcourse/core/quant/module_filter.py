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

None of this runs a kernel: it only decides which modules ``convert_to_float8_training`` swaps.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch.nn as nn

ModuleFilter = Callable[[nn.Module, str], bool]

#: torchao's auto-filter boxes per recipe: a (K, N) GEMM with K <= k_max and N <= n_max in any box stays high
SMALL_GEMM_BOXES: dict[str, tuple[tuple[float, float], ...]] = {
    "tensorwise": ((4096, 1024),),
    "rowwise": ((float("inf"), 2048), (1024, float("inf")), (2048, 4096)),
}
HARDWARE_MULTIPLE = 16   # FP8 tensor cores need every GEMM dim a multiple of 16 (torchao checks K and N)


def block_index(fqn: str, container: str = "blocks") -> int | None:
    """The transformer block a module belongs to: 4 for "blocks.4.mlp.fc" (``container`` names the ModuleList,
    "blocks" in the course's GPT, "layers" in torchtitan's Llama); None outside every block (e.g. "head")."""
    m = re.search(rf"(?:^|\.){re.escape(container)}\.(\d+)(?:\.|$)", fqn)
    return int(m.group(1)) if m else None


def edge_blocks_filter(n_blocks: int, first: int = 0, last: int = 1, container: str = "blocks") -> ModuleFilter:
    """Filter keeping the linears of the first ``first`` and last ``last`` of ``n_blocks`` blocks high (False);
    every other linear, inside a block or not, is converted (True). ``first = last = 0`` keeps nothing high."""
    if n_blocks < 1 or first < 0 or last < 0:
        raise ValueError(f"need n_blocks >= 1 and first, last >= 0; got n_blocks={n_blocks}, first={first}, "
                         f"last={last}")

    def convert(module: nn.Module, fqn: str) -> bool:
        i = block_index(fqn, container)
        return i is None or first <= i < n_blocks - last
    return convert


def is_small_gemm(k: int, n: int, recipe: str = "tensorwise") -> bool:
    """torchao's auto-filter rule: does a GEMM with inner dim K and output dim N stay high precision?"""
    if recipe not in SMALL_GEMM_BOXES:
        raise ValueError(f"unknown recipe {recipe!r} for the small-GEMM rule: use one of {sorted(SMALL_GEMM_BOXES)}")
    if k % HARDWARE_MULTIPLE or n % HARDWARE_MULTIPLE:
        return True
    return any(k <= k_max and n <= n_max for k_max, n_max in SMALL_GEMM_BOXES[recipe])


def small_gemm_filter(recipe: str = "tensorwise", filter_fqns: Sequence[str] = ()) -> ModuleFilter:
    """Filter converting an ``nn.Linear`` unless ``is_small_gemm`` (weight (N, K)) or its fqn contains one of
    ``filter_fqns``: torchao's ``_auto_filter_for_recipe(recipe, filter_fqns)``, decision for decision."""
    is_small_gemm(16, 16, recipe)                     # an unknown recipe fails here, not at the first layer

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        n, k = module.weight.shape                    # (out_features N, in_features K)
        return not is_small_gemm(k, n, recipe)
    return convert


def all_of(*filters: ModuleFilter) -> ModuleFilter:
    """Filter converting a module only where every one of ``filters`` converts it."""
    def convert(module: nn.Module, fqn: str) -> bool:
        return all(f(module, fqn) for f in filters)
    return convert


def split_by_filter(model: nn.Module, module_filter: ModuleFilter) -> tuple[list[str], list[str]]:
    """(converted, kept high): the fqns of ``model``'s ``nn.Linear`` layers that ``module_filter`` would convert
    and keep, in model order. What a filter does, shown before converting anything."""
    names = [(fqn, module_filter(m, fqn)) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [f for f, c in names if c], [f for f, c in names if not c]
