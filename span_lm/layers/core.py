"""Adaptive-span attention as a function of projected queries, keys and values: the mechanism
behind `AdaptiveSpanAttention` (span_lm/layers/attention.py).

Positions are aligned: query i and key j are |i - j| apart. Each head h attends to keys at
distance x < max_span (looking back only when causal) with weight softmax * m_z(x), renormalised,
where m_z(x) = clamp((R + z_h - x) / R, 0, 1) is the paper's soft mask (x = 0: the query itself).
The mask maths is span_lm/kernels/span_mask.py's, the same as the model's: the door's kernels count
distance 1 as the previous token and their mask reads distance d as x = d - 1, so a query that
also attends to itself is a kernel query one position later (`_door`).

Two paths compute the same function:
  door   the causal, unpadded case: span_lm.kernels (the fused kernel on GPU/TPU, the banded cpu
         path on CPU), O(N * max_span). The first ~max_span queries, whose windows would reach
         before the sequence start, run the plain path (O(max_span^2)): the kernels would see
         zeros there, as the model's cache starts.
  plain  anything: dense (N, N) scores with the span mask, the causal rule and the caller's mask.
"""
import logging
import math
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels import banded_reference
from span_lm.kernels import span_mask
from span_lm.model import config as model_config
from span_lm.model import spans as spans_lib

IMPLS = ("auto", "plain") + tuple(kernels.IMPLS)
log = logging.getLogger("span_lm")
_logged: set = set()


def door_config(num_heads: int, head_dim: int, max_span: int, ramp: int, *, attn_impl="auto",
                dtype=jnp.float32, dropout_rate=0.0,
                span_loss_coef=0.0) -> model_config.ModelConfig:
  """The ModelConfig the door (span_lm.kernels) reads for one layer: its sizes, ramp, kernel and
  tile (the largest of 64, 32, 16 dividing max_span; the fused kernels need one)."""
  block = next((b for b in (64, 32, 16) if max_span % b == 0), 64)
  return model_config.ModelConfig(
      vocab_size=1, d_model=num_heads * head_dim, n_heads=num_heads, d_ff=1,
      span=model_config.Span(size=max_span, mode="adaptive", ramp=ramp, loss=span_loss_coef),
      dropout=dropout_rate, dtype=jnp.dtype(dtype).name,
      attention=kernels.Attention(impl="auto" if attn_impl == "plain" else attn_impl, block=block),
      plan=model_config.Plan(granularity=block))


