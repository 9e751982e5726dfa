"""The fused TPU kernel (span_lm/kernels/span/pallas_tpu.py) against the reference implementation.

Interpret mode on CPU: values and every gradient (q, k, v, key_pe, spans, persistent vectors)
against banded_reference.banded_attention, float32 tight and bfloat16 loose, for fixed, adaptive
and dynamic spans, persistent memory and attention dropout (the reference given the kernel's
hashed keep mask) (two slow tests: under a mesh, and in the TPU interpreter, which simulates VMEM and
the pipeline). Windows ahead and segment ids (two-sided with spans both ways, persistent memory,
dropout, padding rows, the model's laid-out cache; in the TPU interpreter too) against the
reference, the bounds the kernels compute for both windows and the segments, and NaN keys in
the tiles they skip. With libtpu (`pytest -m compile` in the tpu-compile environment), the kernels
compiled by Mosaic for a v5e, deviceless, at the enwik8 shape of one head group; the two-sided
segmented kernels and a bidirectional encoder step built from the drop-in layer for a v5p.

The functions are jitted once at module level, so the cases share their (slow, interpreted)
compiles: spans are runtime values and do not recompile.
"""
import functools
import importlib.util
import os
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from span_lm.kernels.span import banded_reference
from span_lm.kernels import hashed_dropout
from span_lm.kernels.span import pallas_tpu as ft
from span_lm.kernels.span import tpu_tiles

B, H, M, D, W, R, BLOCK = 2, 2, 32, 32, 48, 8, 16
D_FIXED = 16  # the fixed-span case runs zero-padded to 128 lanes; the others run as they are
HAS_TPU = importlib.util.find_spec("libtpu") is not None


def _inputs(seed=0, dtype=jnp.float32, d=D):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (B, H, M, d), dtype)
  k = jax.random.normal(ks[1], (B, H, W + M, d), dtype)
  v = jax.random.normal(ks[2], (B, H, W + M, d), dtype)
  pe = jax.random.normal(ks[3], (d, W), jnp.float32)
  ct = jax.random.normal(ks[4], (B, H, M, d), jnp.float32)
  return q, k, v, pe, ct, ks[5]


def _spans(kind, key):
  if kind == "fixed":
    return None
  if kind == "adaptive":  # one span per head, broadcast over the rows, as the model passes it
    return jnp.broadcast_to(jnp.array([3.3, 27.5], jnp.float32)[None, :, None], (B, H, M))
  if kind == "dynamic":
    return jax.random.uniform(key, (B, H, M), minval=0.0, maxval=45.0)
  if kind == "integer":  # z = 0 and whole numbers: the clamp's ends, where torch.clamp's slope is 1
    return jnp.broadcast_to(jnp.array([0.0, 16.0], jnp.float32)[None, :, None], (B, H, M))
  if kind == "beyond":  # spans past the window: every key visited, the mask is 1 everywhere
    return jnp.full((B, H, M), 100.0, jnp.float32)
  raise ValueError(kind)


def _value_and_grads(f, q, k, v, pe, z, ct):
  out, vjp = jax.vjp(f, q, k, v, pe, z)
  return out, vjp(ct.astype(out.dtype))


@functools.partial(jax.jit, static_argnames=("block", "block_k"))
def _fused(q, k, v, pe, z, ct, block=BLOCK, block_k=None):
  f = lambda q, k, v, pe, z: ft.span_attention(q, k, v, pe, z, ramp=R, block=block,
                                               block_k=block_k, interpret=True)
  return _value_and_grads(f, q, k, v, pe, z, ct)


@jax.jit
def _plain(q, k, v, pe, z, ct):
  f = lambda q, k, v, pe, z: banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R)
  return _value_and_grads(f, q, k, v, pe, z, ct)


def _check(got, want, atol, rtol, z):
  (out_g, grads_g), (out_w, grads_w) = got, want
  np.testing.assert_allclose(np.asarray(out_g, np.float32), out_w, atol=atol[0], rtol=rtol)
  names = "q k v pe z".split()[:4 if z is None else 5]
  for name, g, w in zip(names, grads_g, grads_w):
    assert float(jnp.max(jnp.abs(w))) > 0 or name == "z", name  # "beyond": mask 1, no slope
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=atol[1], rtol=rtol,
                               err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic", "integer", "beyond"])
def test_matches_banded_attention_values_and_gradients(kind):
  q, k, v, pe, ct, key = _inputs(d=D_FIXED if kind == "fixed" else D)
  z = _spans(kind, key)
  _check(_fused(q, k, v, pe, z, ct), _plain(q, k, v, pe, z, ct), (1e-5, 2e-5), 1e-4, z)


@pytest.mark.slow
def test_bfloat16_unequal_tiles_unpadded_head_follow_float32():
  """bf16 operands, f32 accumulation, with bq = 8 query rows by bk = 16 keys and head size 32
  (run as it is, no lane padding; one interpreted compile for the three): values and gradients
  near the f32 reference of the same (rounded) inputs; key_pe and its gradient stay float32."""
  assert tpu_tiles.padded_head_dim(D) == D and tpu_tiles.padded_head_dim(D_FIXED) == 128
  q, k, v, pe, ct, key = _inputs(seed=1)
  z = _spans("dynamic", key)
  lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  out, grads = _fused(*lo, pe, z, ct, block=8, block_k=16)
  assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
  assert grads[3].dtype == jnp.float32 and grads[4].dtype == jnp.float32
  want_out, want_grads = _plain(*[x.astype(jnp.float32) for x in lo], pe, z, ct)
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=3e-2, rtol=3e-2)
  for name, g, w in zip("q k v pe z".split(), grads, want_grads):
    scale = float(jnp.max(jnp.abs(w)))
    err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
    assert err < 2e-2 * scale, (name, err, scale)


def test_key_blocks_outside_every_span_are_never_read():
  """NaN keys and values beyond all spans leave outputs and gradients unchanged; the same NaNs
  one key later (inside a visited block) reach the output, so the test can fail."""
  q, k, v, pe, ct, _ = _inputs()
  z = jnp.full((B, H, M), 2.0, jnp.float32)  # rows see d <= floor(2) + R + 1 = 11 distances
  # query block 0 (rows 0..15) starts at key W - 11 = 37, in key block 2: keys < 32 unused
  nan_k, nan_v = k.at[:, :, :32].set(jnp.nan), v.at[:, :, :32].set(jnp.nan)
  clean_out, clean_grads = _fused(q, k, v, pe, z, ct)
  out, grads = _fused(q, nan_k, nan_v, pe, z, ct)
  np.testing.assert_array_equal(out, clean_out)
  for name, g, c in zip("q k v pe z".split(), grads, clean_grads):
    np.testing.assert_array_equal(g, c, err_msg=f"d{name}")
  reached, _ = _fused(q, k, v.at[:, :, :33].set(jnp.nan), pe, z, ct)
  assert bool(jnp.any(jnp.isnan(reached)))


