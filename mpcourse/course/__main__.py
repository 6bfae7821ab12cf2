"""``python -m mpcourse.course``: the course tooling's command line (see ``exercises``)."""
import sys

from .exercises import main

sys.exit(main())
