"""Which layers a quantized recipe hurts most, measured on the course's GPT (``mpcourse rank-layers``).

Trains the ``fp32`` row for ``steps`` steps (0: the FP32 initialisation), then, on one fixed validation batch,
quantizes one block linear at a time with a recipe's quantization (``nvfp4`` by default) and ranks the layers by
how far the step's gradients move from FP32 (``mpcourse.core.inspect.layer_sensitivity``). The measurement behind
``nvfp4-selective``'s choice of the last block: NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) keeps mostly
the last blocks in BF16. Run as ``python -m mpcourse.experiment.ablations.sensitivity --steps 80 --out FILE.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mpcourse.core import quant
from mpcourse.core.inspect import layer_sensitivity
from ..gpt.data import load_corpus
from ..recipes import get_recipe
from ..recipes.fp8 import keep_linear_in_fp8
from ..training.train import TrainConfig, Trainer


def rank_layers(recipe: str = "nvfp4", steps: int = 80, batch_size: int = 16, seed: int = 0, corpus=None) -> dict:
    """{"recipe", "steps", "batch_size", "seed", "ranking": layer_sensitivity rows} for the GPT after ``steps``
    FP32 steps (``TrainConfig`` defaults otherwise) on one validation batch of ``batch_size`` sequences."""
    qrecipe = getattr(get_recipe(recipe), "fp8_recipe", None)
    if qrecipe is None:
        raise ValueError(f"recipe {recipe!r} does not quantize linear layers: pick one such as nvfp4, mxfp8, "
                         "fp8-current")
    corpus = corpus or load_corpus()
    cfg = TrainConfig(steps=max(steps, 1), batch_size=batch_size, seed=seed)
    trainer = Trainer("fp32", corpus, cfg)
    if steps:
        trainer.run(steps)
    model = trainer.recipe.model
    x, y = corpus.batch("val", batch_size, cfg.model.block_size, torch.Generator().manual_seed(seed))  # (B, T)
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and keep_linear_in_fp8(m, n)]

    def quantize_only(m, fqn):
        return quant.convert_to_float8_training(m, module_filter_fn=lambda _, f: f == fqn, recipe=qrecipe)

    rows = layer_sensitivity(model, lambda m: m(x, y)[1], layers, quantize_only,
                             context=lambda: quant.autocast(enabled=True, recipe=qrecipe), seed=seed)
    return {"recipe": recipe, "steps": steps, "batch_size": batch_size, "seed": seed, "ranking": rows}


def block_means(ranking: list[dict], key: str = "grad_error") -> dict[int, float]:
    """The mean of ``key`` over each block's linears: {block index: mean}, in block order."""
    by = {}
    for r in ranking:
        i = quant.block_index(r["layer"])
        if i is not None:
            by.setdefault(i, []).append(r[key])
    return {i: sum(v) / len(v) for i, v in sorted(by.items())}


def format_ranking(result: dict, top: int | None = None) -> str:
    """The ranking as a text table (errors to 3 significant digits), then the mean per block."""
    lines = [f"{result['recipe']} one layer at a time vs fp32, after {result['steps']} FP32 steps "
             f"(batch {result['batch_size']}, seed {result['seed']}); largest gradient error first",
             f"{'layer':22s} {'grad err':>9s} {'wgrad err':>9s} {'out err':>9s} {'|dloss|':>9s}"]
    for r in result["ranking"][:top]:
        lines.append(f"{r['layer']:22s} {r['grad_error']:9.3g} {r['weight_grad_error']:9.3g} "
                     f"{r['output_error']:9.3g} {r['loss_delta']:9.2g}")
    lines.append("mean gradient error per block: " + ", ".join(
        f"{i}: {v:.3g}" for i, v in block_means(result["ranking"]).items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcourse.experiment.ablations.sensitivity", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the ranking as JSON here")
    a = p.parse_args(argv)
    if a.steps < 0 or a.batch_size < 1:
        p.error("--steps must be >= 0 and --batch-size >= 1")
    try:
        res = rank_layers(a.recipe, a.steps, a.batch_size, a.seed)
    except (KeyError, ValueError) as e:
        p.error(str(e).strip("'\""))
    print(format_ranking(res))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
