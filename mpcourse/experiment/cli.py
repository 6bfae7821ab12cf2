"""The ``mpcourse`` command line: ``mpcourse compare`` and ``mpcourse recipes``.

Where ``compare`` writes (``output_folder``): the default run to ``mpcourse-out/``, ``--quick`` alone to
``mpcourse-out-quick/``, every other run to ``mpcourse-out-runs/NAME/``, NAME the flags that change what it computes
(``run_changes``, ``run_name``), so that a side run (one recipe, a notebook's functions, a few steps) never replaces
the main run's ``results.json`` and plot; ``--out`` chooses. Errors are one line with exit code 2
(``OneLineParser``; a misspelled recipe or flag gets a "did you mean").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from mpcourse.core import emulation
from .argtypes import comma_list, did_you_mean, positive_float, positive_int, ratio, seed
from .gpt.data import CorpusError, load_corpus
from .gpt.model import GPTConfig
from .recipes import NOT_IN_DEFAULT_RUN, RECIPES, OptimConfig, default_recipes
from .training.train import TrainConfig

# model-size presets: "small" is the default every recipe runs in a few minutes on a laptop CPU; "large" has
# GEMMs (M = 32 x 256 = 8192 tokens, K, N = 1024..4096) near or past the FP8 break-even on an H100-class GPU
# (mpcourse.core.breakeven), and is meant for --device cuda.
PRESETS = {"small": dict(n_layer=5, n_embd=128, n_head=4, block_size=64),
           "large": dict(n_layer=8, n_embd=1024, n_head=16, block_size=256)}
PRESET_BATCH = {"small": TrainConfig.batch_size, "large": 32}


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


# ``--quick``: every recipe, on under a third of the default's tokens (a first contact, not a measurement:
# 50 steps are barely past the 20-step warm-up, so the gaps between recipes are mostly noise).
QUICK = {"steps": 50, "batch_size": 8}
DEFAULT_OUT, QUICK_OUT = Path("mpcourse-out"), Path("mpcourse-out-quick")
#: where a run other than the default one (or --quick alone) writes: RUNS_OUT/NAME, NAME from ``run_name``
RUNS_OUT = Path("mpcourse-out-runs")
OUT_FILES = ("results.json", "loss_curves.png")     # what a run writes into its folder (compare.run_compare)
MAX_RUN_NAME = 80


def run_changes(args: argparse.Namespace) -> list[str]:
    """What a ``compare`` run changes against the default run (with ``--quick``: against the quick run): one
    ``flag=value`` part per flag that changes what the run computes, in ``--help``'s order; [] for the default run.

    A flag given its default value changes nothing (``--steps 80``, ``--seeds 0``, ``--recipes`` naming exactly
    the default run's recipes); ``--jobs``, ``--no-progress`` and ``--dist-timeout`` never do (a row's bits do not
    depend on ``--jobs``). A notebook (``--with``) or a text file (``--data``) is named by its file name without
    the suffix. ``args``: the parsed flags, ``steps`` and ``batch_size`` already resolved."""
    from .recipes import default_recipes

    base = QUICK if args.quick else {"steps": TrainConfig.steps, "batch_size": PRESET_BATCH[args.preset]}
    parts = []
    if args.recipes and sorted(set(args.recipes)) != sorted(default_recipes()):
        parts.append("recipes=" + ",".join(args.recipes))
    rest = []
    if args.steps != base["steps"]:
        rest.append(f"steps={args.steps}")
    if args.batch_size != base["batch_size"]:
        rest.append(f"batch-size={args.batch_size}")
    if args.lr != OptimConfig.lr:
        rest.append(f"lr={args.lr:g}")
    if args.min_lr_ratio != OptimConfig.min_lr_ratio:
        rest.append(f"min-lr-ratio={args.min_lr_ratio:g}")
    if args.data is not None:
        rest.append(f"data={Path(args.data).stem}")
    if (args.seeds or [args.seed]) != [0]:
        rest.append(f"seeds={','.join(map(str, args.seeds))}" if args.seeds else f"seed={args.seed}")
    if args.device != "cpu":
        rest.append(f"device={args.device}")
    if args.preset != "small":
        rest.append(f"preset={args.preset}")
    if args.inspect:
        rest.append(f"inspect={args.inspect}")
    if args.with_notebooks:
        rest.append("with=" + ",".join(Path(nb).stem for nb in args.with_notebooks))
    if args.nproc != 1:
        rest.append(f"nproc={args.nproc}")
    for flag in ("parallel", "reduce_dtype"):
        if getattr(args, flag):
            rest.append(f"{flag.replace('_', '-')}={getattr(args, flag)}")
    if args.fp8_all_gather:
        rest.append("fp8-all-gather")
    if args.quick and (parts or rest):
        parts.append("quick")
    return [re.sub(r"[^A-Za-z0-9_.,=+-]", "_", part) for part in parts + rest]


def run_name(changes: list[str]) -> str:
    """The folder name of a run with these ``run_changes``: the parts joined by ``+``; past ``MAX_RUN_NAME``
    characters, its start, ``~`` and 8 hex digits of its SHA-1 (the same run, the same name, every time)."""
    name = "+".join(changes)
    if len(name) > MAX_RUN_NAME:
        name = name[:MAX_RUN_NAME - 9] + "~" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def output_folder(args: argparse.Namespace) -> Path:
    """Where a run writes when ``--out`` is not given: ``DEFAULT_OUT`` for the default run, ``QUICK_OUT`` for
    ``--quick`` alone, ``RUNS_OUT/run_name(...)`` for any other, so that no other run replaces their results."""
    changes = run_changes(args)
    if changes:
        return RUNS_OUT / run_name(changes)
    return QUICK_OUT if args.quick else DEFAULT_OUT


def out_folder_error(out: Path) -> str | None:
    """Why ``out`` cannot be the output folder (a file, under a file, not writable, holding a folder where a file
    of ``OUT_FILES`` goes), as the error's text; None if it can. Creates nothing."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a folder"
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"--out {out}: {parent} is a file; give a folder"
            if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
                return f"--out {out}: cannot create it in {parent} (permission denied); pass another folder"
            break
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: cannot write there (permission denied); pass another folder"
    for name in OUT_FILES:                   # the run writes these files; a folder of the name fails it at the end
        if (out / name).is_dir():
            return f"--out {out}: {out / name} is a folder, where the run writes a file; pass another folder"
    return None


