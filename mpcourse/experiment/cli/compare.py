"""``mpcourse compare``: its flags (``add_parser``) and the function that runs it (``compare``).

``compare`` first refuses what would fail after minutes of training (the corpus, the output folder, the device,
a batch the block-scaled recipes cannot split, ``--fp8-all-gather`` without FSDP2, a ``--with`` file that is no
notebook): one line with exit code 2 (``parser.OneLineParser`` does the same for the flags; a misspelled recipe or
flag gets a "did you mean"). Then it trains the job in this process or its ``--jobs`` workers
(``mpcourse.experiment.compare.run``), or over processes (``compare_parallel``). Where it writes: ``out_folder``.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from mpcourse.core import emulation

from ..gpt.data import CorpusError, load_corpus
from ..gpt.model import GPTConfig
from ..recipes import NOT_IN_DEFAULT_RUN, RECIPES, OptimConfig, default_recipes
from ..training.train import TrainConfig
from .argtypes import comma_list, positive_float, positive_int, ratio, seed
from .compare_parallel import compare_parallel
from ..parallel.launcher import launcher_rank, launcher_world_size
from .parser import refuse
from .out_folder import (DEFAULT_OUT, MAX_RUN_NAME, QUICK_OUT, RUNS_OUT, earlier_run, make_folder, out_folder_error,
                         output_folder, remove_if_empty, run_changes, say_overwrite, where_line)
from .presets import PRESET_BATCH, PRESETS, QUICK


def _seed_list(text: str) -> list[int]:
    """An argparse type: comma-separated distinct seeds, each a valid ``--seed``."""
    seeds = [seed(s) for s in text.split(",") if s.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"must be distinct comma-separated seeds such as 0,1,2, got {text!r}")
    return seeds


def _out_path(text: str) -> Path:
    """An argparse type: a non-empty folder path (``--out ""``, e.g. an unset shell variable, would be Path("."),
    the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a folder (or omit --out for the default one)")
    return Path(text)


def _switch_rules(text: str) -> str:
    """An argparse type: an ``--autoswitch`` spec that ``autoswitch.parse_spec`` takes (kept as the text)."""
    from mpcourse.core.autoswitch import parse_spec

    try:
        parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--autoswitch takes", "must be")) from None
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``compare`` and its flags to ``sub`` (the ``mpcourse`` parser's sub-commands); its parser."""
    c = sub.add_parser("compare", help="train one model under every precision recipe and report side by side")
    c.add_argument("--recipes", type=comma_list(RECIPES, what="recipe"), default=None,
                   help="comma-separated recipe names (default: the default run, every registered recipe but those `mpcourse recipes` marks as not in it)")
    c.add_argument("--quick", action="store_true",
                   help=f"a first run, under a third of the default's tokens (about 2 minutes on the 2-core CPU): {QUICK['steps']} steps x {QUICK['batch_size']} sequences "
                        "(explicit --steps/--batch-size still win)")
    c.add_argument("--steps", type=positive_int, default=None,
                   help=f"optimizer steps per recipe (default {TrainConfig.steps}; {QUICK['steps']} with --quick)")
    c.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"sequences per step (default {TrainConfig.batch_size}; {QUICK['batch_size']} with --quick)")
    c.add_argument("--lr", type=positive_float, default=OptimConfig.lr, help="peak learning rate (default %(default)s)")
    c.add_argument("--min-lr-ratio", type=ratio, default=OptimConfig.min_lr_ratio,
                   help="cosine decay to lr * this at the last step; 1 keeps the rate constant (default %(default)s)")
    c.add_argument("--data", default=None, help="UTF-8 text file (default: the embedded pydoc_data topics corpus)")
    c.add_argument("--seed", type=seed, default=0, help="seed for the model init and the batch order (default 0)")
    c.add_argument("--seeds", type=_seed_list, default=None,
                   help="comma-separated seeds, e.g. 0,1,2: every recipe once per seed; the table shows mean +- std")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default %(default)s)")
    c.add_argument("--preset", choices=tuple(PRESETS), default="small",
                   help=f"model size: small (default, a few minutes on a CPU) or large (for --device cuda; "
                        f"batch {PRESET_BATCH['large']} unless --batch-size)")
    c.add_argument("--inspect", type=positive_int, default=None, metavar="N",
                   help="record the numerics inspector every N steps (first seed); writes inspect-RECIPE.json/.png")
    c.add_argument("--autoswitch", type=_switch_rules, default=None, metavar="STAT=THRESHOLD",
                   help="move a quantized layer's GEMMs to high precision for the rest of the run once the inspector "
                        "sees one of its tensors pass the threshold, e.g. underflow=0.05 (TE's AutoswitchGemm; "
                        "statistics: underflow, saturation, rel_error, mse; several: comma-separated, any one "
                        "switches; every=N checks every N steps instead of every step; FP8 attention's tensors "
                        "too: attention=layer (default) switches the whole attention, attention=tensor that tensor "
                        "alone, attention=off leaves attention alone); the switches are printed and kept in "
                        "results.json's history")
    c.add_argument("--out", type=_out_path, default=None,
                   help=f"output folder. Default: {DEFAULT_OUT}/ for the default run, {QUICK_OUT}/ for --quick alone, "
                        f"and {RUNS_OUT}/NAME/ for any other run, so that it never replaces their results: NAME is "
                        "each flag that changes what the run computes, as flag=value joined by + in this list's order "
                        "(e.g. recipes=fp32,mxfp8-floor+steps=8; a flag at its default value changes nothing, nor do "
                        "--jobs, --no-progress and --dist-timeout; a notebook or --data file by its name without the "
                        f"suffix; past {MAX_RUN_NAME} characters shortened with a hash). The run prints the folder at "
                        "its start and end; when it overwrites an earlier results.json there it says so after writing (Ctrl-C "
                        "writes the finished rows to results.partial.json beside it instead)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    c.add_argument("--jobs", type=positive_int, default=None,
                   help="train this many recipes at once in worker processes (default: one per core, at most one "
                        "per run; 1: all in this process). Every run uses one intra-op thread wherever it trains, so "
                        "a row's bits do not depend on --jobs")
    c.add_argument("--with", dest="with_notebooks", action="append", default=[], metavar="NOTEBOOK",
                   help="an exercise notebook whose functions (e.g. update_scale) train a second row per recipe, "
                        "'NAME [yours]'; repeat for several notebooks")
    _add_parallel_flags(c)
    return c


