"""The package's three layers import one way: the library (``mpcourse.core``) never imports the
experiment or the course tooling. Read from the source, so a lazy import inside a function counts. No function in
the package is over 60 lines."""
import ast
from pathlib import Path

import pytest

import mpcourse

PKG = Path(mpcourse.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
    return out


def test_library_imports_neither_experiment_nor_course():
    offenders = []
    for path in sorted((PKG / "core").rglob("*.py")):
        for name in _imports(path):
            if name.startswith(("mpcourse.experiment", "mpcourse.course")):
                offenders.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not offenders, "the library must not import the upper layers:\n" + "\n".join(offenders)


def test_experiment_does_not_import_course_tooling():
    offenders = [f"{p.relative_to(PKG.parent)} imports {n}"
                 for p in sorted((PKG / "experiment").rglob("*.py")) for n in _imports(p)
                 if n.startswith("mpcourse.course")]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_relative_imports(tmp_path):
    # the checker itself must catch `from ...experiment import x` written relatively
    f = PKG / "core" / "quant" / "layers" / "linear.py"
    assert "mpcourse.core.quant.layers.gemm" in _imports(f)


# ----------------------------------------------------------------------------------------------------------
# No import cycle, function-level imports included; rules never import their kernels
# ----------------------------------------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _module_edges(name: str) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (module level or inside a function).
    ``from pkg import sub`` is an edge to the submodule when ``pkg.sub`` is a module, else to ``pkg``."""
    out = set()
    for target in _imports(MODULES[name]):
        if target in MODULES:
            out.add(target)
    # `from pkg import name` yields both "pkg" and "pkg.name": keep the submodule where there is one
    out -= {t for t in out if any(o.startswith(t + ".") and o.rpartition(".")[0] == t for o in out)
            and not _imports_package_itself(name, t)}
    out.discard(name)
    return out


def _imports_package_itself(name: str, pkg: str) -> bool:
    """Whether ``name`` takes a non-module name from ``pkg`` (an edge to the package's ``__init__``)."""
    tree = ast.parse(MODULES[name].read_text())
    own_pkg = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_pkg.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            if target == pkg and any(f"{pkg}.{a.name}" not in MODULES for a in node.names):
                return True
        elif isinstance(node, ast.Import) and any(a.name == pkg for a in node.names):
            return True
    return False


def _graph() -> dict[str, set[str]]:
    return {m: set(_module_edges(m)) for m in MODULES}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    # and in the real graph: one function-level import added back from a module to one that imports it
    graph = _graph()
    m, t = next((m, t) for m in sorted(graph) for t in sorted(graph[m]) if t.startswith("mpcourse.core."))
    graph[t] = graph[t] | {m}
    assert [sorted({m, t})] == [c for c in _cycles(graph) if m in c]


def test_layers_never_import_a_kernel():
    """``mpcourse.core.quant.layers`` takes rule or kernel from what the engine bound (each quantizer's
    ``backend``), never from ``mpcourse.core.quant.kernels`` directly."""
    graph = _graph()
    layers = sorted(m for m in MODULES if m.startswith("mpcourse.core.quant.layers."))
    assert layers
    direct = [f"{m} imports {t}" for m in layers for t in sorted(graph[m])
              if t.startswith("mpcourse.core.quant.kernels")]
    assert not direct, "\n".join(direct)
    # the graph sees a layer's relative imports (gemm's `from ..backend import ...`), so a kernel's would show too
    assert "mpcourse.core.quant.backend" in graph["mpcourse.core.quant.layers.gemm"]


# (rule module, kernel module): the kernel imports the rule it equals, never the other way round (not even
# through other modules)
RULE_KERNEL_PAIRS = [
    ("mpcourse.core.scaling.update", "mpcourse.core.scaling.fused"),
    ("mpcourse.core.scaling.check", "mpcourse.core.scaling.fused"),
    ("mpcourse.core.emulation.rule", "mpcourse.core.emulation.kernel"),
]


def _reachable(graph, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("rule, kernel", RULE_KERNEL_PAIRS)
def test_no_rule_module_imports_its_kernel(rule, kernel):
    graph = _graph()
    assert rule in MODULES and kernel in MODULES
    assert kernel not in _reachable(graph, rule), f"{rule} imports {kernel}: a rule must not import its kernel"
    short = rule.rpartition(".")[2]
    assert f"{short}." in MODULES[kernel].read_text() or f"{short}.py" in MODULES[kernel].read_text(), \
        f"{kernel} should name the rule it equals bit for bit (module {rule})"


# the rules of the loss-scaling, BF16 and format lessons: plain functions, at most 30 lines of body
PLAIN_RULES = ["mpcourse.core.scaling:update_scale", "mpcourse.core.scaling:unscale_grads_",
               "mpcourse.core.scaling.check:check_and_unscale_", "mpcourse.core.bf16:stochastic_round_bf16",
               "mpcourse.core.bf16:kahan_add_", "mpcourse.core.formats:round_to",
               "mpcourse.core.quant.layers.fsdp_fp8:quantize_shard_for_all_gather",
               "mpcourse.core.quant.layers.fsdp_fp8:padded_shard_rows", "mpcourse.core.quant.layers.fsdp_fp8:pad_rows",
               # low-precision optimizer state (torchao's AdamWFp8 / AdamW8bit as rules)
               "mpcourse.core.optim.fp8:quantize_fp8_state", "mpcourse.core.optim.fp8:dequantize_fp8_state",
               "mpcourse.core.optim.int8:dynamic_map", "mpcourse.core.optim.int8:quantize_int8_state",
               "mpcourse.core.optim.int8:dequantize_int8_state", "mpcourse.core.optim.blockwise:adamw_step",
               "mpcourse.core.optim.moment_decay:second_moment_ratio",
               # the course's default second moment (sqrt(v), never 0 for a positive value) and its lesson table
               "mpcourse.core.optim.fp8:nonzero_fp8_codes", "mpcourse.core.optim.int8:nonzero_int8_codes",
               "mpcourse.core.optim.blockwise:quantize_second_moment",
               "mpcourse.core.optim.blockwise:dequantize_second_moment",
               "mpcourse.core.optim.moment_decay:stopped_gradient_steps",
               # a quantized moment under FSDP2: the whole tensor's blocks over each rank's rows
               "mpcourse.core.optim.shards:span_of", "mpcourse.core.optim.shards:to_blocks",
               "mpcourse.core.optim.shards:from_blocks", "mpcourse.core.optim.shards:block_amax",
               # experts in low precision: token grouping and one expert's three GEMMs (the dense rule per group)
               "mpcourse.core.experts.grouping:token_groups", "mpcourse.core.experts.grouping:group_tokens",
               "mpcourse.core.experts.grouping:pad_groups", "mpcourse.core.experts.grouping:unpad_groups",
               "mpcourse.core.experts.expert_gemms:quantizers_for", "mpcourse.core.experts.expert_gemms:forward",
               "mpcourse.core.experts.expert_gemms:dgrad", "mpcourse.core.experts.expert_gemms:wgrad",
               # expert parallelism: what a row becomes on the wire (DeepSeek-V3's FP8 dispatch)
               "mpcourse.core.experts.dispatch:encode", "mpcourse.core.experts.dispatch:decode",
               "mpcourse.core.experts.dispatch:round_trip", "mpcourse.core.experts.dispatch:bytes_per_row",
               # FP8 attention (TE fp8_dpa; cuDNN's FP8 SDPA reference): the products, the online softmax, both passes
               "mpcourse.core.attention.fp8_attention:fp8_matmul",
               "mpcourse.core.attention.fp8_attention:softmax_pv_blocks",
               "mpcourse.core.attention.fp8_attention:attention_forward",
               "mpcourse.core.attention.fp8_attention:attention_backward"]
KERNEL_WORDS = ("fused", "_amp_", "numba", "fastpath", "fast_path", "kernel", "hook")


@pytest.mark.parametrize("qualname", PLAIN_RULES)
def test_rules_are_plain_functions(qualname):
    import importlib
    import inspect
    import textwrap

    mod, name = qualname.split(":")
    fn = inspect.unwrap(getattr(importlib.import_module(mod), name))
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    docstring = isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    body = node.body[1:] if docstring else node.body
    src = source.splitlines()[body[0].lineno - 1: body[-1].end_lineno]      # the body, without the docstring
    code = [ln for ln in src if ln.strip() and not ln.strip().startswith("#")]
    assert 0 < len(code) <= 30, f"{qualname}: {len(code)} lines of body, at most 30"
    named = [w for w in KERNEL_WORDS if w in "\n".join(src).lower()]
    assert not named, f"{qualname} names {named}: a rule holds no kernel, fast path or hook"


# ----------------------------------------------------------------------------------------------------------
# Folders as well as modules: no cycle between folders; the experiment's folders import only downward
# ----------------------------------------------------------------------------------------------------------
def _folder(module: str) -> str:
    """The room a module stands in at folder scale: ``mpcourse.<layer>.<folder or top-level module>``."""
    parts = module.split(".")
    return ".".join(parts[:3])


def _folder_graph(graph=None) -> dict[str, set[str]]:
    graph = _graph() if graph is None else graph
    out: dict[str, set[str]] = {_folder(m): set() for m in graph}
    for m, targets in graph.items():
        out[_folder(m)] |= {_folder(t) for t in targets if _folder(t) != _folder(m)}
    return out


def test_no_import_cycle_between_folders():
    cycles = _cycles(_folder_graph())
    assert not cycles, "folders that import each other (through any of their modules):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_folder_check_finds_a_cycle_the_module_check_misses():
    # two modules in two folders, each importing a module of the other folder that imports nothing back
    graph = {"mpcourse.experiment.a.x": {"mpcourse.experiment.b.y"}, "mpcourse.experiment.b.y": set(),
             "mpcourse.experiment.b.z": {"mpcourse.experiment.a.w"}, "mpcourse.experiment.a.w": set()}
    assert not _cycles(graph)
    assert _cycles(_folder_graph(graph)) == [["mpcourse.experiment.a", "mpcourse.experiment.b"]]


def test_experiment_folders_import_only_downward():
    from mpcourse.experiment import FLOORS

    folders = _folder_graph()
    mine = sorted(f for f in folders if f.startswith("mpcourse.experiment."))
    unplaced = [f for f in mine if f.rpartition(".")[2] not in FLOORS]
    assert not unplaced, f"give each experiment folder a floor in mpcourse.experiment.FLOORS: {unplaced}"
    floor = {f: FLOORS[f.rpartition(".")[2]] for f in mine}
    up = [f"{a} (floor {floor[a]}) imports {b} (floor {floor[b]})"
          for a in mine for b in sorted(folders[a]) if b in floor and floor[b] >= floor[a]]
    assert not up, "imports that run back up (or across a floor):\n" + "\n".join(up)


# ----------------------------------------------------------------------------------------------------------
# No function over 60 lines (def line to last line, docstring included), read from the source
# ----------------------------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 60
#: functions allowed over the limit (none); the list may name only functions that are still long
#: (``test_the_long_function_allow_list_is_not_stale``), so it cannot go stale
LONG_FUNCTIONS_BEING_SPLIT: set[str] = set()


def _function_lengths(source: str, module: str) -> dict[str, int]:
    """``module:qualname`` -> lines (``end_lineno - lineno + 1``) of every function in ``source``, nested ones
    and methods included (``Class.method``, ``outer.inner``); the longest where a name is defined twice."""
    out: dict[str, int] = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    key = f"{module}:{qualname}"
                    out[key] = max(out.get(key, 0), child.end_lineno - child.lineno + 1)
                visit(child, qualname + ".")
            else:
                visit(child, prefix)                  # a def inside an if/try/with keeps its enclosing name

    visit(ast.parse(source), "")
    return out


def _long_functions() -> dict[str, int]:
    """Every function of the package over ``MAX_FUNCTION_LINES``, with its length."""
    lengths = {k: n for name, path in MODULES.items() for k, n in _function_lengths(path.read_text(), name).items()}
    return {k: n for k, n in lengths.items() if n > MAX_FUNCTION_LINES}


def test_no_function_over_60_lines():
    offenders = [f"{k}: {n} lines" for k, n in sorted(_long_functions().items(), key=lambda kv: -kv[1])
                 if k not in LONG_FUNCTIONS_BEING_SPLIT]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split them into small, named helpers):\n"
                           + "\n".join(offenders))


def test_the_long_function_allow_list_is_not_stale():
    done = sorted(LONG_FUNCTIONS_BEING_SPLIT - set(_long_functions()))
    assert not done, (f"no longer over {MAX_FUNCTION_LINES} lines (or gone): remove them from "
                      "LONG_FUNCTIONS_BEING_SPLIT:\n" + "\n".join(done))


def test_the_length_check_counts_nested_functions_and_methods():
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    source = (f"def short():\n{body}"                                       # 60 lines: allowed
              f"class C:\n    def method(self):\n{body.replace('    ', '        ')}        return 1\n"
              f"if True:\n    def outer():\n        def inner():\n{body.replace('    ', '            ')}"
              f"            return 2\n        return inner\n")
    lengths = _function_lengths(source, "m")
    assert lengths == {"m:short": 60, "m:C.method": 61, "m:outer.inner": 61, "m:outer": 63}
