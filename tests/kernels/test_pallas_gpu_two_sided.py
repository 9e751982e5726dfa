"""The fused GPU kernel (span_lm/kernels/span/pallas_gpu.py) with windows ahead and segment ids.

tests/kernels/test_two_sided.py compares it (as `pallas_interpret`) with the float64 definition
and the reference implementation on random shapes, spans and segments; here: dropout against the
reference given the kernel's own keep mask, fixed spans and padded head sizes, rows that see no
key, that key tiles outside both windows and outside a tile's segments are never read (NaN keys
there change nothing), the tile ranges themselves, and (`-m compile`, CUDA plugin) the kernels'
PTX facts, alone and inside an encoder's training step, for an H100 and an A100.
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels.span import banded_reference
from span_lm.kernels.span import cost as kernel_cost
from span_lm.kernels import hashed_dropout
from span_lm.kernels.span import pallas_gpu as fa

B, H, M, D, W, R, BLOCK = 2, 2, 32, 16, 32, 8, 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def _inputs(a, *, seed=0, dh=D, w=W, m=M, n_pers=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 9)
  t = w + m + a
  nrm = lambda k, s: jax.random.normal(k, s, jnp.float32)
  x = dict(q=nrm(ks[0], (B, H, m, dh)), k=nrm(ks[1], (B, H, t, dh)), v=nrm(ks[2], (B, H, t, dh)),
           pe=nrm(ks[3], (dh, w)), pe_a=nrm(ks[4], (dh, a)),
           z=jax.random.uniform(ks[5], (B, H, m), minval=0.0, maxval=w + 4.0),
           z_a=jax.random.uniform(ks[6], (B, H, m), minval=0.0, maxval=a + 4.0))
  if n_pers:
    x.update(pk=nrm(ks[7], (H, dh, n_pers)), pv=nrm(ks[8], (H, n_pers, dh)))
  return x


def _segments(a, *, m=M, w=W, seed=0):
  """Runs of ids 1..4 over the T rows, some padding (0), the block's last rows all padding."""
  rng = np.random.default_rng(seed)
  t = w + m + a
  ids = np.cumsum(rng.uniform(size=(B, t)) < 0.15, axis=1) % 4 + 1
  ids[rng.uniform(size=(B, t)) < 0.1] = 0
  ids[:, w + m - 5:w + m] = 0
  return jnp.asarray(ids[:, w:w + m], jnp.int32), jnp.asarray(ids, jnp.int32)


def _fused(x, seg, **kw):
  return fa.span_attention(x["q"], x["k"], x["v"], x["pe"], x.get("z"), ramp=R, block=BLOCK,
                           interpret=True, key_pe_ahead_DxA=x["pe_a"], z_ahead_BxHxM=x.get("z_a"),
                           pers_k_HxDxN=x.get("pk"), pers_v_HxNxD=x.get("pv"),
                           q_segments_BxM=None if seg is None else seg[0],
                           kv_segments_BxT=None if seg is None else seg[1], **kw)


def _plain(x, seg, dropout=None):
  return banded_reference.banded_attention(
      x["q"], x["k"], x["v"], x["pe"], key_pe_ahead_DxA=x["pe_a"], span_z=x.get("z"),
      span_z_ahead=x.get("z_a"), ramp=R, pers_k_GxDxN=x.get("pk"), pers_v_GxNxD=x.get("pv"),
      segments=None if seg is None else kernels.Segments(*seg), dropout=dropout)


