"""A jax without Pallas's Triton backend (deprecated in jax 0.11 for removal): `import span_lm`
works, `auto` takes the XLA path and says why in one log line, an explicit GPU kernel is refused
in one line naming the jax version and the alternatives; the same for the sparse kernel. The
backend is hidden as a removed module is (its sys.modules entry None: importing it fails)."""
import json
import logging
import os
import subprocess
import sys

import pytest

import jax

from model_helpers import build
from span_lm import kernels
from span_lm.kernels.sparse import door as sparse_door
from span_lm.kernels import target
from span_lm.model import attention_rules

TRITON = "jax.experimental.pallas.triton"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_triton(monkeypatch):
  monkeypatch.setitem(sys.modules, TRITON, None)
  assert target.triton_missing()


def _cfg(impl):
  return build({"vocab_size": 11, "d_model": 32, "n_heads": 2, "d_ff": 8, "span.size": 64,
                "span.ramp": 4, "attention.impl": impl, "attention.block": 64,
                "plan.granularity": 64})


def test_this_jax_has_the_triton_backend():
  """The CI environments' jax lines (0.10 to 0.12) still have it: the GPU kernels are live."""
  assert target.triton_missing() == ""


def test_import_span_lm_loads_no_triton():
  """Neither Pallas's Triton lowering nor our kernels (jax's own jaxlib.gpu_triton, loaded by
  `import jax`, is not ours to avoid)."""
  code = ("import sys, span_lm, span_lm.layers, span_lm.kernels, span_lm.model, span_lm.train, "
          "span_lm.tools, span_lm.cli; import json; "
          "print(json.dumps(sorted(m for m in sys.modules if 'pallas.triton' in m "
          "or m.startswith(('span_lm.kernels.span.pallas', 'span_lm.kernels.sparse.pallas')))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_auto_takes_the_xla_path_on_a_gpu_and_says_why(no_triton, caplog):
  cfg = _cfg("auto")
  with target.compiling_for("gpu", 9.0), caplog.at_level(logging.INFO, logger="span_lm"):
    impl = kernels.select(cfg.attn_spec, 64, 192)  # a shape no other test logs (logged once)
    assert impl.name == "reference"
    assert attention_rules.fit_fallback(cfg) is None  # no kernel to fall back to for memory either
  lines = [r.getMessage() for r in caplog.records if "no Pallas Triton backend" in r.getMessage()]
  assert len(lines) == 1 and jax.__version__ in lines[0] and "XLA path" in lines[0]


@pytest.mark.parametrize("impl", ["pallas", "pallas_interpret"])
def test_an_explicit_gpu_kernel_is_refused_in_one_line(no_triton, impl):
  with pytest.raises(ValueError) as e:
    kernels.check(_cfg(impl).attn_spec)
  msg = str(e.value)
  assert "\n" not in msg and jax.__version__ in msg and "'auto'" in msg and "'reference'" in msg


def test_the_sparse_kernel_degrades_too(no_triton):
  with pytest.raises(ValueError) as e:
    sparse_door.check(sparse_door.SparseSpec("pallas"))
  assert "\n" not in str(e.value) and jax.__version__ in str(e.value) and "'jnp'" in str(e.value)
  with target.compiling_for("gpu", 9.0):
    name, why = sparse_door.choose(sparse_door.SparseSpec("auto", 4, 1024, 64))
  assert name == "jnp" and "no Pallas Triton backend" in why
  with target.compiling_for("tpu", kind="TPU v5p"):  # other platforms are untouched
    assert sparse_door.choose(sparse_door.SparseSpec("auto", 4, 1024, 64))[0] == "splash"


@pytest.mark.slow
def test_main_refuses_the_gpu_kernel_in_one_line(tmp_path):
  """Through the command line, before anything compiles: one line, exit status 1."""
  code = (f"import sys, runpy; sys.modules[{TRITON!r}] = None; "
          "sys.argv = ['main.py', '--config=configs/tiny.py:smoke', "
          f"'--config.workdir={tmp_path}/run', '--config.model.attention.impl=pallas']; "
          "runpy.run_path('main.py', run_name='__main__')")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 1, out.stderr[-2000:]
  err = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(err) == 1 and "no Pallas Triton backend" in err[0] and "Traceback" not in out.stderr
