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

A run that diverges (``--setting diverge``): ``fp8-attention`` (lesson 14's FP8 attention and FP8 linears, all
under delayed scaling, amax history 16) on a 2-block GPT with AdamW at lr 0.3, 100x the default, and no gradient
clipping. At that rate the activations grow several-fold in one step during the first steps, the instability of
large learning rates that Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322) reproduce in small models and Dehghani et al. 2023 (arXiv 2302.05442) met at
22B parameters (attention logits growing; neither paper uses FP8). A delayed scale is the amax of earlier steps,
so a tensor that outgrows it is clipped at the E4M3 maximum (448): on step 2, 64% of blocks.1's Q (seed 0) and
up to 89% of an ``attn.proj`` input saturate. FP32 spikes too (to 10.5 on step 6, seed 0) and recovers;
fp8-attention's loss, after the same early spikes, climbs in the second half of the run to 16.5 (seed 0, step 28;
seeds 1, 2: 12.8, 16.7), 3.5x the untrained model's 4.66, and is still at 6.84 (seeds 1, 2: 5.82, 6.60) at the
end, when the cosine schedule has brought the rate down to 0.03. The same linears in FP8 without FP8 attention
(``fp8-delayed``) recover as FP32 does (final 3.2-3.4, seeds 0, 1), so it is the attention's tensors that break
the run; which of them (Q and K clipped change the logits, V and O the output) is not isolated here. Chaotic at
this rate, the trajectories differ from one CPU's FP32 GEMMs to another's; the blow-up does not (forced AVX2,
seeds 0, 1: peaks 15.2 and 12.9, though seed 0 comes back to 4.6 by the end).

With ``--autoswitch saturation=0.01`` (TE's AutoswitchGemm checks a statistic of each tensor against a threshold;
saturation is the course's: underflow would condemn every tensor on step 0, where delayed scaling casts with scale
1) each attention whose tensor clips more than 1% of its elements computes in FP32 from the next step, with the
linears whose inputs clip (``attn.proj``, ``mlp.proj``): six events on steps 1 and 2, the first "step 1:
blocks.0.attn.core_attention -> high precision (V saturation 0.0356 > 0.01)" (seed 0); final train / validation
loss 3.52 / 3.91, 3.48 / 3.31, 3.63 / 3.60 (seeds 0, 1, 2) against FP32's 3.39 / 3.55, 3.26 / 3.30, 3.71 / 3.64
and fp8-attention's 6.84 / 8.21, 5.82 / 5.69, 6.60 / 6.04 (``notebooks/data/14/autoswitch-divergence.json``).
Switching the linears alone does not rescue it (``saturation=0.01,attention=off``, seeds 0, 1: peaks 16.6 and 11.4
in the second half, final 5.0 and 6.7): the attention's switch does.

    python -m mpcourse.experiment.ablations.autoswitch [--steps 80] [--seeds 0] [--out notebooks/data/14]
    python -m mpcourse.experiment.ablations.autoswitch --setting diverge --steps 40 --seeds 0,1,2