def _add_parallel_flags(c: argparse.ArgumentParser) -> None:
    """``compare``'s data-parallel flags, in a group of their own (after the others: the --out name's order)."""
    d = c.add_argument_group("data parallel (torch.distributed, gloo; see mpcourse.experiment.parallel.distributed)")
    d.add_argument("--nproc", type=positive_int, default=1,
                   help="train each recipe over this many processes on this machine (default 1: no torch.distributed; "
                        "under torchrun the processes torchrun started)")
    d.add_argument("--parallel", choices=("ddp", "fsdp", "ep"), default=None,
                   help="ddp: replicate (DistributedDataParallel); fsdp: shard parameters, gradients and optimizer "
                        "state (FSDP2 fully_shard per block); ep: the moe-* recipes with their experts split over the "
                        "processes (expert parallelism; the rest replicated as under ddp). Required with --nproc > 1 "
                        "or torchrun")
    d.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="dtype gradients are reduced in across ranks (default: DDP the gradients' dtype; FSDP2 fp32 "
                        "for the master-weights recipes, the parameters' dtype otherwise)")
    d.add_argument("--dispatch", choices=("fp8", "bf16", "fp32"), default=None,
                   help="with --parallel ep: how the rows travel to the experts' ranks and back (default fp8: "
                        "DeepSeek-V3's FP8 dispatch, E4M3 with a power-of-two scale per 1x128 tile, and a BF16 "
                        "combine; bf16 both ways; fp32 exact); prints the bytes per rank per step")
    d.add_argument("--fp8-all-gather", action="store_true",
                   help="with --parallel fsdp: the FP8 layers all-gather their weights in FP8 (each rank casts its "
                        "shard with the whole weight's scale; fp8-current only); prints the bytes per rank per step")
    d.add_argument("--dist-timeout", type=positive_float, default=120.0,
                   help="seconds a collective may wait for the other ranks before the job fails (default %(default)s)")


def compare(args: argparse.Namespace) -> int:
    """Run ``mpcourse compare`` with its parsed flags; the exit code (0 done, 1 a run failed, 2 refused before
    training, 130 Ctrl-C)."""
    try:
        return _compare(args)
    except KeyboardInterrupt:                     # before or after the training (run_compare handles its own)
        print("mpcourse compare: interrupted; nothing was written", file=sys.stderr)
        return 130


