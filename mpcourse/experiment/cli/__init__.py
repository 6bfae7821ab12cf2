"""The experiment's sub-commands of ``mpcourse``, one module each: ``compare`` (beside it: ``presets``, the model
sizes and ``--quick``; ``out_folder``, where a run writes; ``compare_parallel``, a run over processes) and
``recipes``. Each module builds its sub-command's parser (``add_parser``) beside the function that runs it;
``mpcourse.cli`` dispatches to them and to the course's commands. ``argtypes``: the argument types; ``parser``:
the parser whose errors are one line.
"""
