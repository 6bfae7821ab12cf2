"""Which layers convert: ``mpcourse.core.quant.layers.module_filter``. Oracles: torchao 0.18's own auto filter
(``torchao.float8.float8_linear_utils._auto_filter_for_recipe``) on the same modules, side by side, and the
model's block structure read from the module tree (not from names) for the edge-blocks rule."""
import itertools

import pytest
import torch.nn as nn

from mpcourse.core.quant import (Float8Linear, NVFP4BlockScaling, all_of, block_index, convert_to_float8_training,
                                 edge_blocks_filter, is_small_gemm, small_gemm_filter, split_by_filter)
from mpcourse.experiment.gpt.model import GPT, GPTConfig

# dims around every threshold of both recipes, multiples of 16 and not
DIMS = (8, 24, 512, 1008, 1024, 1040, 2000, 2048, 2064, 4096, 4112, 8192)
FQNS = ("blocks.0.mlp.fc", "output", "layers.3.attention.wq", "lm_head")


def _modules():
    # meta tensors: the filters read only the weight's shape, and an 8192 x 8192 weight would cost 256 MB
    mods = [(nn.Linear(k, n, bias=False, device="meta"), fqn)
            for (k, n), fqn in zip(itertools.product(DIMS, DIMS), itertools.cycle(FQNS))]
    return mods + [(nn.LayerNorm(4096, device="meta"), "norm"), (nn.Embedding(4096, 4096, device="meta"), "tok")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("filter_fqns", [[], ["output"], ["head", "wq"]])
def test_small_gemm_filter_decides_as_torchao_auto_filter(recipe, filter_fqns):
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    theirs = utils._auto_filter_for_recipe(recipe, filter_fqns=filter_fqns)
    ours = small_gemm_filter(recipe, filter_fqns)
    mods = _modules()
    got = [ours(m, f) for m, f in mods]
    assert got == [theirs(m, f) for m, f in mods]
    assert 0 < sum(got) < len(got)                      # the grid exercises both answers


def test_small_gemm_rule_reads_weight_as_out_by_in():
    # tensorwise keeps K <= 4096 and N <= 1024 high: nn.Linear(in=4096, out=1024) stays high, its transpose converts
    assert is_small_gemm(4096, 1024) and not is_small_gemm(1024, 4096)
    assert not small_gemm_filter()(nn.Linear(4096, 1024, device="meta"), "x")      # K=4096, N=1024
    assert small_gemm_filter()(nn.Linear(1024, 4096, device="meta"), "x")          # K=1024, N=4096
    assert is_small_gemm(8200, 8192) and is_small_gemm(4096, 4104, "rowwise")       # not multiples of 16


def test_unknown_recipe_is_refused_when_the_filter_is_built():
    with pytest.raises(ValueError, match="tensorwise"):
        small_gemm_filter("blockwise")


@pytest.mark.parametrize("fqn, container, want", [
    ("blocks.4.mlp.fc", "blocks", 4), ("blocks.12", "blocks", 12), ("model.blocks.0.attn.qkv", "blocks", 0),
    ("head", "blocks", None), ("myblocks.1.fc", "blocks", None), ("layers.3.attention.wq", "layers", 3),
    ("layers.3.attention.wq", "blocks", None)])
def test_block_index(fqn, container, want):
    assert block_index(fqn, container) == want


@pytest.mark.parametrize("first, last", [(0, 1), (1, 1), (0, 2), (0, 0), (2, 3)])
def test_edge_blocks_filter_against_the_module_tree(first, last):
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=5, n_head=2, n_embd=16))
    n = len(model.blocks)
    high_ids = {id(m) for i, blk in enumerate(model.blocks) if i < first or i >= n - last
                for m in blk.modules() if isinstance(m, nn.Linear)}
    name_of = {id(m): f for f, m in model.named_modules()}
    converted, kept = split_by_filter(model, edge_blocks_filter(n, first, last))
    assert set(kept) == {name_of[i] for i in high_ids}
    assert "head" in converted and len(converted) + len(kept) == 4 * n + 1


