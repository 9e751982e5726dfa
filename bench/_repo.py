"""`import _repo` first in a bench script: the checkout's span_lm, without `pip install -e .`.

`python bench/X.py` puts bench/ on sys.path, not the checkout's root, so `import span_lm` found
only an installed copy (ModuleNotFoundError without one; another tree's code with one). This puts
the root first: the script runs the span_lm beside it. Tests that import bench scripts (bench/ on
sys.path) get the same. tests/test_fresh_clone.py checks every script that imports span_lm.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
