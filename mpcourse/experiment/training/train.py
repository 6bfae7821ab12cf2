"""The training loop every recipe runs: same model init, same batches, same schedule.

``Trainer`` runs one recipe; ``train`` is the one-call form; ``train_inspected`` the same with the numerics
inspector. ``Trainer.train_step`` runs the one training step of the project, ``training_step`` (module
``mpcourse.experiment.recipes.step``; the tests' recipe loop and the benchmarks call it too; the first step runs it
inside ``memory.measure_step``, which counts its memory); the recipe decides the precision of each line
(see ``mpcourse.experiment.recipes.base``)::

    with recipe.forward_context():          # autocast / FP8 autocast / nothing
        _, loss = recipe.model(x, y)        # loss: fp32 ()
    recipe.backward(loss)                   # loss.backward(), or scaler.scale(loss).backward()
    after_backward(step, recipe)            # optional hook: look at (or change) the gradients
    result = recipe.step()                  # clip, optimizer step (maybe skipped), scaler update
    after_step(step, recipe, result)        # optional hook: look at the updated state
    recipe.zero_grad()                      # (Trainer.train_step, after training_step)

Every step runs inside ``mpcourse.core.emulation.tensor_cores(fast=True)`` (``Trainer.emulation()``), so
low-precision matmuls on a CPU without BF16/FP16 units are computed as tensor cores compute them, by
kernels on the matmul ops only (the same bits as the ``TensorCoreEmulation`` dispatch mode, which would see
every op in Python: ``Trainer.fast_emulation = False`` runs that instead). A run whose first step computed no
low-precision matmul through it (FP32 and the FP8 recipes, whose GEMM operands are FP32 or FP8) runs its
later steps and evaluations without it, which changes no bit (every other op passes through unchanged).
Runs are seeded: on CPU the same seed gives the same bits.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..gpt.data import Corpus
from mpcourse.core.emulation import emulated_calls, tensor_cores
from mpcourse.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..measure.memory import STATE_KINDS, measure_step
from ..gpt.model import GPT, GPTConfig, mlp_weights_per_token
from ..measure.speed import flops_per_token
from ..recipes.step import training_step
from ..recipes import OptimConfig, get_recipe
from ..recipes.base import TrainingRecipe


@dataclass
class TrainConfig:
    """One training run.

    Attributes:
        steps: optimizer steps (default 80: ``mpcourse compare``'s 19 default recipes in about 4 minutes on a
            2-core CPU; the course's longer runs pass their own, e.g. ``--steps 150``).
        batch_size: sequences per step B (default 16); tokens per step = B * block_size.
        eval_interval: evaluate validation loss every this many steps (default 50) and at the end.
        eval_batches: batches per evaluation, per split (default 8).
        seed: seeds the model init and the batch order (default 0).
        optim: optimizer hyper-parameters (``mpcourse.experiment.recipes.OptimConfig``).
        model: model hyper-parameters; ``vocab_size`` is taken from the corpus.
        device: where the model and batches live, "cpu" (default) or "cuda" (batches are drawn on the
            CPU with the same generator, then moved, so every device sees the same batches).
    """

    steps: int = 80
    batch_size: int = 16
    eval_interval: int = 50
    eval_batches: int = 8
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    device: str = "cpu"

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1 (got {self.steps}, {self.batch_size})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False: install a CUDA build of "
                             "torch on a machine with a GPU, or use device='cpu'")


@dataclass
class RunResult:
    """The outcome of one recipe's run (one object per recipe in ``results.json``).

    Losses are mean cross-entropy in nats per character; NaN where the run diverged.
    ``history`` holds one record per step: ``step``, ``loss``, ``skipped``, ``loss_scale``, and
    ``val_loss`` on evaluation steps.
    """

    recipe: str
    description: str
    final_train_loss: float
    final_val_loss: float
    skipped_steps: int
    final_loss_scale: float | None
    tokens_per_s: float
    bytes_per_param: dict
    activation_bytes: int
    memory: dict
    flops_per_token: float
    steps_run: int
    diverged_at: int | None
    history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, optim: OptimConfig, total_steps: int | None = None) -> float:
    """Linear warm-up over ``warmup_steps``, then a cosine decay to ``lr * min_lr_ratio`` at
    ``total_steps - 1`` (``total_steps=None``: constant ``lr`` after warm-up)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if total_steps is None:
        return optim.lr
    span = max(1, total_steps - 1 - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(recipe, corpus: Corpus, cfg: TrainConfig) -> dict[str, float]:
    """Mean loss over ``eval_batches`` fixed batches of each split (same batches every call and every recipe)."""
    recipe.model.eval()
    out = {}
    for split in ("train", "val"):
        g = torch.Generator().manual_seed(10_000 + cfg.seed)
        losses = []
        for _ in range(cfg.eval_batches):
            x, y = (t.to(cfg.device) for t in corpus.batch(split, cfg.batch_size, cfg.model.block_size, g))
            with recipe.forward_context():
                _, loss = recipe.model(x, y)
            losses.append(float(loss))
        out[split] = sum(losses) / len(losses)
    recipe.model.train()
    return out


class Trainer:
    """One recipe's training run: step it, checkpoint it, resume it bit for bit.

    Every recipe starts from the same FP32 initialisation (``torch.manual_seed(cfg.seed)``) and
    sees the same batches (a generator seeded with ``cfg.seed``). ``state_dict()`` holds the
    recipe's state (weights, master copy, optimizer, loss scaler, FP8 scaling state), the batch
    generator, torch's global RNG, the step count and the history, so that
    ``Trainer(...).load_state_dict(sd)`` continues exactly where the saved run was.

    ``recipe``: a registered recipe's name, or a recipe class; a learner's functions in place of the library's
    ride in the class (``get_recipe(name).with_functions(...)``), checked where the recipe is built.

    ``inspect_every=N`` hooks the numerics inspector on the model and records every N-th step
    (``self.inspector.records``); its time is part of the step time. ``autoswitch`` (e.g. "underflow=0.05", see
    ``switching``) moves a quantized layer to high precision once its tensors pass a threshold; off by default.

    Raises:
        KeyError: unknown recipe name (the message lists the known ones).
        ValueError: an override the recipe does not accept (the message lists those it does).
    """

    #: enter ``tensor_cores(fast=True)``: the emulation's kernels on the matmul ops only; False: its dispatch mode
    #: (the same bits; the tests compare the two)
    fast_emulation = True

    def __init__(self, recipe: str | type[TrainingRecipe], corpus: Corpus, cfg: TrainConfig, inspect_every: int = 0,
                 autoswitch=None):
        recipe_cls = get_recipe(recipe) if isinstance(recipe, str) else recipe
        mcfg = GPTConfig(**{**asdict(cfg.model), "vocab_size": corpus.vocab_size})
        torch.manual_seed(cfg.seed)
        model = GPT(mcfg).to(cfg.device)                     # FP32 init, identical for every recipe
        with tensor_cores(fast=self.fast_emulation):
            self.cfg = cfg
            built = self.build_recipe(recipe_cls, model)
        self._setup(recipe_cls.name, built, corpus, cfg, torch.Generator().manual_seed(cfg.seed))
        self.inspect(inspect_every)
        self.switching(autoswitch)

    @classmethod
    def wrap(cls, recipe, corpus: Corpus, cfg: TrainConfig, batches: torch.Generator | None = None, *,
             start_step: int = 0, lr_decay: bool = True, evaluate: bool = True) -> "Trainer":
        """A Trainer around a recipe built elsewhere (tests and benchmarks that build or inspect it).

        ``batches`` draws the training batches (default: seeded with ``cfg.seed``); ``start_step`` is
        the step the first ``train_step`` runs; ``lr_decay=False`` keeps the rate constant after warm-up
        (``lr_at(step, optim)``); ``evaluate=False`` skips the periodic validation. The recipe's own
        ``optim`` sets the learning rate.
        """
        self = cls.__new__(cls)
        cfg = replace(cfg, optim=recipe.optim)
        self._setup(recipe.name or type(recipe).__name__, recipe, corpus, cfg,
                    batches if batches is not None else torch.Generator().manual_seed(cfg.seed))
        self.step, self.lr_decay, self.evaluate_during = start_step, lr_decay, evaluate
        return self

    def _setup(self, name, recipe, corpus, cfg, batches) -> None:
        self.name, self.recipe, self.corpus, self.cfg = name, recipe, corpus, cfg
        self.mcfg = GPTConfig(**{**asdict(cfg.model), "vocab_size": corpus.vocab_size})
        self.batches = batches                               # identical batch order for every recipe
        self.step, self.history, self.skipped, self.diverged_at = 0, [], 0, None
        self.step_time, self.timed_steps = 0.0, 0
        self.memory = None            # state bytes by kind (TrainingRecipe.memory) after the first step
        self.step_memory = None       # that step's StepMemory (state, activations, FP8 copies, peak)
        self.lr_decay, self.evaluate_during, self._emulating = True, True, False
        self.needs_emulation = None   # whether the first step ran a low-precision matmul through the emulation
        self._last_eval = None        # (step count after the evaluated step, {"train", "val"}) of the last evaluation
        self.inspector = None         # the numerics inspector (mpcourse.core.inspect), see ``inspect``
        self.autoswitch = None        # the layer switch (mpcourse.core.autoswitch), see ``switching``

    def inspect(self, every: int) -> None:
        """Record numerics statistics every ``every`` steps (``mpcourse.core.inspect.Inspector``); 0: off."""
        self.inspector = None
        if every:
            from mpcourse.core.inspect import Inspector
            scaler = getattr(self.recipe, "scaler", None)
            self.inspector = Inspector(self.recipe.model, every=every,
                                       loss_scale=(lambda: scaler.get_scale()) if scaler is not None else 1.0)

    def switching(self, rules) -> None:
        """After every step, switch each quantized layer whose own quantizer's statistics pass one of ``rules`` to
        high precision for the rest of the run (``mpcourse.core.autoswitch.Autoswitch``: a spec such as
        "underflow=0.05", "underflow=0.05,every=10" or "underflow=0.05,attention=tensor", or ``SwitchRule``
        objects; None: off). The step's events go into its history record
        (``autoswitch``) and to the console."""
        self.autoswitch = None
        if rules:
            from mpcourse.core.autoswitch import Autoswitch, Spec, parse_spec
            spec = parse_spec(rules) if isinstance(rules, str) else Spec(tuple(rules))
            self.autoswitch = Autoswitch(self.recipe.model, spec.rules, every=spec.every, echo=tqdm.write,
                                         attention=spec.attention)

    # -- what a data-parallel trainer (mpcourse.experiment.parallel.distributed) replaces --------------------
    def build_recipe(self, recipe_cls, model):
        """The recipe that trains ``model`` (FP32, freshly initialised)."""
        return recipe_cls(model, self.cfg.optim)

    def forward_loss(self, x, y) -> torch.Tensor:
        """The training loss of batch ``(x, y)`` (B, T) int64 as backward sees it: fp32 ()."""
        return self.recipe.model(x, y)[1]

    def loss_value(self, loss: torch.Tensor) -> float:
        """The step's loss as reported (every rank must get the same number)."""
        return float(loss.detach())

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.steps or self.diverged_at is not None

    @contextlib.contextmanager
    def emulation(self):
        """Enter ``tensor_cores()`` for everything inside, once; nested calls (each step's) do nothing more.
        Nothing either once the first step has shown that this run has no matmul to emulate (module docstring)."""
        if self._emulating or self.needs_emulation is False:
            yield
            return
        with tensor_cores(fast=self.fast_emulation):
            self._emulating = True
            try:
                yield
            finally:
                self._emulating = False

    def train_step(self, *, after_backward=None, after_step=None) -> dict:
        """The training step: one batch, one optimizer step; returns its history record.

        Hooks, for tests and tools that look inside: ``after_backward(step, recipe)`` runs after the
        backward, before ``recipe.step()`` (the gradients are there); ``after_step(step, recipe, result)``
        after it (``result``: the ``StepResult``), before the gradients are freed.
        """
        recipe, cfg = self.recipe, self.cfg
        x, y = self.corpus.batch("train", cfg.batch_size, self.mcfg.block_size, self.batches)  # (B, T) int64
        x, y = x.to(cfg.device), y.to(cfg.device)
        for watcher in (self.inspector, self.autoswitch):
            if watcher is not None:
                watcher.set_step(self.step)
        recipe.set_lr(lr_at(self.step, cfg.optim, cfg.steps if self.lr_decay else None))
        ab = (lambda r: after_backward(self.step, r)) if after_backward is not None else None
        as_ = (lambda r, res: after_step(self.step, r, res)) if after_step is not None else None
        with self.emulation():
            if self.step_memory is None:                     # memory counted on the first step (not timed)
                calls = emulated_calls()                     # measure_step wraps training_step
                loss, result, self.step_memory = measure_step(recipe, x, y, forward_loss=self.forward_loss,
                                                              after_backward=ab, after_step=as_)
                self.memory = {k: getattr(self.step_memory, k) for k in STATE_KINDS}
                if self.needs_emulation is None and self._emulating:
                    self.needs_emulation = emulated_calls() > calls
            else:
                t0 = time.perf_counter()
                loss, result = training_step(recipe, x, y, self.forward_loss, after_backward=ab, after_step=as_)
                self.step_time += time.perf_counter() - t0
                self.timed_steps += 1
            recipe.zero_grad()
            loss_value = self.loss_value(loss)
            self.skipped += int(result.skipped)
            rec = {"step": self.step, "loss": loss_value, "skipped": result.skipped,
                   "loss_scale": result.loss_scale}
            rec.update(result.stats)                         # opt-in statistics (none by default)
            if self.autoswitch is not None and (events := self.autoswitch.after_step(self.step)):
                rec["autoswitch"] = events                   # layers switched to high precision after this step
            if not math.isfinite(loss_value):
                self.diverged_at = self.step
            elif self.evaluate_during and ((self.step + 1) % cfg.eval_interval == 0 or self.step + 1 == cfg.steps):
                losses = evaluate(recipe, self.corpus, cfg)
                rec["val_loss"] = losses["val"]
                self._last_eval = (self.step + 1, losses)   # valid until the next step changes the model
        self.history.append(rec)
        self.step += 1
        return rec

    def run(self, steps: int | None = None, *, progress: bool = False, position: int = 0, on_step=None) -> "Trainer":
        """Train until ``cfg.steps`` (or ``steps`` more), stopping early if the loss becomes inf/NaN.
        ``on_step(trainer)`` runs after every step (``mpcourse.experiment.compare.pool`` counts progress with it)."""
        stop = self.cfg.steps if steps is None else min(self.cfg.steps, self.step + steps)
        bar = tqdm(total=stop, initial=self.step, desc=f"{self.name:>16}", disable=not progress,
                   position=position, leave=True, dynamic_ncols=True)
        try:
            while self.step < stop and self.diverged_at is None:
                rec = self.train_step()                      # each step enters the emulation (or not: see above)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                if on_step is not None:
                    on_step(self)
            if self.diverged_at is not None and bar.total != self.step:
                bar.total = self.step                        # stopped early: the bar ends at 100% of the steps run
                bar.set_description(f"{self.name:>16} (diverged at step {self.diverged_at})", refresh=False)
                bar.refresh()
        finally:                                             # Ctrl-C too: what is said next starts its own line
            bar.close()
        return self

    def result(self) -> RunResult:
        """Final evaluation and report (losses NaN if the run diverged: nothing is averaged away)."""
        if self.diverged_at is None and self._last_eval is not None and self._last_eval[0] == self.step:
            final = self._last_eval[1]     # the last step evaluated this very model on the same batches
        elif self.diverged_at is None:
            with self.emulation():
                final = evaluate(self.recipe, self.corpus, self.cfg)
        else:
            final = {"train": float("nan"), "val": float("nan")}
        steps_run = len(self.history)
        return RunResult(
            recipe=self.name, description=self.recipe.description,
            final_train_loss=final["train"], final_val_loss=final["val"],
            skipped_steps=self.skipped,
            final_loss_scale=self.history[-1]["loss_scale"] if self.history else None,
            tokens_per_s=self.timed_steps * self.cfg.batch_size * self.mcfg.block_size / max(self.step_time, 1e-9),
            bytes_per_param=self.step_memory.bytes_per_param() if self.step_memory else {},
            activation_bytes=self.step_memory.activations + self.step_memory.fp8_cache if self.step_memory else 0,
            memory=self.step_memory.to_dict() if self.step_memory else {},
            flops_per_token=flops_per_token(self.mcfg.n_layer, self.mcfg.n_embd, self.mcfg.block_size,
                                            self.mcfg.vocab_size, mlp=mlp_weights_per_token(self.model_config())),
            steps_run=steps_run, diverged_at=self.diverged_at,
            history=list(self.history))

    def model_config(self) -> GPTConfig:
        """The config of the model the recipe trains (a MoE recipe's twin has its own; a wrapper's module's), else
        the run's."""
        model = getattr(self.recipe.model, "module", self.recipe.model)
        return getattr(model, "cfg", self.mcfg)

    def state_dict(self) -> dict:
        """A checkpoint: recipe state, RNG states, step, history, the corpus it trains on (``corpus_id``)."""
        state = {"recipe_name": self.name, "recipe": self.recipe.state_dict(), "step": self.step,
                 "history": list(self.history), "skipped": self.skipped, "diverged_at": self.diverged_at,
                 "batch_rng": self.batches.get_state(), "torch_rng": torch.get_rng_state(),
                 "corpus": corpus_id(self.corpus)}
        if self.autoswitch is not None:
            state["autoswitch"] = self.autoswitch.state_dict()  # the layers switched so far
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``. Raises ValueError (``CheckpointError``) if it was saved under another
        recipe or does not have a Trainer checkpoint's keys; the recipe checks its own state before loading."""
        keys = {"recipe_name", "recipe", "step", "history", "skipped", "diverged_at", "batch_rng", "torch_rng"}
        if not isinstance(state, dict) or set(state) - {"corpus", "autoswitch"} != keys:   # optional: absent in older ones
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"not a Trainer checkpoint: expected the keys {sorted(keys)}, got {got}")
        if state["recipe_name"] != self.name:
            raise ValueError(f"checkpoint is from recipe {state['recipe_name']!r}, not {self.name!r}; "
                             f"build Trainer({state['recipe_name']!r}, ...) to resume it")
        check_same_corpus(state.get("corpus"), self.corpus)
        switched = state.get("autoswitch", {}).get("switched", [])
        if switched and self.autoswitch is None:
            raise CheckpointError(f"the checkpoint's run switched {switched} to high precision (--autoswitch): "
                                  "resume it with the same --autoswitch, or those layers would go back to low precision")
        self.recipe.load_state_dict(state["recipe"])
        if self.autoswitch is not None and "autoswitch" in state:
            self.autoswitch.load_state_dict(state["autoswitch"])
        self.step, self.history = state["step"], list(state["history"])
        self._last_eval = None
        self.skipped, self.diverged_at = state["skipped"], state["diverged_at"]
        self.batches.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"])

    def save(self, path) -> str:
        """Write ``state_dict()`` to ``path`` with a SHA-256 checksum (``mpcourse.core.checkpoint``); returns it."""
        return save_checkpoint(self.state_dict(), path)

    def load(self, path) -> "Trainer":
        """Resume from a file written by ``save``. A damaged file (checksum or length mismatch) raises
        ``CheckpointError`` before any state is touched, instead of resuming with damaged weights or optimizer
        state."""
        self.load_state_dict(load_checkpoint(path))
        return self


def corpus_id(corpus: Corpus) -> dict:
    """What a checkpoint records of its corpus: name, length, vocabulary size and the SHA-256 of the text."""
    import hashlib

    return {"name": corpus.name, "chars": len(corpus.text), "vocab_size": corpus.vocab_size,
            "sha256": hashlib.sha256(corpus.text.encode("utf-8")).hexdigest()}


def check_same_corpus(saved: dict | None, corpus: Corpus) -> None:
    """CheckpointError naming ``--data`` unless ``saved`` (a checkpoint's ``corpus_id``; None: an older checkpoint
    that did not record it) is ``corpus``'s: resumed on another text the run would go on silently on other data."""
    here = corpus_id(corpus)
    if saved is not None and saved.get("sha256") != here["sha256"]:
        raise CheckpointError(
            f"corpus mismatch: the checkpoint was trained on {saved['name']} ({saved['chars']:,} chars, vocab "
            f"{saved['vocab_size']}, sha256 {saved['sha256'][:12]}), this run reads {here['name']} "
            f"({here['chars']:,} chars, vocab {here['vocab_size']}, sha256 {here['sha256'][:12]}): resume with "
            "the same --data (no --data: the embedded corpus)")


def train(recipe: str | type[TrainingRecipe], corpus: Corpus, cfg: TrainConfig, *, progress: bool = True,
          position: int = 0, label: str | None = None, autoswitch=None) -> RunResult:
    """Train a fresh GPT on ``corpus`` under ``recipe`` (a name, or a recipe class, e.g. one carrying a learner's
    functions: ``TrainingRecipe.with_functions``) and report the outcome.

    A run whose training loss becomes inf or NaN stops there (``diverged_at``), and its final
    losses are NaN: nothing is silently averaged away. ``label``: the name of the result's row (default the
    recipe's); ``autoswitch``: switch layers to high precision on what the inspector sees (``Trainer.switching``).

    Raises:
        KeyError: unknown recipe name (the message lists the known ones).
    """
    trainer = Trainer(recipe, corpus, cfg, autoswitch=autoswitch)
    if label is not None:
        trainer.name = label                                 # the row's name, e.g. "fp16-dynamic [yours]"
    return trainer.run(progress=progress, position=position).result()


def train_inspected(name: str, corpus: Corpus, cfg: TrainConfig, out, every: int, progress: bool,
                    on_step=None, autoswitch=None) -> RunResult:
    """``train`` with the numerics inspector every ``every`` steps; writes ``out/inspect-NAME.json`` (every record:
    the element formats' fractions and every recipe's quantizer statistics, ``mpcourse.core.inspect``),
    ``out/inspect-NAME.png`` (layer x step: FP16-subnormal fraction of the output gradients),
    ``out/inspect-NAME-recipes.png`` (layer x recipe, per role: the underflow fraction under each recipe's
    quantizer, mean over the inspected steps) and ``out/inspect-NAME-hist.png`` (log2|x| of the last inspected
    step's output gradient with the widest dynamic range, each format's flush-to-zero edge marked); with FP8
    attention, ``out/inspect-NAME-attention.png`` (each attention tensor x recipe, ``inspect_attention``) and
    ``out/inspect-NAME-attention-hist.png``; with ``autoswitch``, the JSON's ``autoswitch`` lists the layers
    switched and why. Used by ``mpcourse compare
    --inspect`` in this process and in the pool's workers."""
    from pathlib import Path

    from mpcourse.core.inspect import plot_binades, plot_heatmap, plot_recipe_heatmap
    from mpcourse.core.inspect_attention import plot_attention_histogram, plot_attention_recipes

    out = Path(out)
    trainer = Trainer(name, corpus, cfg, inspect_every=every, autoswitch=autoswitch).run(progress=progress,
                                                                                         on_step=on_step)
    records = trainer.inspector.records
    extra = {"autoswitch": trainer.autoswitch.events} if trainer.autoswitch is not None else {}
    trainer.inspector.to_json(out / f"inspect-{name}.json", **extra)
    if records:
        plot_heatmap(records, out / f"inspect-{name}.png", role="output_grad", fmt="fp16", kind="subnormal")
        plot_recipe_heatmap(records, out / f"inspect-{name}-recipes.png")
        last = [r for r in records if r["step"] == records[-1]["step"] and r["role"] == "output_grad"] or records
        plot_binades(max(last, key=lambda r: r["dynamic_range_binades"]), out / f"inspect-{name}-hist.png")
        plot_attention_recipes(records, out / f"inspect-{name}-attention.png")        # FP8 attention, if any
        plot_attention_histogram(records, out / f"inspect-{name}-attention-hist.png")
    trainer.inspector.remove()
    return trainer.result()
