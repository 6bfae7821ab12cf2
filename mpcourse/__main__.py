"""``python -m mpcourse``: the same command line as the ``mpcourse`` console script."""
import sys

from .experiment.cli import main

sys.exit(main())
