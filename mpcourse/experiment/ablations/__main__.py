"""``python -m mpcourse.experiment.ablations NAME``: run one ablation and write OUT/NAME.json."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import ABLATIONS, get_ablation
from .common import AblationConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations", description=__doc__)
    p.add_argument("name", choices=list(ABLATIONS))
    p.add_argument("--steps", type=int, default=AblationConfig.steps)
    p.add_argument("--batch-size", type=int, default=AblationConfig.batch_size)
    p.add_argument("--seeds", default=",".join(map(str, AblationConfig.seeds)), help="comma-separated, e.g. 0,1")
    p.add_argument("--out", default="notebooks/data/11", help="output folder (default notebooks/data/11)")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, e.g. 0,1; got {a.seeds!r}")
    acfg = AblationConfig(steps=a.steps, batch_size=a.batch_size, seeds=seeds)
    t0 = time.perf_counter()
    result = get_ablation(a.name)(acfg)
    result["config"] = {**asdict(acfg), "model": "GPTConfig() defaults", "corpus": "pydoc_data topics"}
    result["command"] = f"python -m mpcourse.experiment.ablations {a.name} --steps {a.steps} " \
                        f"--batch-size {a.batch_size} --seeds {a.seeds}"
    result["torch"] = torch.__version__
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{a.name}.json"
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path} ({len(result['runs'])} runs, {time.perf_counter() - t0:.0f} s, {platform.machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
