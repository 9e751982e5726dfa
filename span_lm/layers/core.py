"""Adaptive-span attention as a function of projected queries, keys and values: the mechanism
behind `AdaptiveSpanAttention` (span_lm/layers/attention.py).

Positions are aligned: query i and key j are x = |i - j| apart. Each head h attends to keys at
distance x < max_span behind it (itself included, x = 0) and, when bidirectional, x < max_span
ahead, with weight softmax * m_z(x), renormalised, where m_z(x) = clamp((R + z_h - x) / R, 0, 1)
is the paper's soft mask (z ahead: the head's own span ahead when asymmetric, else z_h). Segment
ids (padding, packing) keep each query to keys of its own segment; id 0 is padding.

One implementation: the layer builds a `kernels.Spec` and calls the door (span_lm.kernels), the
model's own function, O(N * max_span). The door counts distance 1 as the previous row and reads
its mask at x = d - 1, so the layer's key j is the door's row W - 1 + j: a query's own key lies at
its distance 1, the keys ahead at distances 1..max_span - 1 ahead. Rows before the sequence and
after it are padding (segment 0), so the first and last queries need no special case.

A dense `mask` that is not a key-padding mask runs `plain_attention` (dense (N, N) scores, for
masks the door cannot express), and says so once at WARNING.
"""
import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import kernels
from span_lm.kernels.span import banded_reference
from span_lm.kernels.span import span_mask
from span_lm.model import spans as spans_lib

IMPLS = ("auto", "plain") + tuple(kernels.IMPLS)
log = logging.getLogger("span_lm")
_logged: set = set()


def layer_spec(num_heads: int, head_dim: int, max_span: int, ramp: int, *, causal: bool = True,
               attn_impl: str = "auto", dtype=jnp.float32, dropout_rate: float = 0.0,
               segmented: bool = True, kv_heads: int | None = None) -> kernels.Spec:
  """The door's spec of one layer: window max_span behind, max_span - 1 ahead when
  bidirectional, segment ids (the layer always passes them: the sequence's ends are padding),
  the tile (the largest of 64, 32, 16 dividing max_span; the fused kernels need one), and the
  key/value heads (grouped heads; None or num_heads: one per query head)."""
  block = next((b for b in (64, 32, 16) if max_span % b == 0), 64)
  return kernels.Spec(
      heads=num_heads, head_dim=head_dim, window=max_span, ahead=0 if causal else max_span - 1,
      ramp=ramp, mode="adaptive", dtype=jnp.dtype(dtype).name, dropout=dropout_rate,
      segmented=segmented,
      attention=kernels.Attention(impl="auto" if attn_impl == "plain" else attn_impl,
                                  block=block),
      kv_heads=None if kv_heads in (None, num_heads) else kv_heads)


def _log_once(level, key, text, *args):
  if key not in _logged:
    _logged.add(key)
    log.log(level, text, *args)


def key_padding(mask, batch: tuple, n: int, kv_len: int):
  """The (batch..., N) key-padding vector a Flax mask stands for, or None where it is not one:
  (batch..., 1, 1, N) (or (batch..., N)) as it is; (batch..., 1, N, N) where it is known (not
  traced) to be nn.make_attention_mask(pad, pad)'s outer product of one vector."""
  mask = jnp.asarray(mask) if not isinstance(mask, np.ndarray) else mask
  if n != kv_len:
    return None
  shape = mask.shape
  if len(shape) == len(batch) + 1 and shape[-1] == n:
    return jnp.broadcast_to(mask, batch + (n,)) != 0
  if len(shape) != len(batch) + 3 or shape[-1] != n or shape[-3] != 1:
    return None
  if shape[-2] == 1:
    return jnp.broadcast_to(mask[..., 0, 0, :], batch + (n,)) != 0
  if shape[-2] != n or isinstance(mask, jax.core.Tracer):
    return None
  m = np.asarray(mask)[..., 0, :, :] != 0
  pad = np.diagonal(m, axis1=-2, axis2=-1)
  if not np.array_equal(m, pad[..., :, None] & pad[..., None, :]):
    return None
  return jnp.broadcast_to(jnp.asarray(pad), batch + (n,))


