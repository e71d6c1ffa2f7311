"""The old name of :mod:`mlxbun.synth.write`, for the two callers that still use it
(tests/test_serve.py, bench/serve.py): delete this module once they import ``mlxbun.synth.write``."""

import sys

from mlxbun.synth import write

sys.modules[__name__] = write
