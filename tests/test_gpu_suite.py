"""The prepared GPU suite (benchmarks/gpu_suite.py) in its CPU dry run, so it cannot rot between GPU sessions.

The dry run goes through every section with tiny shapes (torch.compile with the "eager" backend), the
pytest section on a two-test file written here (one GPU-marked test that passes, one that skips without
CUDA), and must write one JSON and one markdown file naming every FP8 recipe the library has.
"""
import importlib.util
import json
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def suite_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_suite", os.path.join(ROOT, "benchmarks", "gpu_suite.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow                                           # runs every section on the CPU, torch.compile included
def test_dry_run_writes_every_section(suite_module, tmp_path):
    tests = tmp_path / "test_tiny_gpu.py"
    tests.write_text(textwrap.dedent("""
        import pytest, torch

        @pytest.mark.gpu
        def test_runs():
            assert True

        @pytest.mark.gpu
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        def test_needs_cuda():
            assert False

        def test_not_gpu_marked():
            assert False
    """))
    out = tmp_path / "out"
    assert suite_module.main(["--dry-run", "--out", str(out), "--tests-path", str(tests), "--budget-s", "300"]) == 0
    res = json.loads((out / "gpu_suite.json").read_text())
    md = (out / "gpu_suite.md").read_text()
    meta = res["meta"]
    assert meta["dry_run"] and meta["complete"] and not meta["errors"] and not meta["skipped_sections"]
    t = res["tests"]
    assert (t["tests"], t["passed"], t["skipped"], t["failures"]) == (2, 1, 1, 0)  # -m gpu deselects the third
    assert "-m gpu" in t["command"] and "addopts=" in t["command"]  # no nbval needed
    assert t["returncode"] == 0
    recipes = list(suite_module.bench.fp8_recipes())
    assert {"fp8-current", "fp8-delayed"} <= set(recipes)
    for section in ("linear", "linear_compile"):
        impls = [r["impl"] for r in res[section]]
        assert impls[0].startswith("bf16 nn.Linear")
        for name in recipes:
            assert any(f"({name})" in i for i in impls), (section, name)
        assert all("error" not in r and r["tflops"] > 0 for r in res[section])
    # against BF16, same weights: FP8 (3 mantissa bits, half-ulp 2^-4) well under 0.1; NVFP4's E2M1 has one
    # mantissa bit (half-ulp 2^-2 relative), so its layer error is larger but still under that bound
    for r in res["linear"]:
        assert r["rel_err_vs_bf16"] < (0.25 if "NVFP4" in r["impl"] else 0.1), r["impl"]
    train = {r["recipe"]: r for r in res["train"]}
    for name in ("fp32", "bf16-autocast", "torch-amp-bf16", *[n for n in recipes if n.startswith("fp8")]):
        assert name in train and "error" not in train[name] and train[name]["finite"]
    assert any(r["kind"].startswith("bf16") and r["tflops"] > 0 for r in res["gemm"])
    assert meta["bf16_ceiling_tflops"] > 0
    assert "Dry run" in md and "| fp8-delayed |" in md and "torch.compile" in md


def test_budget_stops_sections_and_still_writes(suite_module, tmp_path):
    out = tmp_path / "out"
    assert suite_module.main(["--dry-run", "--out", str(out), "--budget-s", "1"]) == 0
    res = json.loads((out / "gpu_suite.json").read_text())
    assert set(res["meta"]["skipped_sections"]) == {"tests", "gemm", "linear", "train", "linear_compile"}
    assert res["env"]["torch"] and not res["linear"]


def test_junit_parsing_counts_failures(suite_module, tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="boom">x</failure></testcase>'
                   '<testcase classname="a" name="err"><error message="E">x</error></testcase>'
                   '<testcase classname="a" name="s"><skipped message="no"/></testcase></testsuite></testsuites>')
    got = suite_module.parse_junit(str(xml))
    assert (got["tests"], got["passed"], got["failures"], got["errors"], got["skipped"]) == (4, 1, 1, 1, 1)
    assert got["failed_tests"] == ["a::bad [failure] boom", "a::err [error] E"]
