"""Decoding from a ring cache bounded by each head's learned window, and the dense attention
weights the layers sow on request: written in plain jnp (a chunk of C queries is small).

The cache (both modules): keys and values (batch..., max_span, kv_heads, head_dim), the segment id
of each slot (batch..., max_span) (0: never written, or padding) and the number of tokens written
so far. Position p lives in slot p % max_span, so memory does not grow with the tokens decoded.

A call with C new tokens at positions p0 .. p0 + C - 1 reads, for KV head g, the `reads[g]`
positions before p0 from the ring (a static size: the widest window ceil(z_h) + R among the
query heads sharing g, rounded up to a bucket) and its own C keys, scores the query heads of g
together against them (q reshaped to (B, G, C, D): the cache is never repeated per query head),
and then writes its C keys into the ring. Keys are read before they are written over, so a
chunk longer than one token sees the same keys the full causal forward does.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.span import span_mask
from span_lm.layers import core

BUCKET = 16  # read sizes are rounded up to a multiple of this: fewer distinct compilations


def head_windows(span_ratio, max_span: int, ramp: int) -> np.ndarray:
  """Each head's window min(ceil(z_h) + R, max_span), (heads,) int, from concrete spans."""
  z = np.asarray(core.span_tokens(jnp.asarray(span_ratio), max_span), np.float64)
  return np.minimum(np.ceil(z).astype(np.int64) + ramp, max_span)


