"""The experiment: the corpus (``data``), the GPT (``model``), the precision recipes
(``recipes``), the training loop (``train``), the compare job (``compare``) and the command line
(``cli``).

The experiment imports the library (``mpcourse.core``); the library never imports it.
"""
