"""``mpcourse compare --nproc N --parallel ddp|fsdp`` (or under torchrun): each recipe trained over processes
(``mpcourse.experiment.parallel.distributed``); rank 0 prints the table and writes the folder.
"""
from __future__ import annotations

import sys
import time

from mpcourse.core import emulation

from .out_folder import earlier_run, say_overwrite, where_line


def compare_parallel(args, corpus, cfg, recipes, side: bool = False) -> int:
    """``compare --nproc N --parallel ddp|fsdp`` (or under torchrun): rank 0 prints and writes."""
    from ..parallel.distributed import Job, RankFailed, is_rank_zero, run_distributed_compare

    if args.parallel is None:
        print("mpcourse compare: error: --nproc > 1 (or torchrun) needs --parallel ddp or --parallel fsdp",
              file=sys.stderr)
        return 2
    nproc = args.nproc
    if cfg.batch_size % max(nproc, 1):
        print(f"mpcourse compare: error: --batch-size {cfg.batch_size} is not divisible by --nproc {nproc} "
              "(each rank trains on batch_size / nproc sequences)", file=sys.stderr)
        return 2
    if args.with_notebooks:                       # every rank loads them; check here that they load and fit
        from mpcourse.core.learner_table import OverrideRefused
        from ..learner import LearnerLoadError
        from .with_notebooks import exercise_functions
        try:
            exercise_functions(args.with_notebooks, recipes, args.parallel)
        except (LearnerLoadError, OverrideRefused) as e:
            print(f"mpcourse compare: error: --with{':' * isinstance(e, OverrideRefused)} {e}", file=sys.stderr)
            return 2
    from ..parallel.data_parallel import unsupported
    refused = {name: unsupported(name, args.parallel) for name in recipes}
    if all(refused.values()):                        # nothing would run: say why instead of an empty table
        print(f"mpcourse compare: error: --parallel {args.parallel} runs none of the recipes asked for: "
              + "; ".join(f"{n}: {why}" for n, why in refused.items()), file=sys.stderr)
        return 2
    job = Job(recipes=recipes, corpus=corpus, cfg=cfg, out=args.out, parallel=args.parallel,
              reduce_dtype=args.reduce_dtype, progress=not args.no_progress, timeout_s=args.dist_timeout,
              fp8_all_gather=args.fp8_all_gather, learner_notebooks=tuple(str(nb) for nb in args.with_notebooks))
    talk = is_rank_zero()
    if talk:
        print(f"corpus: {corpus.name}, {len(corpus.text):,} chars, vocab {corpus.vocab_size}")
        print(f"recipes: {', '.join(recipes)}; {cfg.steps} steps x {cfg.batch_size} x {cfg.model.block_size} tokens, "
              f"--parallel {args.parallel} over {'torchrun' if nproc == 1 else nproc} gloo processes, "
              f"reduce dtype {args.reduce_dtype or 'default'}; bytes per parameter are per rank")
        print(where_line(args.out, side))
        print(f"tensor cores: {emulation.status()}")
    earlier = earlier_run(args.out)
    t0 = time.time()
    try:
        results = run_distributed_compare(job, nproc)
    except RankFailed as e:
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        return 1
    if talk and results:
        print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'} ({time.time() - t0:.0f} s)")
        say_overwrite(args.out, earlier)
    elif talk:
        print(f"no recipe ran under --parallel {args.parallel}: nothing written ({args.out}/ keeps what it held)")
    return 0