def _compare(fused, plain, x, names, *, atol=3e-5, rtol=1e-4):
  """Values and the gradient of every input in `names`, both ways."""
  ct = jax.random.normal(jax.random.PRNGKey(9), x["q"].shape)
  args = [x[n] for n in names]
  np.testing.assert_allclose(fused(x), plain(x), atol=1e-5, rtol=1e-5)
  (_, got), (_, want) = (jax.value_and_grad(
      lambda *a, f=f: jnp.sum(f(dict(x, **dict(zip(names, a)))) * ct),
      argnums=tuple(range(len(args))))(*args) for f in (fused, plain))
  for n, g, w in zip(names, got, want):
    assert float(jnp.max(jnp.abs(w))) > 0, n  # the comparison can fail
    np.testing.assert_allclose(g, w, atol=atol, rtol=rtol, err_msg=f"d{n}")


@pytest.mark.slow
@pytest.mark.parametrize("asym", [False, True])
def test_two_sided_dropout_matches_the_reference_given_the_same_keep_mask(asym):
  """The kernel's hashed keep mask (key t: row t of the T = W + M + A rows; persistent vector n:
  key T + n), given to the reference as its dropout, gives the same values and gradients (q, k,
  v, both position embeddings, both spans, persistent memory), with segments; and it drops."""
  a, n, rate, seed = 24, 16, 0.3, jnp.uint32(77)
  x = _inputs(a, n_pers=n)
  if not asym:
    del x["z_a"]
  seg = _segments(a)
  t = W + M + a

  def band_dropout(p):  # (B, H, M/C, C, W + A + N): column s < W + A of row i is key i + s
    c, cols = p.shape[3], p.shape[4]
    rows = jnp.arange(M).reshape(1, 1, M // c, c, 1)
    bh = (jnp.arange(B)[:, None] * H + jnp.arange(H)[None, :]).reshape(B, H, 1, 1, 1)
    s = jnp.arange(cols).reshape(1, 1, 1, 1, cols)
    keys = jnp.where(s < W + a, rows + s, t + (s - W - a))
    return p * hashed_dropout.dropout_scale(seed, bh, rows, keys, n_rows=M, n_keys=t + n,
                                            rate=rate)

  fused = lambda x: _fused(x, seg, dropout_rate=rate, dropout_seed=seed)
  names = ("q", "k", "v", "pe", "pe_a", "z", "pk", "pv") + (("z_a",) if asym else ())
  _compare(fused, lambda x: _plain(x, seg, band_dropout), x, names)
  assert float(jnp.max(jnp.abs(fused(x) - _fused(x, seg)))) > 0.1  # dropout did something


@pytest.mark.slow
@pytest.mark.parametrize("a,segmented", [(16, True), (9, False), (40, True)])
def test_fixed_spans_and_a_padded_head_size(a, segmented):
  """A fixed span (no mask, every distance of both windows) and a head size that is not a power
  of two (24, padded to 32), A a multiple of the tile or not (padded to whole key tiles)."""
  x = _inputs(a, dh=24, n_pers=16)
  del x["z"], x["z_a"]
  seg = _segments(a) if segmented else None
  _compare(lambda x: _fused(x, seg), lambda x: _plain(x, seg), x,
           ("q", "k", "v", "pe", "pe_a", "pk", "pv"))


@pytest.mark.slow
def test_rows_that_see_no_key_give_exact_zeros_and_zero_gradients():
  """A query whose window holds no key of its segment (the first row of a segment, causal: its
  distance 1 is the previous segment's) and queries of segment 0 with persistent memory: outputs
  exactly 0, every gradient finite, their dq exactly 0; the rest equals the reference."""
  ids = np.ones((B, W + M), np.int32)
  ids[:, W + 8:] = 2  # query 8 starts segment 2: causal, it sees only segment 1's rows
  ids[:, W + 20:W + 24] = 0  # queries 20..23: padding
  seg = (jnp.asarray(ids[:, W:]), jnp.asarray(ids))
  x = _inputs(0, n_pers=16)
  x.update(pe_a=None, z_a=None)
  ct = jax.random.normal(jax.random.PRNGKey(9), x["q"].shape)
  names = ("q", "k", "v", "pe", "z", "pk", "pv")
  grads = {}
  for name, f in (("fused", lambda x: _fused(x, seg)), ("plain", lambda x: _plain(x, seg))):
    out, vjp = jax.vjp(lambda *a, f=f: f(dict(x, **dict(zip(names, a)))), *[x[n] for n in names])
    grads[name] = (out, vjp(ct))
  out, g = grads["fused"]
  dead = np.zeros(M, bool)
  dead[20:24] = True  # padding queries: zeros even with persistent memory
  np.testing.assert_array_equal(np.asarray(out)[:, :, dead], 0.0)
  np.testing.assert_array_equal(np.asarray(g[0])[:, :, dead], 0.0)
  np.testing.assert_allclose(out, grads["plain"][0], atol=1e-5, rtol=1e-5)
  for n, got, want in zip(names, g, grads["plain"][1]):
    assert bool(jnp.all(jnp.isfinite(got))), n
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4, err_msg=f"d{n}")
  # without persistent memory query 8 sees nothing: 0, not a uniform average (nor NaN)
  x.update(pk=None, pv=None)
  out = _fused(x, seg)
  assert float(jnp.max(jnp.abs(out[:, :, 8]))) == 0.0
  np.testing.assert_allclose(out, _plain(x, seg), atol=1e-5, rtol=1e-5)
  g = jax.grad(lambda q, k: jnp.sum(_fused(dict(x, q=q, k=k), seg) * ct), argnums=(0, 1))(
      x["q"], x["k"])
  assert all(bool(jnp.all(jnp.isfinite(t))) for t in g)
  assert float(jnp.max(jnp.abs(g[0][:, :, 8]))) == 0.0


