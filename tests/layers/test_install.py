"""A plain install gives `from span_lm import layers` anywhere (issue 43, goal 8): the README and
docs/layer.md say `pip install -e .` (or `pip install .`) where they introduce the layer, since
`pip install -r requirements.txt` installs only the dependencies.

The test builds and installs this checkout with pip into an empty folder (no dependencies, no
index: nothing from the network; the environment's setuptools builds it), then imports the layer
and runs a forward pass from another empty folder with only that folder on PYTHONPATH. Where the
environment's setuptools cannot build a wheel offline (before 70.1 it needs the `wheel` package,
which pip's isolated build would fetch), setuptools' `build_py` lays the package out instead: the
same files a wheel of this pure-Python package holds (package discovery and package data from
pyproject.toml), without its metadata.
"""
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import span_lm
    from span_lm import layers
    from span_lm.data import demo
    attn = layers.AdaptiveSpanAttention(num_heads=2, max_span=16, causal=False,
                                        span_init=0.5)
    x = jax.random.normal(jax.random.key(0), (2, 40, 16))
    v = attn.init(jax.random.key(1), x)
    y, state = attn.apply(v, x, segment_ids=jnp.asarray([[1] * 40, [1] * 30 + [0] * 10]),
                          mutable=["intermediates"])
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y))), y
    assert float(jnp.abs(y[1, 30:]).max()) == 0.0  # padding (segment 0) gives zeros
    print("FILE", span_lm.__file__)
    print("LOSS", float(layers.span_loss(state["intermediates"])))
    print("DEMO", len(demo.read_bytes()))  # the packaged corpus came with the install
""")


def _setuptools_version():
  try:
    return tuple(int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return None


@pytest.mark.slow
def test_plain_install_imports_the_layer_from_another_directory(tmp_path):
  if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                    check=False).returncode:
    pytest.skip("needs pip")
  st = _setuptools_version()
  if st is None:
    pytest.skip("needs setuptools (the build backend) in this environment: no network here")
  # What pip builds from: this checkout's package, metadata, readme and licence (a copy, so the
  # build leaves no build/ or egg-info in the checkout).
  src = tmp_path / "src"
  shutil.copytree(REPO / "span_lm", src / "span_lm",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  for f in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(REPO / f, src / f)
  pyproject = (src / "pyproject.toml").read_text()
  assert 'license = "Apache-2.0"' in pyproject
  if st < (77, 0):
    # pyproject asks for setuptools >= 77 (PEP 639's licence string); pip's isolated build
    # fetches one, but with no network this environment's older setuptools builds, given the
    # licence in the table form it reads. Nothing else of the package changes.
    (src / "pyproject.toml").write_text(
        pyproject.replace('license = "Apache-2.0"', 'license = {text = "Apache-2.0"}'))
  site = tmp_path / "site"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
  if st >= (70, 1) or importlib.util.find_spec("wheel") is not None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
           "--no-index", "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
           str(src)]
  else:
    cmd = [sys.executable, "-c", "from setuptools import setup; setup()", "build_py",
           "--build-lib", str(site)]
  proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (site / "span_lm" / "layers" / "attention.py").is_file()
  assert (site / "span_lm" / "data" / "demo" / "enwik8_head.xz").is_file()

  elsewhere = tmp_path / "elsewhere"  # an empty folder: no checkout beside or above it
  elsewhere.mkdir()
  env.update(PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", PROBE], cwd=elsewhere, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
  assert pathlib.Path(out["FILE"]).is_relative_to(site), out  # the installed copy ran
  assert float(out["LOSS"]) > 0 and int(out["DEMO"]) == 4_154_000, out