def span_tokens(span_ratio, max_span: int):
  """Spans in tokens, S * z' with z' clipped to [0, 1] as the reference's post-step clamp would;
  the clip's gradient passes straight through, so a z' pushed past an end comes back."""
  r = span_ratio.astype(jnp.float32)
  return max_span * (r + jax.lax.stop_gradient(jnp.clip(r, 0.0, 1.0) - r))


def span_loss(span_ratio, max_span: int, coef: float):
  """The reference's penalty coef * S * mean(z') (the model's spans_lib.span_loss), z' clipped as
  in `span_tokens`."""
  return spans_lib.span_penalty(span_tokens(span_ratio, max_span) / max_span, coef, max_span)


def _position_logits(q_BxHxNxD, pos_back_DxS, pos_ahead_DxS, k_len: int):
  """q . e(i - j) for every query i and key j, (B, H, N, K): column S - 1 - x of pos_back is
  distance x back (the door's key_pe layout), of pos_ahead distance x ahead; 0 beyond S."""
  f32 = dict(preferred_element_type=jnp.float32)
  s, n = pos_back_DxS.shape[-1], q_BxHxNxD.shape[2]
  band = lambda q, pe: jnp.einsum("bhnd,ds->bhns", q, pe.astype(q.dtype), **f32)  # B H N S
  if k_len != n:  # unaligned lengths: a gather (its backward, a scatter, is slow on CPUs)
    ij = (jnp.arange(n)[:, None] - jnp.arange(k_len)[None, :])[None, None]
    col = jnp.clip(s - 1 - jnp.abs(ij), 0, s - 1)
    take = lambda a: jnp.take_along_axis(a, jnp.broadcast_to(col, a.shape[:2] + col.shape[2:]),
                                         -1)
    back = take(band(q_BxHxNxD, pos_back_DxS))
    if pos_ahead_DxS is None:
      return back
    return jnp.where(ij >= 0, back, take(band(q_BxHxNxD, pos_ahead_DxS)))
  # Bands to query-by-key by the reference's pad-and-reshape skew: row i's column S - 1 - x
  # lands on key i - x (banded_reference.skew puts band column s of row i at i + s).
  back = banded_reference.skew(band(q_BxHxNxD, pos_back_DxS))[..., s - 1:s - 1 + n]
  if pos_ahead_DxS is None:
    return back
  flip = lambda a: a[..., ::-1, :]  # reversed positions: ahead becomes back
  ahead = banded_reference.skew(band(flip(q_BxHxNxD), pos_ahead_DxS))[..., s - 1:s - 1 + n]
  ahead = ahead[..., ::-1, ::-1]
  ij = (jnp.arange(n)[:, None] - jnp.arange(n)[None, :])[None, None]
  return jnp.where(ij >= 0, back, ahead)


