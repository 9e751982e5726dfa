"""Test setup: 8 fake CPU devices (real sharding), float64 available, strict rank promotion."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Deviceless TPU compiles load libtpu in the test process; two pytest-xdist workers doing so at
# once collide on libtpu's lockfile ("Internal error when accessing libtpu multi-process
# lockfile", seen here) unless told that several loads are meant (no TPU is opened: they compile).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent XLA cache for every test process (pytest-xdist workers, the training processes the
# fault and distributed tests start, later runs): the suite compiles the same small steps in many
# processes. A key is the program, the jax version and the flags, so a hit is the same executable.
# Tests of the cache itself (train.compilation_cache) point it at their own directory.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"span_lm_tests_xla_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def enwik8_head(tmp_path_factory):
  """The head of enwik8 packaged with span_lm (span_lm/data/demo), as a raw file: tests that need
  a real text file on disk (data.path) read it; nothing outside the checkout is needed."""
  from span_lm.data import demo  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp("data") / "enwik8_head.bin"
  path.write_bytes(demo.read_bytes())
  return path
