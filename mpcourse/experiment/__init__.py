"""The experiment: the course's GPT trained under every precision recipe, side by side.

Rooms by what they do: ``gpt`` (the model and its corpus), ``recipes`` (the precision recipes), ``training`` (the
step and the loop), ``measure`` (memory, speed, spikes, the CPU kind), ``parallel`` (DDP / FSDP2 runs over
processes), ``ablations`` (the studies the lessons cite, and ``rank-layers``), ``compare`` (the comparison job: its
runs, table, plot and output files, one module each) and ``cli`` (the ``mpcourse`` sub-commands that run it, one
module each).

The experiment imports the library (``mpcourse.core``); the library never imports it.
"""
