"""The long lane names real tests: every prefix in ``conftest.LONG`` is a folder, a module or a test function that
exists (a renamed test would otherwise leave the lane silently and land back in the README's test command)."""
import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


@pytest.mark.parametrize("prefix", conftest.LONG)
def test_each_long_prefix_names_something_that_exists(prefix):
    path, _, name = prefix.partition("::")
    assert (ROOT / path).exists(), f"conftest.LONG: {path} does not exist"
    if name:
        tree = ast.parse((ROOT / path).read_text())
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"conftest.LONG: no test {name} in {path}"


def test_ci_runs_the_readmes_two_commands_and_the_long_lane():
    """``.ci/run`` calls the README's main job and test command as the README writes them, then the long lane."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```bash")[1:]]
    lines = [line for b in blocks for line in b.splitlines()]
    commands = [line.split("#", 1)[0].strip() for line in lines if line.startswith("pip install -e")][:2]
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert len(commands) == 2 and all(c in ci for c in commands), (commands, ".ci/run")
    assert 'pytest -n auto -m "not long"' in commands[1] and "pytest -n auto -m long" in ci
