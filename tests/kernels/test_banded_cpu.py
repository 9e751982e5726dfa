"""The CPU implementation (span_lm/kernels/span/banded_cpu.py): its layouts, custom VJPs and skews
against dense attention and the numpy reference, and its own HLO checks."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import reference_numpy as ref
from model_helpers import make_cfg, to_jax, to_np
from span_lm.kernels.span import banded_cpu
from span_lm.kernels.span import span_mask

B = 2




@pytest.mark.parametrize("mode,n_pers,w,m,chunk", [
    ("adaptive", 4, 12, 8, 0), ("adaptive", 4, 12, 8, 4), ("fixed", 3, 8, 24, 0),
    ("adaptive", 0, 8, 24, 0), ("adaptive", 2, 8, 24, 4)])
def test_banded_attention_weights_match_reference(mode, n_pers, w, m, chunk):
  """banded_cpu.banded_attention's probabilities (the model drops them) against the reference's
  dense weights, mapped into the band layout (column s = distance W - s), and their sums."""
  h_, dh = 3, 4
  cfg = make_cfg(d_model=h_ * dh, n_heads=h_, **{"span.size": w, "span.ramp": 3,
                                                 "span.mode": mode}, pers_mem=n_pers,
                 n_layers=1)
  rng = np.random.default_rng(75)
  x = rng.normal(size=(B, w + m, cfg.d_model))
  key_pe = rng.normal(size=(dh, w))
  eye = {"kernel": np.eye(cfg.d_model)}
  p = {"proj_query": eye, "proj_key": eye, "proj_val": eye, "proj_out": eye}
  if mode == "adaptive":
    p["span_ratio"] = rng.uniform(0.0, 0.9, size=h_)
  if n_pers:
    p["pers_key"] = rng.normal(size=(h_, dh, n_pers)) / np.sqrt(dh)
    p["pers_val"] = rng.normal(size=(h_, n_pers, dh)) / np.sqrt(n_pers)
  x, key_pe, p = to_np(to_jax(x)), to_np(to_jax(key_pe)), to_np(to_jax(p))
  out_ref, wts = ref.attention(cfg, p, key_pe, x[:, w:], x[:, :w], return_weights=True)

  heads = lambda y: jnp.asarray(y.reshape(B, -1, h_, dh).transpose(0, 2, 1, 3), jnp.float32)
  mask = None
  if mode == "adaptive":
    z = jnp.asarray(p["span_ratio"] * w, jnp.float32)
    mask = span_mask.soft_mask(z[None, :, None, None],
                           jnp.arange(w, 0, -1, dtype=jnp.float32)[None, None, None, :], cfg.span.ramp)
  kw = {}
  if n_pers:
    kw = dict(pers_k_GxDxN=jnp.asarray(p["pers_key"] * np.sqrt(dh), jnp.float32),
              pers_v_GxNxD=jnp.asarray(p["pers_val"] * np.sqrt(n_pers), jnp.float32))
  fn = jax.jit(lambda *a, **k: banded_cpu.banded_attention(*a, chunk=chunk, **k))
  out, probs = fn(heads(x[:, w:]), heads(x), heads(x), jnp.asarray(key_pe, jnp.float32),
                  mask=mask, **kw)
  out, probs = np.asarray(out), np.asarray(probs)
  assert probs.shape == (B, h_, m, w + n_pers)
  ctx = wts["context"]  # (B, H, M, W + M) over absolute key positions
  qi = np.arange(m)[:, None]
  band = ctx[:, :, qi, w + qi - (w - np.arange(w))[None, :]]  # distance d = W - s
  np.testing.assert_allclose(band.sum(-1), ctx.sum(-1), atol=1e-12)  # nothing outside the band
  np.testing.assert_allclose(probs[..., :w], band, rtol=1e-5, atol=1e-6)
  if n_pers:
    np.testing.assert_allclose(probs[..., w:], wts["persistent"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-4)
  np.testing.assert_allclose(out.transpose(0, 2, 1, 3).reshape(B, m, -1), out_ref,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("w,m,chunk,dtype,preferred", [
    (16, 8, 0, "float32", True), (16, 8, 0, "bfloat16", True), (4, 8, 0, "bfloat16", False),
    (6, 8, 4, "float32", False)])
def test_banded_attention_positions_last_equals_first(w, m, chunk, dtype, preferred):
  """Keys and values laid out (B, G, Dh, T) give banded_attention's outputs and gradients (q, k,
  v, position embeddings, span mask) of the (B, G, T, Dh) layout, with one chunk (its own path)
  and with several (cut along T)."""
  rng = np.random.default_rng(w * 10 + m)
  g_, dh = 2, 4
  q = jnp.asarray(rng.normal(size=(B, g_, m, dh)), dtype)
  k = jnp.asarray(rng.normal(size=(B, g_, w + m, dh)), dtype)
  v = jnp.asarray(rng.normal(size=(B, g_, w + m, dh)), dtype)
  pe = jnp.asarray(rng.normal(size=(dh, w)), dtype)
  z = jnp.asarray(rng.uniform(1, w, size=(g_,)), jnp.float32)
  dist = jnp.arange(w, 0, -1, dtype=jnp.float32)

  def loss(q, k, v, pe, z, last):
    mask = span_mask.soft_mask(z[None, :, None, None], dist[None, None, None, :], 3)
    kk, vv = (k.swapaxes(2, 3), v.swapaxes(2, 3)) if last else (k, v)
    out, _ = banded_cpu.banded_attention(q, kk, vv, pe, mask=mask, chunk=chunk, positions_last=last)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

  tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
  (_, out0), g0 = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
      q, k, v, pe, z, False)
  (_, out1), g1 = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
      q, k, v, pe, z, True)
  np.testing.assert_allclose(np.asarray(out1, np.float32), np.asarray(out0, np.float32), **tol)
  for a, b in zip(g1, g0):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.abs(np.asarray(b, np.float32)).max() > 0
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  assert banded_cpu.prefer_positions_last(m, w, chunk, dtype) == preferred  # one chunk only
  if len(jax.devices()) >= 2 and preferred:  # bf16 over several devices keeps (B, G, T, Dh)
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))):
      assert banded_cpu.prefer_positions_last(m, w, chunk, dtype) == (dtype == "float32")


@pytest.mark.slow
@pytest.mark.parametrize("c,w,dtype", [(4, 6, "float32"), (8, 8, "float32"), (8, 3, "bfloat16"),
                                       (16, 40, "bfloat16"), (4, 12, "float32")])
def test_skew_unskew_values_and_transposes(c, w, dtype):
  """skew/unskew (gather form with custom VJPs for W >= 2C, pad form below) against their
  definitions: skew puts band column s of row r at key r + s, unskew reads it back; each one's VJP
  is the other, equal to autodiff of a dense one-hot form."""
  rng = np.random.default_rng(c * 100 + w)
  lead = (2, 3)
  x = jnp.asarray(rng.normal(size=(*lead, c, w)), dtype)
  sel = np.zeros((c, w, w + c), np.float32)  # sel[r, s, k] = 1 where k = r + s
  for r in range(c):
    sel[r, np.arange(w), r + np.arange(w)] = 1
  dense_skew = lambda a: jnp.einsum("...rs,rsk->...rk", a.astype(jnp.float32), sel)
  dense_unskew = lambda a: jnp.einsum("...rk,rsk->...rs", a.astype(jnp.float32), sel)

  y = jax.jit(banded_cpu.skew)(x)
  assert y.shape == (*lead, c, w + c) and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(dense_skew(x)))
  big = jnp.asarray(rng.normal(size=(*lead, c, w + c)), dtype)
  u = jax.jit(banded_cpu.unskew, static_argnums=1)(big, w)
  np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(dense_unskew(big)))
  np.testing.assert_array_equal(np.asarray(banded_cpu.unskew(y, w), np.float32),
                                np.asarray(x, np.float32))

  gy = jnp.asarray(rng.normal(size=y.shape), dtype)
  gx, = jax.vjp(banded_cpu.skew, x)[1](gy)
  np.testing.assert_array_equal(np.asarray(gx, np.float32),
                                np.asarray(jax.vjp(dense_skew, x)[1](gy.astype(jnp.float32))[0]))
  gu = jnp.asarray(rng.normal(size=u.shape), dtype)
  gb, = jax.vjp(lambda a: banded_cpu.unskew(a, w), big)[1](gu)
  assert gb.shape == big.shape
  np.testing.assert_array_equal(
      np.asarray(gb, np.float32),
      np.asarray(jax.vjp(dense_unskew, big)[1](gu.astype(jnp.float32))[0]))


def _dense_attention(q, k, v, pe, mask_W, pers_k, pers_v, eps=1e-8):
  """banded_attention by definition, in float32: every query against all T = W + M keys, keys
  beyond distance W (or at distance 0 and after) at -inf; no skew, chunk or key coordinates."""
  q, k, v, pe = (a.astype(jnp.float32) for a in (q, k, v, pe))
  b, g, m, dh = q.shape
  w = pe.shape[-1]
  dist = w + np.arange(m)[:, None] - np.arange(w + m)[None, :]  # query i at position W + i
  valid = (dist >= 1) & (dist <= w)
  col = jnp.asarray(np.broadcast_to(np.clip(w - dist, 0, w - 1), (b, g, m, w + m)))  # pe column
  pos = jnp.take_along_axis(jnp.einsum("bgmd,dw->bgmw", q, pe), col, axis=3)
  logits = jnp.where(valid, (jnp.einsum("bgmd,bgtd->bgmt", q, k) + pos) / np.sqrt(dh), -jnp.inf)
  n_pers = 0 if pers_k is None else pers_k.shape[-1]
  if n_pers:
    logits = jnp.concatenate([logits, jnp.einsum("bgmd,gdp->bgmp", q, pers_k) / np.sqrt(dh)], -1)
  probs = jax.nn.softmax(logits, axis=-1)
  if mask_W is not None:
    mask_T = jnp.where(valid, jnp.take_along_axis(jnp.broadcast_to(mask_W, (b, g, m, w)), col,
                                                  axis=3), 0.0)
    probs = probs * jnp.concatenate([mask_T, jnp.ones((b, g, m, n_pers))], -1)
    probs = probs / (jnp.sum(probs, -1, keepdims=True) + eps)
  out = jnp.einsum("bgmt,bgtd->bgmd", probs[..., :w + m], v)
  if n_pers:
    out = out + jnp.einsum("bgmp,gpd->bgmd", probs[..., w + m:], pers_v)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("w,m,chunk,mode,n_pers,dtype,last", [
    (16, 8, 0, "fixed", 0, "float32", True),  # one chunk, key coordinates, positions last
    (16, 8, 0, "adaptive", 3, "float32", False),
    (12, 24, 4, "dynamic", 0, "float32", False),  # several chunks, key coordinates
    (12, 24, 4, "adaptive", 2, "float32", False),
    (6, 24, 0, "adaptive", 0, "float32", False),  # short bands: band coordinates
    (32, 8, 0, "adaptive", 0, "bfloat16", True)])
def test_banded_attention_values_and_gradients_match_dense(w, m, chunk, mode, n_pers, dtype,
                                                           last):
  """banded_attention (key coordinates for long bands, band coordinates for short ones) against
  the dense definition: outputs and the gradients of q, k, v, the position embeddings, the span
  parameters and the persistent vectors."""
  rng = np.random.default_rng(w * 100 + m + n_pers)
  g_, dh = 2, 4
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, k, v, pe = arr(B, g_, m, dh), arr(B, g_, w + m, dh), arr(B, g_, w + m, dh), arr(dh, w)
  pk = pv = None
  if n_pers:
    pk, pv = arr(g_, dh, n_pers), arr(g_, n_pers, dh)
  z = jnp.asarray(rng.uniform(1, w + 2, size=(B, g_, m) if mode == "dynamic" else (g_,)),
                  jnp.float32)
  dist = jnp.arange(w, 0, -1, dtype=jnp.float32)

  def mask_of(z):
    if mode == "fixed":
      return None
    zz = z[..., None] if mode == "dynamic" else z[None, :, None, None]
    return span_mask.soft_mask(zz, dist[None, None, None, :], 3)

  def ours(q, k, v, pe, z, pk, pv):
    kk, vv = (k.swapaxes(2, 3), v.swapaxes(2, 3)) if last else (k, v)
    return banded_cpu.banded_attention(q, kk, vv, pe, mask=mask_of(z), pers_k_GxDxN=pk,
                                      pers_v_GxNxD=pv, chunk=chunk, positions_last=last)[0]

  def dense(q, k, v, pe, z, pk, pv):
    return _dense_attention(q, k, v, pe, mask_of(z), pk, pv)

  assert banded_cpu.long_band(banded_cpu.choose_chunk(m, w, chunk), w) == (w >= 12)
  ct = jnp.asarray(rng.normal(size=(B, g_, m, dh)), jnp.float32)
  argnums = (0, 1, 2, 3) + ((4,) if mode != "fixed" else ()) + ((5, 6) if n_pers else ())
  results = []
  for f in (ours, dense):
    loss = lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct)
    results.append((jax.jit(f)(q, k, v, pe, z, pk, pv),
                    jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, pe, z, pk, pv)))
  (out, grads), (want, want_grads) = results
  tol = dict(rtol=3e-2, atol=3e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), **tol)
  for i, got, exp in zip(argnums, grads, want_grads):
    assert got.shape == exp.shape and float(jnp.max(jnp.abs(exp.astype(jnp.float32)))) > 0, i
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exp, np.float32),
                               err_msg=f"argument {i}", **tol)


@pytest.mark.parametrize("mode,dtype", [("fixed", "float32"), ("adaptive", "float32"),
                                        ("fixed", "bfloat16"), ("adaptive", "bfloat16")])
def test_banded_attention_dropout_matches_dense(mode, dtype):
  """Key coordinates with dropout (banded_cpu._keyed_attention takes the dropout's scaled keep mask
  and differentiates by dO . out): one chunk, whose (C, W + C) key coordinates are the dense
  definition's (M, T), so the same keep mask applies to both; values and every gradient."""
  rng = np.random.default_rng(5)
  g_, dh, w, m, rate = 2, 4, 24, 8, 0.3
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, k, v, pe = arr(B, g_, m, dh), arr(B, g_, dh, w + m), arr(B, g_, dh, w + m), arr(dh, w)
  keep = jnp.asarray((rng.uniform(size=(B, g_, m, w + m)) > rate) / (1 - rate), jnp.float32)
  z = jnp.asarray(rng.uniform(1, w + 2, size=(g_,)), jnp.float32)
  dist = jnp.arange(w, 0, -1, dtype=jnp.float32)
  mask_of = lambda z: None if mode == "fixed" else span_mask.soft_mask(
      z[None, :, None, None], dist[None, None, None, :], 3)

  def ours(q, k, v, pe, z):
    return banded_cpu.banded_attention(
        q, k, v, pe, mask=mask_of(z), positions_last=True,
        dropout=lambda p: p * keep.reshape(p.shape))[0]

  def dense(q, k, v, pe, z):  # _dense_attention with the keep mask on the weights
    q, k, v, pe = (a.astype(jnp.float32) for a in (q, k, v, pe))
    k, v = k.swapaxes(2, 3), v.swapaxes(2, 3)
    d_ = w + np.arange(m)[:, None] - np.arange(w + m)[None, :]
    valid = (d_ >= 1) & (d_ <= w)
    col = jnp.asarray(np.broadcast_to(np.clip(w - d_, 0, w - 1), (B, g_, m, w + m)))
    pos = jnp.take_along_axis(jnp.einsum("bgmd,dw->bgmw", q, pe), col, axis=3)
    logits = jnp.where(valid, (jnp.einsum("bgmd,bgtd->bgmt", q, k) + pos) / np.sqrt(dh), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if mode != "fixed":
      mask_t = jnp.where(valid, jnp.take_along_axis(
          jnp.broadcast_to(mask_of(z), (B, g_, m, w)), col, axis=3), 0.0)
      probs = probs * mask_t
      probs = probs / (jnp.sum(probs, -1, keepdims=True) + 1e-8)
    return jnp.einsum("bgmt,bgtd->bgmd", probs * keep, v)

  assert banded_cpu.long_band(banded_cpu.choose_chunk(m, w), w)
  ct = jnp.asarray(rng.normal(size=(B, g_, m, dh)), jnp.float32)
  argnums = (0, 1, 2, 3) + ((4,) if mode != "fixed" else ())
  got, want = (
      (jax.jit(f)(q, k, v, pe, z), jax.jit(jax.grad(
          lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct), argnums=argnums))(
              q, k, v, pe, z)) for f in (ours, dense))
  tol = dict(rtol=3e-2, atol=3e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0]), **tol)
  for i, a, b in zip(argnums, got[1], want[1]):
    assert a.shape == b.shape and float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0, i
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               err_msg=f"argument {i}", **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("last", [True, False])
def test_split_rows_equals_reshape(dtype, last):
  """banded_cpu._split_rows_last / _split_rows_first (custom VJPs writing both gradients in one
  pass) equal the plain reshape/transpose split of the (2 G Dh, B, T) or (B, T, 2 G Dh)
  projections, in values and in the gradient."""
  rng = np.random.default_rng(3)
  g_, dh, b, t = 2, 3, 4, 5
  if last:
    kv = jnp.asarray(rng.normal(size=(2 * g_ * dh, b, t)), dtype)
    split = banded_cpu._split_rows_last
    plain = lambda a: tuple(a.reshape(2, g_, dh, b, t).transpose(0, 3, 1, 2, 4))
    ct_shape = (b, g_, dh, t)
  else:
    kv = jnp.asarray(rng.normal(size=(b, t, 2 * g_ * dh)), dtype)
    split = banded_cpu._split_rows_first
    plain = lambda a: tuple(a.reshape(b, t, 2, g_, dh).transpose(2, 0, 3, 1, 4))
    ct_shape = (b, g_, t, dh)
  cts = tuple(jnp.asarray(rng.normal(size=ct_shape), dtype) for _ in range(2))
  for got, want in zip(split(kv, g_), plain(kv)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  got, = jax.vjp(lambda a: split(a, g_), kv)[1](cts)
  want, = jax.vjp(plain, kv)[1](cts)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_project_rows_last_gradients_and_dead_cache_gradient(dtype):
  """banded_cpu._project_rows_last (one matmul over [cache; block], custom VJP) equals the einsum
  of the concatenation in value and in all three gradients; differentiated in the weights and
  the block only (as in training), the compiled step has no matmul for the cache rows' gradient."""
  rng = np.random.default_rng(11)
  cache, h = (jnp.asarray(rng.normal(size=(3, t, 8)), dtype) for t in (10, 4))
  w = jnp.asarray(rng.normal(size=(8, 6)), dtype)
  ct = jnp.asarray(rng.normal(size=(6, 3, 14)), jnp.float32)
  plain = lambda c, h, w: jnp.einsum("btd,dz->zbt", jnp.concatenate([c, h], 1).astype(jnp.float32),
                                     w.astype(jnp.float32))
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
  tol = dict(rtol=2e-2, atol=5e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(banded_cpu._project_rows_last(cache, h, w), np.float32),
                             np.asarray(plain(cache, h, w)), **tol)
  got = jax.grad(loss(banded_cpu._project_rows_last), argnums=(0, 1, 2))(cache, h, w)
  want = jax.grad(loss(plain), argnums=(0, 1, 2))(cache, h, w)
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  hlo = jax.jit(jax.value_and_grad(loss(banded_cpu._project_rows_last), argnums=(1, 2))).lower(
      cache, h, w).compile().as_text()
  dots = re.findall(r"= (\w+\[[\d,]*\])\S* dot\(", hlo)
  assert len(dots) == 3, dots  # forward, weight gradient, block gradient
  assert not any(d.endswith("[3,10,8]") for d in dots), dots  # none for the cache rows


# ----------------------------------------------------------------------------------------------
# 8. Dynamic span extremes.




@pytest.mark.slow
@pytest.mark.parametrize("w,m,chunk,dynamic,pers,dtype,g_", [
    (16, 8, 0, False, 0, "float32", 2),     # long band, one chunk (keyed, custom VJP)
    (16, 8, 4, True, 0, "float32", 2),      # long band, several chunks, per-query spans
    (16, 8, 0, False, 3, "float32", 2),     # long band with persistent memory (keyed, autodiff)
    (16, 8, 0, False, 0, "float32", 1),     # one head: the band mask skewed (gather)
    (16, 8, 4, True, 0, "float32", 1),
    (4, 8, 0, False, 0, "float32", 2),      # short band (band coordinates)
    (6, 8, 4, True, 0, "float32", 2),
    (16, 8, 0, False, 0, "bfloat16", 2),
    (16, 8, 0, False, 0, "ties", 2)])       # whole-token spans: the mask's ramp ends hit exactly
def test_banded_attention_span_z_equals_band_mask(w, m, chunk, dynamic, pers, dtype, g_):
  """span_z (the mask built inside, in key coordinates for long bands) gives the outputs and the
  gradients (q, k, v, position embeddings and the spans themselves) of the same soft mask passed
  in band coordinates and skewed."""
  ties = dtype == "ties"  # float32, spans on whole tokens: ramp ends hit exactly
  dtype = "float32" if ties else dtype
  rng = np.random.default_rng(w * 100 + m * 10 + chunk + pers + g_)
  dh, ramp = 4, 3
  q = jnp.asarray(rng.normal(size=(B, g_, m, dh)), dtype)
  k = jnp.asarray(rng.normal(size=(B, g_, w + m, dh)), dtype)
  v = jnp.asarray(rng.normal(size=(B, g_, w + m, dh)), dtype)
  pe = jnp.asarray(rng.normal(size=(dh, w)), dtype)
  z = rng.uniform(0.5, w - 1, size=(B, g_, m) if dynamic else (1, g_, 1))
  if ties:  # where jnp.clip's derivative is 1/2
    z = np.round(z)
  z = jnp.asarray(z, jnp.float32)
  dist = jnp.arange(w, 0, -1, dtype=jnp.float32)
  kw = {}
  if pers:
    kw = dict(pers_k_GxDxN=jnp.asarray(rng.normal(size=(g_, dh, pers)), dtype),
              pers_v_GxNxD=jnp.asarray(rng.normal(size=(g_, pers, dh)), dtype))

  def loss(q, k, v, pe, z, inside):
    if inside:
      out, _ = banded_cpu.banded_attention(q, k, v, pe, span_z=z, ramp=ramp, chunk=chunk, **kw)
    else:
      mask = span_mask.soft_mask(z[..., None], dist[None, None, None, :], ramp)
      out, _ = banded_cpu.banded_attention(q, k, v, pe, mask=mask, chunk=chunk, **kw)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

  assert banded_cpu.long_band(banded_cpu.choose_chunk(m, w, chunk), w) == (w >= 16)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True),
                 static_argnums=5)
  (_, out0), g0 = grad(q, k, v, pe, z, False)
  (_, out1), g1 = grad(q, k, v, pe, z, True)
  tol = dict(rtol=1e-2, atol=1e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out1, np.float32), np.asarray(out0, np.float32), **tol)
  for a, b in zip(g1, g0):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.abs(np.asarray(b, np.float32)).max() > 0
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  with pytest.raises(ValueError, match="either mask or span_z"):
    banded_cpu.banded_attention(q, k, v, pe, mask=jnp.ones((1, g_, 1, w)), span_z=z, ramp=ramp)
