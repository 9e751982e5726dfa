"""The door (span_lm/kernels): every implementation equals `reference` in values and in every
gradient (queries, keys, values, position embeddings, spans, persistent memory), for fixed,
adaptive and dynamic spans, in float32 and bfloat16; `auto` picks by backend; one table, one
`select`, one `check`, and the Pallas kernels load only where chosen."""
import dataclasses
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from model_helpers import build
from span_lm import kernels
from span_lm.model import attention_rules

B, G, DH, R = 2, 2, 16, 4


def cfg_for(impl, **kw):
  base = {"vocab_size": 11, "d_model": G * DH, "n_heads": G, "d_ff": 8, "span.size": 32,
          "span.ramp": R, "span.mode": "adaptive", "attention.impl": impl, "attention.block": 16,
          "plan.granularity": 16}
  return build(base, **kw)


def _case(mode, m, w, n_pers, dtype, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  args = [arr(B, G, m, DH), arr(B, G, w + m, DH), arr(B, G, w + m, DH), arr(DH, w)]
  z = {"fixed": None, "adaptive": rng.uniform(1, w - R, (1, G, 1)),
       "dynamic": rng.uniform(0, w, (B, G, m))}[mode]
  z = None if z is None else jnp.asarray(z, jnp.float32)
  pers = (arr(G, DH, n_pers), arr(G, n_pers, DH)) if n_pers else (None, None)
  return args, z, pers


_SHAPES = [("fixed", 16, 16, 0), ("adaptive", 16, 32, 0), ("dynamic", 16, 32, 0),
           ("adaptive", 16, 16, 16), ("dynamic", 32, 16, 16)]
# Every shape in both dtypes; the interpreted kernel (slow) takes bf16 for the adaptive ones only.
_CASES = [(impl, *shape, dtype) for impl in ("cpu", "pallas_interpret") for shape in _SHAPES
          for dtype in ("float32", "bfloat16")
          if not (impl == "pallas_interpret" and dtype == "bfloat16" and shape[0] != "adaptive")]
# The TPU kernel: float32 in every span mode and with persistent memory, bf16 adaptive.
_CASES += [("pallas_tpu_interpret", *shape, dtype) for shape in _SHAPES
           for dtype in ("float32", "bfloat16") if dtype == "float32" or shape == _SHAPES[1]]


@pytest.mark.slow
@pytest.mark.parametrize("impl,mode,m,w,n_pers,dtype", _CASES)
def test_every_implementation_equals_the_reference(impl, mode, m, w, n_pers, dtype):
  (q, k, v, pe), z, (pk, pv) = _case(mode, m, w, n_pers, dtype)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

  def loss(impl, q, k, v, pe, z, pk, pv):
    out = kernels.IMPLS[impl].attend(cfg_for(impl).attn_spec, q, kernels.KV(k, v), pe, span_z=z,
                                     pers_k_GxDxN=pk, pers_v_GxNxD=pv)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  argnums = tuple(i for i, a in enumerate((q, k, v, pe, z, pk, pv)) if a is not None)
  grad = lambda impl: jax.jit(jax.value_and_grad(
      lambda *a: loss(impl, *a), argnums=argnums, has_aux=True))(q, k, v, pe, z, pk, pv)
  (_, got), g_got = grad(impl)
  (_, want), g_want = grad("reference")
  low = dtype == "bfloat16"
  tol = dict(rtol=3e-2, atol=3e-2) if low else dict(rtol=2e-4, atol=2e-5)
  assert got.shape == want.shape == q.shape and got.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
  names = [("q", "k", "v", "pe", "z", "pk", "pv")[i] for i in argnums]
  for name, a, b in zip(names, g_got, g_want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, name
    assert np.abs(b).max() > 0, name
    scale = np.abs(b).max() if low else 1.0  # bf16: relative to the gradient's size
    np.testing.assert_allclose(a / scale, b / scale, err_msg=f"d{name}", **tol)


def test_auto_picks_cpu_on_the_cpu_and_logs_once(caplog):
  spec = cfg_for("auto").attn_spec
  assert jax.default_backend() == "cpu"
  with caplog.at_level(logging.INFO, logger="span_lm"):
    assert kernels.choose(spec, 16, 32) == "cpu"
    assert kernels.choose(spec, 16, 32) == "cpu"
  assert sum("attention: cpu" in r.message for r in caplog.records) <= 1
  assert not kernels.runtime_spans(spec)


def test_fused_falls_back_to_the_reference_where_it_does_not_tile():
  spec = cfg_for("pallas_interpret").attn_spec
  assert kernels.choose(spec, 16, 32) == "pallas_interpret"
  assert kernels.choose(spec, 1, 32) == "reference"  # init's one-token block
  assert kernels.runtime_spans(spec)
  for impl in ("reference", "cpu"):
    assert kernels.choose(cfg_for(impl).attn_spec, 16, 32) == impl


def test_auto_on_a_gpu_runs_what_was_timed_faster(monkeypatch):
  """On a GPU `auto` follows kernels.GPU_TIMINGS: the kernel only where every timing of the
  current version has it faster; a timing of an older version, or none, gives the XLA path."""
  from span_lm.kernels import target  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.span import door, pallas_gpu  # pylint: disable=g-import-not-at-top
  cfg = cfg_for("auto", n_heads=2, d_model=128)  # head size 64
  spec = cfg.attn_spec
  timing = lambda version, *ms: {(9, 64): {"version": version, "source": "test",
                                           "ms": dict(zip(("learned", "all S"), ms))}}
  with target.compiling_for("gpu", 9.0):
    monkeypatch.setattr(door, "GPU_TIMINGS", timing("older", (1.0, 5.0), (2.0, 5.0)))
    assert kernels.choose(spec, 16, 32) == "reference" and "untimed" in kernels.why(spec, 16, 32)
    monkeypatch.setattr(door, "GPU_TIMINGS",
                        timing(pallas_gpu.VERSION, (1.0, 5.0), (2.0, 5.0)))
    assert kernels.choose(spec, 16, 32) == "pallas" and "faster" in kernels.why(spec, 16, 32)
    assert attention_rules.fit_fallback(cfg) is None  # the kernel already
    monkeypatch.setattr(door, "GPU_TIMINGS",
                        timing(pallas_gpu.VERSION, (1.0, 5.0), (6.0, 5.0)))  # slower at one
    assert kernels.choose(spec, 16, 32) == "reference"
    # unless the XLA path does not fit
    assert attention_rules.fit_fallback(cfg).attention.impl == "pallas"
  with target.compiling_for("gpu", 8.0):  # another generation: untimed
    assert kernels.choose(spec, 16, 32) == "reference"


def test_xla_is_read_as_cpu():
  assert cfg_for("xla").attention.impl == "cpu"
  with pytest.raises(ValueError, match="config.model.attention.impl"):
    cfg_for("triton")


def test_only_the_door_imports_a_platform_implementation():
  """model/ reaches attention through span_lm.kernels only; the reference imports no other
  implementation; tools/flops and tools/paper import each other no more."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[2] / "span_lm"

  def imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return names

  platform = ("span_lm.kernels.span.banded_cpu", "span_lm.kernels.span.pallas_gpu",
              "span_lm.kernels.span.pallas_tpu", "span_lm.kernels.span.impl_",
              "span_lm.kernels.span.ring", "span_lm.kernels.span.banded_reference")
  for path in (root / "model").rglob("*.py"):
    bad = [n for n in imports(path) if n.startswith(platform)]
    assert not bad, f"{path.name} imports {bad}"
  assert not any("banded_cpu" in n or "pallas_gpu" in n
                 for n in imports(root / "kernels" / "span" / "banded_reference.py"))
  assert "span_lm.tools.paper" not in imports(root / "tools" / "flops.py")


def test_one_table_every_implementation_offers_the_same_functions():
  """config.model.attention.impl's names are the table's (and 'auto'); each implementation's module
  offers the door's functions, and `select` hands out the table's entries."""
  assert kernels.ATTN_IMPLS == ("auto",) + tuple(kernels.IMPLS)
  surface = ("project_kv", "split_kv", "attend", "cached_rows", "residual_bytes",
             "schedule_cost", "compiler_options", "misfit")
  for name, impl in kernels.IMPLS.items():
    assert impl.name == name and cfg_for(name).attention.impl == name
    missing = [f for f in surface if not callable(getattr(impl.ops, f, None))]
    assert not missing, f"{impl.ops_module} lacks {missing}"
    spec = cfg_for(name).attn_spec
    misfit = impl.misfit(spec, 16, 32)
    assert kernels.select(spec, 16, 32) is (kernels.IMPLS["reference"] if misfit else impl)
    assert kernels.why(spec, 16, 32) == misfit
    assert (impl.platform is None) == (not impl.needs)  # a compiled kernel says what it needs
  assert kernels.select(cfg_for("pallas_interpret").attn_spec, 1, 32) is kernels.IMPLS["reference"]
  # Mosaic's rule, compiled only
  assert "128 lanes" in kernels.why(cfg_for("pallas_tpu").attn_spec, 16, 32)
  assert kernels.why(cfg_for("pallas_tpu_interpret").attn_spec, 16, 32) == ""
  assert kernels.select(cfg_for("auto").attn_spec, 16, 32) is kernels.IMPLS["cpu"]


_LAZY_CHILD = """
import sys
import span_lm.config
from span_lm import kernels
from span_lm.model import attention_rules
assert "jax" not in sys.modules, "the door and the config validate without jax"
import jax, jax.numpy as jnp
from span_lm.model import attention_rules, caches, config, transformer
from span_lm.train import loop  # the trainer, its tile autotune included
for impl in ("auto", "reference"):
  cfg = config.ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, d_ff=8,
                           span=config.Span(size=16, ramp=4, mode="adaptive"),
                           attention=kernels.Attention(impl=impl))
  x = jnp.zeros((1, 16), jnp.int32)
  model = transformer.SpanTransformer(cfg)
  params = model.init(jax.random.key(0), x, caches.init_caches(cfg, None, 1))
  model.apply(params, x, caches.init_caches(cfg, None, 1))
  kernels.compiler_options(cfg.attn_spec), attention_rules.fit_fallback(cfg)
loaded = ("span_lm.kernels.span.pallas", "span_lm.kernels.sparse.pallas",
          "span_lm.kernels.span.impl_gpu", "span_lm.kernels.span.impl_tpu",
          "jax.experimental.pallas")
print(sorted(m for m in sys.modules if m.startswith(loaded)))
"""


@pytest.mark.slow
def test_the_cpu_and_reference_paths_load_no_pallas():
  """Importing the door and the trainer and running the model with `auto` on a CPU (cpu) and
  with `reference` imports neither Pallas kernel nor Pallas' public API (jax and flax load some of its internals
  themselves)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _LAZY_CHILD], capture_output=True, text=True,
                       env=env, check=False, cwd=os.path.dirname(os.path.dirname(
                           os.path.dirname(os.path.abspath(__file__)))))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_check_refuses_an_explicit_choice_that_cannot_run_in_one_line():
  """`check` holds the rules an explicit attention.impl must meet: one ValueError naming the field."""
  attention_rules.check(cfg_for("auto"), block=24, backend="cpu")  # auto always has somewhere to go
  attention_rules.check(cfg_for("pallas_interpret"), block=32, backend="cpu")  # interpreted: anywhere
  attention_rules.check(cfg_for("pallas"), block=32, backend="gpu")
  cases = [
      ("pallas", dict(backend="cpu"),
       "config.model.attention.impl='pallas' runs a Triton kernel, which needs a GPU (Ampere or "
       "newer); this process has cpu devices: use 'auto' (or 'pallas_interpret' to run the "
       "kernel interpreted)"),
      ("pallas_tpu", dict(backend="gpu"),
       "config.model.attention.impl='pallas_tpu' runs a Mosaic kernel, which needs a TPU; this process "
       "has gpu devices: use 'auto' (or 'pallas_tpu_interpret' to run the kernel interpreted)"),
      ("pallas_tpu_interpret", dict(block=24),
       "config.data.block=24: must be a multiple of model.attention.block=16 with the fused kernel"),
  ]
  for impl, where, line in cases:
    with pytest.raises(ValueError) as e:
      attention_rules.check(cfg_for(impl), **where)
    assert str(e.value) == line
  with pytest.raises(ValueError) as e:  # ModelConfig asks `check` too
    cfg_for("pallas", pers_mem=24)
  assert str(e.value) == ("config.model.pers_mem=24: must be a multiple of attention.block=16 "
                          "with attention.impl='pallas'")
  with pytest.raises(ValueError) as e:
    cfg_for("auto", **{"attention.precision": "exact"})
  assert str(e.value) == ("config.model.attention.precision='exact': choose one of "
                          "('default', 'highest')")