def _make_folder(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; the folders created, ``out`` first."""
    created = [d for d in (out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    return created


def _remove_if_empty(created: list[Path]) -> None:
    """Remove the folders ``_make_folder`` created, while they are empty (a run that wrote nothing leaves none)."""
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break


def _earlier_run(out: Path) -> tuple[bytes, str] | None:
    """The bytes of ``out/results.json`` and what run it holds (rows, steps), or None where there is none."""
    f = out / "results.json"
    try:
        raw = f.read_bytes()
    except OSError:
        return None
    try:
        old = json.loads(raw)
        what = f"{len(old['results'])} rows, {old['config']['steps']} steps x {old['config']['batch_size']}"
    except (ValueError, KeyError, TypeError):
        what = "unreadable"
    return raw, what


def _overwrite_note(out: Path, earlier: tuple[bytes, str] | None) -> str | None:
    """The note for a run that replaced an earlier ``results.json`` (its bytes changed); None if it did not."""
    f = out / "results.json"
    if earlier is None or not f.is_file() or f.read_bytes() == earlier[0]:
        return None
    return f"note: this run overwrote {f}, which held an earlier run ({earlier[1]}); pass --out to keep a run elsewhere"


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE`` with exit code 2 (no usage
    block: ``PROG --help`` prints it); an unrecognized flag close to a known one (of this parser or a
    sub-command's) gets a "did you mean"."""

    def _flags(self) -> list[str]:
        flags = [o for a in self._actions for o in a.option_strings]
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                flags += [f for sub in a.choices.values() for f in sub._flags()]
        return flags

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            guesses = [f"{w} (did you mean {g}?)" for w in message.split(": ", 1)[1].split()
                       if w.startswith("--") and (g := did_you_mean(w.split("=")[0], self._flags()))]
            if guesses:
                message += "; " + "; ".join(guesses)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mpcourse", description="Mixed-precision training, checked.")
    sub = p.add_subparsers(dest="command", required=True)
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
    c.add_argument("--out", type=_out_path, default=None,
                   help=f"output folder. Default: {DEFAULT_OUT}/ for the default run, {QUICK_OUT}/ for --quick alone, "
                        f"and {RUNS_OUT}/NAME/ for any other run, so that it never replaces their results: NAME is "
                        "each flag that changes what the run computes, as flag=value joined by + in this list's order "
                        "(e.g. recipes=fp32,mxfp8-floor+steps=8; a flag at its default value changes nothing, nor do "
                        "--jobs, --no-progress and --dist-timeout; a notebook or --data file by its name without the "
                        f"suffix; past {MAX_RUN_NAME} characters shortened with a hash). The run prints the folder at "
                        "its start and end; when it overwrites an earlier results.json there it says so after writing")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    c.add_argument("--jobs", type=positive_int, default=None,
                   help="train this many recipes at once in worker processes (default: one per core, at most one "
                        "per run; 1: all in this process). Every run uses one intra-op thread wherever it trains, so "
                        "a row's bits do not depend on --jobs")
    c.add_argument("--with", dest="with_notebooks", action="append", default=[], metavar="NOTEBOOK",
                   help="an exercise notebook whose functions (e.g. update_scale) train a second row per recipe, "
                        "'NAME [yours]'; repeat for several notebooks")
    d = c.add_argument_group("data parallel (torch.distributed, gloo; see mpcourse.experiment.parallel.distributed)")
    d.add_argument("--nproc", type=positive_int, default=1,
                   help="train each recipe over this many processes on this machine (default 1: no torch.distributed; "
                        "under torchrun the processes torchrun started)")
    d.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                   help="ddp: replicate (DistributedDataParallel); fsdp: shard parameters, gradients and optimizer "
                        "state (FSDP2 fully_shard per block). Required with --nproc > 1 or torchrun")
    d.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="dtype gradients are reduced in across ranks (default: DDP the gradients' dtype; FSDP2 fp32 "
                        "for the master-weights recipes, the parameters' dtype otherwise)")
    d.add_argument("--fp8-all-gather", action="store_true",
                   help="with --parallel fsdp: the FP8 layers all-gather their weights in FP8 (each rank casts its "
                        "shard with the whole weight's scale; fp8-current only); prints the bytes per rank per step")
    d.add_argument("--dist-timeout", type=positive_float, default=120.0,
                   help="seconds a collective may wait for the other ranks before the job fails (default %(default)s)")
    sub.add_parser("recipes", help="list the registered recipes (marking those a plain compare leaves out)")
    return p


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _peak_flops(device: str, threads: int | None = None) -> dict[str, float]:
    """The peaks for the %peak column by GEMM dtype key (``speed.peak_key``): the GPU's dense datasheet peaks
    (BF16, FP8; {} for a GPU not in ``speed.GPU_PEAKS``), or this CPU's measured GEMMs on ``threads`` threads (a
    worker's, so that its tok/s and the peak count the same cores): FP32, and BF16/FP16 where native."""
    from .measure.speed import cpu_peaks, emulated_dtypes, gpu_peaks

    if device == "cuda":
        import torch

        return gpu_peaks(torch.cuda.get_device_name())
    return cpu_peaks(emulated_dtypes(), threads=threads)