def plain_attention(q_BxHxNxD, k_BxHxKxD, v_BxHxKxD, z_H, pos_back_DxS, pos_ahead_DxS=None, *,
                    causal: bool, ramp: int, mask=None, z_ahead_H=None,
                    dropout: Callable | None = None):
  """Dense span attention, (B, H, N, Dh): scores of every query with every key; keys outside
  the window (distance >= S), after the query (causal) or where `mask` is 0 get weight 0. For
  the masks the door cannot take, and the definition the door is tested against. Grouped
  heads: k, v (B, H_kv, K, Dh), query head h reading key/value head h // (H / H_kv)."""
  b, h, n, dh = q_BxHxNxD.shape
  kl, hk = k_BxHxKxD.shape[2], k_BxHxKxD.shape[1]
  r = kernels.kv_group(h, hk)
  s = pos_back_DxS.shape[-1]
  f32 = dict(preferred_element_type=jnp.float32)
  q = q_BxHxNxD
  if r == 1:
    cont = jnp.einsum("bhnd,bhkd->bhnk", q, k_BxHxKxD, **f32)
  else:  # the group as an axis of the queries only: no repeated keys
    cont = jnp.einsum("bgrnd,bgkd->bgrnk", q.reshape(b, hk, r, n, dh), k_BxHxKxD,
                      **f32).reshape(b, h, n, kl)
  pos = _position_logits(q, pos_back_DxS, pos_ahead_DxS, kl)
  ij = (jnp.arange(n)[:, None] - jnp.arange(kl)[None, :])[None, None]  # 1 1 N K
  allowed = (ij >= 0 if causal else True) & (jnp.abs(ij) < s)
  if mask is not None:
    allowed = allowed & (jnp.asarray(mask) != 0)
  logits = jnp.where(allowed, (cont + pos) / math.sqrt(dh), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  z = z_H[None, :, None, None]
  if z_ahead_H is not None:
    z = jnp.where(ij >= 0, z, z_ahead_H[None, :, None, None])
  soft = span_mask.soft_mask(z, (jnp.abs(ij) + 1).astype(jnp.float32),
                             ramp)  # distance x read as the kernels' x + 1
  probs = span_mask.renormalise(probs * jnp.where(allowed, soft, 0.0))
  if dropout is not None:
    probs = dropout(probs)
  probs = probs.astype(v_BxHxKxD.dtype)
  if r == 1:
    out = jnp.einsum("bhnk,bhkd->bhnd", probs, v_BxHxKxD, **f32)
  else:
    out = jnp.einsum("bgrnk,bgkd->bgrnd", probs.reshape(b, hk, r, n, kl), v_BxHxKxD,
                     **f32).reshape(b, h, n, dh)
  return out.astype(q_BxHxNxD.dtype)


def _dropout(rate: float, rng):
  """Dropout on attention weights (None: none), and the uint32 seed the fused kernels draw from."""
  if not rate or rng is None:
    return None, None
  keep_rng, seed_rng = jax.random.split(rng)

  def drop(p):
    keep = jax.random.bernoulli(keep_rng, 1.0 - rate, p.shape)
    return jnp.where(keep, p / (1.0 - rate), 0.0).astype(p.dtype)

  return drop, lambda: jax.random.bits(seed_rng, (), jnp.uint32)


def _door(spec, impl, q, k, v, z_H, z_ahead_H, pos_back_DxS, pos_ahead_DxS, seg_BxN,
          dropout_rng):
  """Span attention through the door for all N queries, (B, H, N, Dh): queries padded to whole
  tiles, key rows laid out as the door reads them (the layer's key j at row W - 1 + j), the
  rows outside the sequence and the padded queries in segment 0."""
  b, h, n, dh = q.shape
  w, a, blk = spec.window, spec.ahead, spec.attention.block
  mp = -(-n // blk) * blk  # queries in whole tiles
  rows = lambda x: jnp.pad(x, ((0, 0), (0, 0), (w - 1, mp - n + a + 1), (0, 0)))  # W + Mp + A
  q_seg = jnp.pad(seg_BxN, ((0, 0), (0, mp - n)))
  kv_seg = jnp.pad(seg_BxN, ((0, 0), (w - 1, mp - n + a + 1)))
  dropout, seed = _dropout(spec.dropout, dropout_rng)
  extra = {}
  if a:  # the door's column a - 1 is distance a ahead: pos_ahead's column S - 1 - a
    extra.update(key_pe_ahead_DxA=pos_ahead_DxS[:, w - 2::-1],
                 span_z_ahead=None if z_ahead_H is None else z_ahead_H[None, :, None])
  out = impl.attend(spec, jnp.pad(q, ((0, 0), (0, 0), (0, mp - n), (0, 0))),
                    kernels.KV(rows(k), rows(v)), pos_back_DxS, span_z=z_H[None, :, None],
                    segments=kernels.Segments(q_seg, kv_seg), dropout=dropout,
                    dropout_seed=seed, **extra)
  return out[:, :, :n]


def _check_args(key, value, h: int, hk: int, pos_ahead, causal: bool, attn_impl: str):
  """`span_attention`'s refusals, in one line each, before anything is traced."""
  if attn_impl not in IMPLS:
    raise ValueError(f"attn_impl={attn_impl!r}: choose one of {IMPLS}")
  if value.shape[-3:] != key.shape[-3:]:
    raise ValueError(f"span_attention: key {tuple(key.shape)} and value {tuple(value.shape)} "
                     "differ in (length, kv_heads, head_dim)")
  if hk < 1 or h % hk:
    raise ValueError(f"span_attention: {h} query heads are not a multiple of {hk} key/value "
                     "heads (grouped heads: kv_heads must divide heads)")
  if not causal and pos_ahead is None:
    raise ValueError("span_attention: bidirectional attention needs pos_ahead")


def _why_plain(mask, seg, batch: tuple, n: int, kl: int, attn_impl: str):
  """Why the dense plain path runs ('' where the door takes the call), and the segment ids with
  a key-padding mask folded in (padding: 0)."""
  why = ""
  if mask is not None:
    pad = key_padding(mask, batch, n, kl)
    if pad is None:
      why = "a mask that is not a key-padding mask"
    else:
      seg = jnp.where(pad, 1 if seg is None else seg, 0)
  if attn_impl == "plain":
    why = "attn_impl='plain'"
  elif n != kl:
    why = "queries and keys differ in length"
  return why, seg


def _plain_path(q, k, v, z_H, z_ahead_H, pos_back, pos_ahead, mask, seg, batch: tuple,
                causal: bool, ramp: int, rate: float, dropout_rng):
  """The dense plain path (B H N D): Flax's mask and the segment ids as one (B, H, N, KL) mask;
  padding queries (segment 0) give zeros."""
  h, n, kl = q.shape[1], q.shape[2], k.shape[2]
  if mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(mask), batch + (h, n, kl)).reshape(-1, h, n, kl)
  if seg is not None:
    s2 = seg.reshape(-1, n)
    same = (s2[:, None, :, None] == s2[:, None, None, :]) & (s2[:, None, None, :] != 0)
    mask = same if mask is None else (mask != 0) & same
  out = plain_attention(q, k, v, z_H, pos_back, None if causal else pos_ahead, causal=causal,
                        ramp=ramp, mask=mask, z_ahead_H=z_ahead_H,
                        dropout=_dropout(rate, dropout_rng)[0])
  if seg is not None:
    out = jnp.where((seg.reshape(-1, n) != 0)[:, None, :, None], out, 0.0).astype(out.dtype)
  return out


def _door_path(q, k, v, z_H, z_ahead_H, pos_back, pos_ahead, seg, dtype, max_span: int,
               ramp: int, causal: bool, attn_impl: str, rate: float, dropout_rng):
  """The door's implementation for this layer (B H N D; logged once), every row segment 1
  where no ids are given."""
  h, n, dh, hk = q.shape[1], q.shape[2], q.shape[3], k.shape[1]
  spec = layer_spec(h, dh, max_span, ramp, causal=causal, attn_impl=attn_impl,
                    dtype=dtype, dropout_rate=rate, kv_heads=hk)
  blk = spec.attention.block
  impl = kernels.select(spec, -(-n // blk) * blk, max_span)
  _log_once(logging.INFO, ("door", attn_impl, impl.name, causal, n, max_span),
            "adaptive span attention: %s (attn_impl=%s, %d queries, max_span %d, %s)",
            impl.name, attn_impl, n, max_span, "causal" if causal else "bidirectional")
  seg = jnp.ones((q.shape[0], n), jnp.int32) if seg is None else seg.reshape(-1, n)
  return _door(spec, impl, q, k, v, z_H, z_ahead_H, pos_back, pos_ahead, seg, dropout_rng)


def span_attention(query, key, value, span_ratio, pos_back, pos_ahead=None, *, max_span: int,
                   causal: bool = True, ramp: int = 32, mask=None, segment_ids=None,
                   span_ratio_ahead=None, dropout_rate: float = 0.0, dropout_rng=None,
                   attn_impl: str = "auto") -> Any:
  """Adaptive-span attention in nn.dot_product_attention's layout.

  Args:
    query: (batch..., q_len, heads, head_dim); key, value: (batch..., kv_len, kv_heads,
      head_dim), positions aligned with the queries'; kv_heads divides heads (grouped heads,
      GQA; 1: MQA): query head h reads key/value head h // (heads // kv_heads), the keys and
      values never repeated.
    span_ratio: (heads,) z' (spans S * z', z' clipped to [0, 1]); span_ratio_ahead: the spans
      ahead when they are learned apart (bidirectional; None: span_ratio on both sides).
    pos_back: (head_dim, max_span) position embeddings, column S - 1 - x for distance x back;
      pos_ahead: the same for keys ahead (bidirectional; distance 0 reads pos_back).
    mask: Flax's mask, broadcastable to (batch..., heads, q_len, kv_len), nonzero = attend. A
      key-padding mask ((batch..., 1, 1, kv_len), or make_attention_mask(pad, pad) when not
      traced) runs the door as segment ids; any other mask runs the dense plain path.
    segment_ids: (batch..., q_len) int: a query attends only to keys of its own segment; 0 is
      padding (its queries give zeros). Packing several sequences into one row: 1, 2, 3, ...
    dropout_rate, dropout_rng: dropout on the attention weights (after the span mask).
    attn_impl: 'auto' (the door, by platform), 'plain', or a span_lm.kernels implementation.
  Returns:
    (batch..., q_len, heads, head_dim) in query's dtype.
  """
  *batch, n, h, dh = query.shape
  batch = tuple(batch)
  kl, hk = key.shape[-3], key.shape[-2]
  _check_args(key, value, h, hk, pos_ahead, causal, attn_impl)
  flat = lambda a: a.reshape((-1,) + a.shape[-3:]).transpose(0, 2, 1, 3)  # B H N D
  q, k, v = flat(query), flat(key), flat(value)
  z_H = span_tokens(span_ratio, max_span)
  z_ahead_H = None if span_ratio_ahead is None else span_tokens(span_ratio_ahead, max_span)
  rate = dropout_rate if dropout_rng is not None else 0.0

  seg = None if segment_ids is None else jnp.broadcast_to(
      jnp.asarray(segment_ids, jnp.int32), batch + (n,))
  why, seg = _why_plain(mask, seg, batch, n, kl, attn_impl)
  if why:
    _log_once(logging.WARNING if mask is not None and attn_impl != "plain" else logging.INFO,
              ("plain", why, n, kl),
              "adaptive span attention: the dense plain path, O(N^2) (%s, %d queries, %d keys)%s",
              why, n, kl, "; the fast path takes a key-padding mask (batch, 1, 1, N) or "
              "segment_ids=(batch, N)" if mask is not None and attn_impl != "plain" else "")
    out = _plain_path(q, k, v, z_H, z_ahead_H, pos_back, pos_ahead, mask, seg, batch, causal,
                      ramp, rate, dropout_rng)
  else:
    out = _door_path(q, k, v, z_H, z_ahead_H, pos_back, pos_ahead, seg, query.dtype, max_span,
                     ramp, causal, attn_impl, rate, dropout_rng)
  return out.transpose(0, 2, 1, 3).reshape(query.shape).astype(query.dtype)