def _compare(args: argparse.Namespace) -> int:
    """The checks that need no training (each refusal one line, exit code 2), then the job: here, or over processes."""
    try:
        corpus = load_corpus(args.data)
    except CorpusError as e:
        return refuse(str(e))
    preset = QUICK if args.quick else {"steps": TrainConfig.steps, "batch_size": PRESET_BATCH[args.preset]}
    args.steps = args.steps if args.steps is not None else preset["steps"]
    args.batch_size = args.batch_size if args.batch_size is not None else preset["batch_size"]
    side = args.out is None and bool(run_changes(args))
    if args.out is None:
        args.out = output_folder(args)
    bad = out_folder_error(args.out)            # fail now, not after minutes of training
    if bad:
        return refuse(bad)
    if args.device == "cuda" and not _cuda_available():
        return refuse("--device cuda but no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
                      "drop --device or install a CUDA build of torch")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                      optim=OptimConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio),
                      model=GPTConfig(**PRESETS[args.preset]), device=args.device)
    recipes = args.recipes or default_recipes()
    if not args.recipes and NOT_IN_DEFAULT_RUN and launcher_rank() == 0:
        print(f"not in the default run (name them with --recipes): {', '.join(NOT_IN_DEFAULT_RUN)}")
    world = launcher_world_size()                # under torchrun: its processes are the ranks, checked as --nproc's
    if world is not None and args.nproc not in (1, world):
        return refuse(f"--nproc {args.nproc} but torchrun started {world} processes (WORLD_SIZE={world}); drop "
                      "--nproc under torchrun (torchrun's --nproc-per-node sets the ranks)")
    bad = _token_count_error(recipes, cfg, world or args.nproc)
    if bad:
        return refuse(bad)
    if args.fp8_all_gather:
        from ..parallel.data_parallel import fp8_all_gather_error
        if args.parallel != "fsdp":
            return refuse("--fp8-all-gather needs --parallel fsdp (it changes what FSDP2 all-gathers)")
        bad = [why for why in map(fp8_all_gather_error, recipes) if why]
        if bad:
            return refuse(bad[0])
    if getattr(args, "dispatch", None) and args.parallel != "ep":
        return refuse("--dispatch needs --parallel ep (it says how the experts' rows travel between the ranks)")
    if args.autoswitch and args.with_notebooks:
        return refuse("--autoswitch with --with: your rows would train without the switch and their verdicts "
                      "compare other runs; drop one of them")
    if args.autoswitch and (args.nproc > 1 or args.parallel or world is not None):
        return refuse("--autoswitch trains in one process (each rank would switch on its own shard's statistics); "
                      "drop --nproc/--parallel or --autoswitch")
    if args.nproc > 1 or args.parallel or world is not None:
        return compare_parallel(args, corpus, cfg, recipes, side)
    return _compare_here(args, corpus, cfg, recipes, side)


class _Refused(Exception):
    """A refusal before training, found while the job is being set up: its one line (exit code 2, ``refuse``)."""


def _print_start(out: Path, side: bool, corpus, cfg: TrainConfig, recipes: list[str]) -> None:
    """The start-up lines: the corpus, the job's size, where it writes, the tensor cores, the CPU."""
    from ..measure import machine

    print(f"corpus: {corpus.name}, {len(corpus.text):,} chars, vocab {corpus.vocab_size}, "
          f"unigram entropy {corpus.unigram_entropy():.3f} nats")
    print(f"recipes: {', '.join(recipes)}; {cfg.steps} steps x {cfg.batch_size} x {cfg.model.block_size} tokens")
    print(where_line(out, side))
    print(f"tensor cores: {emulation.status()}")
    print(f"cpu: {machine.summary()}")


def _learner_functions(notebooks: list, recipes: list[str]) -> dict:
    """The functions of the ``--with`` notebooks the recipes take ({} without --with), and the line naming them."""
    if not notebooks:
        return {}
    from mpcourse.core.learner_table import OverrideRefused
    from ..learner import LearnerLoadError
    from .with_notebooks import exercise_functions
    try:
        learner = exercise_functions(notebooks, recipes)
    except (LearnerLoadError, OverrideRefused) as e:
        raise _Refused(f"--with{':' * isinstance(e, OverrideRefused)} {e}") from None
    print(f"your functions: {', '.join(sorted(learner)) or 'none found'}")
    return learner