write OUT/autoswitch.json and OUT/autoswitch-divergence.json: per run its losses, final losses and the switch
events (step, layer, role, statistic, value, threshold).
"""
from __future__ import annotations

from dataclasses import replace

from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.recipes import OptimConfig, get_recipe
from mpcourse.experiment.training.train import Trainer
from .common import AblationConfig, run_one
from .outlier_channels import PLANTED, RATIO, plant_outliers

RULES = "underflow=0.05"            # TE's example threshold: 5% of the nonzero elements quantized to zero
RUNS = (("fp32", None), ("fp8-current", None), ("fp8-current", RULES))

DIVERGE_RULES = "saturation=0.01"   # 1% of a tensor's elements clipped at the FP8 maximum by a stale delayed scale
DIVERGE_RUNS = (("fp32", None), ("fp8-attention", None), ("fp8-attention", DIVERGE_RULES))
DIVERGE_LR = 0.3                    # 100x the default 3e-3: FP32 spikes and recovers
DIVERGE_OPTIM = OptimConfig(lr=DIVERGE_LR, grad_clip=0.0)
DIVERGE_MODEL = GPTConfig(n_layer=2)


def switching_trainer(rules: str, box: dict):
    """A ``Trainer`` class whose ``wrap`` turns the switch on (``Trainer.switching``) after the recipe (and the
    plant) are built, so that the inspector's hooks run after the plant's; the trainer lands in ``box``."""
    class SwitchingTrainer(Trainer):
        @classmethod
        def wrap(cls, *args, **kwargs):
            trainer = super().wrap(*args, **kwargs)
            trainer.switching(rules)                                  # the spec, its options included
            trainer.autoswitch.echo = None
            box["trainer"] = trainer
            return trainer
    return SwitchingTrainer


def switch_run(recipe: str, rules, acfg: AblationConfig, *, prepare=None, optim=None, model_cfg=None,
               corpus=None) -> list[dict]:
    """``recipe`` on the GPT (``model_cfg``, default ``GPTConfig()``) over ``acfg``'s seeds, ``prepare(recipe)``
    applied once it is built (e.g. the plant), the optimizer ``optim`` (default ``OptimConfig()``), the switch on
    where ``rules`` (e.g. "underflow=0.05"); each run's record has ``recipe`` and ``autoswitch``, its events."""
    cls = get_recipe(recipe)

    def make(model, opt):
        r = cls(model, opt)
        if prepare is not None:
            prepare(r)
        return r

    label = recipe + (f" --autoswitch {rules}" if rules else "")
    out = []
    for seed in acfg.seeds:
        box = {}
        cfg = acfg.train_config(seed, optim)
        cfg = cfg if model_cfg is None else replace(cfg, model=model_cfg)
        run = run_one(label, make, cfg, corpus=corpus, model_cfg=model_cfg,
                      trainer_cls=switching_trainer(rules, box) if rules else Trainer)
        out.append({**run, "recipe": recipe, "autoswitch": box["trainer"].autoswitch.events if rules else []})
    return out


def planted_run(recipe: str, rules, acfg: AblationConfig, ratio: float = RATIO, model_cfg=None, corpus=None) -> list[dict]:
    """``switch_run`` with the outlier channels planted (``plant_outliers(model, ratio)``)."""
    return switch_run(recipe, rules, acfg, prepare=lambda r: plant_outliers(r.model, ratio), model_cfg=model_cfg,
                      corpus=corpus)


def diverging_run(recipe: str, rules, acfg: AblationConfig, corpus=None) -> list[dict]:
    """``switch_run`` in the divergence setting: the 2-block GPT (``DIVERGE_MODEL``), AdamW at ``DIVERGE_LR`` with
    no gradient clipping (``DIVERGE_OPTIM``), nothing planted."""
    return switch_run(recipe, rules, acfg, optim=DIVERGE_OPTIM, model_cfg=DIVERGE_MODEL, corpus=corpus)


def run(acfg: AblationConfig, ratio: float = RATIO) -> dict:
    runs = [r for recipe, rules in RUNS for r in planted_run(recipe, rules, acfg, ratio)]
    return {"ablation": "autoswitch", "plant": "outlier channels", "ratio": ratio,
            "planted": [f"blocks.*.{n}" for n in PLANTED], "rules": RULES, "runs": runs}


def run_diverge(acfg: AblationConfig) -> dict:
    runs = [r for recipe, rules in DIVERGE_RUNS for r in diverging_run(recipe, rules, acfg)]
    return {"ablation": "autoswitch", "setting": "diverge", "model": {"n_layer": DIVERGE_MODEL.n_layer},
            "optim": {"lr": DIVERGE_OPTIM.lr, "grad_clip": DIVERGE_OPTIM.grad_clip}, "rules": DIVERGE_RULES,
            "runs": runs}


SETTINGS = {"outliers": ("autoswitch.json", lambda acfg: run(acfg)),
            "diverge": ("autoswitch-divergence.json", lambda acfg: run_diverge(acfg))}


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations.autoswitch")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--out", default="notebooks/data/14")
    p.add_argument("--setting", choices=tuple(SETTINGS), default="outliers",
                   help="outliers: planted outlier channels, fp8-current (autoswitch.json); diverge: fp8-attention "
                        f"at lr {DIVERGE_LR:g} without clipping (autoswitch-divergence.json)")
    a = p.parse_args(argv)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, e.g. 0,1; got {a.seeds!r}")
    if a.steps < 1:
        p.error(f"--steps must be >= 1; got {a.steps}")
    name, build = SETTINGS[a.setting]
    result = build(AblationConfig(steps=a.steps, seeds=seeds))
    setting = "" if a.setting == "outliers" else f" --setting {a.setting}"
    result["command"] = (f"python -m mpcourse.experiment.ablations.autoswitch{setting} --steps {a.steps} "
                         f"--seeds {a.seeds}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
