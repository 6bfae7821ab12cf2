"""The package's three layers import one way: the library (``mpcourse.core``) never imports the
experiment or the course tooling. Read from the source, so a lazy import inside a function counts."""
import ast
from pathlib import Path

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
    f = PKG / "core" / "quant" / "linear.py"
    assert "mpcourse.core.quant.gemm" in _imports(f)