@pytest.mark.slow
def test_key_tiles_outside_both_windows_are_never_read():
  """Short spans both sides: NaN keys and values in the tiles no row reaches, behind or ahead,
  leave outputs and gradients unchanged (their dk and dv exactly 0); the same NaNs one tile
  nearer (inside a window) reach the output, so the test can fail."""
  a, w = 64, 64
  x = _inputs(a, w=w)
  # z = 2: rows see d <= floor(2) + R + 1 = 11 behind and a <= 2 + R = 10 ahead. Query tile 0
  # (rows 0..15) reads keys from w - 11 = 53 (tile 3); tile 1 (rows 16..31) up to
  # w + 31 + 10 - 1 = 104 (tile 6): tiles 0-2 and 7-9 (keys < 48 and >= 112) are never read.
  x["z"] = jnp.full((B, H, M), 2.0)
  x["z_a"] = jnp.full((B, H, M), 2.0)
  clean = _fused(x, None)
  poison = lambda t: t.at[:, :, :48].set(jnp.nan).at[:, :, 112:].set(jnp.nan)
  dirty = dict(x, k=poison(x["k"]), v=poison(x["v"]))
  np.testing.assert_array_equal(_fused(dirty, None), clean)
  ct = jax.random.normal(jax.random.PRNGKey(9), x["q"].shape)
  loss = lambda q, k, v, pe, pe_a: jnp.sum(_fused(dict(x, q=q, k=k, v=v, pe=pe, pe_a=pe_a),
                                                  None) * ct)
  args = lambda x: (x["q"], x["k"], x["v"], x["pe"], x["pe_a"])
  g_clean = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args(x))
  g_dirty = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args(dirty))
  for i in (0, 3, 4):
    np.testing.assert_array_equal(g_dirty[i], g_clean[i])
  for i in (1, 2):  # dk, dv: exactly 0 where no row looks, as the clean run's
    np.testing.assert_array_equal(g_dirty[i][:, :, 48:112], g_clean[i][:, :, 48:112])
    assert float(jnp.max(jnp.abs(g_dirty[i][:, :, :48]))) == 0.0
    assert float(jnp.max(jnp.abs(g_dirty[i][:, :, 112:]))) == 0.0
  # a visited tile's values enter a matmul (0 x NaN = NaN), even where its weights are 0
  for rows in (slice(48, 49), slice(111, 112)):
    assert bool(jnp.any(jnp.isnan(_fused(dict(x, v=x["v"].at[:, :, rows].set(jnp.nan)), None))))