def read_sizes(span_ratio, max_span: int, ramp: int, num_kv_heads: int,
               bucket: int = BUCKET) -> tuple:
  """The cached positions each KV head's decoding call reads: the widest window among the query
  heads sharing it, rounded up to `bucket`, at most max_span; static ints (a jit needs them)."""
  w = head_windows(span_ratio, max_span, ramp).reshape(num_kv_heads, -1).max(axis=1)
  return tuple(int(min(-(-int(x) // bucket) * bucket, max_span)) for x in w)


def reads_for(windows, span_ratio, max_span: int, ramp: int, num_kv_heads: int) -> tuple:
  """The read sizes a call uses: `windows` as given (an int for every KV head, or one per KV
  head), else from the spans where they are concrete, else max_span (a traced span)."""
  if windows is None:
    try:
      return read_sizes(span_ratio, max_span, ramp, num_kv_heads)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      return (max_span,) * num_kv_heads
  if isinstance(windows, int):
    windows = (windows,) * num_kv_heads
  return tuple(min(int(w), max_span) for w in windows)


def check_cache(key_cache_shape, batch: tuple, where: str):
  """One line for a cache of another batch than the call's."""
  if tuple(key_cache_shape[:-3]) != tuple(batch):
    raise ValueError(
        f"{where}: the decoding cache was set up for batch {tuple(key_cache_shape[:-3])}, this "
        f"call has batch {tuple(batch)}: set it up again for this batch (init_cache((batch, 1, "
        f"features)) for NNX, model.init(...) with a batch of this size for Linen)")


def decode_attention(q, k, v, cache, segment_ids, span_ratio, pos_back, *, max_span: int,
                     ramp: int, reads: tuple):
  """C new tokens against the ring cache.

  q: (batch..., C, H, D); k, v: (batch..., C, H_kv, D), the new tokens' keys and values;
  cache: (keys, values, segments, index) as the module holds them; segment_ids: (batch..., C)
  int or None (every new token in segment 1). Returns the outputs (batch..., C, H, D) and the
  updated cache.
  """
  ck, cv, cseg, idx = cache
  *batch, c, h, dh = q.shape
  batch = tuple(batch)
  hk = k.shape[-2]
  g_size = h // hk
  flat = lambda a: a.reshape((-1,) + a.shape[len(batch):])
  qf, kf, vf = flat(q), flat(k), flat(v)
  ckf, cvf, csegf = flat(ck), flat(cv), cseg.reshape((-1, max_span))
  b = qf.shape[0]
  seg = (jnp.ones((b, c), jnp.int32) if segment_ids is None
         else jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), batch + (c,)).reshape(b, c))
  z = core.span_tokens(span_ratio, max_span)  # (H,)
  idx = jnp.asarray(idx, jnp.int32)
  q_pos = idx + jnp.arange(c, dtype=jnp.int32)  # C
  ring = (ckf, cvf, csegf, idx)
  outs = [_group_attention(g, g_size, qf, kf, vf, ring, seg, z, pos_back, q_pos,
                           max_span=max_span, ramp=ramp, r=reads[g]) for g in range(hk)]
  out = jnp.concatenate(outs, axis=2)  # B C H D
  out = jnp.where((seg != 0)[:, :, None, None], out, 0.0).astype(q.dtype).reshape(q.shape)
  return out, _write_ring(cache, ring, kf, vf, seg, q_pos, max_span)


def _group_attention(g, g_size, qf, kf, vf, ring, seg, z, pos_back, q_pos, *, max_span: int,
                     ramp: int, r: int):
  """The g_size query heads of KV head g against its r cached positions before the chunk
  (`ring`: keys, values, segments and index, batch flattened) and the chunk's own keys:
  (B, C, G, D) in float32."""
  ckf, cvf, csegf, idx = ring
  c, dh = qf.shape[1], qf.shape[-1]
  f32 = dict(preferred_element_type=jnp.float32)
  past = idx - r + jnp.arange(r, dtype=jnp.int32)  # the r positions before the chunk
  slots = jnp.mod(past, max_span)
  keys = jnp.concatenate([ckf[:, slots, g].astype(qf.dtype), kf[:, :, g]], axis=1)  # B K D
  vals = jnp.concatenate([cvf[:, slots, g].astype(vf.dtype), vf[:, :, g]], axis=1)
  k_seg = jnp.concatenate([jnp.where(past[None] >= 0, csegf[:, slots], 0), seg], axis=1)  # B K
  k_pos = jnp.concatenate([past, q_pos])  # K
  x = q_pos[:, None] - k_pos[None, :]  # C K: distance back
  allowed = ((x >= 0) & (x < max_span))[None, None]  # 1 1 C K
  allowed = allowed & ((k_seg[:, None, None, :] == seg[:, None, :, None])
                       & (k_seg[:, None, None, :] != 0))  # B 1 C K
  qg = qf[:, :, g * g_size:(g + 1) * g_size]  # B C G D
  # position logits from the columns these distances reach: S - 1 - x, x < r + C
  lo = max(max_span - (r + c), 0)
  band = jnp.einsum("bcgd,ds->bgcs", qg, pos_back[:, lo:].astype(qg.dtype), **f32)
  col = jnp.clip(max_span - 1 - x, lo, max_span - 1) - lo  # C K
  pos = jnp.take_along_axis(band, jnp.broadcast_to(col[None, None], band.shape[:3] + col.shape[1:]),
                            axis=-1)
  cont = jnp.einsum("bcgd,bkd->bgck", qg, keys, **f32)
  logits = jnp.where(allowed, (cont + pos) / math.sqrt(dh), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  zg = z[g * g_size:(g + 1) * g_size][None, :, None, None]  # 1 G 1 1
  soft = span_mask.soft_mask(zg, (x + 1).astype(jnp.float32)[None, None], ramp)
  probs = span_mask.renormalise(probs * jnp.where(allowed, soft, 0.0))
  return jnp.einsum("bgck,bkd->bcgd", probs.astype(vals.dtype), vals, **f32)


def _write_ring(cache, ring, kf, vf, seg, q_pos, max_span: int):
  """The cache, in the module's shapes, after the chunk: its last max_span tokens written into
  their slots of the ring."""
  (ck, cv, cseg, _), (ckf, cvf, csegf, idx) = cache, ring
  c = seg.shape[1]
  m = min(c, max_span)
  slots = jnp.mod(q_pos[c - m:], max_span)
  ckf = ckf.at[:, slots].set(kf[:, c - m:].astype(ckf.dtype))
  cvf = cvf.at[:, slots].set(vf[:, c - m:].astype(cvf.dtype))
  csegf = csegf.at[:, slots].set(seg[:, c - m:])
  return (ckf.reshape(ck.shape), cvf.reshape(cv.shape), csegf.reshape(cseg.shape), idx + c)


def attention_weights(q, k, span_ratio, pos_back, pos_ahead=None, *, max_span: int,
                      causal: bool, ramp: int, mask=None, segment_ids=None,
                      span_ratio_ahead=None):
  """The attention weights a full call applies, after the soft mask and its renormalisation:
  (batch..., H, q_len, kv_len), dense (O(q_len * kv_len) memory: for inspecting small inputs).
  q: (batch..., N, H, D); k: (batch..., K, H_kv, D)."""
  *batch, n, h, dh = q.shape
  batch = tuple(batch)
  kl, hk = k.shape[-3], k.shape[-2]
  qf = q.reshape((-1, n, h, dh)).transpose(0, 2, 1, 3)  # B H N D
  kf = k.reshape((-1, kl, hk, dh)).transpose(0, 2, 1, 3)  # B Hk K D
  b = qf.shape[0]
  f32 = dict(preferred_element_type=jnp.float32)
  cont = jnp.einsum("bkgnd,bkmd->bkgnm", qf.reshape(b, hk, h // hk, n, dh), kf, **f32)
  cont = cont.reshape(b, h, n, kl)
  pos = core._position_logits(qf, pos_back, None if causal else pos_ahead, kl)  # pylint: disable=protected-access
  ij = (jnp.arange(n)[:, None] - jnp.arange(kl)[None, :])[None, None]
  allowed = (ij >= 0 if causal else True) & (jnp.abs(ij) < max_span)
  allowed = jnp.broadcast_to(allowed, (b, h, n, kl))
  seg = None if segment_ids is None else jnp.broadcast_to(
      jnp.asarray(segment_ids, jnp.int32), batch + (n,))
  pad = None if mask is None else core.key_padding(mask, batch, n, kl)
  if pad is not None:  # as the call applies it: segment ids (padded queries give zeros)
    seg, mask = jnp.where(pad, 1 if seg is None else seg, 0), None
  if mask is not None:
    allowed = allowed & (jnp.broadcast_to(jnp.asarray(mask), batch + (h, n, kl))
                         .reshape(b, h, n, kl) != 0)
  if seg is not None:
    seg = seg.reshape(b, n)
    allowed = allowed & ((seg[:, None, :, None] == seg[:, None, None, :])
                         & (seg[:, None, None, :] != 0))
  logits = jnp.where(allowed, (cont + pos) / math.sqrt(dh), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  z = core.span_tokens(span_ratio, max_span)[None, :, None, None]
  if span_ratio_ahead is not None:
    z = jnp.where(ij >= 0, z, core.span_tokens(span_ratio_ahead, max_span)[None, :, None, None])
  soft = span_mask.soft_mask(z, (jnp.abs(ij) + 1).astype(jnp.float32), ramp)
  probs = span_mask.renormalise(probs * jnp.where(allowed, soft, 0.0))
  if seg is not None:
    probs = jnp.where((seg != 0)[:, None, :, None], probs, 0.0)
  return probs.reshape(batch + (h, n, kl))


def check_mask(mask, batch: tuple, heads: int, q_len: int, kv_len: int, where: str):
  """One line for a mask that does not broadcast to (batch..., heads, q_len, kv_len)."""
  if mask is None:
    return
  shape = tuple(np.shape(mask))
  want = tuple(batch) + (heads, q_len, kv_len)
  fits = lambda have, full: len(have) <= len(full) and all(
      s in (1, w) for s, w in zip(have[::-1], full[::-1]))
  ok = fits(shape, want) or (  # or a key-padding vector (batch..., kv_len)
      len(shape) == len(batch) + 1 and shape[-1] == kv_len and fits(shape[:-1], tuple(batch)))
  if not ok:
    raise ValueError(
        f"{where}: mask of shape {shape} does not broadcast to (batch..., heads, q_len, kv_len) "
        f"= {want}: nn.make_attention_mask(pad, pad) gives (batch, 1, q_len, kv_len); a "
        f"key-padding mask is (batch, 1, 1, kv_len), or pass segment_ids=(batch, q_len)")
