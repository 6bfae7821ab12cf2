"""``python -m mpcourse``: the same command line as the ``mpcourse`` console script."""
import sys

from .cli import main

sys.exit(main())
