"""``mpcourse compare --nproc N --parallel ddp|fsdp|ep`` (or under torchrun): each recipe trained over processes
(``mpcourse.experiment.parallel.distributed``); rank 0 prints the table and writes the folder. ``--parallel ep``
(``--dispatch fp8|bf16|fp32``) takes the moe-* recipes only, with experts that split evenly over the processes, and
prints each rank's all-to-all bytes per step.
"""
from __future__ import annotations

import sys
import time

from mpcourse.core import emulation

from ..parallel.launcher import launcher_world_size
from .parser import refuse
from .out_folder import earlier_run, say_overwrite, where_line


def expert_parallel_error(recipes: list[str], ranks: int, torchrun: bool = False) -> str | None:
    """Why ``--parallel ep`` cannot run ``recipes`` over ``ranks`` processes (a recipe without experts, or experts that
    do not split evenly), or None."""
    from ..parallel.data_parallel import moe_experts

    dense = [name for name in recipes if not moe_experts(name)]
    if dense:
        return (f"--parallel ep splits the experts of the moe-* recipes over the ranks; {', '.join(dense)} "
                f"{'has' if len(dense) == 1 else 'have'} none: name only moe-* recipes with --recipes, or use "
                "--parallel ddp or fsdp")
    uneven = sorted({moe_experts(name) for name in recipes if moe_experts(name) % ranks})
    if uneven:
        who = f"the {ranks} processes torchrun started" if torchrun else f"--nproc {ranks}"
        return (f"--parallel ep needs the experts to split evenly, but {uneven[0]} experts per block do not divide "
                f"over {who}: use a number of processes that divides {uneven[0]}")
    return None


def compare_parallel(args, corpus, cfg, recipes, side: bool = False) -> int:
    """``compare --nproc N --parallel ddp|fsdp`` (or under torchrun): rank 0 prints and writes."""
    from ..parallel.distributed import Job, RankFailed, is_rank_zero, run_distributed_compare

    if args.parallel is None:
        return refuse("--nproc > 1 (or torchrun) needs --parallel ddp or --parallel fsdp (or ep, the moe-* recipes)")
    world = launcher_world_size()                  # torchrun's processes, checked as --nproc's would be
    ranks = world or args.nproc
    bad = expert_parallel_error(recipes, ranks, world is not None) if args.parallel == "ep" else None
    if bad:
        return refuse(bad)
    if cfg.batch_size % ranks:
        who = f"--nproc {ranks}" if world is None else f"the {ranks} processes torchrun started (WORLD_SIZE={ranks})"
        return refuse(f"--batch-size {cfg.batch_size} is not divisible by {who} (each rank trains on batch_size / "
                      f"nproc sequences; pick a multiple of {ranks})")
    if args.with_notebooks:                       # every rank loads them; check here that they load and fit
        from mpcourse.core.learner_table import OverrideRefused
        from ..learner import LearnerLoadError
        from .with_notebooks import exercise_functions
        try:
            exercise_functions(args.with_notebooks, recipes, args.parallel)
        except (LearnerLoadError, OverrideRefused) as e:
            return refuse(f"--with{':' * isinstance(e, OverrideRefused)} {e}")
    from ..parallel.data_parallel import unsupported
    refused = {name: unsupported(name, args.parallel) for name in recipes}
    if all(refused.values()):                        # nothing would run: say why instead of an empty table
        return refuse(f"--parallel {args.parallel} runs none of the recipes asked for: "
                      + "; ".join(f"{n}: {why}" for n, why in refused.items()))
    job = Job(recipes=recipes, corpus=corpus, cfg=cfg, out=args.out, parallel=args.parallel,
              reduce_dtype=args.reduce_dtype, progress=not args.no_progress, timeout_s=args.dist_timeout,
              fp8_all_gather=args.fp8_all_gather, learner_notebooks=tuple(str(nb) for nb in args.with_notebooks),
              dispatch=getattr(args, "dispatch", None) or "fp8")
    talk = is_rank_zero()
    if talk:
        print(f"corpus: {corpus.name}, {len(corpus.text):,} chars, vocab {corpus.vocab_size}")
        print(f"recipes: {', '.join(recipes)}; {cfg.steps} steps x {cfg.batch_size} x {cfg.model.block_size} tokens, "
              f"--parallel {args.parallel} over {ranks} gloo processes{' (torchrun)' * (world is not None)}, "
              f"reduce dtype {args.reduce_dtype or 'default'}"
              f"{f', dispatch {job.dispatch}' * (args.parallel == 'ep')}; bytes per parameter are per rank")
        print(where_line(args.out, side))
        print(f"tensor cores: {emulation.status()}")
    earlier = earlier_run(args.out)
    t0 = time.time()
    try:
        results = run_distributed_compare(job, args.nproc)
    except RankFailed as e:
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        if e.results:
            print(f"mpcourse compare: the {len(e.results)} finished rows are in {args.out / 'results.json'} (its "
                  f"\"failed\" list names {', '.join(f['recipe'] for f in e.failed)})", file=sys.stderr)
            say_overwrite(args.out, earlier)
        return 1
    if talk and results:
        print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'} ({time.time() - t0:.0f} s)")
        say_overwrite(args.out, earlier)
    elif talk:
        print(f"no recipe ran under --parallel {args.parallel}: nothing written ({args.out}/ keeps what it held)")
    return 0
