"""``mpcourse compare``: train one model under every precision recipe and report side by side.

For each recipe: final train and validation loss and the gap to FP32, its largest loss spike
(``mpcourse.experiment.measure.spikes``, judged against the runs of the same seed on the same batches), skipped
steps, the final loss scale, tokens per second, bytes per parameter (weights + gradients + master copy + optimizer
state), the activation bytes and the peak bytes of one step (``mpcourse.experiment.measure.memory``), and the
fraction of the machine's peak FLOP/s the step reaches (``mpcourse.experiment.measure.speed``). With several
seeds (``seeds=[0, 1, 2]``) every recipe runs once per seed and the table shows mean +- standard
deviation (sample std, n-1) of the final losses and of the gap to FP32 (the gap is taken per seed, each
recipe against the FP32 run of the same seed). Writes ``DIR/results.json`` (one object per run,
``RunResult.to_dict()`` plus its ``seed``) and ``DIR/loss_curves.png`` (the first seed).

One module per concern:

- ``run``: the job, ``run_compare`` (every recipe on every seed; a failed or interrupted run keeps the others);
- ``pool``: ``--jobs N``, the runs trained in worker processes;
- ``report``: the table (one seed, or mean +- std over seeds) and the seed table's numbers for ``results.json``;
- ``spikes``: which runs spiked, each judged against the runs of its seed, and the peak loss after warm-up;
- ``peaks``: the peak FLOP/s each row's %peak is taken against;
- ``plot``: the loss curves, one panel per recipe family;
- ``outputs``: what a job writes into its folder (``results.json``, strict JSON, and the plot);
- ``learner_rows``: the ``[yours]`` rows, a recipe trained with a learner's functions, and their verdicts.

The command line that runs it is ``mpcourse.experiment.cli.compare``.
"""