def choose(cfg: model_config.ModelConfig, attn_impl: str, *, causal: bool, masked: bool,
           q_len: int, kv_len: int) -> tuple[kernels.Impl | None, int]:
  """(the door's implementation or None for the plain path, the number of leading queries the
  plain path runs).

  The door takes causal self-attention without a mask whose sequence leaves at least one tile
  of queries after the first max_span - 1; anything else runs plain. Logged once per case."""
  if attn_impl not in IMPLS:
    raise ValueError(f"attn_impl={attn_impl!r}: choose one of {IMPLS}")
  w, blk = cfg.span.size, cfg.attention.block
  m = blk * ((q_len - w + 1) // blk)  # queries the door runs: whole tiles
  why = next((text for bad, text in (
      (attn_impl == "plain", "attn_impl='plain'"), (not causal, "bidirectional"),
      (masked, "a mask was given"), (q_len != kv_len, "queries and keys differ in length"),
      (m < blk, f"{q_len} queries, fewer than max_span + {blk - 1}")) if bad), "")
  impl, head = (None, q_len) if why else (kernels.select(cfg, m, w), q_len - m)
  name = "plain" if impl is None else impl.name
  key = (attn_impl, name, causal, masked, q_len, kv_len, w)
  if key not in _logged:
    _logged.add(key)
    log.info("adaptive span attention: %s (attn_impl=%s, %d queries, max_span %d%s)", name,
             attn_impl, q_len, w, f"; {why}" if why else
             f"; the first {head} queries plain" if head else "")
  return impl, head


def span_tokens(span_ratio, max_span: int):
  """Spans in tokens, S * z' with z' clipped to [0, 1] as the reference's post-step clamp would;
  the clip's gradient passes straight through, so a z' pushed past an end comes back."""
  r = span_ratio.astype(jnp.float32)
  return max_span * (r + jax.lax.stop_gradient(jnp.clip(r, 0.0, 1.0) - r))


def span_loss(span_ratio, max_span: int, coef: float):
  """The reference's penalty coef * S * mean(z') (the model's spans_lib.span_loss), z' clipped as
  in `span_tokens`."""
  cfg = types.SimpleNamespace(span=types.SimpleNamespace(loss=coef, size=max_span))  # what it reads
  return spans_lib.span_loss(span_tokens(span_ratio, max_span) / max_span, cfg)


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
                    causal: bool, ramp: int, mask=None, dropout: Callable | None = None):
  """Dense span attention, (B, H, N, Dh): scores of every query with every key; keys outside
  the window (distance >= S), after the query (causal) or where `mask` is 0 get weight 0."""
  n, kl, dh = q_BxHxNxD.shape[2], k_BxHxKxD.shape[2], q_BxHxNxD.shape[-1]
  s = pos_back_DxS.shape[-1]
  f32 = dict(preferred_element_type=jnp.float32)
  q = q_BxHxNxD
  cont = jnp.einsum("bhnd,bhkd->bhnk", q, k_BxHxKxD, **f32)
  pos = _position_logits(q, pos_back_DxS, pos_ahead_DxS, kl)
  ij = (jnp.arange(n)[:, None] - jnp.arange(kl)[None, :])[None, None]  # 1 1 N K
  allowed = (ij >= 0 if causal else True) & (jnp.abs(ij) < s)
  if mask is not None:
    allowed = allowed & (jnp.asarray(mask) != 0)
  logits = jnp.where(allowed, (cont + pos) / math.sqrt(dh), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  soft = span_mask.soft_mask(z_H[None, :, None, None], (jnp.abs(ij) + 1).astype(jnp.float32),
                             ramp)  # distance x read as the kernels' x + 1
  probs = span_mask.renormalise(probs * jnp.where(allowed, soft, 0.0))
  if dropout is not None:
    probs = dropout(probs)
  out = jnp.einsum("bhnk,bhkd->bhnd", probs.astype(v_BxHxKxD.dtype), v_BxHxKxD, **f32)
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


def _door(cfg, impl, head: int, q, k, v, z_H, pos_back_DxS, dropout_rng):
  """Causal span attention through span_lm.kernels for queries head.. (the kernel's block) and
  the plain path for the first `head`. The kernel's query i (distance 1 = the previous key) is
  fed keys shifted by one, so it sees the query's own key at its distance 1 (x = 0)."""
  w = cfg.span.size
  rngs = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
  dropout, seed = _dropout(cfg.dropout, rngs[0])
  off = head - w + 1  # first key any door query reaches
  pad = lambda a: jnp.pad(a[:, :, off:], ((0, 0), (0, 0), (0, 1), (0, 0)))  # W + M keys
  out = impl.attend(cfg, q[:, :, head:], kernels.KV(pad(k), pad(v)), pos_back_DxS,
                    span_z=z_H[None, :, None], dropout=dropout, dropout_seed=seed)
  if head == 0:
    return out
  first = plain_attention(q[:, :, :head], k[:, :, :head], v[:, :, :head], z_H, pos_back_DxS,
                          causal=True, ramp=cfg.span.ramp,
                          dropout=_dropout(cfg.dropout, rngs[1])[0])
  return jnp.concatenate([first, out.astype(first.dtype)], axis=2)


def span_attention(query, key, value, span_ratio, pos_back, pos_ahead=None, *, max_span: int,
                   causal: bool = True, ramp: int = 32, mask=None, dropout_rate: float = 0.0,
                   dropout_rng=None, attn_impl: str = "auto") -> Any:
  """Adaptive-span attention in nn.dot_product_attention's layout.

  Args:
    query: (batch..., q_len, heads, head_dim); key, value: (batch..., kv_len, heads, head_dim),
      positions aligned with the queries'.
    span_ratio: (heads,) z' (spans S * z', z' clipped to [0, 1]).
    pos_back: (head_dim, max_span) position embeddings, column S - 1 - x for distance x back;
      pos_ahead: the same for keys ahead (bidirectional; distance 0 reads pos_back).
    mask: Flax's mask, broadcastable to (batch..., heads, q_len, kv_len), nonzero = attend.
    dropout_rate, dropout_rng: dropout on the attention weights (after the span mask).
    attn_impl: 'auto' (the door where it applies), 'plain', or a span_lm.kernels implementation.
  Returns:
    (batch..., q_len, heads, head_dim) in query's dtype.
  """
  *batch, n, h, dh = query.shape
  kl = key.shape[-3]
  if not causal and pos_ahead is None:
    raise ValueError("span_attention: bidirectional attention needs pos_ahead")
  flat = lambda a: a.reshape((-1,) + a.shape[-3:]).transpose(0, 2, 1, 3)  # B H N D
  q, k, v = flat(query), flat(key), flat(value)
  if mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(mask), tuple(batch) + (h, n, kl)).reshape(-1, h, n, kl)
  cfg = door_config(h, dh, max_span, ramp, attn_impl=attn_impl, dtype=query.dtype,
                    dropout_rate=dropout_rate if dropout_rng is not None else 0.0)
  impl, head = choose(cfg, attn_impl, causal=causal, masked=mask is not None, q_len=n,
                      kv_len=kl)
  z_H = span_tokens(span_ratio, max_span)
  if impl is None:
    out = plain_attention(q, k, v, z_H, pos_back, None if causal else pos_ahead, causal=causal,
                          ramp=ramp, mask=mask, dropout=_dropout(cfg.dropout, dropout_rng)[0])
  else:
    out = _door(cfg, impl, head, q, k, v, z_H, pos_back, dropout_rng)
  return out.transpose(0, 2, 1, 3).reshape(query.shape).astype(query.dtype)
