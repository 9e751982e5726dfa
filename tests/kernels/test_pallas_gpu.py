"""The fused Pallas kernel (span_lm/kernels/span/pallas_gpu.py) against the reference implementation.

Runs the kernels in interpret mode on CPU, and lowers them for CUDA (Triton) without a GPU so a
construct Triton cannot express fails here rather than on the first GPU run.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from model_helpers import build
from span_lm import config as config_lib
from span_lm.kernels.span import banded_reference
from span_lm.kernels.span import gpu_tiles
from span_lm.kernels import hashed_dropout
from span_lm.kernels.span import pallas_gpu as fa
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.transformer import SpanTransformer

B, H, M, D, W, R, BLOCK = 2, 2, 32, 16, 48, 8, 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def _inputs(seed=0, dtype=jnp.float32, w=W, m=M):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (B, H, m, D), dtype)
  k = jax.random.normal(ks[1], (B, H, w + m, D), dtype)
  v = jax.random.normal(ks[2], (B, H, w + m, D), dtype)
  pe = jax.random.normal(ks[3], (D, w), dtype)
  return q, k, v, pe, ks[4]


def _plain(q, k, v, pe, z):
  w = pe.shape[-1]
  dist = jnp.arange(w, 0, -1, dtype=jnp.float32)
  del dist
  return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R)


def _fused(q, k, v, pe, z):
  return fa.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK, interpret=True)


def _spans(kind, key):
  if kind == "fixed":
    return None
  if kind == "adaptive":  # one span per head, broadcast over the rows, as the model passes it
    z_H = jnp.array([3.3, 27.5])
    return jnp.broadcast_to(z_H[None, :, None], (B, H, M))
  if kind == "dynamic":
    return jax.random.uniform(key, (B, H, M), minval=0.0, maxval=45.0)
  if kind == "integer":  # z = 0 and whole numbers: the clamp's boundaries, where its gradient is 1/2
    return jnp.broadcast_to(jnp.array([0.0, 16.0])[None, :, None], (B, H, M))
  if kind == "beyond":  # spans past the window: every key visited, the mask is 1 everywhere
    return jnp.full((B, H, M), 100.0)
  raise ValueError(kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic", "integer", "beyond"])
def test_matches_banded_attention_values_and_gradients(kind):
  q, k, v, pe, key = _inputs()
  z = _spans(kind, key)
  np.testing.assert_allclose(_fused(q, k, v, pe, z), _plain(q, k, v, pe, z), atol=1e-5, rtol=1e-5)
  ct = jax.random.normal(jax.random.PRNGKey(9), (B, H, M, D))
  argnums = (0, 1, 2, 3) if z is None else (0, 1, 2, 3, 4)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=argnums)(q, k, v, pe, z)
           for f in (_fused, _plain)]
  for name, got, want in zip("q k v pe z".split(), *grads):
    assert float(jnp.max(jnp.abs(want))) > 0 or name == "z", name
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("block,block_k", [(BLOCK, BLOCK // 2), (BLOCK // 2, BLOCK)])
def test_query_and_key_tiles_of_different_sizes_match(block, block_k):
  """A query tile twice the key tile (the A100's bf16 table entry) or half of it: the key-block
  ranges, the rel-shift view's tiles and the per-key-block backward still cover every visited
  distance once (dynamic spans, persistent memory): values and every gradient."""
  q, k, v, pe, key = _inputs()
  z = _spans("dynamic", key)
  pk = jax.random.normal(jax.random.PRNGKey(3), (H, D, 2 * BLOCK))
  pv = jax.random.normal(jax.random.PRNGKey(4), (H, 2 * BLOCK, D))
  fused = lambda q, k, v, pe, z, pk, pv: fa.span_attention(
      q, k, v, pe, z, ramp=R, block=block, block_k=block_k, pers_k_HxDxN=pk, pers_v_HxNxD=pv,
      interpret=True)
  plain = lambda q, k, v, pe, z, pk, pv: banded_reference.banded_attention(
      q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk, pers_v_GxNxD=pv)
  args = (q, k, v, pe, z, pk, pv)
  np.testing.assert_allclose(fused(*args), plain(*args), atol=1e-5, rtol=1e-5)
  ct = jax.random.normal(jax.random.PRNGKey(9), (B, H, M, D))
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=tuple(range(7)))(*args)
           for f in (fused, plain)]
  for name, got, want in zip("q k v pe z pk pv".split(), *grads):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.slow
def test_dropout_matches_plain_path_with_the_same_keep_mask():
  """The kernel's hashed keep mask, given to the plain path as its dropout, gives the same
  outputs and gradients; and it keeps 1 - rate of the weights."""
  rate, seed = 0.3, jnp.uint32(1234567)
  q, k, v, pe, key = _inputs()
  z = _spans("dynamic", key)

  def band_dropout(p):  # (B, H, n, C, W) bands: column s of row i is key i + s
    c = p.shape[3]
    rows = jnp.arange(M).reshape(1, 1, M // c, c, 1)
    bh = (jnp.arange(B)[:, None] * H + jnp.arange(H)[None, :]).reshape(B, H, 1, 1, 1)
    keys = rows + jnp.arange(W).reshape(1, 1, 1, 1, W)
    return p * hashed_dropout.dropout_scale(seed, bh, rows, keys, n_rows=M, n_keys=W + M,
                                            rate=rate)

  def plain(q, k, v, pe, z):
    dist = jnp.arange(W, 0, -1, dtype=jnp.float32)[None, None, None, :]
    del dist
    return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R, dropout=band_dropout)

  def fused(q, k, v, pe, z):
    return fa.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK, interpret=True,
                             dropout_rate=rate, dropout_seed=seed)

  got, want = fused(q, k, v, pe, z), plain(q, k, v, pe, z)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert float(jnp.max(jnp.abs(got - _fused(q, k, v, pe, z)))) > 0.1  # dropout did something
  ct = jax.random.normal(jax.random.PRNGKey(9), (B, H, M, D))
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3, 4))(q, k, v, pe, z)
           for f in (fused, plain)]
  for name, g_f, g_p in zip("q k v pe z".split(), *grads):
    np.testing.assert_allclose(g_f, g_p, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")
  keep = hashed_dropout.dropout_scale(
      seed, jnp.arange(8)[:, None, None], jnp.arange(128)[None, :, None],
      jnp.arange(256)[None, None, :], n_rows=128, n_keys=256, rate=rate)
  assert abs(float(jnp.mean(keep > 0)) - (1 - rate)) < 0.01
  np.testing.assert_allclose(float(jnp.max(keep)), 1 / (1 - rate), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind,rate", [("fixed", 0.0), ("dynamic", 0.0), ("integer", 0.3)])
def test_persistent_memory_matches_banded_attention(kind, rate):
  """All-attention: N persistent keys/values per head in the same softmax (mask 1), with
  dropout on their weights too; values and gradients, persistent vectors included."""
  n, seed = 32, jnp.uint32(99)
  q, k, v, pe, key = _inputs()
  z = _spans(kind, key)
  ks = jax.random.split(jax.random.PRNGKey(5), 2)
  pk = jax.random.normal(ks[0], (H, D, n))
  pv = jax.random.normal(ks[1], (H, n, D))

  def band_dropout(p):  # (B, H, n, C, W + N): band column s is key i + s, persistent n is W+M+n
    c = p.shape[3]
    rows = jnp.arange(M).reshape(1, 1, M // c, c, 1)
    bh = (jnp.arange(B)[:, None] * H + jnp.arange(H)[None, :]).reshape(B, H, 1, 1, 1)
    cols = jnp.arange(W + n).reshape(1, 1, 1, 1, W + n)
    keys = jnp.where(cols < W, rows + cols, (W + M) + (cols - W))
    return p * hashed_dropout.dropout_scale(seed, bh, rows, keys, n_rows=M, n_keys=W + M + n,
                                            rate=rate)

  def plain(q, k, v, pe, z, pk, pv):
    return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk,
                                             pers_v_GxNxD=pv,
                                             dropout=band_dropout if rate else None)

  def fused(q, k, v, pe, z, pk, pv):
    return fa.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK, interpret=True,
                             pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=rate,
                             dropout_seed=seed if rate else None)

  args = (q, k, v, pe, z, pk, pv)
  np.testing.assert_allclose(fused(*args), plain(*args), atol=1e-5, rtol=1e-5)
  ct = jax.random.normal(jax.random.PRNGKey(9), (B, H, M, D))
  argnums = (0, 1, 2, 3, 5, 6) if z is None else (0, 1, 2, 3, 4, 5, 6)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=argnums)(*args)
           for f in (fused, plain)]
  for i, g_f, g_p in zip(argnums, *grads):
    np.testing.assert_allclose(g_f, g_p, atol=3e-5, rtol=1e-4, err_msg=f"argument {i}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel needs a GPU "
                    "(JAX_PLATFORMS=cuda python -m pytest -m gpu)")
@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic", "integer"])
def test_gpu_kernel_matches_banded_attention(kind):
  """The compiled kernel (not interpreted) against the plain path, values and gradients."""
  q, k, v, pe, key = _inputs()
  z = _spans(kind, key)
  compiled = lambda q, k, v, pe, z: fa.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK)
  np.testing.assert_allclose(compiled(q, k, v, pe, z), _plain(q, k, v, pe, z), atol=1e-4,
                             rtol=1e-4)
  ct = jax.random.normal(jax.random.PRNGKey(9), (B, H, M, D))
  argnums = (0, 1, 2, 3) if z is None else (0, 1, 2, 3, 4)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=argnums)(q, k, v, pe, z)
           for f in (compiled, _plain)]
  for name, got, want in zip("q k v pe z".split(), *grads):
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3, err_msg=f"d{name}")


def test_bfloat16_inputs_follow_float32():
  q, k, v, pe, key = _inputs()
  z = _spans("dynamic", key)
  lo = [x.astype(jnp.bfloat16) for x in (q, k, v, pe)]
  want = _plain(*[x.astype(jnp.float32) for x in lo], z)
  got = _fused(*lo, z)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
def test_key_blocks_outside_every_span_are_never_read():
  """NaN keys and values beyond all spans leave outputs and gradients finite and unchanged; the
  same NaNs one block later (inside a span) reach the output, so the test can fail."""
  w = 64
  q, k, v, pe, _ = _inputs(w=w)
  z = jnp.full((B, H, M), 2.0)  # rows see d <= floor(2) + R + 1 = 11 distances
  clean = _fused(q, k, v, pe, z)
  # The first query block (rows 0..15) starts at key w - 11 = 53, in block 3: keys < 48 unused.
  poisoned_k, poisoned_v = k.at[:, :, :48].set(jnp.nan), v.at[:, :, :48].set(jnp.nan)
  out = _fused(q, poisoned_k, poisoned_v, pe, z)
  np.testing.assert_array_equal(out, clean)
  g = jax.grad(lambda q, k, v: jnp.sum(_fused(q, k, v, pe, z)), argnums=(0, 1, 2))(
      q, poisoned_k, poisoned_v)
  assert all(bool(jnp.all(jnp.isfinite(x[:, :, 48:] if x.shape[2] > M else x))) for x in g)
  # A visited block's values enter a matmul (0 x NaN = NaN), even where their weights are 0.
  reached = _fused(q, k, v.at[:, :, :49].set(jnp.nan), pe, z)
  assert bool(jnp.any(jnp.isnan(reached)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_cuda(dtype):
  b, h, m, d, w = 2, 4, 128, 64, 256
  q = jnp.ones((b, h, m, d), dtype)
  k = jnp.ones((b, h, w + m, d), dtype)
  pe = jnp.ones((d, w), dtype)
  z = jnp.ones((b, h, m), jnp.float32)
  pk, pv = jnp.ones((h, d, 128), dtype), jnp.ones((h, 128, d), dtype)  # persistent memory
  loss = lambda q, k, v, pe, z: jnp.sum(fa.span_attention(
      q, k, v, pe, z, pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=0.1,
      dropout_seed=jnp.uint32(1)).astype(jnp.float32))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  # jax >= 0.11 asks which GPU it lowers for when there is none: an abstract H100.
  from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h100)):
    text = step.trace(q, k, k, pe, z).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3  # forward, backward for q (and pe, z), for k and v
  for name in ("span_attention_fwd", "span_attention_bwd_q", "span_attention_bwd_kv"):
    assert name in text


def test_key_and_value_gradients_are_deterministic_and_spans_bound_the_work():
  """dk and dv come from a per-key-block kernel (no atomics): two runs agree bit for bit; a key
  block no row sees gets exactly zero gradient."""
  w = 64
  q, k, v, pe, _ = _inputs(w=w)
  z = jnp.full((B, H, M), 2.0)
  grad = jax.jit(jax.grad(lambda k, v: jnp.sum(_fused(q, k, v, pe, z) ** 2), argnums=(0, 1)))
  (dk1, dv1), (dk2, dv2) = grad(k, v), grad(k, v)
  np.testing.assert_array_equal(dk1, dk2)
  np.testing.assert_array_equal(dv1, dv2)
  assert float(jnp.max(jnp.abs(dk1[:, :, :48]))) == 0.0 == float(jnp.max(jnp.abs(dv1[:, :, :48])))
  assert float(jnp.max(jnp.abs(dv1[:, :, 48:]))) > 0


@pytest.mark.slow
def test_runs_per_shard_under_a_mesh():
  """Under a mesh (the trainer compiles under one) the kernel runs in a shard_map over the batch
  axis, since XLA would otherwise gather the whole batch to every device for an opaque kernel:
  same values and gradients, and dropout masks that differ between shards."""
  from span_lm.train import sharding  # pylint: disable=g-import-not-at-top
  q, k, v, pe, key = _inputs()
  z = _spans("dynamic", key)
  loss = lambda q, k, v, pe, z: jnp.sum(_fused(q, k, v, pe, z) ** 2)
  want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, pe, z)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  with jax.set_mesh(sharding.make_mesh(2)):
    assert "shard_map" in str(jax.make_jaxpr(step)(q, k, v, pe, z))
    got = step(q, k, v, pe, z)
    same = [jnp.broadcast_to(x[:1], x.shape) for x in (q, k, v)]  # two identical streams
    dropped = jax.jit(lambda q, k, v: fa.span_attention(
        q, k, v, pe, None, ramp=R, block=BLOCK, interpret=True, dropout_rate=0.5,
        dropout_seed=jnp.uint32(7)))(*same)
  with jax.set_mesh(sharding.fsdp_mesh(2, 2)):  # the FSDP mesh: batches over both axes
    got_fsdp = step(q, k, v, pe, z)
  for result in (got, got_fsdp):
    np.testing.assert_allclose(result[0], want[0], rtol=1e-5)
    for g_got, g_want in zip(result[1], want[1]):
      np.testing.assert_allclose(g_got, g_want, atol=2e-5, rtol=1e-4)
  assert float(jnp.max(jnp.abs(dropped[0] - dropped[1]))) > 0.1


def test_rejects_shapes_the_kernel_cannot_tile():
  q, k, v, pe, _ = _inputs()
  with pytest.raises(ValueError, match="multiples of the tiles 64 and 64"):
    fa.span_attention(q, k, v, pe, None, block=64, interpret=True)
  with pytest.raises(ValueError, match="multiples of the tiles 16 and 64"):
    fa.span_attention(q, k, v, pe, None, block=BLOCK, block_k=64, interpret=True)
  with pytest.raises(ValueError, match="key rows"):
    fa.span_attention(q, k[:, :, 1:], v, pe, None, block=BLOCK, interpret=True)


# ----------------------------------------------------------------------------------------------
# In the model: attn_impl='pallas_interpret' against attn_impl='xla' with the same parameters.


def _cfg(**kw):
  base = {"vocab_size": 13, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 24,
          "span.size": 32, "span.mode": "adaptive", "span.ramp": 4, "span.loss": 0.1,
          "plan.granularity": 16, "plan.margin": 0, "attention.block": 16}
  return build(base, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("mode,n_pers", [("fixed", 0), ("adaptive", 0), ("dynamic", 0),
                                         ("adaptive", 16)])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_model_fused_equals_cpu(mode, n_pers, kv_cache):
  xla = _cfg(**{"span.mode": mode}, pers_mem=n_pers)
  fused = _cfg(**{"span.mode": mode, "attention.impl": "pallas_interpret"}, pers_mem=n_pers)
  rng = np.random.default_rng(3)
  m = 16
  tokens = jnp.asarray(rng.integers(xla.vocab_size, size=(B, m)), jnp.int32)
  plan = None
  if mode == "adaptive":  # two head groups of different windows in the xla plan
    plan = plan_lib.SpanPlan(layers=(plan_lib.LayerPlan(32, (((0,), 16), ((1,), 32))),) * 2)
  params = SpanTransformer(xla, plan=plan).init(
      jax.random.key(0), tokens, caches_lib.init_caches(xla, plan, B), train=False)["params"]
  if mode == "adaptive":
    for i, ratio in enumerate(([0.2, 0.75], [0.05, 0.5])):  # z + R: 10.4, 28; 5.6, 20
      params[f"layers_{i}"]["attn"]["span_ratio"] = jnp.asarray(ratio)
  caches = caches_lib.init_caches(xla, plan, B, kv=kv_cache)
  caches = tuple(jnp.asarray(rng.normal(size=c.shape), jnp.float32) for c in caches)

  def run(cfg):
    model = SpanTransformer(cfg, plan=plan, kv_cache=kv_cache)

    def loss(p):
      logp, new_caches, _ = model.apply({"params": p}, tokens, caches, train=False)
      return -jnp.mean(logp[..., 0]) + sum(jnp.sum(c) for c in new_caches) * 1e-3, logp

    (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logp, grads

  (logp_x, grads_x), (logp_f, grads_f) = run(xla), run(fused)
  np.testing.assert_allclose(logp_f, logp_x, atol=2e-5, rtol=1e-5)
  flat_x = jax.tree_util.tree_leaves_with_path(grads_x)
  flat_f = jax.tree.leaves(grads_f)
  for (path, gx), gf in zip(flat_x, flat_f):
    np.testing.assert_allclose(gf, gx, atol=2e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_model_fused_dropout_trains_and_is_reproducible():
  cfg = _cfg(**{"attention.impl": "pallas_interpret"}, dropout=0.5)
  m = 16
  tokens = jnp.asarray(np.random.default_rng(0).integers(cfg.vocab_size, size=(B, m)), jnp.int32)
  model = SpanTransformer(cfg)
  caches = caches_lib.init_caches(cfg, None, B)
  params = model.init(jax.random.key(0), tokens, caches, train=False)["params"]

  def loss(p, rng, train):
    logp = model.apply({"params": p}, tokens, caches, train=train, rngs={"dropout": rng})[0]
    return -jnp.mean(logp[..., 0])

  a = loss(params, jax.random.key(1), True)
  assert float(a) == float(loss(params, jax.random.key(1), True))
  assert float(a) != float(loss(params, jax.random.key(2), True))
  assert float(a) != float(loss(params, jax.random.key(1), False))
  grads = jax.grad(loss)(params, jax.random.key(1), True)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_blocks_the_kernel_cannot_tile_take_the_jnp_path():
  """init_state builds parameters from a one-token block: that must work with attn_impl=pallas."""
  # not interpreted: the kernel would fail on CPU if called
  cfg = _cfg(**{"attention.impl": "pallas"})
  one = jnp.zeros((B, 1), jnp.int32)
  params = SpanTransformer(cfg).init(jax.random.key(0), one, caches_lib.init_caches(cfg, None, B))
  logp, _, _ = SpanTransformer(cfg).apply(params, one, caches_lib.init_caches(cfg, None, B))
  ref_cfg = _cfg(**{"attention.impl": "reference"})
  want, _, _ = SpanTransformer(ref_cfg).apply(params, one, caches_lib.init_caches(cfg, None, B))
  np.testing.assert_array_equal(logp, want)


def test_fused_plan_is_one_group_at_the_largest_window():
  cfg = _cfg(**{"attention.impl": "pallas"})
  lp = plan_lib.layer_plan_from_windows(cfg, [16, 32])
  assert lp.groups == (((0, 1), 32),)


@pytest.mark.parametrize("kw,field", [
    (dict(pers_mem=24), "pers_mem"),  # not a multiple of the tile
    ({"attention.block": 24}, "attention.block"),
    ({"plan.granularity": 8}, "plan.granularity"),
    ({"attention.impl": "triton"}, "attention.impl"),
])
def test_bad_fused_configs_raise(kw, field):
  with pytest.raises(ValueError, match=f"config.model.{field}"):
    _cfg(**{"attention.impl": kw.pop("attention.impl", "pallas")}, **kw)


def test_run_config_checks_block_length_against_the_tile():
  config = config_lib.load_config("configs/tiny.py", {
      "model.attention.impl": "pallas", "model.attention.block": 64, "data.block": 96,
      "workdir": "/tmp/unused"})
  with pytest.raises(ValueError, match="config.data.block"):
    config_lib.validate(config)


def test_pallas_on_a_cpu_is_refused_before_anything_runs(tmp_path):
  from span_lm.train import loop  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config("configs/synthetic.py", {
      "model.attention.impl": "pallas", "workdir": str(tmp_path / "run")})
  with pytest.raises(ValueError, match="needs a GPU"):
    loop.Run(config)
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sampling_with_the_fused_kernel_equals_cpu():
  """generate() with attn_impl='pallas_interpret': a prompt of one tile runs through the kernel,
  the one-token steps through the ring path; the tokens are those of attn_impl='xla'."""
  from span_lm.tools import sample  # pylint: disable=g-import-not-at-top
  xla = _cfg(**{"span.mode": "fixed"})
  fused = _cfg(**{"span.mode": "fixed", "attention.impl": "pallas_interpret"})
  prompt = np.random.default_rng(4).integers(xla.vocab_size, size=16)
  params = SpanTransformer(xla).init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32),
                                     caches_lib.init_caches(xla, None, 1))["params"]
  want = sample.generate(xla, params, None, prompt, 20, temperature=0.0)
  np.testing.assert_array_equal(sample.generate(fused, params, None, prompt, 20, temperature=0.0),
                                want)


@pytest.mark.slow
@pytest.mark.parametrize("kind,n_pers", [("adaptive", 0), ("dynamic", 16)])
def test_head_dim_96_is_padded_and_equals_the_reference(kind, n_pers):
  """Head sizes that are not a power of two (the large paper models' 96; 24 here) run with
  zero-padded heads: values and every gradient equal the reference's."""
  dh = 24
  ks = jax.random.split(jax.random.PRNGKey(11), 7)
  q = jax.random.normal(ks[0], (B, H, M, dh))
  k = jax.random.normal(ks[1], (B, H, W + M, dh))
  v = jax.random.normal(ks[2], (B, H, W + M, dh))
  pe = jax.random.normal(ks[3], (dh, W))
  z = _spans(kind, ks[4])
  pk = jax.random.normal(ks[5], (H, dh, n_pers)) if n_pers else None
  pv = jax.random.normal(ks[6], (H, n_pers, dh)) if n_pers else None
  assert gpu_tiles.padded_head_dim(dh) == 32 and gpu_tiles.padded_head_dim(96) == 128

  def fused(q, k, v, pe, z):
    return fa.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK, interpret=True,
                             pers_k_HxDxN=pk, pers_v_HxNxD=pv)

  def plain(q, k, v, pe, z):
    return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk,
                                             pers_v_GxNxD=pv)

  got = fused(q, k, v, pe, z)
  assert got.shape == q.shape
  np.testing.assert_allclose(got, plain(q, k, v, pe, z), atol=1e-5, rtol=1e-5)
  ct = jax.random.normal(jax.random.PRNGKey(9), q.shape)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3, 4))(q, k, v, pe, z)
           for f in (fused, plain)]
  for name, got, want in zip("q k v pe z".split(), *grads):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4, err_msg=f"d{name}")


