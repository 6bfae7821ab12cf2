"""The experiment: the course's GPT trained under every precision recipe, side by side.

Rooms by what they do, on floors: a folder imports only folders on lower floors (``FLOORS``, held to the code by
``tests/test_layout.py``), so the experiment reads top-down, from the command line to the model::

    7  cli         the ``mpcourse`` sub-commands, one module each (and ``--with``'s check of a learner's notebooks)
    6  parallel    DDP / FSDP2 runs over processes
    5  compare     the comparison job: its runs, table, plot and output files, one module each
    5  ablations   the studies the lessons cite, and ``rank-layers``
    4  training    the loop (``Trainer``), its threads
    3  measure     memory, speed, spikes, the CPU kind
    2  recipes     the training recipes (``TrainingRecipe``), one step of one (``recipes.step``), what one holds
    1  gpt         the model and its corpus
    1  learner     a learner's functions read from a notebook

The experiment imports the library (``mpcourse.core``); the library never imports it.
"""

#: each folder (or top-level module) of the experiment and its floor: an import runs only to a lower floor
FLOORS = {"gpt": 1, "learner": 1, "recipes": 2, "measure": 3, "training": 4, "compare": 5, "ablations": 5,
          "parallel": 6, "cli": 7}