def _jobs(args: argparse.Namespace, n_runs: int) -> tuple[int, int]:
    """(worker processes, intra-op threads per run): ``--jobs``, else one process on a GPU, else one worker per core
    (``pool.default_jobs``); the line naming them where there are workers."""
    from ..training.threads import TRAINING_THREADS

    if args.jobs is not None:
        jobs, threads = args.jobs, TRAINING_THREADS
    elif args.device == "cuda":
        jobs, threads = 1, TRAINING_THREADS      # one GPU: one process
    else:
        from ..compare.pool import default_jobs
        jobs, threads = default_jobs(n_runs)
    if jobs > 1 and args.device == "cuda":
        raise _Refused("--jobs > 1 trains on the CPU; drop --jobs with --device cuda")
    if jobs > 1:
        print(f"jobs: {jobs} worker processes x {threads} thread(s)")
    return jobs, threads


def _measurement(args: argparse.Namespace, cfg: TrainConfig, vocab_size: int, n_runs: int, threads: int):
    """What the job measures besides the loss (``compare.run.Measurement``): the peaks for %peak, taken on
    ``threads`` threads and named in one line (with a warning for ``--preset large`` on the CPU), how a CPU peak is
    measured again, ``--inspect`` and ``--autoswitch``."""
    from ..compare.run import Measurement

    peaks = _peak_flops(args.device, threads)
    if isinstance(peaks, (int, float)):          # one number: the FP32 (CPU) or BF16 (GPU) peak
        peaks = {"bf16" if args.device == "cuda" else "fp32": float(peaks)}
    print(_peak_line(peaks, args.device, threads))
    if args.preset == "large" and args.device != "cuda" and peaks.get("fp32"):
        print(large_on_cpu_warning(cfg, vocab_size, n_runs, peaks["fp32"]), file=sys.stderr)
    remeasure = None
    if args.device != "cuda":
        from ..measure.speed import measure_gemm_peak
        remeasure = functools.partial(measure_gemm_peak, threads=threads)
    return Measurement(peak_flops=peaks or None, remeasure_peak=remeasure, inspect_every=args.inspect or 0,
                       autoswitch=args.autoswitch)


def _make_out(out: Path):
    """``out`` created (``out_folder.make_folder``: what it created, for ``remove_if_empty``)."""
    try:
        return make_folder(out)
    except OSError as e:
        raise _Refused(f"--out {out}: cannot create the output folder ({e.strerror}); pass another folder") from None


def _say_unfinished(e: Exception, out: Path, earlier) -> int:
    """The lines after a job that did not finish (a worker lost, runs failed, Ctrl-C); the exit code."""
    from ..compare.run import CompareFailed, CompareInterrupted

    if isinstance(e, CompareInterrupted):
        print(_interrupted_line(e, out, earlier), file=sys.stderr)
        say_overwrite(out, earlier)
        return 130
    if not isinstance(e, CompareFailed):         # a worker process lost (pool.WorkerError)
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        return 1
    for f in e.failed:
        print(f"mpcourse compare: error: {f['recipe']} (seed {f['seed']}) failed: {f['error']}", file=sys.stderr)
    if e.results:
        print(f"mpcourse compare: {len(e.failed)} run(s) failed; the {len(e.results)} finished rows are in "
              f"{out / 'results.json'} (its \"failed\" list names the others)", file=sys.stderr)
    else:
        print(f"mpcourse compare: no run finished: nothing written ({out}/ keeps what it held)", file=sys.stderr)
    say_overwrite(out, earlier)
    return 1


def _compare_here(args: argparse.Namespace, corpus, cfg: TrainConfig, recipes: list[str], side: bool) -> int:
    """The job in this process or its ``--jobs`` workers: the start-up lines, the learner's notebooks, the jobs and
    the peaks, then the run and the lines that say where its rows are."""
    from ..compare.pool import WorkerError
    from ..compare.run import CompareFailed, CompareInterrupted, Execution, run_compare

    _print_start(args.out, side, corpus, cfg, recipes)
    n_runs = len(recipes) * len(args.seeds or [args.seed])
    try:
        learner = _learner_functions(args.with_notebooks, recipes)
        jobs, threads = _jobs(args, n_runs)
        measurement = _measurement(args, cfg, corpus.vocab_size, n_runs, threads)
        earlier = earlier_run(args.out)
        created = _make_out(args.out)
    except _Refused as e:
        return refuse(str(e))
    t0 = time.time()
    try:
        run_compare(recipes, corpus, cfg, args.out, seeds=args.seeds, learner=learner, measurement=measurement,
                    execution=Execution(jobs=jobs, progress=not args.no_progress))
    except (WorkerError, CompareFailed, CompareInterrupted) as e:
        return _say_unfinished(e, args.out, earlier)
    finally:
        remove_if_empty(created)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'} ({time.time() - t0:.0f} s)")
    say_overwrite(args.out, earlier)
    return 0