def test_filters_combine_and_drive_the_conversion():
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16))
    f = all_of(lambda m, fqn: fqn != "head", edge_blocks_filter(3, 0, 1))
    convert_to_float8_training(model, module_filter_fn=f, recipe=NVFP4BlockScaling())
    kinds = {fqn: type(m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {k for k, t in kinds.items() if t is nn.Linear} == {"head"} | {f"blocks.2.{s}" for s in
                                                                           ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert sum(t is Float8Linear for t in kinds.values()) == 8


def test_bad_edge_arguments():
    with pytest.raises(ValueError, match="n_blocks"):
        edge_blocks_filter(0)
    with pytest.raises(ValueError, match="last"):
        edge_blocks_filter(4, 0, -1)


# ------------------------------------------------------------------ a filter naming what the model lacks
def _kinds(model):
    return {fqn: type(m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


def _wide_model():
    # weights (N, K) = (2048, 64): tensorwise converts them (N > 1024), so a filter that fails to keep one
    # high is visible; "lm_head" is the head's name here, as in HF models (torchtitan: "output")
    return nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(64, 2048, bias=False) for _ in range(2)]),
                          "lm_head": nn.Linear(64, 2048, bias=False)})


def test_edge_filter_with_an_absent_container_is_refused_before_any_conversion():
    from mpcourse.experiment.recipes.fp8 import keep_linear_in_fp8
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16))
    before = _kinds(model)
    f = all_of(keep_linear_in_fp8, edge_blocks_filter(3, 0, 1, container="layers"))   # the GPT names it "blocks"
    with pytest.raises(ValueError, match=r"container 'layers'.*matches no module.*'blocks' \(3 blocks\)"):
        convert_to_float8_training(model, module_filter_fn=f, recipe=NVFP4BlockScaling())
    assert _kinds(model) == before and all(t is nn.Linear for t in before.values())     # nothing converted
    with pytest.raises(ValueError, match="container 'layers'"):
        split_by_filter(model, f)


def test_edge_filter_container_path_may_be_dotted():
    model = nn.Sequential()
    model.add_module("model", nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])}))
    converted, kept = split_by_filter(model, edge_blocks_filter(3, 0, 1, container="model.layers"))
    assert converted == ["model.layers.0", "model.layers.1"] and kept == ["model.layers.2"]
    with pytest.raises(ValueError, match=r"its block containers are: 'model\.layers' \(3 blocks\)"):
        split_by_filter(model, edge_blocks_filter(3, 0, 1, container="layers.model"))


def test_edge_filter_with_fewer_blocks_than_the_model_is_refused():
    # n_blocks=3 on 5 blocks: "the last block" would be block 2, and blocks 3, 4 (beyond n_blocks) stay high
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=5, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match=r"n_blocks=3.*'blocks'.*block 4.*n_blocks=5"):
        split_by_filter(model, edge_blocks_filter(3, 0, 1))


def test_small_gemm_filter_naming_an_absent_module_is_refused_before_any_conversion():
    model = _wide_model()
    with pytest.raises(ValueError, match=r"filter_fqns names 'output', which matches no nn\.Linear of the model; "
                                         r"its nn\.Linear layers are: layers\.\{0\.\.1\}, lm_head"):
        convert_to_float8_training(model, module_filter_fn=small_gemm_filter("tensorwise", ["lm_head", "output"]),
                                   recipe=NVFP4BlockScaling())
    assert all(t is nn.Linear for t in _kinds(model).values())                          # nothing converted
    with pytest.raises(ValueError, match="'output'"):
        split_by_filter(model, all_of(lambda m, f: True, small_gemm_filter("rowwise", ["output"])))


def test_small_gemm_filter_with_present_names_converts_as_torchao():
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    model = _wide_model()
    for fqns in (["lm_head"], ["head"], ["layers.1"], []):        # substrings of fqns, as torchao matches them
        theirs = utils._auto_filter_for_recipe("tensorwise", filter_fqns=fqns)
        want = [f for f, m in model.named_modules() if isinstance(m, nn.Linear) and theirs(m, f)]
        assert split_by_filter(model, small_gemm_filter("tensorwise", fqns))[0] == want
    convert_to_float8_training(model, module_filter_fn=small_gemm_filter("tensorwise", ["head"]),
                               recipe=NVFP4BlockScaling())
    assert _kinds(model) == {"layers.0": Float8Linear, "layers.1": Float8Linear, "lm_head": nn.Linear}