def large_on_cpu_warning(cfg: TrainConfig, vocab_size: int, n_runs: int, peak_flops: float) -> str:
    """The warning for ``--preset large`` on a CPU: a lower bound of the run's time from the model FLOPs
    (``speed.flops_per_token``) at the measured FP32 GEMM peak (the emulated recipes take longer)."""
    from .measure.speed import flops_per_token

    m = cfg.model
    flops = flops_per_token(m.n_layer, m.n_embd, m.block_size, vocab_size) * m.block_size * cfg.batch_size
    seconds = flops * cfg.steps * n_runs / peak_flops
    when = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
    return (f"mpcourse compare: warning: --preset large on the CPU will take at least {when} ({n_runs} runs x "
            f"{cfg.steps} steps x {flops / 1e12:.3g} TFLOP at this CPU's measured {peak_flops / 1e9:.3g} GFLOP/s; "
            "the emulated low-precision recipes take longer): the preset is meant for --device cuda; drop "
            "--preset large for the few-minute CPU run")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:                     # before or after the training (run_compare handles its own)
        print("mpcourse compare: interrupted; nothing was written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "recipes":
        width = max(map(len, RECIPES))
        for name, cls in RECIPES.items():
            mark = "  [not in the default run: name it with --recipes]" if name in NOT_IN_DEFAULT_RUN else ""
            print(f"{name.ljust(width)}  {cls.description}{mark}")
        return 0
    try:
        corpus = load_corpus(args.data)
    except CorpusError as e:
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        return 2
    from .compare import run_compare

    preset = QUICK if args.quick else {"steps": TrainConfig.steps, "batch_size": PRESET_BATCH[args.preset]}
    args.steps = args.steps if args.steps is not None else preset["steps"]
    args.batch_size = args.batch_size if args.batch_size is not None else preset["batch_size"]
    side = args.out is None and bool(run_changes(args))
    if args.out is None:
        args.out = output_folder(args)
    bad = out_folder_error(args.out)            # fail now, not after minutes of training
    if bad:
        print(f"mpcourse compare: error: {bad}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _cuda_available():
        print("mpcourse compare: error: --device cuda but no CUDA GPU is visible to torch "
              "(torch.cuda.is_available() is False); drop --device or install a CUDA build of torch", file=sys.stderr)
        return 2
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                      optim=OptimConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio),
                      model=GPTConfig(**PRESETS[args.preset]), device=args.device)
    recipes = args.recipes or default_recipes()
    if not args.recipes and NOT_IN_DEFAULT_RUN:
        print(f"not in the default run (name them with --recipes): {', '.join(NOT_IN_DEFAULT_RUN)}")
    bad = _token_count_error(recipes, cfg, args.nproc)
    if bad:
        print(f"mpcourse compare: error: {bad}", file=sys.stderr)
        return 2
    if args.fp8_all_gather:
        from .parallel.data_parallel import fp8_all_gather_error
        if args.parallel != "fsdp":
            print("mpcourse compare: error: --fp8-all-gather needs --parallel fsdp (it changes what FSDP2 all-gathers)",
                  file=sys.stderr)
            return 2
        bad = [why for why in map(fp8_all_gather_error, recipes) if why]
        if bad:
            print(f"mpcourse compare: error: {bad[0]}", file=sys.stderr)
            return 2
    from .parallel.distributed import launched_by_torchrun
    if args.nproc > 1 or args.parallel or launched_by_torchrun():
        return _main_distributed(args, corpus, cfg, recipes, side)
    print(f"corpus: {corpus.name}, {len(corpus.text):,} chars, vocab {corpus.vocab_size}, "
          f"unigram entropy {corpus.unigram_entropy():.3f} nats")
    print(f"recipes: {', '.join(recipes)}; {cfg.steps} steps x {cfg.batch_size} x {cfg.model.block_size} tokens")
    print(_where_line(args.out, side))
    print(f"tensor cores: {emulation.status()}")
    from .measure import machine
    print(f"cpu: {machine.summary()}")
    learner = {}
    if args.with_notebooks:
        from mpcourse.core.learner_table import OverrideRefused
        from .learner import LearnerLoadError, exercise_functions
        try:
            learner = exercise_functions(args.with_notebooks, recipes)
        except (LearnerLoadError, OverrideRefused) as e:
            print(f"mpcourse compare: error: --with{':' * isinstance(e, OverrideRefused)} {e}", file=sys.stderr)
            return 2
        print(f"your functions: {', '.join(sorted(learner)) or 'none found'}")
    n_runs = len(recipes) * len(args.seeds or [args.seed])
    from .training.threads import TRAINING_THREADS
    if args.jobs is not None:
        jobs, threads = args.jobs, TRAINING_THREADS
    elif args.device == "cuda":
        jobs, threads = 1, TRAINING_THREADS      # one GPU: one process
    else:
        from .pool import default_jobs
        jobs, threads = default_jobs(n_runs)
    if jobs > 1 and args.device == "cuda":
        print("mpcourse compare: error: --jobs > 1 trains on the CPU; drop --jobs with --device cuda", file=sys.stderr)
        return 2
    if jobs > 1:
        print(f"jobs: {jobs} worker processes x {threads} thread(s)")
    peaks = _peak_flops(args.device, threads)
    if isinstance(peaks, (int, float)):          # one number: the FP32 (CPU) or BF16 (GPU) peak
        peaks = {"bf16" if args.device == "cuda" else "fp32": float(peaks)}
    print(_peak_line(peaks, args.device, threads))
    if args.preset == "large" and args.device != "cuda" and peaks.get("fp32"):
        print(large_on_cpu_warning(cfg, corpus.vocab_size, n_runs, peaks["fp32"]), file=sys.stderr)
    remeasure = None
    if args.device != "cuda":
        from .measure.speed import measure_gemm_peak
        remeasure = lambda key: measure_gemm_peak(key, threads=threads)      # noqa: E731
    earlier = _earlier_run(args.out)
    try:
        created = _make_folder(args.out)
    except OSError as e:
        print(f"mpcourse compare: error: --out {args.out}: cannot create the output folder ({e.strerror}); "
              "pass another folder", file=sys.stderr)
        return 2
    t0 = time.time()
    from .compare import CompareFailed, CompareInterrupted
    from .pool import WorkerError
    try:
        run_compare(recipes, corpus, cfg, args.out, progress=not args.no_progress, seeds=args.seeds,
                    peak_flops=peaks or None, inspect_every=args.inspect or 0, learner=learner, jobs=jobs,
                    remeasure_peak=remeasure)
    except WorkerError as e:
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        return 1
    except CompareFailed as e:
        for f in e.failed:
            print(f"mpcourse compare: error: {f['recipe']} (seed {f['seed']}) failed: {f['error']}", file=sys.stderr)
        if e.results:
            print(f"mpcourse compare: {len(e.failed)} run(s) failed; the {len(e.results)} finished rows are in "
                  f"{args.out / 'results.json'} (its \"failed\" list names the others)", file=sys.stderr)
        else:
            print(f"mpcourse compare: no run finished: nothing written ({args.out}/ keeps what it held)",
                  file=sys.stderr)
        _say_overwrite(args.out, earlier)
        return 1
    except CompareInterrupted as e:
        print(f"mpcourse compare: interrupted; the {len(e.results)} finished rows are in {args.out / 'results.json'} "
              "(its \"failed\" list names the runs not finished)" if e.results else
              f"mpcourse compare: interrupted before any run finished: nothing written ({args.out}/ keeps what it "
              "held)", file=sys.stderr)
        _say_overwrite(args.out, earlier)
        return 130
    finally:
        _remove_if_empty(created)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'} ({time.time() - t0:.0f} s)")
    _say_overwrite(args.out, earlier)
    return 0