@pytest.mark.slow
def test_key_tiles_outside_a_tiles_segments_are_never_read():
  """Packed segments in whole tiles (rows 0-47: 1, 48-79: 2, 80-127: 3; fixed spans, so every
  tile is inside both windows): NaN keys and values in segment 2's rows leave segments 1 and 3's
  outputs and gradients unchanged (their tiles are skipped: the key-tile ranges), while
  segment 2's own queries, which read them, turn NaN."""
  a, w, m = 32, 32, 64
  x = _inputs(a, w=w, m=m)
  del x["z"], x["z_a"]
  ids = np.full((B, w + m + a), 3, np.int32)
  ids[:, :48], ids[:, 48:80] = 1, 2
  seg = (jnp.asarray(ids[:, w:w + m]), jnp.asarray(ids))
  others = np.asarray(seg[0][0] != 2)  # queries of segments 1 and 3
  poison = lambda t: t.at[:, :, 48:80].set(jnp.nan)
  dirty = dict(x, k=poison(x["k"]), v=poison(x["v"]))
  clean, got = _fused(x, seg), _fused(dirty, seg)
  np.testing.assert_array_equal(got[:, :, others], clean[:, :, others])
  assert bool(jnp.all(jnp.isnan(got[:, :, ~others])))
  ct = jax.random.normal(jax.random.PRNGKey(9), x["q"].shape) * others[None, None, :, None]
  loss = lambda q, k, v: jnp.sum(_fused(dict(x, q=q, k=k, v=v), seg) * ct)
  g_clean = jax.grad(loss, argnums=(0, 1, 2))(x["q"], x["k"], x["v"])
  g_dirty = jax.grad(loss, argnums=(0, 1, 2))(dirty["q"], dirty["k"], dirty["v"])
  np.testing.assert_array_equal(g_dirty[0][:, :, others], g_clean[0][:, :, others])
  keep = np.r_[0:48, 80:w + m + a]
  for i in (1, 2):
    np.testing.assert_array_equal(g_dirty[i][:, :, keep], g_clean[i][:, :, keep])


