"""Banded span attention, the readable definition: the numerical reference for every other
implementation, and the default where no faster one applies (TPU; GPU without the fused kernel).

Queries of a block attend to the W distances strictly before them. Scores are laid out as bands:
column s of a query's row is the key at distance W - s, so the relative position embeddings
`key_pe` (Dh, W) line up with columns by a slice and the span mask is one vector per head. The
band comes from the reference's pad-and-reshape "skew", applied per chunk of C queries: a chunk
needs only the W + C keys ending at its last query, so short spans cost O(W + C) per query, not
O(M + W). Plain autodiff; no gathers; no custom VJP (docs/benchmarks.md for what the others buy).
"""
import math

import jax
import jax.numpy as jnp

from span_lm.kernels import matmul
from span_lm.kernels.span import span_mask
from span_lm.kernels.heads import kv_group


def choose_chunk(m: int, w: int, requested: int = 0) -> int:
  """Queries per chunk: the smallest divisor of M that is >= W (M itself when W >= M)."""
  if requested >= m:  # also init's one-token block
    return m
  if requested:
    if m % requested:
      raise ValueError(f"config.model.attention.chunk={requested} must divide the block length {m}")
    return requested
  for c in range(min(w, m), m + 1):
    if m % c == 0:
      return c
  return m


def unskew(x, w: int):
  """(..., C, W + C) query-by-key scores -> (..., C, W) bands (column s: distance W - s)."""
  *lead, c, n = x.shape
  x = x.reshape(*lead, c * n)
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, c)])
  return x.reshape(*lead, c, n + 1)[..., :w]


def skew(x):
  """(..., C, W) bands -> (..., C, W + C) query-by-key weights, zeros off the band."""
  *lead, c, w = x.shape
  x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, c + 1)])
  x = x.reshape(*lead, c * (w + c + 1))[..., : c * (w + c)]
  return x.reshape(*lead, c, w + c)


def key_windows(y_BxGxTxD, w: int, c: int, a: int = 0):
  """(B, G, W + M + A, Dh) -> (B, G, M/C, W + C + A, Dh): the keys each chunk of C queries reads
  (slices); also (B, T) segment ids -> (B, M/C, W + C + A)."""
  lead = y_BxGxTxD.ndim == 2
  t = y_BxGxTxD.shape[1 if lead else 2]
  n = (t - w - a) // c
  take = (lambda j: y_BxGxTxD[:, j * c:j * c + w + c + a]) if lead else (
      lambda j: y_BxGxTxD[:, :, j * c:j * c + w + c + a])
  return jnp.stack([take(j) for j in range(n)], axis=1 if lead else 2)


def band_distances(w: int, a: int = 0):
  """The distance each band column stands for, as the span mask reads it (d; x = d - 1): W..1
  behind, then the keys ahead at distances 1..A as d = 2..A + 1 (x = the distance ahead)."""
  return jnp.concatenate([jnp.arange(w, 0, -1), jnp.arange(2, a + 2)]).astype(jnp.float32)


def segment_band(segments, w: int, a: int, c: int):
  """(B, M/C, C, W + A) booleans: may the query attend the key of each band column (same
  segment, key not padding), from segment ids (q (B, M), kv (B, W + M + A))."""
  q_seg, kv_seg = segments
  b, m = q_seg.shape
  n = m // c
  kv_win = key_windows(kv_seg, w, c, a)  # B n (W+C+A)
  q = q_seg.reshape(b, n, c, 1)
  same = (q == kv_win[:, :, None, :]) & (kv_win[:, :, None, :] != 0)  # B n C (W+C+A)
  return unskew(same.astype(jnp.int8), w + a).astype(bool)


