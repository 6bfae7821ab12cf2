"""Course tooling: the graders the check cells and the tests share (``grading``) and the exercises
generated from the solutions (``exercises``; ``python -m mpcourse.course``).

Course tooling may import the library (``mpcourse.core``) and the experiment
(``mpcourse.experiment``); the library never imports it.
"""
