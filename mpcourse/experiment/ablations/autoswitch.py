"""Lesson 14's inspector that acts: a run that fails in FP8, and the same run rescued by switching the layers the
inspector condemns to high precision (``mpcourse.core.autoswitch``, TE's ``AutoswitchGemm``).

The failure is lesson 09's outlier channels (``outlier_channels.plant_outliers``): in every block the inputs of
``attn.qkv`` and ``mlp.fc`` carry two channels 2^20 times larger than the other 126, the weights their GEMMs read
2^20 times smaller there, exact in FP32 (the FP32 run trains bit for bit as the unplanted model). Under per-tensor
current scaling (``fp8-current``) E4M3 flushes the 126 ordinary channels of each such input to zero (the
inspector's "run" underflow is 126/128 = 98.4%) and the two outlier columns of each weight as well: the ten layers'
GEMMs output their bias only, their weights get gradients that no forward can use, and the run stops learning
near step 25, its loss drifting back up while FP32's falls. With ``--autoswitch underflow=0.05`` the inspector sees
the underflow on step 0, the ten layers compute in high precision from step 1, and the run trains as FP32 does
while the other ten linear layers stay in FP8. Measured (the command below, seed 0, 80 steps of 8 x 64 characters
of the default GPT): final train / validation loss FP32 2.51 / 2.36, fp8-current 3.25 / 3.44, fp8-current with
the switch 2.50 / 2.36 (``notebooks/data/14/autoswitch.json``).

    python -m mpcourse.experiment.ablations.autoswitch [--steps 80] [--seeds 0] [--out notebooks/data/14]

writes OUT/autoswitch.json: per run its losses, final losses and the switch events (step, layer, role, statistic,
value, threshold).
"""
from __future__ import annotations

from dataclasses import replace

from mpcourse.core.autoswitch import parse_rules
from mpcourse.experiment.recipes import get_recipe
from mpcourse.experiment.training.train import Trainer
from .common import AblationConfig, run_one
from .outlier_channels import PLANTED, RATIO, plant_outliers

RULES = "underflow=0.05"            # TE's example threshold: 5% of the nonzero elements quantized to zero
RUNS = (("fp32", None), ("fp8-current", None), ("fp8-current", RULES))


def switching_trainer(rules: str, box: dict):
    """A ``Trainer`` class whose ``wrap`` turns the switch on (``Trainer.switching``) after the recipe (and the
    plant) are built, so that the inspector's hooks run after the plant's; the trainer lands in ``box``."""
    class SwitchingTrainer(Trainer):
        @classmethod
        def wrap(cls, *args, **kwargs):
            trainer = super().wrap(*args, **kwargs)
            trainer.switching(parse_rules(rules))
            trainer.autoswitch.echo = None
            box["trainer"] = trainer
            return trainer
    return SwitchingTrainer


def planted_run(recipe: str, rules, acfg: AblationConfig, ratio: float = RATIO, model_cfg=None, corpus=None) -> list[dict]:
    """``recipe`` on the GPT (``model_cfg``, default ``GPTConfig()``) with the outlier channels planted, over
    ``acfg``'s seeds, the switch on where ``rules`` (e.g. "underflow=0.05"); each run's record has ``autoswitch``,
    its events."""
    cls = get_recipe(recipe)

    def make(model, optim):
        r = cls(model, optim)
        plant_outliers(r.model, ratio)
        return r

    label = recipe + (f" --autoswitch {rules}" if rules else "")
    out = []
    for seed in acfg.seeds:
        box = {}
        cfg = acfg.train_config(seed)
        cfg = cfg if model_cfg is None else replace(cfg, model=model_cfg)
        run = run_one(label, make, cfg, corpus=corpus, model_cfg=model_cfg,
                      trainer_cls=switching_trainer(rules, box) if rules else Trainer)
        out.append({**run, "recipe": recipe, "autoswitch": box["trainer"].autoswitch.events if rules else []})
    return out


def run(acfg: AblationConfig, ratio: float = RATIO) -> dict:
    runs = [r for recipe, rules in RUNS for r in planted_run(recipe, rules, acfg, ratio)]
    return {"ablation": "autoswitch", "plant": "outlier channels", "ratio": ratio,
            "planted": [f"blocks.*.{n}" for n in PLANTED], "rules": RULES, "runs": runs}


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations.autoswitch")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--out", default="notebooks/data/14")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, e.g. 0,1; got {a.seeds!r}")
    if a.steps < 1:
        p.error(f"--steps must be >= 1; got {a.steps}")
    result = run(AblationConfig(steps=a.steps, seeds=seeds))
    result["command"] = f"python -m mpcourse.experiment.ablations.autoswitch --steps {a.steps} --seeds {a.seeds}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoswitch.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
