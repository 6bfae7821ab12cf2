"""``mpcourse compare``'s progress bars end at 100% when a recipe diverges (``fp16-pure`` is NaN at step 1 and
stops there): the one bar over all runs of ``--jobs N`` and the per-recipe bar of a run in this process."""
import pytest
import tqdm

from mpcourse.experiment.compare import pool
from mpcourse.experiment.training import train
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.gpt.model import GPTConfig
from mpcourse.experiment.compare.pool import Task, run_pool
from mpcourse.experiment.training.train import TrainConfig, Trainer

SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
CFG = TrainConfig(steps=4, batch_size=2, eval_interval=2, eval_batches=1, model=SMALL)


@pytest.fixture
def closed_bars(monkeypatch):
    """Every bar the code under test draws, as (n, total, description) when it is closed."""
    seen = []

    class Recording(tqdm.tqdm):
        def close(self):
            if not self.disable and not getattr(self, "_recorded", False):
                self._recorded = True
                seen.append((self.n, self.total, self.desc))
            super().close()

    monkeypatch.setattr(pool, "tqdm", Recording)
    monkeypatch.setattr(train, "tqdm", Recording)
    return seen


def test_one_process_bar_of_a_diverged_run_ends_at_100_percent(closed_bars):
    t = Trainer("fp16-pure", load_corpus(), CFG).run(progress=True)
    assert t.diverged_at == 1 and len(t.history) == 2            # the precondition: it stops early
    (n, total, desc), = closed_bars
    assert n == total == 2 and "diverged at step 1" in desc
    Trainer("fp32", load_corpus(), CFG).run(progress=True)       # a run that does not diverge is unchanged
    assert closed_bars[1][:2] == (4, 4) and "diverged" not in closed_bars[1][2]


@pytest.mark.slow
def test_pool_bar_counts_a_diverged_runs_remaining_steps_as_done(closed_bars):
    tasks = [Task("fp16-pure", CFG), Task("fp32", CFG)]
    results = run_pool(tasks, load_corpus(), jobs=2, threads=1, progress=True)
    assert [r.diverged_at for r in results] == [1, None] and [r.steps_run for r in results] == [2, 4]
    (n, total, _), = closed_bars
    assert n == total == 8