def test_visited_key_blocks_follow_the_spans():
  """The scalar-prefetched bounds the index maps and the skips read: [first, last + 1) key block
  per (batch, head, query block), computed from the spans at run time."""
  static = ft._Static(  # pylint: disable=protected-access
      n_cached=W, ramp=R, eps=1e-8, bq=BLOCK, bk=BLOCK, scale=1.0, precision="default", interpret=True,
      vmem_limit_bytes=None, w=W)
  n = B * H * (M // BLOCK)
  for span, first in ((2.0, [2, 3]), (100.0, [0, 1])):
    z = jnp.full((B, H, M), span, jnp.float32)
    bounds = ft._key_bounds(z, B, H, M, static)  # pylint: disable=protected-access
    np.testing.assert_array_equal(bounds[:n], np.tile(first, B * H))
    np.testing.assert_array_equal(bounds[n:], np.tile([4, 5], B * H))  # last + 1: distance 1


@pytest.mark.slow  # its own interpreted compile (one batch row per device): ~15 s more
def test_runs_per_shard_under_a_mesh():
  """Under a mesh the kernel runs in a shard_map over the batch axes (XLA cannot partition an
  opaque kernel): the same values and gradients, and dropout masks that differ between shards."""
  from span_lm.train import sharding  # pylint: disable=g-import-not-at-top
  q, k, v, pe, ct, key = _inputs()
  z = _spans("dynamic", key)
  want = _fused(q, k, v, pe, z, ct)
  step = jax.jit(_fused.__wrapped__)
  with jax.set_mesh(sharding.make_mesh(2)):
    assert "shard_map" in str(jax.make_jaxpr(step)(q, k, v, pe, z, ct))
    got = step(q, k, v, pe, z, ct)
    same = [jnp.broadcast_to(x[:1], x.shape) for x in (q, k, v)]  # two identical streams
    dropped = jax.jit(lambda q, k, v: ft.span_attention(
        q, k, v, pe, None, ramp=R, block=BLOCK, interpret=True, dropout_rate=0.5,
        dropout_seed=jnp.uint32(7)))(*same)
  assert float(jnp.max(jnp.abs(dropped[0] - dropped[1]))) > 0.1
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  for g_got, g_want in zip(got[1], want[1]):
    np.testing.assert_allclose(g_got, g_want, atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # the TPU interpreter simulates VMEM, DMAs and the pipeline: ~45 s
def test_tpu_interpreter_with_uninitialised_memory_as_nan():
  """pltpu.InterpretParams runs the kernels as Mosaic would schedule them (blocks copied in and
  out of simulated VMEM, scratch and resident output blocks, such as d pe's, kept between grid
  steps; uninitialised memory NaN, races looked for): values and gradients as before."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  q, k, v, pe, ct, key = _inputs()
  z = _spans("dynamic", key)
  params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
  f = lambda q, k, v, pe, z: ft.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK,
                                               interpret=params)
  _check(_value_and_grads(f, q, k, v, pe, z, ct), _plain(q, k, v, pe, z, ct), (1e-5, 2e-5),
         1e-4, z)
  assert not interpret_pallas_call.races.races_found


N_PERS, SEED = 32, 3_000_000_001  # a seed past 2**31: the hash's uint32 bits in int32


def _band_dropout(rate, n_pers, W=W, a=0):  # pylint: disable=redefined-outer-name
  """The kernel's keep mask for banded_reference's (B, H, n, C, W + A + N) bands: band column s
  of row i is key i + s (the door's rows: window, block, the A ahead), persistent vector n is
  key W + M + A + n."""
  def drop(p):
    c = p.shape[3]
    rows = jnp.arange(M).reshape(1, 1, M // c, c, 1)
    bh = (jnp.arange(B)[:, None] * H + jnp.arange(H)[None, :]).reshape(B, H, 1, 1, 1)
    cols = jnp.arange(W + a + n_pers).reshape(1, 1, 1, 1, W + a + n_pers)
    keys = jnp.where(cols < W + a, rows + cols, (W + M + a) + (cols - W - a))
    return p * hashed_dropout.dropout_scale(jnp.uint32(SEED), bh, rows, keys, n_rows=M,
                                            n_keys=W + M + a + n_pers, rate=rate)
  return drop


@functools.partial(jax.jit, static_argnames=("rate", "impl"))
def _with_pers_and_dropout(q, k, v, pe, z, pk, pv, ct, rate, impl):
  def f(q, k, v, pe, z, pk, pv):
    if impl == "fused":
      return ft.span_attention(q, k, v, pe, z, ramp=R, block=BLOCK, interpret=True,
                               pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=rate,
                               dropout_seed=jnp.uint32(SEED) if rate else None)
    return banded_reference.banded_attention(
        q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk, pers_v_GxNxD=pv,
        dropout=_band_dropout(rate, 0 if pk is None else pk.shape[-1]) if rate else None)
  out, vjp = jax.vjp(f, q, k, v, pe, z, pk, pv)
  return out, vjp(ct)


@pytest.mark.slow
@pytest.mark.parametrize("kind,n_pers,rate", [("dynamic", N_PERS, 0.3), ("fixed", N_PERS, 0.0),
                                              ("integer", 0, 0.3)])
def test_persistent_memory_and_dropout_match_the_reference(kind, n_pers, rate):
  """All-attention layers (N persistent keys and values per head in the same softmax, mask 1)
  and attention dropout (the reference given the kernel's hashed keep mask, persistent weights
  included): values and every gradient, the persistent vectors' (float32) among them."""
  q, k, v, pe, ct, key = _inputs()
  z = _spans(kind, key)
  ks = jax.random.split(jax.random.PRNGKey(5), 2)
  pk, pv = (jax.random.normal(ks[0], (H, D, n_pers)), jax.random.normal(ks[1], (H, n_pers, D))
            ) if n_pers else (None, None)
  args = (q, k, v, pe, z, pk, pv, ct)
  out, grads = _with_pers_and_dropout(*args, rate=rate, impl="fused")
  want_out, want_grads = _with_pers_and_dropout(*args, rate=rate, impl="reference")
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-4)
  if rate:  # the mask did something: the output differs from the kernel's without dropout
    assert float(jnp.max(jnp.abs(out - _with_pers_and_dropout(*args, rate=0.0, impl="reference")[0]
                                 ))) > 0.1
  for name, g, w in zip("q k v pe z pk pv".split(), grads, want_grads):
    if w is None:
      assert g is None, name
      continue
    assert g.dtype == w.dtype, name
    assert float(jnp.max(jnp.abs(w))) > 0, name
    np.testing.assert_allclose(g, w, atol=3e-5, rtol=1e-4, err_msg=f"d{name}")


def test_tiles_widen_where_the_shapes_allow():
  """256 query rows and 512 keys at the enwik8 shapes (persistent vectors too), 128 x 256 where
  512 does not divide or the window is narrow, 128 x 128 for windows laid out as odd multiples
  of 128 (the initial plan's 64 reads 128 cached positions); small test shapes keep the
  attention block; a block that is no multiple of 128 does not fit Mosaic and says why."""
  assert tpu_tiles.tiles(64, 512, 8192, 2048) == (256, 512)
  assert tpu_tiles.tiles(64, 512, 8192, 256) == (128, 256)  # N = 256
  assert tpu_tiles.tiles(64, 256, 8192, 0) == (128, 256)  # wiki103_pers' block of 256
  assert tpu_tiles.tiles(64, 512, 1024, 0) == (128, 256)  # 512 keys: half the window
  assert tpu_tiles.tiles(64, 512, 8192 + 128, 0) == (128, 128)
  assert tpu_tiles.layout_window(17 * 64) == 1152
  assert tpu_tiles.tiles(64, 512, 1152, 0) == (128, 128)
  assert tpu_tiles.layout_window(64) == 128 and tpu_tiles.tiles(64, 512, 128, 0) == (128, 128)
  assert tpu_tiles.tiles(16, 32, 48, 0) == (16, 16)
  assert not tpu_tiles.misfit(64, 512, 64) and not tpu_tiles.misfit(64, 512, 17 * 64)
  assert "128 lanes" in tpu_tiles.misfit(64, 192, 1024)


def test_bad_shapes_say_so():
  q, k, v, pe, _, _ = _inputs()
  with pytest.raises(ValueError, match="come together"):
    ft.span_attention(q, k, v, pe, pers_k_HxDxN=jnp.zeros((H, D, 16)), block=BLOCK,
                      interpret=True)
  with pytest.raises(ValueError, match="persistent vectors"):
    ft.span_attention(q, k, v, pe, pers_k_HxDxN=jnp.zeros((H, D, 24)),
                      pers_v_HxNxD=jnp.zeros((H, 24, D)), block=BLOCK, interpret=True)
  with pytest.raises(ValueError, match="needs a dropout_seed"):
    ft.span_attention(q, k, v, pe, dropout_rate=0.1, block=BLOCK, interpret=True)
  with pytest.raises(ValueError, match="multiple"):
    ft.span_attention(q, k, v, pe, block=24, interpret=True)


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
@pytest.mark.parametrize("w,d,dtype,kind,n_pers,rate", [
    (1024, 64, "bfloat16", "dynamic", 0, 0.0), (1024, 128, "bfloat16", "dynamic", 0, 0.0),
    (8192, 64, "bfloat16", "dynamic", 0, 0.0), (8192, 128, "bfloat16", "dynamic", 0, 0.0),
    (8192, 128, "float32", "dynamic", 0, 0.0), (8192, 128, "bfloat16", "fixed", 0, 0.0),
    (8192, 64, "bfloat16", "adaptive", 2048, 0.4), (1024, 128, "float32", "fixed", 256, 0.1),
    (64, 128, "bfloat16", "adaptive", 0, 0.4)])
def test_compiles_for_v5e_at_the_enwik8_head_group(w, d, dtype, kind, n_pers, rate):
  """Forward and backward of one head group (B=2, H=8, M=512, W, Dh; enwik8_pers' 2048
  persistent vectors and dropout 0.4; the initial plan's window of 64), at the door's tiles,
  compiled by Mosaic for a v5e, no TPU here: block shapes, VMEM, the strided rolls and the
  dropout hash's integer vector ops are checked as on a TPU host."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b, h, m = 2, 8, 512
  sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rep)
  z = None if kind == "fixed" else sd((b, h, m), "float32")
  args = (sd((b, h, m, d)), sd((b, h, w + m, d)), sd((b, h, w + m, d)), sd((d, w), "float32"))
  pers = (sd((h, d, n_pers), "float32"), sd((h, n_pers, d), "float32")) if n_pers else ()

  # the door's tiles, attn_block=64
  bq, bk = tpu_tiles.tiles(64, m, tpu_tiles.layout_window(w), n_pers)

  def loss(q, k, v, pe, z, *pers):
    out = ft.span_attention(q, k, v, pe, z, ramp=32, block=bq, block_k=bk,
                            pers_k_HxDxN=pers[0] if pers else None,
                            pers_v_HxNxD=pers[1] if pers else None, dropout_rate=rate,
                            dropout_seed=jnp.uint32(SEED) if rate else None)
    return jnp.sum(out.astype(jnp.float32))

  start = time.time()
  argnums = tuple(i for i, a in enumerate((*args, z, *pers)) if a is not None)
  compiled = jax.jit(jax.grad(loss, argnums=argnums)).lower(*args, z, *pers).compile()
  text = compiled.as_text()
  assert text.count("tpu_custom_call") >= 3, "forward, dq and dk/dv kernels"
  print(f"v5e compile W={w} Dh={d} {dtype} {kind} N={n_pers} dropout={rate}: "
        f"{time.time() - start:.1f} s")


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
def test_xla_sees_the_kernel_cost_of_its_tile_schedule():
  """The forward's pl.CostEstimate reaches XLA's cost analysis (the compile mode's roofline) and
  its FLOPs equal an independent count: every (query block, key block) tile with a key some row
  sees at span W, times the content, position (bq + bk distances) and value matmuls."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b, h, m, w, d, blk = 1, 2, 256, 512, 128, 128
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  f = jax.jit(lambda q, kvc, kvb, pe: ft.span_attention_kv(q, kvc, kvb, pe, None, block=blk))
  compiled = f.lower(sd((b, h, m, d)), sd((b, 2, h, d, w)), sd((b, 2, h, d, m)),
                     sd((d, w), jnp.float32)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  tiles = 0
  for i0 in range(0, m, blk):
    for t0 in range(0, w + m, blk):
      dist = w + np.arange(i0, i0 + blk)[:, None] - np.arange(t0, t0 + blk)[None, :]
      tiles += bool(((dist >= 1) & (dist <= w)).any())
  want = b * h * tiles * (2 * 2 * blk * blk * d + 2 * blk * 2 * blk * d)
  assert want <= cost["flops"] <= want * 1.001  # the rest: XLA's own padding of the inputs
  assert cost["bytes accessed"] >= 2 * b * h * (w + m) * d * 2  # keys and values read once


@pytest.mark.slow
def test_the_model_through_the_tpu_kernel_equals_the_reference(mode="adaptive", n_pers=16):
  """The door's TPU path end to end: SpanTransformer with attn_impl=pallas_tpu_interpret streams
  two blocks (the second over a non-zero cache) with the reference's loss and parameter
  gradients (adaptive spans, per head, and persistent memory). Its keys and values are projected positions last in two parts, the cache's padded
  to 128 positions (window 48: 80 zero states, never visited); with key/value caches
  (inference) the same output."""
  from span_lm.model import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  from model_helpers import make_cfg  # pylint: disable=g-import-not-at-top
  kw = {"span.mode": mode, "span.size": 48, "span.ramp": 4, "attention.block": 16, "n_heads": 2,
        "pers_mem": n_pers, "plan.granularity": 16}
  cfgs = {impl: make_cfg(**kw, **{"attention.impl": impl})
          for impl in ("pallas_tpu_interpret", "reference")}
  b, m = 2, 16
  tokens = jax.random.randint(jax.random.PRNGKey(3), (b, 2 * m), 0, 11)
  model = SpanTransformer(cfgs["reference"])
  params = model.init(jax.random.PRNGKey(4), tokens[:, :m],
                      caches_lib.init_caches(cfgs["reference"], None, b))["params"]
  if mode == "adaptive":  # spans inside the window, different per head
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray([0.3, 0.8], x.dtype) if "span_ratio" in str(p) else x, params)

  def loss(params, impl):
    model = SpanTransformer(cfgs[impl])
    caches = caches_lib.init_caches(cfgs[impl], None, b)
    total = 0.0
    for i in range(2):
      x = tokens[:, i * m:(i + 1) * m]
      logp, caches, _ = model.apply({"params": params}, x, caches)
      total += jnp.mean(logp[..., 0] * jnp.arange(m)[None])
    return total

  got, g_got = jax.value_and_grad(loss)(params, "pallas_tpu_interpret")
  want, g_want = jax.value_and_grad(loss)(params, "reference")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for path, a in jax.tree_util.tree_leaves_with_path(g_got):
    w = functools.reduce(lambda t, k: t[k.key], path, g_want)
    np.testing.assert_allclose(a, w, rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(g_got))

  kv_model = SpanTransformer(cfgs["pallas_tpu_interpret"], kv_cache=True)
  kc = caches_lib.init_caches(cfgs["pallas_tpu_interpret"], None, b, kv=True)
  hc = caches_lib.init_caches(cfgs["reference"], None, b)
  for i in range(2):
    x = tokens[:, i * m:(i + 1) * m]
    lk, kc, _ = kv_model.apply({"params": params}, x, kc)
    lh, hc, _ = model.apply({"params": params}, x, hc)
    np.testing.assert_allclose(lk, lh, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_window_laid_out_in_whole_key_tiles_visits_only_the_window():
  """A window of 40 in 16-key tiles is laid out as 48 cached positions (the rows API pads) or
  80 (a caller's longer cache part, its 40 oldest positions set to 1e4): dynamic spans up to
  past the window, persistent memory and dropout give the reference's values and gradients
  either way (the padding is never visited; dropout numbers keys as if it were absent), and the
  key blocks visited start at the window."""
  w = 40
  ks = jax.random.split(jax.random.PRNGKey(8), 8)
  q = jax.random.normal(ks[0], (B, H, M, D))
  k, v = (jax.random.normal(x, (B, H, w + M, D)) for x in ks[1:3])
  pe = jax.random.normal(ks[3], (D, w))
  z = jax.random.uniform(ks[4], (B, H, M), minval=25.0, maxval=45.0)
  pk, pv = jax.random.normal(ks[5], (H, D, 16)), jax.random.normal(ks[6], (H, 16, D))
  ct = jax.random.normal(ks[7], (B, H, M, D))
  kw = dict(ramp=R, block=BLOCK, interpret=True, pers_k_HxDxN=pk, pers_v_HxNxD=pv,
            dropout_rate=0.3, dropout_seed=jnp.uint32(SEED))

  def long_cache(q, k, v, pe, z):
    kv = jnp.swapaxes(jnp.stack([k, v], axis=1), -1, -2)  # B 2 H Dh T
    cache = jnp.concatenate([jnp.full((*kv.shape[:4], 40), 1e4, kv.dtype), kv[..., :w]], -1)
    return ft.span_attention_kv(q, cache, kv[..., w:], pe, z, **kw)

  def reference(q, k, v, pe, z):
    return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk,
                                             pers_v_GxNxD=pv, dropout=_band_dropout(0.3, 16, w))

  want = _value_and_grads(jax.jit(reference), q, k, v, pe, z, ct)
  for f in (lambda q, k, v, pe, z: ft.span_attention(q, k, v, pe, z, **kw), long_cache):
    _check(_value_and_grads(jax.jit(f), q, k, v, pe, z, ct), want, (2e-5, 5e-5), 1e-4, z)
  static = ft._Static(  # pylint: disable=protected-access
      n_cached=80, w=w, ramp=R, eps=1e-8, bq=BLOCK, bk=BLOCK, scale=1.0, precision="default",
      interpret=True, vmem_limit_bytes=None)
  bounds = ft._key_bounds(jnp.full((B, H, M), 100.0), B, H, M, static)  # pylint: disable=protected-access
  np.testing.assert_array_equal(bounds[:B * H * 2], np.tile([2, 3], B * H))  # keys 40 + i0 on


# ----------------------------------------------------------- windows ahead and segment ids

A = 20  # keys ahead: not a multiple of the key tile, so the rows API pads the part ahead


def _two_sided_inputs(seed=11):
  """Queries, the door's W + M + A key rows, position embeddings both ways, dynamic spans both
  ways (windows ahead from 8 to A), and segment ids: runs of 1 to 6 rows (shorter than the
  ramp and longer), scattered padding, and batch row 1's last 8 queries all padding."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 10)
  t = W + M + A
  q = jax.random.normal(ks[0], (B, H, M, D))
  k, v = (jax.random.normal(x, (B, H, t, D)) for x in ks[1:3])
  pe, pe_a = jax.random.normal(ks[3], (D, W)), jax.random.normal(ks[4], (D, A))
  z = jax.random.uniform(ks[5], (B, H, M), minval=0.0, maxval=50.0)
  za = jax.random.uniform(ks[6], (B, H, M), minval=0.0, maxval=14.0)
  rng = np.random.default_rng(seed)
  ids = np.cumsum(rng.integers(1, 7, size=(B, t)) == 1, axis=1) % 4 + 1
  ids[rng.uniform(size=(B, t)) < 0.1] = 0
  ids[1, W + M - 8:W + M] = 0
  seg = (jnp.asarray(ids[:, W:W + M], jnp.int32), jnp.asarray(ids, jnp.int32))
  ct = jax.random.normal(ks[7], (B, H, M, D))
  pk, pv = jax.random.normal(ks[8], (H, D, 16)), jax.random.normal(ks[9], (H, 16, D))
  return q, k, v, pe, pe_a, z, za, seg, ct, pk, pv


@functools.partial(jax.jit, static_argnames=("impl", "rate", "asym", "n_pers"))
def _two_sided(q, k, v, pe, pe_a, z, za, seg, ct, pk, pv, *, impl, rate, asym, n_pers):
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  pers = (pk, pv) if n_pers else (None, None)

  def f(q, k, v, pe, pe_a, z, za, pk, pv):
    za = za if asym else None
    if impl == "fused":
      return ft.span_attention(q, k, v, pe, z, key_pe_ahead_DxA=pe_a, z_ahead_BxHxM=za,
                               q_seg_BxM=seg[0], kv_seg_BxT=seg[1], ramp=R, block=BLOCK,
                               interpret=True, pers_k_HxDxN=pk, pers_v_HxNxD=pv,
                               dropout_rate=rate,
                               dropout_seed=jnp.uint32(SEED) if rate else None)
    return banded_reference.banded_attention(
        q, k, v, pe, key_pe_ahead_DxA=pe_a, span_z=z, span_z_ahead=za, ramp=R,
        segments=kernels.Segments(*seg), pers_k_GxDxN=pk, pers_v_GxNxD=pv,
        dropout=_band_dropout(rate, n_pers, W, A) if rate else None)

  out, vjp = jax.vjp(f, q, k, v, pe, pe_a, z, za, *pers)
  return out, vjp(ct)


@pytest.mark.slow
@pytest.mark.parametrize("asym,n_pers,rate", [(True, 16, 0.3), (False, 0, 0.0)])
def test_two_sided_segments_dropout_and_persistent_memory_match_the_reference(asym, n_pers,
                                                                             rate):
  """Windows ahead (A = 20, padded to two key tiles), spans per row both ways (learned apart or
  one for both sides), segment ids with padding, segments shorter than the ramp and all-padding
  rows, persistent memory and dropout (the reference given the kernel's hashed keep mask, keys
  numbered as the door's rows: persistent vector n is key W + M + A + n): values and every
  gradient; padding rows give zeros and no NaN anywhere."""
  args = _two_sided_inputs()
  kw = dict(rate=rate, asym=asym, n_pers=n_pers)
  out, grads = _two_sided(*args, impl="fused", **kw)
  want_out, want_grads = _two_sided(*args, impl="reference", **kw)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-4)
  q_seg = args[7][0]
  assert np.all(np.asarray(out)[np.broadcast_to((q_seg == 0)[:, None, :, None], out.shape)] == 0)
  assert bool(jnp.any(q_seg == 0)) and bool(jnp.all(q_seg[1, -8:] == 0))
  if rate:  # the mask did something
    plain = _two_sided(*args, impl="reference", rate=0.0, asym=asym, n_pers=n_pers)[0]
    assert float(jnp.max(jnp.abs(out - plain))) > 0.1
  for name, g, w in zip("q k v pe pe_ahead z z_ahead pk pv".split(), grads, want_grads):
    if w is None:  # no persistent memory
      assert g is None, name
      continue
    if name == "z_ahead" and not asym:
      assert float(jnp.max(jnp.abs(g))) == 0  # not an input of either
      continue
    assert g.dtype == w.dtype, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert float(jnp.max(jnp.abs(w))) > 0, name
    np.testing.assert_allclose(g, w, atol=3e-5, rtol=1e-4, err_msg=f"d{name}")


def _static(**kw):
  return ft._Static(  # pylint: disable=protected-access
      **dict(dict(n_cached=W, w=W, ramp=R, eps=1e-8, bq=BLOCK, bk=BLOCK, scale=1.0,
                  precision="default", interpret=True, vmem_limit_bytes=None), **kw))


def test_visited_key_blocks_follow_both_windows_and_the_segments():
  """The bounds the index maps and the skips read, two-sided (W = 48, A = 20 laid out as 32:
  7 key blocks of 16): behind to the row's window, ahead to floor(z_a) + R; with segment ids
  narrowed to the key blocks whose id range meets the query block's (an all-padding query
  block: an empty range), and the per-tile ranges the kernels check inside that range."""
  s = _static(a=A, ap=32)
  n = B * H * (M // BLOCK)
  steps = ft._key_steps(M, s)  # pylint: disable=protected-access
  assert steps == 6  # rows 0..15 at span W and A: keys 0..(48 + 14 + 20) = blocks 0..5
  for z, za, lo, hi in (
      (None, None, [0, 1], [6, 7]),  # fixed span: every distance both ways
      (2.0, 0.0, [2, 3], [5, 6]),  # behind 11 (keys 37.., 53..); ahead 8: rows 15, 31 reach
      # keys 48 + 15 + 8 - 1 = 70 (block 4) and 86 (block 5)
      (2.0, 10.0, [2, 3], [6, 7]),  # ahead 18: keys 80 (block 5) and 96 (block 6)
      (100.0, 100.0, [0, 1], [6, 7])):  # past both windows: clipped to W and A
    zz = None if z is None else jnp.full((B, H, M), z, jnp.float32)
    zza = None if za is None else jnp.full((B, H, M), za, jnp.float32)
    bounds = ft._key_bounds(zz, B, H, M, s._replace(asym=za is not None), zza)  # pylint: disable=protected-access
    np.testing.assert_array_equal(bounds[:n], np.tile(lo, B * H), err_msg=f"{z} {za}")
    np.testing.assert_array_equal(bounds[n:], np.tile(hi, B * H), err_msg=f"{z} {za}")
    assert max(h - l for l, h in zip(lo, hi)) <= steps

  # segments, fixed span (windows [0, 6) and [1, 7)): batch row 0 keys rows 0..63 segment 1,
  # 64..99 segment 2, its queries (rows 48..79) likewise; batch row 1 keys of segments 1 and 3
  # alternating per 16 rows, its first query block segment 3, its second all padding
  t = W + M + A
  kv = np.zeros((B, t), np.int32)
  kv[0, :64], kv[0, 64:] = 1, 2
  kv[1] = np.where((np.arange(t) // 16) % 2 == 0, 1, 3)
  qs = kv[:, W:W + M].copy()
  qs[1, :16], qs[1, 16:] = 3, 0
  ks = np.pad(kv, ((0, 0), (0, 32 - A)))  # laid out: L = W, the part ahead padded to 32
  ss = s._replace(segmented=True)
  ranges = ft._segment_ranges(jnp.asarray(qs), jnp.asarray(ks), BLOCK, BLOCK)  # pylint: disable=protected-access
  meets = ft._tiles_meet(ranges, B, M // BLOCK, 7)  # pylint: disable=protected-access
  np.testing.assert_array_equal(meets[0], [[1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1]])
  np.testing.assert_array_equal(meets[1], [[0, 1, 0, 1, 0, 1, 0], [0] * 7])
  bounds = ft._key_bounds(None, B, H, M, ss, None, meets)  # pylint: disable=protected-access
  lo, hi = bounds[:n].reshape(B, H, 2), bounds[n:].reshape(B, H, 2)
  np.testing.assert_array_equal(lo[0], [[0, 4]] * H)
  np.testing.assert_array_equal(hi[0], [[4, 7]] * H)
  # batch row 1: query block 0 meets key blocks 1, 3, 5 only (2 and 4 are skipped inside);
  # query block 1 (padding) visits none: its range is empty, first = last + 1
  np.testing.assert_array_equal(lo[1], [[1, 1]] * H)
  np.testing.assert_array_equal(hi[1], [[6, 1]] * H)
  # the dk/dv kernel's query ranges per key block follow: key block 0 is read by none
  qb = ft._query_bounds(bounds, B, H, M, ss)  # pylint: disable=protected-access
  nk = B * H * 7
  np.testing.assert_array_equal(qb[:nk].reshape(B, H, 7)[0, 0], [0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(qb[nk:].reshape(B, H, 7)[0, 0], [1, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(qb[nk:].reshape(B, H, 7)[1, 0], [0, 1, 1, 1, 1, 1, 0])


@pytest.mark.slow  # three interpreted calls sharing one compile: ~40 s
def test_key_tiles_outside_both_windows_and_the_segments_are_never_read():
  """NaN keys and values in key blocks no query may read leave outputs and every gradient
  unchanged: blocks beyond the spans behind, and a block of a segment no query holds, in the
  middle of the windows (skipped inside the visited range, by the tiles' id ranges: the
  segments are not monotone); the same NaNs in a read block reach the output, so the test can
  fail."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  q, k, v, pe, pe_a, _, _, _, ct, _, _ = _two_sided_inputs(seed=3)
  z = jnp.full((B, H, M), 2.0, jnp.float32)  # behind: 11 distances, keys 37.. and 53..
  za = jnp.full((B, H, M), 12.0, jnp.float32)  # ahead: min(12 + R, A) = 20
  t = W + M + A
  kv = np.ones((B, t), np.int32)
  kv[:, 64:80] = 2  # key block 4: segment 2, which no query holds
  kv[:, [5, 50, 90]] = 0  # and some padding keys
  seg = (jnp.ones((B, M), jnp.int32), jnp.asarray(kv))

  @jax.jit
  def run(k, v):
    f = lambda q, k, v, pe, pe_a, z, za: ft.span_attention(
        q, k, v, pe, z, key_pe_ahead_DxA=pe_a, z_ahead_BxHxM=za, q_seg_BxM=seg[0],
        kv_seg_BxT=seg[1], ramp=R, block=BLOCK, interpret=True)
    out, vjp = jax.vjp(f, q, k, v, pe, pe_a, z, za)
    return out, vjp(ct)

  clean_out, clean_grads = run(k, v)
  want = banded_reference.banded_attention(q, k, v, pe, key_pe_ahead_DxA=pe_a, span_z=z,
                                           span_z_ahead=za, ramp=R,
                                           segments=kernels.Segments(*seg))
  np.testing.assert_allclose(clean_out, want, atol=1e-5, rtol=1e-4)
  unread = np.zeros(t, bool)
  unread[:32] = True  # behind the spans: key blocks 0, 1
  unread[64:80] = True  # segment 2
  nan = lambda x: jnp.where(jnp.asarray(unread)[None, None, :, None], jnp.nan, x)
  out, grads = run(nan(k), nan(v))
  np.testing.assert_array_equal(out, clean_out)
  for name, g, c in zip("q k v pe pe_ahead z z_ahead".split(), grads, clean_grads):
    np.testing.assert_array_equal(g, c, err_msg=f"d{name}")
  reached, _ = run(k, v.at[:, :, 80].set(jnp.nan))  # key block 5: segment 1, ahead, read
  assert bool(jnp.any(jnp.isnan(reached)))


def _v5p(devices=1):
  """A v5p topology's first `devices` chips (deviceless) and its replicated sharding."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:devices]), ("data",))
  return mesh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _xla_cost(compiled):
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
@pytest.mark.parametrize("w,a,d,dtype,asym,n_pers,rate", [
    (1024, 1023, 64, "bfloat16", False, 0, 0.0), (256, 255, 64, "bfloat16", True, 0, 0.1),
    (1024, 1023, 128, "float32", True, 256, 0.1), (8192, 8191, 64, "bfloat16", False, 0, 0.0)])
def test_two_sided_segmented_compiles_for_v5p(w, a, d, dtype, asym, n_pers, rate):
  """Forward and backward of one head group (B=2, H=8, M=512) with windows ahead (the drop-in
  layer's A = max_span - 1), segment ids, spans both ways (learned apart or not), persistent
  memory and dropout, at the door's tiles, compiled by Mosaic for a v5p, no TPU here: the three
  kernels (dk/dv once per part) within the scoped VMEM limit `vmem_bytes` sets (Mosaic refuses
  at compile time what does not fit), and XLA's FLOPs and bytes, printed."""
  mesh, rep = _v5p()
  b, h, m = 2, 8, 512
  t = w + m + a
  sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rep)
  args = [sd((b, h, m, d)), sd((b, h, t, d)), sd((b, h, t, d)), sd((d, w), "float32"),
          sd((d, a), "float32"), sd((b, h, m), "float32")]
  args += [sd((b, h, m), "float32")] if asym else []
  args += [sd((h, d, n_pers), "float32"), sd((h, n_pers, d), "float32")] if n_pers else []
  segs = (sd((b, m), "int32"), sd((b, t), "int32"))
  bq, bk = tpu_tiles.tiles(64, m, tpu_tiles.layout_window(w), n_pers)

  def loss(q, k, v, pe, pe_a, z, *rest, q_seg, kv_seg):
    za = rest[0] if asym else None
    pk, pv = rest[-2:] if n_pers else (None, None)
    out = ft.span_attention(q, k, v, pe, z, key_pe_ahead_DxA=pe_a, z_ahead_BxHxM=za,
                            q_seg_BxM=q_seg, kv_seg_BxT=kv_seg, ramp=32, block=bq, block_k=bk,
                            pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=rate,
                            dropout_seed=jnp.uint32(SEED) if rate else None)
    return jnp.sum(out.astype(jnp.float32))

  start = time.time()
  step = jax.jit(lambda segs, *x: jax.grad(loss, argnums=tuple(range(len(x))))(
      *x, q_seg=segs[0], kv_seg=segs[1]))
  compiled = step.lower(segs, *args).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 4, (
      "forward, dq and the dk/dv kernel once per part")
  cost = _xla_cost(compiled)
  assert cost["flops"] > 0 and cost["bytes accessed"] > 0
  vmem = tpu_tiles.vmem_bytes(tpu_tiles.layout_window(w) + a, tpu_tiles.padded_head_dim(d), bq, bk,
                              dtype, n_pers=n_pers, row_stats=2 * asym + 1, key_ids=True)
  print(f"v5p compile two-sided W={w} A={a} Dh={d} {dtype} asym={asym} N={n_pers} "
        f"dropout={rate} tiles {bq}x{bk}: {time.time() - start:.1f} s, scoped VMEM limit "
        f"{vmem / 2**20:.0f} MiB, XLA {cost['flops'] / 1e9:.1f} GFLOP, "
        f"{cost['bytes accessed'] / 1e9:.3f} GB")


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
def test_xla_sees_the_two_sided_kernel_cost_of_its_tile_schedule():
  """Two-sided with segments, the forward's pl.CostEstimate in XLA's cost analysis equals an
  independent count: every (query block, key block) tile with a key some row sees within W
  behind or A ahead (the grid's worst case: segments and shorter spans skip at run time), times
  the content, position (bq + bk distances) and value matmuls; the part ahead's keys are read."""
  _, rep = _v5p()
  b, h, m, w, a, d, blk = 1, 2, 256, 512, 300, 128, 128
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  f = jax.jit(lambda q, k, v, pe, pe_a, qs, ks: ft.span_attention(
      q, k, v, pe, None, key_pe_ahead_DxA=pe_a, q_seg_BxM=qs, kv_seg_BxT=ks, block=blk))
  t = w + m + a
  compiled = f.lower(sd((b, h, m, d)), sd((b, h, t, d)), sd((b, h, t, d)),
                     sd((d, w), jnp.float32), sd((d, a), jnp.float32), sd((b, m), jnp.int32),
                     sd((b, t), jnp.int32)).compile()
  cost = _xla_cost(compiled)
  tiles = 0
  ap = -(-a // blk) * blk
  for i0 in range(0, m, blk):
    for t0 in range(0, w + m + ap, blk):  # laid out: query i is key w + i
      dist = w + np.arange(i0, i0 + blk)[:, None] - np.arange(t0, t0 + blk)[None, :]
      tiles += bool(((dist >= 1 - a) & (dist <= w)).any())
  want = b * h * tiles * (2 * 2 * blk * blk * d + 2 * blk * 2 * blk * d)
  # the rest (0.6 %): XLA's own passes around the kernel (the rows' layout, the segment id
  # ranges, the bounds)
  assert want <= cost["flops"] <= want * 1.01
  assert cost["bytes accessed"] >= 2 * b * h * (w + m + a) * d * 2  # keys and values read once


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
def test_bidirectional_encoder_step_compiles_for_v5p():
  """A real step: jit(grad) of a small encoder (two pre-norm blocks of the drop-in
  AdaptiveSpanAttention(causal=False, asymmetric=True), max_span 256, dropout, bf16) on packed
  and padded rows (segment_ids), its batch sharded over a v5p:2x2x1's four chips, compiled
  deviceless: `auto` picks the TPU kernel, whose three kernels (dk/dv per part) run per layer
  inside shard_map, and the step fits the chip; XLA's FLOPs and bytes, printed."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from span_lm import layers  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import target  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import chips  # pylint: disable=g-import-not-at-top
  mesh, rep = _v5p(4)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  bf16 = jnp.bfloat16

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, tokens, seg):
      x = nn.Embed(256, 256, dtype=bf16)(tokens)
      for _ in range(2):
        x = x + layers.AdaptiveSpanAttention(
            num_heads=4, max_span=256, causal=False, asymmetric=True, dropout_rate=0.1,
            dtype=bf16)(nn.LayerNorm(dtype=bf16)(x), segment_ids=seg, deterministic=False)
        h = nn.LayerNorm(dtype=bf16)(x)
        x = x + nn.Dense(256, dtype=bf16)(nn.gelu(nn.Dense(1024, dtype=bf16)(h)))
      return nn.Dense(256, dtype=jnp.float32)(x)

  model, (b, n) = Encoder(), (8, 1024)
  ids = lambda: jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=rows)

  def loss(params, tokens, seg, rng):  # masked-LM-like: every non-padding token, span penalty
    logits, inter = model.apply({"params": params}, tokens, seg, rngs={"dropout": rng},
                                mutable=["intermediates"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]
    keep = (seg != 0).astype(jnp.float32)
    return (jnp.sum(nll * keep) / jnp.maximum(jnp.sum(keep), 1.0)
            + layers.span_loss(inter["intermediates"]))

  start = time.time()
  with target.compiling_for("tpu", None, mesh.devices.flat[0].device_kind), jax.set_mesh(mesh):
    spec = layers.core.layer_spec(4, 64, 256, 32, causal=False, dtype=bf16)
    assert kernels_choose(spec, n) == "pallas_tpu"
    params = jax.eval_shape(lambda: model.init(
        {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
        jnp.zeros((b, n), jnp.int32), jnp.ones((b, n), jnp.int32)))["params"]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    compiled = jax.jit(jax.grad(loss)).lower(
        params, ids(), ids(), jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)).compile()
  text = compiled.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 2 * 4, "4 kernels per layer"
  assert "span_attention_bwd_kv" in text
  cost, mem = _xla_cost(compiled), compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes)
  assert 0 < peak < chips.get("v5p").memory_bytes
  assert cost["flops"] > 0 and cost["bytes accessed"] > 0
  print(f"v5p:2x2x1 bidirectional encoder step (2 layers, 8 x 1024 tokens, max_span 256, "
        f"segment ids, bf16): {time.time() - start:.1f} s, per chip XLA "
        f"{cost['flops'] / 1e9:.1f} GFLOP, {cost['bytes accessed'] / 1e9:.3f} GB, "
        f"temporaries {mem.temp_size_in_bytes / 2**20:.0f} MiB")


def kernels_choose(spec, n):
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  blk = spec.attention.block
  return kernels.choose(spec, -(-n // blk) * blk, spec.window)


@pytest.mark.slow
def test_segment_ids_with_the_models_laid_out_cache():
  """Causal segment ids through the model's layout (`span_attention_kv`: a cache part longer
  than the window, its 40 oldest positions 1e4 and never visited; the keys' ids given for the
  door's W + M rows and laid out by the kernel), with dynamic spans and dropout: the reference's
  values and gradients."""
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  w = 40
  ks = jax.random.split(jax.random.PRNGKey(9), 6)
  q = jax.random.normal(ks[0], (B, H, M, D))
  k, v = (jax.random.normal(x, (B, H, w + M, D)) for x in ks[1:3])
  pe = jax.random.normal(ks[3], (D, w))
  z = jax.random.uniform(ks[4], (B, H, M), minval=0.0, maxval=45.0)
  ct = jax.random.normal(ks[5], (B, H, M, D))
  ids = np.cumsum(np.random.default_rng(4).integers(1, 5, size=(B, w + M)) == 1, axis=1) + 1
  ids[0, :10] = 0
  ids[1, w + 20:] = 0  # batch row 1's last 12 queries: padding
  seg = (jnp.asarray(ids[:, w:], jnp.int32), jnp.asarray(ids, jnp.int32))

  def laid_out(q, k, v, pe, z):
    kv = jnp.swapaxes(jnp.stack([k, v], axis=1), -1, -2)  # B 2 H Dh T
    cache = jnp.concatenate([jnp.full((*kv.shape[:4], 40), 1e4, kv.dtype), kv[..., :w]], -1)
    return ft.span_attention_kv(q, cache, kv[..., w:], pe, z, q_seg_BxM=seg[0],
                                kv_seg_BxT=seg[1], ramp=R, block=BLOCK, interpret=True,
                                dropout_rate=0.3, dropout_seed=jnp.uint32(SEED))

  def reference(q, k, v, pe, z):
    return banded_reference.banded_attention(q, k, v, pe, span_z=z, ramp=R,
                                             segments=kernels.Segments(*seg),
                                             dropout=_band_dropout(0.3, 0, w))

  got = _value_and_grads(jax.jit(laid_out), q, k, v, pe, z, ct)
  want = _value_and_grads(jax.jit(reference), q, k, v, pe, z, ct)
  _check(got, want, (2e-5, 5e-5), 1e-4, z)
  assert float(jnp.max(jnp.abs(got[0][1, :, -12:]))) == 0  # padding queries


@pytest.mark.slow  # the TPU interpreter: ~1 min
def test_two_sided_segmented_in_the_tpu_interpreter():
  """The two-sided segmented kernels as Mosaic would schedule them (pltpu.InterpretParams:
  blocks copied in and out of simulated VMEM, the keys' (1, bk) id blocks and the index maps'
  empty ranges (an all-padding query block) included, uninitialised memory NaN, races looked
  for): the reference's values and gradients."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  from span_lm import kernels  # pylint: disable=g-import-not-at-top
  q, k, v, pe, pe_a, z, za, seg, ct, _, _ = _two_sided_inputs(seed=5)
  seg = (seg[0].at[1, BLOCK:].set(0), seg[1])  # batch row 1's second query block: all padding
  params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)

  def f(q, k, v, pe, pe_a, z, za):
    return ft.span_attention(q, k, v, pe, z, key_pe_ahead_DxA=pe_a, z_ahead_BxHxM=za,
                             q_seg_BxM=seg[0], kv_seg_BxT=seg[1], ramp=R, block=BLOCK,
                             interpret=params)

  def g(q, k, v, pe, pe_a, z, za):
    return banded_reference.banded_attention(q, k, v, pe, key_pe_ahead_DxA=pe_a, span_z=z,
                                             span_z_ahead=za, ramp=R,
                                             segments=kernels.Segments(*seg))

  args = (q, k, v, pe, pe_a, z, za)
  out, vjp = jax.vjp(f, *args)
  want, want_vjp = jax.vjp(jax.jit(g), *args)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-4)
  assert float(jnp.max(jnp.abs(out[1, :, BLOCK:]))) == 0
  for name, got, w in zip("q k v pe pe_ahead z z_ahead".split(), vjp(ct), want_vjp(ct)):
    np.testing.assert_allclose(got, w, atol=3e-5, rtol=1e-4, err_msg=f"d{name}")
  assert not interpret_pallas_call.races.races_found
