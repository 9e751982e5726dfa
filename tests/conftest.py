"""Test setup: 8 fake CPU devices (real sharding), float64 available, strict rank promotion."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