def project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, w: int, g: int):
  """Keys and values of g heads over the last w cached states and the block: each
  (B, G, W + M, Dh). The cache is a constant of the step: its rows get no input gradient."""
  x = cache_BxLxD[:, cache_BxLxD.shape[1] - w:]
  d, z2 = w_kv_Dx2Z.shape
  w_Dx2xGxH = matmul.weight(w_kv_Dx2Z, x.dtype).reshape(d, 2, g, z2 // (2 * g))
  # projected straight into (2, B, G, T, Dh): the layout attention reads, no transpose pass
  kv = jnp.concatenate([matmul.einsum("btd,dzgh->zbgth", x, w_Dx2xGxH),
                        matmul.einsum("btd,dzgh->zbgth", h_BxMxD, w_Dx2xGxH)], axis=3)
  return kv[0], kv[1]


def split_kv(kv_BxTx2Z, g: int):
  """[keys | values] rows (B, T, 2 G Dh) -> keys, values, each (B, G, T, Dh)."""
  b, t, z = kv_BxTx2Z.shape
  kv = kv_BxTx2Z.reshape(b, t, 2, g, z // (2 * g)).transpose(2, 0, 3, 1, 4)
  return kv[0], kv[1]


def banded_attention(q_BxGxMxD, k_BxGxTxD, v_BxGxTxD, key_pe_DxW, *, key_pe_ahead_DxA=None,
                     span_z=None, span_z_ahead=None, segments=None, ramp: int = 0,
                     pers_k_GxDxN=None, pers_v_GxNxD=None, chunk: int = 0, dropout=None):
  """Attention of M queries over the W distances before each of them (and the A after), for one
  head group.

  Args:
    q_BxGxMxD: queries; k, v: keys/values of the T = W + M + A rows (window, block, ahead):
      query i is row W + i; behind it, distance d is row W + i - d; ahead, distance a is row
      W + i + a - 1. Grouped heads: k, v (B, G_kv, T, Dh), query head h reading key/value head
      h // (G / G_kv): the queries get a group axis, the keys none (no repeated copy).
    key_pe_DxW: relative position embeddings for distances W..1 (column W - 1 is distance 1);
      key_pe_ahead_DxA: for distances 1..A ahead (column a - 1), None when causal.
    span_z, span_z_ahead: spans in tokens, (1 or B, G, 1 or M), of the soft mask with ramp R
      (behind: x = d - 1; ahead: x = a); None: fixed (ahead None: span_z on both sides).
    segments: kernels.Segments (q (B, M), kv (B, T)) or None: a query attends only keys of its
      own nonzero segment; a query of segment 0 gives zeros.
    pers_k_GxDxN, pers_v_GxNxD: persistent memory (already multiplied by sqrt(Dh), sqrt(N)),
      in the same softmax with mask 1.
    chunk: queries per chunk (0: automatic). dropout: applied to the attention weights.
  Returns:
    out (B, G, M, Dh) in the dtype of q.
  """
  b, g, m, dh = q_BxGxMxD.shape
  w = key_pe_DxW.shape[-1]
  a = 0 if key_pe_ahead_DxA is None else key_pe_ahead_DxA.shape[-1]
  if k_BxGxTxD.shape[2] != w + m + a:
    raise ValueError(f"banded_attention: got {k_BxGxTxD.shape[2]} keys for window {w}, block {m}"
                     f", ahead {a}")
  c = choose_chunk(m, w + a, chunk)
  n = m // c
  # Grouped heads: queries (B, G_kv, r, ...) against keys (B, G_kv, ...), r = G / G_kv; the
  # group axis is spelled only where r > 1, so the ungrouped program is what it always was.
  r = kv_group(g, k_BxGxTxD.shape[1])
  R, heads = ("r", (g // r, r)) if r > 1 else ("", (g,))
  q = q_BxGxMxD.reshape(b, *heads, n, c, dh)
  k_win, v_win = (key_windows(k_BxGxTxD, w, c, a),
                  key_windows(v_BxGxTxD, w, c, a))  # B G n (W+C+A) Dh

  cont = matmul.einsum(f"bg{R}ncd,bgnkd->bg{R}nck", q, k_win, jnp.float32)
  # float32 parameters (key_pe, persistent vectors) go in as they are: matmul.einsum casts them
  # to q's dtype and keeps their gradients in float32
  pe = key_pe_DxW if not a else jnp.concatenate(
      [key_pe_DxW.astype(jnp.float32), key_pe_ahead_DxA.astype(jnp.float32)], axis=-1)
  pos = matmul.einsum(f"bg{R}ncd,dw->bg{R}ncw", q, matmul.weight(pe, q.dtype), jnp.float32)
  logits = (unskew(cont, w + a) + pos) / math.sqrt(dh)  # B G n C (W+A)
  one = (1,) * len(heads)  # the head axes of a per-row factor
  allowed = None
  if segments is not None:
    allowed = segment_band(segments, w, a, c)[(slice(None),) + (None,) * len(heads)]
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
  pers_heads = lambda x: x if r == 1 else x.reshape(*heads, *x.shape[1:])
  if pers_k_GxDxN is not None:
    pers = matmul.einsum(f"bg{R}ncd,g{R}dp->bg{R}ncp", q,
                         matmul.weight(pers_heads(pers_k_GxDxN), q.dtype), jnp.float32)
    logits = jnp.concatenate([logits, pers / math.sqrt(dh)], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  mask = None
  if span_z is not None:
    band = lambda zz: (lambda z: z.reshape(z.shape[0], *heads, 1, 1, 1) if z.shape[2] == 1 else
                       z.reshape(z.shape[0], *heads, n, c, 1))(jnp.asarray(zz, jnp.float32))
    dist = band_distances(w, a).reshape(1, *one, 1, 1, w + a)
    z = band(span_z)  # (1|B, G, n|1, C|1, 1)
    if a and span_z_ahead is not None:  # the columns ahead read their own spans
      z = jnp.where(jnp.arange(w + a).reshape(1, *one, 1, 1, w + a) < w, z, band(span_z_ahead))
    mask = span_mask.soft_mask(z, dist, ramp)
  if allowed is not None:  # a row with no key of its segment: zeros, not a uniform average
    mask = allowed.astype(jnp.float32) if mask is None else mask * allowed
  if mask is not None:
    if pers_k_GxDxN is not None:  # the persistent vectors' mask is 1
      ones = jnp.ones(mask.shape[:-1] + (pers_k_GxDxN.shape[-1],), mask.dtype)
      mask = jnp.concatenate([mask, ones], axis=-1)
    probs = span_mask.renormalise(probs * mask) if span_z is not None else probs * mask
  if dropout is not None:
    probs = dropout(probs)
  probs = probs.astype(v_BxGxTxD.dtype)
  out = matmul.einsum(f"bg{R}nck,bgnkd->bg{R}ncd", skew(probs[..., :w + a]), v_win,
                      jnp.float32)
  if pers_v_GxNxD is not None:
    out = out + matmul.einsum(f"bg{R}ncp,g{R}pd->bg{R}ncd", probs[..., w + a:],
                              matmul.weight(pers_heads(pers_v_GxNxD), probs.dtype), jnp.float32)
  out = out.reshape(b, g, m, dh)
  if segments is not None:  # padding queries (segment 0): zeros, persistent memory included
    out = jnp.where((segments.q != 0)[:, None, :, None], out, 0.0)
  return out.astype(q_BxGxMxD.dtype)


def residual_bytes(span_mode: str, pers_mem: int, dtype, batch: int, m: int, g: int, w: int,
                   dh: int, chunk: int, dropout: bool) -> dict:
  """Bytes one head group keeps for the backward pass, as autodiff saves them here (jax's
  saved_residuals; tests/tools/test_tools.py): the key/value windows, the float32 score bands (the
  softmax's output; with a span mask its exponentials and the masked copy, the dynamic mask's two
  more; dropout's output and its boolean keep mask) and the skewed weights. XLA may keep fewer:
  XLA:TPU recomputes most of the elementwise chain (docs/benchmarks.md)."""
  act, f32 = jnp.dtype(dtype).itemsize, 4
  c = choose_chunk(m, w, chunk)
  rows = batch * g * m
  band_bytes = {"fixed": 1, "adaptive": 3, "dynamic": 5}[span_mode] * f32 + (
      f32 + 1 if dropout else 0)
  return {"keys_values": 2 * batch * g * (m // c) * (w + c) * dh * act,
          "score_bands": rows * (w + pers_mem) * band_bytes,
          "weights": rows * (w + c + pers_mem) * act}
