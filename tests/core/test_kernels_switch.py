"""The library's switch between kernels and rules (``mpcourse.core.kernels_switch``): ``MPCOURSE_FUSED`` read once,
in one module; an explicit choice and ``flags`` blocks for code that builds both ways in one process.

* Precedence: an explicit ``kernels`` beats the innermost ``flags`` block, which beats the environment at import;
  a block restores the choice when it ends, also on an exception; anything but a bool is refused.
* The quantizers (``quant.engine``) and the loss scalers (``scaling``) both bind from it.
* No module but ``kernels_switch`` names the environment variable in code (docstrings aside).
* In a fresh process ``MPCOURSE_FUSED=0`` binds the rules everywhere, leaves numba unimported and the kernels'
  compiled passes off (``quant.kernels.jit``); the variable set after the import changes nothing.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpcourse
from mpcourse.core import kernels_switch
from mpcourse.core.quant import CurrentScaling, MXFP8BlockScaling, engine
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler, check, dynamic, fused

PKG = Path(mpcourse.__file__).resolve().parent


def test_an_explicit_choice_beats_the_innermost_block_which_beats_the_environment():
    assert kernels_switch.enabled() is kernels_switch.ENABLED
    with kernels_switch.flags(enabled=False):
        assert kernels_switch.enabled() is False
        assert kernels_switch.enabled(True) is True
        with kernels_switch.flags(enabled=True):
            assert kernels_switch.enabled() is True and kernels_switch.enabled(False) is False
        assert kernels_switch.enabled() is False
    assert kernels_switch.enabled() is kernels_switch.ENABLED


def test_a_block_ends_on_an_exception_and_only_bools_are_taken():
    with pytest.raises(RuntimeError, match="inside"):
        with kernels_switch.flags(enabled=not kernels_switch.ENABLED):
            raise RuntimeError("inside")
    assert kernels_switch.enabled() is kernels_switch.ENABLED
    for bad in ("0", 0, None):
        with pytest.raises(TypeError, match="True or False"):
            with kernels_switch.flags(enabled=bad):
                pass
    with pytest.raises(TypeError, match="True, False or None"):
        kernels_switch.enabled("0")
    with pytest.raises(TypeError, match="True, False or None"):
        engine.quantizers(CurrentScaling(), kernels="0")


@pytest.mark.parametrize("on", [True, False])
def test_quantizers_and_scalers_bind_from_the_switch(on):
    with kernels_switch.flags(enabled=on):
        q = engine.quantizers(MXFP8BlockScaling())
        dyn, static = DynamicLossScaler(), StaticLossScaler(2.0 ** 8)
    assert all(quantizer.backend.kernels is on for quantizer in q.values())
    assert engine.quantizers(MXFP8BlockScaling(), kernels=on)["input"].backend.kernels is on
    unscale = fused.check_and_unscale_ if on and fused.HAS_FUSED_UNSCALE else check.check_and_unscale_
    update = dynamic._by_kernel if on and fused.HAS_FUSED_UPDATE else dynamic._by_rule
    assert dyn._check_and_unscale_ is unscale and static._check_and_unscale_ is unscale
    assert dyn._update_step is update


def _names_the_variable(path: Path) -> bool:
    """Whether ``path``'s code holds the string "MPCOURSE_FUSED" itself (a docstring that mentions it does not)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Constant) and n.value == kernels_switch.ENV for n in ast.walk(tree))


def test_only_the_switch_module_names_the_environment_variable():
    readers = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if _names_the_variable(p))
    assert readers == ["core/kernels_switch.py"], readers
    planted = PKG / "core" / "kernels_switch.py"                      # the check can fail: the module itself is seen
    assert _names_the_variable(planted)


CHILD = """
import json, os, sys
from mpcourse.core import kernels_switch
from mpcourse.core.quant import CurrentScaling, NVFP4BlockScaling, engine
from mpcourse.core.quant.kernels import jit
from mpcourse.core.scaling import DynamicLossScaler, check
os.environ["MPCOURSE_FUSED"] = "1"                              # too late: read once, at import
s = DynamicLossScaler()
print(json.dumps({
    "enabled": kernels_switch.ENABLED, "numba": "numba" in sys.modules, "available": jit.AVAILABLE,
    "compiled": jit.COMPILED,
    "quantizers": [q.backend.kernels for r in (CurrentScaling(), NVFP4BlockScaling())
                   for q in engine.quantizers(r).values()],
    "unscale_rule": s._check_and_unscale_ is check.check_and_unscale_,
}))
"""


def test_mpcourse_fused_0_in_a_fresh_process_binds_the_rules_everywhere():
    env = {**os.environ, "MPCOURSE_FUSED": "0", "PYTHONPATH": str(PKG.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"enabled": False, "numba": False, "available": False, "compiled": False,
                   "quantizers": [False] * 8, "unscale_rule": True}, got
