"""The layout of ``mpcourse.core.quant``: each rule a plain function, the kernels beside the rules, one engine.

* Every rule a lesson teaches is importable from ``mpcourse.core.quant``, and its source names no kernel, fast path
  or learner's hook, in at most 30 lines of body (its docstring aside).
* No rule module imports a kernel module (``kernels/``) or the engine, at module level or inside a function.
* The package has no import cycle, function-level imports included.
* The recipes are configuration: dataclass fields (TE's / torchao's), no ``*_fn`` fields, no quantizing methods.
* The engine's quantizers give the same bits with kernels (the default) as with the rules (``kernels=False``, what
  ``MPCOURSE_FUSED=0`` binds) for every recipe, role and axis.
* No layer imports a kernel: the layers run their quantizers' backend (``quant.backend``), and each kernel's docstring names its rule.
"""
import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

import mpcourse.core.quant as quant
from mpcourse.core.quant import engine

RULES = ["compute_amax", "compute_scale", "quantize", "quantize_fp32_scaled", "block_quantize", "mx_shared_exponent",
         "quantize_mx", "two_level_scales", "quantize_nvfp4", "amax_and_scale_update"]
RULE_MODULES = ["rules.tensor", "rules.delayed", "rules.scaled", "rules.blockwise", "rules.mx", "rules.nvfp4",
                "rules.hadamard", "recipe", "block_recipes"]
KERNEL_MODULES = {"kernels.jit", "kernels.loops", "kernels.fp8_passes", "kernels.nvfp4_passes", "kernels.per_tensor",
                  "kernels.upcast", "kernels.blocks", "kernels.e2m1", "kernels.nvfp4_quant", "engine"}
FORBIDDEN = re.compile(r"fused|fastpath|kernel|numba|_passes|nvfp4_quant|\bjit\b|hook|_fn\b|learner", re.IGNORECASE)
PACKAGE = Path(quant.__file__).parent


def _body_lines(fn) -> int:
    """Lines of ``fn``'s body, its docstring, blank lines and comment-only lines left out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    src = inspect.getsource(fn).splitlines()
    first = tree.body[0].lineno if not ast.get_docstring(tree) else body[0].lineno
    lines = src[first - 1:body[-1].end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def _code(fn) -> str:
    """``fn``'s source without its docstring."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if ast.get_docstring(tree):
        tree.body = tree.body[1:]
    return ast.unparse(tree)


@pytest.mark.parametrize("name", RULES)
def test_each_rule_is_a_plain_function_of_at_most_30_lines(name):
    fn = getattr(quant, name)
    assert inspect.isfunction(fn) and inspect.getmodule(fn).__name__.removeprefix("mpcourse.core.quant.") in RULE_MODULES, name
    code = _code(fn)
    assert not FORBIDDEN.search(code), f"{name} names {FORBIDDEN.search(code).group()}"
    assert _body_lines(fn) <= 30, f"{name}: {_body_lines(fn)} lines"


def test_the_layout_checks_can_fail():
    def planted(x):
        """A rule with a fast path."""
        from mpcourse.core.quant.kernels import fp8_passes   # noqa: F401
        return x
    assert FORBIDDEN.search(_code(planted))
    assert _body_lines(planted) == 2
    tree = ast.parse("def f():\n    from ..kernels import blocks\n    from ..layers.gemm import fp8_gemm\n")
    assert _imports(tree, "mpcourse.core.quant.rules.m") == {"kernels.blocks", "layers.gemm"}
    # a planted edge from a rule to a kernel is caught by the room check
    graph = _graph()
    graph["rules.tensor"] = graph["rules.tensor"] | {"kernels.per_tensor"}
    assert _room_violations(graph)
    graph = _graph()                                # and one from a layer to a kernel
    graph["layers.gemm"] = graph["layers.gemm"] | {"kernels.upcast"}
    assert _room_violations(graph) == ["layers.gemm imports kernels.upcast"]


def _imports(tree: ast.AST, module: str) -> set[str]:
    """The ``mpcourse.core.quant`` modules (as ``room.name`` or ``name`` relative to the package) that ``tree``
    (the source of ``module``) imports, anywhere in it, function-level imports included."""
    package = "mpcourse.core.quant"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[:-node.level]
                base = ".".join(parts + ([base] if base else []))
            if base == package or base.startswith(package + "."):
                rel = base[len(package) + 1:]
                for a in node.names:   # `from pkg import sub` names a submodule where there is one
                    sub = f"{rel}.{a.name}" if rel else a.name
                    out.add(sub if sub in MODULES else rel)
        elif isinstance(node, ast.Import):
            out |= {a.name[len(package) + 1:] for a in node.names if a.name.startswith(package + ".")}
    return {m for m in out if m in MODULES}


#: every module of the package, as ``room.name`` (``rules.tensor``) or ``name`` (``engine``), rooms' __init__ aside
MODULES = {str(p.relative_to(PACKAGE).with_suffix("")).replace("/", "."): p
           for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"}
#: what each room may not import: a rule no kernel, layer, engine or recipe; a kernel no layer or engine; a layer
#: no kernel (it takes rule or kernel from what the engine bound)
FORBIDDEN_ROOMS = {"rules": ("kernels.", "layers.", "engine", "region", "recipe", "block_recipes"),
                   "kernels": ("layers.", "engine", "region"),
                   "layers": ("kernels.",)}


def _graph() -> dict[str, set[str]]:
    return {m: _imports(ast.parse(p.read_text()), f"mpcourse.core.quant.{m}") - {m} for m, p in MODULES.items()}


def _room_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
            if m.split(".")[0] in FORBIDDEN_ROOMS and t.startswith(FORBIDDEN_ROOMS[m.split(".")[0]])]