def test_the_door_takes_a_spec_and_the_model_adds_its_own_rules():
  """The door reads a Spec only (check, fit_fallback); what only a model config knows, its
  span size and plan granularity named as config.model names them, is model/attention_rules.py's,
  asked before the door."""
  from span_lm.kernels import target  # pylint: disable=g-import-not-at-top
  spec = cfg_for("pallas").attn_spec
  kernels.check(spec, block=32, backend="gpu")
  with pytest.raises(ValueError) as e:
    kernels.check(spec.replace(pers_mem=24))
  assert str(e.value) == ("config.model.pers_mem=24: must be a multiple of attention.block=16 "
                          "with attention.impl='pallas'")
  with pytest.raises(ValueError, match=r"^config\.data\.block=24: must be a multiple"):
    kernels.check(spec, block=24)
  auto = cfg_for("auto")
  with target.compiling_for("gpu", 8.0):  # untimed there: the XLA path, the kernel if it won't fit
    fallback = kernels.fit_fallback(auto.attn_spec)
    assert isinstance(fallback, kernels.Spec) and fallback.attention.impl == "pallas"
    assert attention_rules.fit_fallback(auto) == auto.replace(attention=fallback.attention)
    assert attention_rules.fit_fallback(cfg_for("auto", **{"span.size": 40})) is None
  assert attention_rules.fused_misfit(auto) == ("", "")
  assert attention_rules.fused_misfit(cfg_for("auto", **{"plan.granularity": 8})) == (
      "plan.granularity", "must be a multiple of attention.block=16")
  with pytest.raises(ValueError) as e:
    cfg_for("pallas", **{"span.size": 40})
  assert str(e.value) == ("config.model.span.size=40: must be a multiple of attention.block=16 "
                          "with attention.impl='pallas'")


def test_check_reads_the_run_configs_model_section():
  """train/loop.py checks the platform rule on config.model before the ModelConfig is built
  (old names included)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  def section(impl):
    d = dataclasses.asdict(cfg_for("auto"))
    d["attention"]["impl"] = impl
    return ml_collections.ConfigDict(d)
  attention_rules.check(section("xla"), backend="cpu")
  with pytest.raises(ValueError, match="needs a GPU"):
    attention_rules.check(section("pallas"), backend="tpu")