def test_segment_tile_ranges_hold_every_tile_with_a_shared_id():
  """For any ids (random, returning to earlier values, padding 0), every (query tile, key tile)
  pair holding an equal non-zero id lies inside both ranges; for ids in order along the rows
  the ranges hold exactly those pairs."""
  rng = np.random.default_rng(0)
  bq, bk, m, t = 16, 8, 64, 160
  for trial in range(20):
    ids = rng.integers(0, 6, size=(2, t)) if trial % 2 else np.sort(
        np.cumsum(rng.uniform(size=(2, t)) < 0.05, axis=1) * (rng.uniform(size=(2, t)) > 0.2),
        axis=1)
    if trial % 4 == 2:  # padding runs inside ordered ids (a run may split a segment: a tile
      # of padding between two of its tiles is inside the range, visited and masked)
      ids = np.where((np.arange(t) // 24) % 3 == 1, 0, ids)
    q_ids, kv_ids = ids[:, 40:40 + m], ids
    q_rng, k_rng = (np.asarray(r) for r in fa.segment_tile_ranges(
        jnp.asarray(q_ids), jnp.asarray(kv_ids), bq, bk))
    for b in range(2):
      qt, kt = q_ids[b].reshape(-1, bq), kv_ids[b].reshape(-1, bk)
      share = np.array([[bool(set(qt[i][qt[i] != 0]) & set(kt[j][kt[j] != 0]))
                         for j in range(len(kt))] for i in range(len(qt))])
      for i, j in zip(*np.nonzero(share)):
        assert q_rng[b, i, 0] <= j < q_rng[b, i, 1] and k_rng[b, j, 0] <= i < k_rng[b, j, 1]
      if trial % 4 == 0:  # ordered ids: the ranges are exactly the tiles that share an id
        inside = np.array([[q_rng[b, i, 0] <= j < q_rng[b, i, 1] for j in range(len(kt))]
                           for i in range(len(qt))])
        np.testing.assert_array_equal(inside, share)


def test_schedule_cost_counts_the_tiles_both_windows_reach():
  """schedule_cost's FLOPs grow with the window ahead and shrink with the spans, as the kernels'
  key-block ranges do (a fixed span visits every tile of both windows)."""
  cost = lambda **kw: kernel_cost.schedule_cost(2, 4, 512, 1024, 64, jnp.bfloat16, 64,
                                                **kw)["fwd"]["flops"]
  causal, both = cost(), cost(ahead=1023)
  assert both > 1.9 * causal
  assert cost(ahead=1023, span=100.0) < 0.25 * both
  assert cost(ahead=1023, span=100.0) > cost(span=100.0)


# ------------------------------------------------------------------------------------------------
# Deviceless compiles for an H100 and an A100 (CUDA plugin): the kernels' PTX facts.

_PRELUDE = """
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

# The kernels alone at the door's tiles: two-sided (A = 255: not a whole key tile), segment ids,
# one span both sides and spans ahead learned apart, persistent memory, dropout; bf16 and
# float32, head sizes 64 and 96.
_KERNEL_CHILD = _PRELUDE + """
b, h, m, w, a, n = 1, 2, 128, 256, 255, 64
for dt in (jnp.bfloat16, jnp.float32):
  for dh in (64, 96):
    tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64, two_sided=True)
    bk = gpu_tiles.key_tile(chip.cc, dh, dt, tile, two_sided=True)
    print("TILES " + json.dumps([jnp.dtype(dt).name, dh, tile, warps, stages, bk]), flush=True)
    sds = lambda *s, d=dt: jax.ShapeDtypeStruct(s, d, sharding=sh)
    for apart in (False, True):
      def loss(q, k, v, pe, pe_a, z, z_a, pk, pv, qs, ks):
        return jnp.sum(pallas_gpu.span_attention(
            q, k, v, pe, z, ramp=32, block=tile, block_k=bk, num_warps=warps,
            num_stages=stages, pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=0.1,
            dropout_seed=jnp.uint32(3), key_pe_ahead_DxA=pe_a,
            z_ahead_BxHxM=z_a if apart else None, q_segments_BxM=qs,
            kv_segments_BxT=ks).astype(jnp.float32))
      f32, i32 = jnp.float32, jnp.int32
      jax.jit(jax.value_and_grad(loss, argnums=tuple(range(9)))).lower(
          sds(b, h, m, dh), sds(b, h, w + m + a, dh), sds(b, h, w + m + a, dh), sds(dh, w),
          sds(dh, a), sds(b, h, m, d=f32), sds(b, h, m, d=f32), sds(h, dh, n, d=f32),
          sds(h, n, dh, d=f32), sds(b, m, d=i32), sds(b, w + m + a, d=i32)
          ).compile(compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""

# A real step: jit(grad) of a small encoder (embedding, one bidirectional AdaptiveSpanAttention
# with segment ids and dropout, a readout), the layer's door on the fused kernel, compiled for
# the chip (kernels.target.compiling_for: the tiles of its table).
_ENCODER_CHILD = _PRELUDE + """
import flax.linen as nn
from span_lm import layers
from span_lm.kernels import target

class Encoder(nn.Module):
  heads: int
  head_dim: int
  dtype: object
  @nn.compact
  def __call__(self, tokens, seg, rng):
    x = nn.Embed(256, self.heads * self.head_dim, dtype=self.dtype)(tokens)
    x = x + layers.AdaptiveSpanAttention(num_heads=self.heads, max_span=64, causal=False,
                                         dtype=self.dtype, attn_impl="pallas", dropout_rate=0.1,
                                         deterministic=False)(x, segment_ids=seg, dropout_rng=rng)
    return nn.Dense(256, dtype=jnp.float32)(x)

b, n = 2, 256
with target.compiling_for("gpu", chip.cc, chip.device_kind):
  for dt in (jnp.bfloat16, jnp.float32):
    for dh in (64, 96):
      print("STEP " + json.dumps([jnp.dtype(dt).name, dh]), flush=True)
      model = Encoder(heads=4, head_dim=dh, dtype=dt)
      sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sh)
      tokens, seg = sds((b, n), jnp.int32), sds((b, n), jnp.int32)
      # traced, not run: on jax >= 0.11 the default device is the topology's, which runs nothing
      rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=sh)
      params = jax.eval_shape(lambda t, s, r: model.init(jax.random.key(0), t, s, r),
                              tokens, seg, rng)
      params = jax.tree.map(lambda p: sds(p.shape, p.dtype), params)
      def loss(params, tokens, seg, rng):
        logits = model.apply(params, tokens, seg, rng, mutable=["intermediates"])[0]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1) * (seg[..., None] > 0))
      jax.jit(jax.grad(loss)).lower(params, tokens, seg, rng).compile(
          compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""

# The kernels' parameters (tools/ptx.py numbers them as the kernel's arguments, inputs first): G,
# the position scores' rel-shift view, is parameter 3 of all three; bwd_q's zeroed gradient
# buffers (12-14) alias its outputs and are never read (as the causal kernel's).
_G, _ALIASED_ZEROS = 3, {12, 13, 14}


def _compile(tmp_path, child, target):
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path}"
  r = subprocess.run([sys.executable, "-c", child, target], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=1500, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  facts = ptx.dumped_kernels(tmp_path, "span_attention")
  reports = [k for k in compile_lib.parse_ptxas(r.stdout + r.stderr)
             if k["kernel"].startswith("span_attention")]
  return r, facts, reports


def _assert_facts(facts, target):
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


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_two_sided_segmented_kernels_ptx(tmp_path, target):
  """The two-sided segmented kernels (A = 255, not a whole tile; one span both sides and spans
  ahead learned apart; persistent memory, dropout) at the door's tiles (TILES_TWO_SIDED), bf16
  and float32, head sizes 64 and 96: no read-back, asynchronous copies, the position tiles
  pipelined, tensor-core instructions (wgmma on the H100), no spills in bf16."""
  r, facts, reports = _compile(tmp_path, _KERNEL_CHILD, target)
  tiles = [json.loads(l[6:]) for l in r.stdout.splitlines() if l.startswith("TILES ")]
  assert len(tiles) == 4 and all(t[4] >= 2 for t in tiles), tiles  # pipelined launches
  assert len(facts) == 24 == len(reports), ([f["kernel"] for f in facts], reports)
  _assert_facts(facts, target)
  bf16 = reports[:12]  # compiled in the child's order: bf16 first
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in bf16), bf16


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_encoder_training_step_runs_the_two_sided_kernels(tmp_path, target):
  """jit(grad) of an encoder built from the drop-in layer (bidirectional, segment ids, dropout,
  attn_impl='pallas'), compiled for the chip: its step holds the three two-sided segmented
  kernels per dtype and head size, with the same PTX facts, and no spills in bf16."""
  r, facts, reports = _compile(tmp_path, _ENCODER_CHILD, target)
  steps = [json.loads(l[5:]) for l in r.stdout.splitlines() if l.startswith("STEP ")]
  assert len(steps) == 4, r.stdout[-2000:]
  assert len(facts) == 12 == len(reports), ([f["kernel"] for f in facts], reports)
  _assert_facts(facts, target)
  bf16 = reports[:6]
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in bf16), bf16
