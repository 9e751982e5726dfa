"""The plain float64 definition now lives in span_lm/testing.py (bench's GPU checks use it too, and
bench imports nothing from tests/); this name stays an alias for the tests that import it."""
import sys

from span_lm import testing

sys.modules[__name__] = testing