def test_pipeline_depth_is_checked_before_tracing():
  """num_stages < 1 is one clear line; depths 1 to 3 all give the definition's values (interpret
  mode ignores the depth: the device evidence is the PTX test below)."""
  q, k, v, pe, _ = _inputs()
  with pytest.raises(ValueError, match="num_stages=0"):
    fa.span_attention(q, k, v, pe, None, ramp=R, block=BLOCK, num_stages=0)
  want = _plain(q, k, v, pe, None)
  for stages in (1, 3):
    got = fa.span_attention(q, k, v, pe, None, ramp=R, block=BLOCK, num_stages=stages,
                            interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# Deviceless: one GPU of the chip named by argv[1], `sh` a sharding on it.
_PTX_PRELUDE = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.kernels.span import gpu_tiles
from span_lm.kernels.span import pallas_gpu
chip = chips.get(sys.argv[1])
topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                    target_config=chips.gpu_target_config(chip))
sh = NamedSharding(Mesh(np.asarray(topo.devices), ("x",)), P())
# jax >= 0.11: Pallas-Triton lowers for the default device's GPU (target.compiling_for)
jax.config.update("jax_default_device", topo.devices[0])
"""

_PTX_CHILD = _PTX_PRELUDE + """
b, h, m, w, n = 1, 2, 128, 256, 64
for dt in (jnp.bfloat16, jnp.float32):
  for dh in (64, 96):  # enwik8's and enwik8_large's head sizes (96 runs padded to 128)
    tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64)  # what the door runs
    bk = gpu_tiles.key_tile(chip.cc, dh, dt, tile)
    print("TILES " + json.dumps([jnp.dtype(dt).name, dh, tile, warps, stages, bk]), flush=True)
    sds = lambda *s, d=dt: jax.ShapeDtypeStruct(s, d, sharding=sh)
    def loss(q, k, v, pe, z, pk, pv):
      return jnp.sum(pallas_gpu.span_attention(q, k, v, pe, z, ramp=32, block=tile, block_k=bk,
          num_warps=warps, num_stages=stages, pers_k_HxDxN=pk, pers_v_HxNxD=pv,
          dropout_rate=0.1, dropout_seed=jnp.uint32(3)).astype(jnp.float32))
    jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)))).lower(
        sds(b, h, m, dh), sds(b, h, w + m, dh), sds(b, h, w + m, dh), sds(dh, w),
        sds(b, h, m, d=jnp.float32), sds(h, dh, n, d=jnp.float32),
        sds(h, n, dh, d=jnp.float32)).compile(compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""

_PTX_EXACT_CHILD = _PTX_PRELUDE + """
b, h, m, w, dh = 1, 2, 64, 128, 64
sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh)
def loss(q, k, v, pe, z):
  return jnp.sum(pallas_gpu.span_attention(q, k, v, pe, z, ramp=32, block=32, block_k=32,
                                           num_warps=4, num_stages=2, precision="highest"))
jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
    sds(b, h, m, dh), sds(b, h, w + m, dh), sds(b, h, w + m, dh), sds(dh, w),
    sds(b, h, m)).compile(compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
def test_precision_highest_reaches_every_kernel(tmp_path):
  """attention.precision='highest' (exact float32) is passed to each kernel as it is traced: no
  kernel of a float32 step then issues a tensor-core instruction, where the default (TF32) ones
  do (test_ptx_pipelined_tensor_cores_no_read_back_no_spills)."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path}"
  r = subprocess.run([sys.executable, "-c", _PTX_EXACT_CHILD, "h100"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  facts = ptx.dumped_kernels(tmp_path, "span_attention")
  assert len(facts) == 3, [f["kernel"] for f in facts]
  for f in facts:
    assert f["wgmma"] == 0 == f["mma"], f


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
def test_compile_children_dump_the_ptx_and_no_emitters_pass_logs(tmp_path):
  """The compile mode's GPU children (child_env) dump what the report reads, each kernel's PTX,
  and not every emitter's IR after every pass: on jax >= 0.11 that dump (an emitter regex of
  '.*') held ~0.5 GB for configs/text8.py's step and took enwik8_large's H100 compile past 11
  minutes and 14 GB of host memory."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path}"
  r = subprocess.run([sys.executable, "-c", _PTX_EXACT_CHILD, "h100"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert len(ptx.dumped_kernels(tmp_path, "span_attention")) == 3
  per_pass = [p.name for p in tmp_path.iterdir()
              if p.name.endswith((".mlir-passes.log", ".ttir.txt", ".triton-to-llvm.txt"))]
  assert not per_pass, per_pass[:5]
  mb = sum(p.stat().st_size for p in tmp_path.iterdir()) / 2**20
  assert mb < 20, f"{mb:.0f} MB dumped"


# The kernels' parameters (tools/ptx.py numbers them as the kernel's arguments, inputs first): G,
# the position scores' rel-shift view, is parameter 3 of all three; bwd_q's zeroed gradient
# buffers (12-14) alias its outputs and are never read.
_G, _ALIASED_ZEROS = 3, {12, 13, 14}


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_ptx_pipelined_tensor_cores_no_read_back_no_spills(tmp_path, target):
  """Deviceless PTX and ptxas reports of the three kernels at the tiles the door picks (bf16 and
  float32 (TF32), head sizes 64 and 96, adaptive spans, persistent memory, dropout):
  - no kernel reads a global buffer it also writes (the first kernel's wrong gradients: Triton's
    pipeliner moved a scratch read-back ahead of its store), and bwd_q never reads the zeroed
    buffers aliased to its outputs;
  - loads are pipelined: asynchronous copies (cp.async) in every kernel; the position tiles are
    a cp.async in bwd_kv and, in the key-block loops of fwd and bwd_q, loaded at the top of the
    iteration before its first matmul (a tile ahead);
  - tensor-core instructions in every kernel (wgmma on sm_90, mma.sync on sm_80);
  - no spills in bf16; query tiles of 64 rows in bf16."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path}"
  r = subprocess.run([sys.executable, "-c", _PTX_CHILD, target], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=1500, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  tiles = [json.loads(l[6:]) for l in r.stdout.splitlines() if l.startswith("TILES ")]
  assert len(tiles) == 4 and all(t[4] >= 2 for t in tiles), tiles  # pipelined launches
  # 64-row query tiles in bf16 (float32 on the A100 runs 32 rows: 64 spilled at every key tile)
  assert all(t[2] >= 64 for t in tiles if t[0] == "bfloat16"), tiles
  facts = ptx.dumped_kernels(tmp_path, "span_attention")
  assert len(facts) == 12, [f["kernel"] for f in facts]  # 3 kernels x 2 dtypes x 2 head sizes
  sm90 = target == "h100"
  for f in facts:
    name = f["kernel"]
    assert f["unresolved"] == 0 and f["writes"], f  # the reader saw every address
    assert not f["read_back"], f
    assert f["cp_async"] > 0, f
    assert (f["wgmma"] if sm90 else f["mma"]) > 0, f
    if name == "span_attention_bwd_kv":
      assert _G in f["reads_async"], f
    else:
      assert _G in f["loop_prefetch"], f
    if name == "span_attention_bwd_q":
      assert not _ALIASED_ZEROS & set(f["reads"] + f["reads_async"]), f
  reports = [k for k in compile_lib.parse_ptxas(r.stdout + r.stderr)
             if k["kernel"].startswith("span_attention")]
  assert len(reports) == 12, reports
  bf16 = reports[:6]  # compiled in the child's order: bf16 first
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in bf16), bf16


# A paper config's attention per device in its training step on 8 GPUs, the kernels at the tiles
# the door picks: argv[2:] = batch, heads, block, span, persistent vectors, head size, dropout
# (bf16). The PTX test's small shape (B=1, H=2) did not show the spills these did.
_STEP_CHILD = _PTX_PRELUDE + """
b, h, m, w, n, dh = map(int, sys.argv[2:8])
rate, dt = float(sys.argv[8]), jnp.bfloat16
tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64)
bk = gpu_tiles.key_tile(chip.cc, dh, dt, tile)
print("TILES " + json.dumps([tile, bk, warps, stages]), flush=True)
sds = lambda *s, d=dt: jax.ShapeDtypeStruct(s, d, sharding=sh)
def loss(q, k, v, pe, z, pk, pv):
  return jnp.sum(pallas_gpu.span_attention(q, k, v, pe, z, ramp=32, block=tile, block_k=bk,
      num_warps=warps, num_stages=stages, pers_k_HxDxN=pk if n else None,
      pers_v_HxNxD=pv if n else None, dropout_rate=rate,
      dropout_seed=jnp.uint32(3)).astype(jnp.float32))
jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)))).lower(
    sds(b, h, m, dh), sds(b, h, w + m, dh), sds(b, h, w + m, dh), sds(dh, w),
    sds(b, h, m, d=jnp.float32), sds(h, dh, max(n, 1), d=jnp.float32),
    sds(h, max(n, 1), dh, d=jnp.float32)).compile(
        compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""


def _assert_step_kernels_clean(tmp_path, target, shape):
  """The three kernels compiled at `shape` (_STEP_CHILD's argv) for `target`: no spills, tensor-
  core instructions, asynchronous copies, no read-back."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path}"
  r = subprocess.run([sys.executable, "-c", _STEP_CHILD, target, *map(str, shape)], cwd=REPO,
                     env=env, capture_output=True, text=True, timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  reports = [k for k in compile_lib.parse_ptxas(r.stdout + r.stderr)
             if k["kernel"].startswith("span_attention")]
  assert len(reports) == 3, reports
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in reports), reports
  facts = ptx.dumped_kernels(tmp_path, "span_attention")
  assert len(facts) == 3, [f["kernel"] for f in facts]
  for f in facts:
    assert not f["read_back"] and f["unresolved"] == 0, f
    assert f["cp_async"] > 0, f
    assert (f["wgmma"] if target == "h100" else f["mma"]) > 0, f


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_enwik8_large_step_shapes_no_bf16_spills(tmp_path, target):
  """At enwik8_large's per-device shapes (batch 64 / 8 devices / batch_split 2 = 4 sequences,
  8 heads, block 512, span 8192, head size 96 run as 128, dropout 0.4) every kernel compiles
  without spills in bf16, with tensor-core instructions and asynchronous copies and no
  read-back (the compile mode's `GPU kernels` table of
  `main.py --config=configs/enwik8_large.py --config.mode=compile --config.compile.targets=h100:8
  --config.compile.steps=train --config.model.dtype=bfloat16 --config.model.attention.impl=pallas`
  shows the same kernels). It failed on the H100's old 64 x 64 tiles: bwd_kv 8+8 B."""
  _assert_step_kernels_clean(tmp_path, target, (4, 8, 512, 8192, 0, 96, 0.4))


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_enwik8_pers_step_shapes_no_bf16_spills(tmp_path, target):
  """The same at configs/enwik8_pers.py's per-device shapes (4 sequences, 8 heads, block 512,
  span 8192, 2,048 persistent vectors, head size 64, dropout 0.4): the persistent loop of bwd_q
  is what needs the registers. It failed on the H100's old 64 x 64 tiles: bwd_q 255 registers,
  4+4 B spilled."""
  _assert_step_kernels_clean(tmp_path, target, (4, 8, 512, 8192, 2048, 64, 0.4))