def _where_line(out: Path, side: bool) -> str:
    """The line that says, before the run, where its results go."""
    if side:
        return (f"results go to {out}/ (a run other than the default one gets a folder of its own, named after what "
                f"it changes, so {DEFAULT_OUT}/ keeps the default run's; --out to choose)")
    return f"results go to {out}/ (--out to choose another folder)"


def _say_overwrite(out: Path, earlier) -> None:
    note = _overwrite_note(out, earlier)
    if note:
        print(note)


def _peak_line(peaks: dict[str, float], device: str, threads: int) -> str:
    """The start-up line naming the peaks %peak is taken against."""
    if not peaks:
        return "peak FLOP/s: unknown GPU, %peak not shown"
    from .measure.speed import GEMM_REPEATS
    where = ("dense tensor-core datasheet" if device == "cuda" else
             f"this CPU, the best of {GEMM_REPEATS} timed 1024^3 GEMMs on {threads} thread(s) per dtype")
    values = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in peaks.items())
    return f"peak FLOP/s for %peak, each row against its GEMM dtype's: {values} ({where})"


def _token_count_error(recipes, cfg, nproc: int) -> str | None:
    """Why a block-scaled recipe cannot train on ``cfg``'s tokens per step (per rank: batch / nproc x block_size),
    naming --batch-size and the values it takes; None if every recipe can."""
    import math
    from mpcourse.core.quant import token_multiple
    from .recipes import get_recipe
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