def test_the_rooms_are_there():
    rooms = {m.split(".")[0] for m in MODULES if "." in m}
    assert rooms == {"rules", "kernels", "layers"}
    for rule in ("tensor", "delayed", "scaled", "blockwise", "mx", "nvfp4", "hadamard"):
        assert f"rules.{rule}" in MODULES
    assert KERNEL_MODULES - {"engine"} <= set(MODULES)


def test_rules_import_no_kernel_or_layer_and_kernels_no_layer():
    assert not _room_violations(_graph()), "\n".join(_room_violations(_graph()))


def test_no_rule_module_imports_a_kernel_module_or_the_engine():
    graph = _graph()
    for m in RULE_MODULES:
        assert not graph[m] & KERNEL_MODULES, f"{m} imports {graph[m] & KERNEL_MODULES}"


def test_the_package_has_no_import_cycle():
    graph, state = _graph(), {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", "import cycle: " + " -> ".join(path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


RECIPES = [quant.DelayedScaling, quant.Float8CurrentScaling, quant.Float8RowwiseScaling, quant.Float8BlockScaling,
           quant.MXFP8BlockScaling, quant.NVFP4BlockScaling]


@pytest.mark.parametrize("cls", RECIPES, ids=lambda c: c.__name__)
def test_recipes_are_configuration(cls):
    assert issubclass(cls, quant.Recipe) and dataclasses.is_dataclass(cls)
    assert not [f.name for f in dataclasses.fields(cls) if f.name.endswith("_fn")]
    # no behaviour: at most ``refusal``, which field settings the lesson's functions do not follow
    methods = {n for n, v in vars(cls).items() if callable(v) and not n.startswith("__")}
    assert methods <= {"refusal"}, f"{cls.__name__} has methods {methods}"
    assert [f.name for f in dataclasses.fields(cls) if f.kw_only] == ["functions"]   # the learner's, keyword only
    for name in cls.TAKES:   # the exercise's names
        assert name in {"compute_scale", "quantize", "update", "block_quantize", "mx_shared_exponent", "nvfp4_scales",
                        "pad_token_groups", "unpad_token_groups", "group_scales"}


def test_a_non_recipe_is_refused_naming_every_recipe():
    with pytest.raises(TypeError) as e:
        quant.Float8Linear(16, 16, recipe="delayed")
    for cls in RECIPES:
        assert cls.__name__ in str(e.value) or cls is quant.Float8CurrentScaling


def _spread(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 3e4])
    x[1:17, 16:48] = 0.0                                          # all-zero blocks
    return x


BLOCK = [quant.Float8RowwiseScaling(), quant.Float8BlockScaling(), quant.MXFP8BlockScaling(),
         quant.MXFP8BlockScaling(scale_rule="floor", fp8_format=quant.Format.HYBRID), quant.NVFP4BlockScaling(),
         quant.NVFP4BlockScaling(disable_2d_quantization=True)]


def _bits(st):
    t = st.tensor_scale_inv
    return (st.data.view(torch.uint8), st.scale_inv.float().view(torch.int32),
            None if t is None else t.reshape(1).view(torch.int32))


@pytest.mark.parametrize("recipe", BLOCK, ids=repr)
def test_block_kernels_equal_the_rules_through_the_engine(recipe):
    fast, rules = engine.quantizers(recipe, kernels=True), engine.quantizers(recipe, kernels=False)
    assert not rules["input"].backend.kernels and fast["input"].backend.kernels
    for x in (_spread((256, 256), 1), _spread((128, 384), 2).bfloat16()):
        for role in ("input", "weight", "grad_output"):
            for axis, wgrad in ((1, False), (0, True)):
                torch.manual_seed(5)
                a = fast[role](x, axis, wgrad)
                torch.manual_seed(5)
                b = rules[role](x, axis, wgrad)
                assert b.dequantized is None
                for u, v in zip(_bits(a), _bits(b)):
                    assert (u is None and v is None) or torch.equal(u, v), (role, axis)
                if a.dequantized is not None:                   # the kernel's kept copy: the rule's dequantization
                    d, r = a.dequantized, b.dequantize(torch.float32)
                    assert torch.equal(d.isnan(), r.isnan())
                    assert torch.equal(d.nan_to_num(0.0).view(torch.int32), r.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("recipe", [quant.Float8CurrentScaling(), quant.DelayedScaling(amax_history_len=4),
                                    quant.Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3)], ids=repr)
def test_per_tensor_kernels_equal_the_rules_through_the_engine(recipe):
    fast, rules = engine.quantizers(recipe, kernels=True), engine.quantizers(recipe, kernels=False)
    assert not rules["input"].backend.kernels and fast["input"].backend.kernels
    for x in (_spread((64, 256), 3), _spread((64, 256), 4).reshape(4, 16, 256), _spread((32, 64), 5).bfloat16()):
        for role in ("input", "grad_output"):
            for _ in range(2):                                  # delayed: a second cast with the updated scale
                a, b = fast[role](x, True), rules[role](x, True)
                assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                assert torch.equal(a.scale_inv.view(torch.int32), b.scale_inv.view(torch.int32))
