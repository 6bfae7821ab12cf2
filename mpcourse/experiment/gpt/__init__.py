"""The model every recipe trains and the text it reads: ``model`` (a small GPT) and ``data`` (the embedded
character-level corpus, or ``--data PATH``)."""