def test_small_gemm_filter_refuses_a_bare_string():
    with pytest.raises(TypeError, match=r"\['output'\]"):
        small_gemm_filter("tensorwise", "output")


def test_summarize_fqns_folds_numbered_siblings():
    from mpcourse.core.quant.layers.module_filter import summarize_fqns
    assert summarize_fqns(["blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "head"]) == "blocks.{0..2}.fc, head"
    assert summarize_fqns(["a.0.x", "a.2.x", "a.1.e.3", "a.5.x"]) == "a.{0,2,5}.x, a.1.e.3"
    assert summarize_fqns([]) == "none"


def test_the_recipes_head_filter_refuses_a_model_without_its_head():
    """The FP8 recipes keep ``head`` out of FP8 by name: a model whose head is named otherwise is refused (its
    output layer would be converted silently), and the course's GPT passes."""
    import torch.nn as nn

    from mpcourse.core.quant import convert_to_float8_training
    from mpcourse.experiment.recipes.fp8 import keep_linear_in_fp8

    renamed = nn.Sequential()
    renamed.add_module("body", nn.Linear(16, 16))
    renamed.add_module("lm_head", nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"no nn.Linear of that name; its nn.Linear layers are: body, lm_head"):
        convert_to_float8_training(renamed, module_filter_fn=keep_linear_in_fp8)
    assert isinstance(renamed.lm_head, nn.Linear) and type(renamed.lm_head) is nn.Linear   # nothing converted
    named = nn.Sequential()
    named.add_module("body", nn.Linear(16, 16))
    named.add_module("head", nn.Linear(16, 16))
    convert_to_float8_training(named, module_filter_fn=keep_linear_in_fp8)
    assert type(named.head) is nn.Linear and type(named.body) is not nn.Linear


def test_edge_filter_on_a_model_that_is_itself_the_list_of_blocks():
    """An nn.Sequential of blocks numbers them at the root ("2.fc"): container="" names it, and the error for an
    absent container lists it (it used to say the model had no block containers, and no container worked)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    model = nn.Sequential(Block(), Block(), Block())
    assert block_index("2.fc", "") == 2 and block_index("fc", "") is None
    converted, kept = split_by_filter(model, edge_blocks_filter(3, 1, 1, container=""))
    assert converted == ["1.fc"] and kept == ["0.fc", "2.fc"]
    with pytest.raises(ValueError, match=r"its block containers are: '' \(3 blocks\)"):
        split_by_filter(model, edge_blocks_filter(3, 0, 1))


def test_a_filter_that_raises_midway_leaves_the_model_unconverted():
    """convert_to_float8_training builds every replacement before it swaps any: a filter (or a layer) that raises
    on the third linear used to leave the first two swapped, a half-converted model."""
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16))
    before = [(fqn, type(m)) for fqn, m in model.named_modules()]

    def raises_on_the_last_block(module, fqn):
        if fqn.startswith("blocks.2."):
            raise RuntimeError("a filter's own bug")
        return True

    with pytest.raises(RuntimeError, match="a filter's own bug"):
        convert_to_float8_training(model, module_filter_fn=raises_on_the_last_block)
    assert [(fqn, type(m)) for fqn, m in model.named_modules()] == before
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_an_empty_name_in_filter_fqns_is_refused():
    """"" is a substring of every fqn: torchao would keep every layer high without a word."""
    from mpcourse.core.quant.layers.module_filter import small_gemm_filter

    for bad in ([""], ["head", ""], [None]):
        with pytest.raises(ValueError, match="non-empty name"):
            small_gemm_filter(filter_fqns=bad)
    small_gemm_filter(filter_fqns=["head"])            # a real name still builds