def _main_distributed(args, corpus, cfg, recipes, side: bool = False) -> int:
    """``compare --nproc N --parallel ddp|fsdp`` (or under torchrun): rank 0 prints and writes."""
    from .parallel.distributed import Job, RankFailed, is_rank_zero, run_distributed_compare

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
        from .learner import LearnerLoadError, exercise_functions
        try:
            exercise_functions(args.with_notebooks, recipes, args.parallel)
        except (LearnerLoadError, OverrideRefused) as e:
            print(f"mpcourse compare: error: --with{':' * isinstance(e, OverrideRefused)} {e}", file=sys.stderr)
            return 2
    from .parallel.data_parallel import unsupported
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
        print(_where_line(args.out, side))
        print(f"tensor cores: {emulation.status()}")
    earlier = _earlier_run(args.out)
    t0 = time.time()
    try:
        results = run_distributed_compare(job, nproc)
    except RankFailed as e:
        print(f"mpcourse compare: error: {e}", file=sys.stderr)
        return 1
    if talk and results:
        print(f"wrote {args.out / 'results.json'} and {args.out / 'loss_curves.png'} ({time.time() - t0:.0f} s)")
        _say_overwrite(args.out, earlier)
    elif talk:
        print(f"no recipe ran under --parallel {args.parallel}: nothing written ({args.out}/ keeps what it held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
