"""mpcourse: mixed-precision training (FP16, BF16, FP8) from first principles.

Three layers, each its own folder, imports running one way (``tests/test_layout.py``):

* ``mpcourse.core``: the library proper (formats, tensor-core emulation, master weights, loss
  scaling, autocast, BF16 updates, the quantization package). Imports nothing of the other two.
* ``mpcourse.experiment``: the corpus, the GPT, the precision recipes, the training loop, the
  compare job and the command line. Imports the library.
* ``mpcourse.course``: graders shared by the tests and the notebooks' check cells, and exercise
  generation. Imports the library (and the experiment, to train with a learner's code).
"""
__version__ = "0.1.0"