def _interrupted_line(e, out: Path, earlier) -> str:
    """The one line after Ctrl-C: where the finished rows went (``results.json``, or ``results.partial.json``
    beside the earlier run's ``results.json``, which stays) or that nothing was written."""
    from ..compare.outputs import OUT_FILES
    if e.path is None:
        return f"mpcourse compare: interrupted before any run finished: nothing written ({out}/ keeps what it held)"
    line = (f"mpcourse compare: interrupted; the {len(e.results)} finished rows are in {e.path} (its \"failed\" list "
            "names the runs not finished)")
    if e.path.name != OUT_FILES[0] and earlier is not None:
        line += f"; {out / OUT_FILES[0]} keeps the earlier run ({earlier[1]}) until a run completes"
    return line


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _peak_flops(device: str, threads: int | None = None) -> dict[str, float]:
    """The peaks for the %peak column by GEMM dtype key (``speed.peak_key``): the GPU's dense datasheet peaks
    (BF16, FP8; {} for a GPU not in ``speed.GPU_PEAKS``), or this CPU's measured GEMMs on ``threads`` threads (a
    worker's, so that its tok/s and the peak count the same cores): FP32, and BF16/FP16 where native."""
    from ..measure.speed import cpu_peaks, emulated_dtypes, gpu_peaks

    if device == "cuda":
        import torch

        return gpu_peaks(torch.cuda.get_device_name())
    return cpu_peaks(emulated_dtypes(), threads=threads)


def large_on_cpu_warning(cfg: TrainConfig, vocab_size: int, n_runs: int, peak_flops: float) -> str:
    """The warning for ``--preset large`` on a CPU: a lower bound of the run's time from the model FLOPs
    (``speed.flops_per_token``) at the measured FP32 GEMM peak (the emulated recipes take longer)."""
    from ..measure.speed import flops_per_token

    m = cfg.model
    flops = flops_per_token(m.n_layer, m.n_embd, m.block_size, vocab_size) * m.block_size * cfg.batch_size
    seconds = flops * cfg.steps * n_runs / peak_flops
    when = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
    return (f"mpcourse compare: warning: --preset large on the CPU will take at least {when} ({n_runs} runs x "
            f"{cfg.steps} steps x {flops / 1e12:.3g} TFLOP at this CPU's measured {peak_flops / 1e9:.3g} GFLOP/s; "
            "the emulated low-precision recipes take longer): the preset is meant for --device cuda; drop "
            "--preset large for the few-minute CPU run")


def _peak_line(peaks: dict[str, float], device: str, threads: int) -> str:
    """The start-up line naming the peaks %peak is taken against."""
    if not peaks:
        return "peak FLOP/s: unknown GPU, %peak not shown"
    from ..measure.speed import GEMM_REPEATS
    where = ("dense tensor-core datasheet" if device == "cuda" else
             f"this CPU, the best of {GEMM_REPEATS} timed 1024^3 GEMMs on {threads} thread(s) per dtype")
    values = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in peaks.items())
    return f"peak FLOP/s for %peak, each row against its GEMM dtype's: {values} ({where})"


def _token_count_error(recipes, cfg, nproc: int) -> str | None:
    """Why a block-scaled recipe cannot train on ``cfg``'s tokens per step (per rank: batch / nproc x block_size),
    naming --batch-size and the values it takes; None if every recipe can."""
    import math
    from mpcourse.core.quant import token_multiple
    from ..recipes import get_recipe
    if nproc > 1 and cfg.batch_size % nproc:
        return None                                          # the batch's split over the ranks is reported later
    seqs, T = cfg.batch_size // max(nproc, 1), cfg.model.block_size
    for name in recipes:
        try:
            m = token_multiple(getattr(get_recipe(name), "fp8_recipe", None))
        except KeyError:
            return None                                      # an unknown name is reported where it always was
        if (seqs * T) % m:
            step = m // math.gcd(m, T) * max(nproc, 1)
            return (f"--batch-size {cfg.batch_size} gives {seqs} x {T} = {seqs * T} tokens per step"
                    f"{' per rank' if nproc > 1 else ''}, but {name} scales them in blocks of {m}: use a --batch-size "
                    f"that is a multiple of {step} (e.g. {step}, {2 * step}, {4 * step})")
    return None
