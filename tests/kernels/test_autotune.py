"""model.attention.tiles: the GPU kernel's tiles from the table, named, or timed on the device.

The timing itself needs a GPU; here the same code runs the kernel interpreted, which exercises
everything but the clock's meaning: candidates filtered and compiled, the fastest kept, the
cache written and read back, and an explicit choice reaching the kernel with the same maths."""
import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from model_helpers import make_cfg
from span_lm import kernels
from span_lm.kernels.span import autotune
from span_lm.model import caches as caches_lib
from span_lm.model.transformer import SpanTransformer


def _cfg(**kw):
  return make_cfg(**dict({"d_model": 32, "n_layers": 1, "n_heads": 2, "span.size": 32,
                          "span.mode": "adaptive", "plan.granularity": 32, "plan.margin": 0,
                          "attention.block": 32}, **kw))


@pytest.mark.slow
def test_tune_times_the_candidates_that_fit_and_caches_the_fastest(tmp_path):
  cfg = _cfg(**{"attention.impl": "pallas_interpret"})
  path = str(tmp_path / "tiles.json")
  said = []
  # 64 > attn_block: never tried; the two others compile and are timed
  got = autotune.tune(cfg.attn_spec, batch=1, m=32, w=32,
                      candidates=[(16, 4, 1), (32, 4, 1), (64, 4, 1)], reps=1, path=path,
                      interpret=True, echo=said.append)
  assert got in ("16,4,1", "32,4,1")
  (entry,) = json.load(open(path)).values()
  assert entry["tiles"] == got and sorted(entry["ms"]) == ["16,4,1", "32,4,1"]
  assert entry["ms"][got] == min(entry["ms"].values())
  assert not any("64,4,1" in line for line in said)
  # the second time it is read back, not measured (no candidate left to measure)
  assert autotune.tune(cfg.attn_spec, batch=1, m=32, w=32, candidates=(), path=path, interpret=True,
                       echo=said.append) == got
  # a different shape is a different key: measured, and here nothing is left to measure
  with pytest.raises(ValueError, match="no candidate tile runs this layer"):
    autotune.tune(cfg.attn_spec, batch=2, m=32, w=32, candidates=(), path=path, interpret=True)
  # an entry the config now refuses (5 stages) is measured again
  stale = json.load(open(path))
  stale[next(iter(stale))]["tiles"] = "32,4,5"
  json.dump(stale, open(path, "w"))
  assert autotune.tune(cfg.attn_spec, batch=1, m=32, w=32, candidates=[(32, 4, 1)], reps=1,
                       path=path, interpret=True, echo=said.append) == "32,4,1"
  assert any("no longer allowed" in line for line in said)
  # an unreadable cache is measured again and rewritten, not a crash
  open(path, "w").write("{not json")
  assert autotune.tune(cfg.attn_spec, batch=1, m=32, w=32, candidates=[(32, 4, 1)], reps=1,
                       path=path, interpret=True) == "32,4,1"
  assert json.load(open(path))


def test_resolve_leaves_runs_without_the_gpu_kernel_alone():
  said = []
  spec = _cfg(**{"attention.tiles": "tune"}).attn_spec  # auto on this CPU host: cpu
  assert autotune.resolve(spec, batch=1, m=32, echo=said.append) is spec
  assert "nothing to tune" in said[0]
  assert kernels.gpu_tiles(spec, "pallas_interpret", jnp.float32) == (32, 4, 2)  # the table's


@pytest.mark.parametrize("bad", ["33,8,1", "32,3,1", "32,8,0", "32,8,5", "big", "64,4,1"])
def test_bad_tiles_are_one_line_naming_the_field(bad):
  with pytest.raises(ValueError, match=r"config\.model\.attention\.tiles="):
    _cfg(**{"attention.tiles": bad})


@pytest.mark.slow
def test_named_tiles_reach_the_kernel_with_the_same_maths():
  """attn_tiles='16,4,1' with attn_block=32: the kernel runs 16-row tiles (its schedule's
  bytes change), and the model's values and gradients still equal the cpu implementation's."""
  cpu, fused = _cfg(), _cfg(**{"attention.impl": "pallas_interpret", "attention.tiles": "16,4,1"})
  assert kernels.gpu_tiles(fused.attn_spec, "pallas_interpret", jnp.float32) == (16, 4, 1)
  whole = _cfg(**{"attention.impl": "pallas_interpret", "attention.tiles": "32,4,1"})
  interpret = kernels.IMPLS["pallas_interpret"]
  assert (interpret.schedule_cost(fused.attn_spec, 1, 256, 1024, None) !=
          interpret.schedule_cost(whole.attn_spec, 1, 256, 1024, None))
  rng = np.random.default_rng(0)
  b, m = 2, 32
  tokens = jnp.asarray(rng.integers(cpu.vocab_size, size=(b, m)), jnp.int32)
  caches = tuple(jnp.asarray(rng.normal(size=c.shape), jnp.float32)
                 for c in caches_lib.init_caches(cpu, None, b))
  params = SpanTransformer(cpu).init(jax.random.key(0), tokens, caches, train=False)["params"]
  params["layers_0"]["attn"]["span_ratio"] = jnp.asarray([0.3, 0.8])

  def run(cfg):
    def loss(p):
      logp = SpanTransformer(cfg).apply({"params": p}, tokens, caches, train=False)[0]
      return -jnp.mean(logp[..., 0]), logp
    return jax.value_and_grad(loss, has_aux=True)(params)

  (_, logp_c), grads_c = run(cpu)
  (_, logp_f), grads_f = run(fused)
  np.testing.assert_allclose(logp_f, logp_c, atol=2e-5, rtol=1e-5)
  for gc, gf in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_f)):
    np.testing.assert_allclose(gf, gc, atol=2e-5, rtol=1e-4)
