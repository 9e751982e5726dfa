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

from span_lm.kernels import span_mask
from span_lm.kernels import matmul


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


def key_windows(y_BxGxTxD, w: int, c: int):
  """(B, G, W + M, Dh) -> (B, G, M/C, W + C, Dh): the keys each chunk of C queries reads (slices)."""
  n = (y_BxGxTxD.shape[2] - w) // c
  return jnp.stack([y_BxGxTxD[:, :, j * c:j * c + w + c] for j in range(n)], axis=2)


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


def banded_attention(q_BxGxMxD, k_BxGxTxD, v_BxGxTxD, key_pe_DxW, *, span_z=None, ramp: int = 0,
                     pers_k_GxDxN=None, pers_v_GxNxD=None, chunk: int = 0, dropout=None):
  """Attention of M queries over the W distances before each of them, for one head group.

  Args:
    q_BxGxMxD: queries; k, v: keys/values of the last T = W + M positions (window + block).
    key_pe_DxW: relative position embeddings for distances W..1 (column W - 1 is distance 1).
    span_z: spans in tokens, (1 or B, G, 1 or M), of the soft mask with ramp R; None: fixed.
    pers_k_GxDxN, pers_v_GxNxD: persistent memory (already multiplied by sqrt(Dh), sqrt(N)),
      in the same softmax with mask 1.
    chunk: queries per chunk (0: automatic). dropout: applied to the attention weights.
  Returns:
    out (B, G, M, Dh) in the dtype of q.
  """
  b, g, m, dh = q_BxGxMxD.shape
  w = key_pe_DxW.shape[-1]
  if k_BxGxTxD.shape[2] != w + m:
    raise ValueError(f"banded_attention: got {k_BxGxTxD.shape[2]} keys for window {w}, block {m}")
  c = choose_chunk(m, w, chunk)
  n = m // c
  q = q_BxGxMxD.reshape(b, g, n, c, dh)
  k_win, v_win = key_windows(k_BxGxTxD, w, c), key_windows(v_BxGxTxD, w, c)  # B G n (W+C) Dh

  cont = matmul.einsum("bgncd,bgnkd->bgnck", q, k_win, jnp.float32)
  # float32 parameters (key_pe, persistent vectors) go in as they are: matmul.einsum casts them
  # to q's dtype and keeps their gradients in float32
  pos = matmul.einsum("bgncd,dw->bgncw", q, matmul.weight(key_pe_DxW, q.dtype), jnp.float32)
  logits = (unskew(cont, w) + pos) / math.sqrt(dh)  # B G n C W
  if pers_k_GxDxN is not None:
    pers = matmul.einsum("bgncd,gdp->bgncp", q, matmul.weight(pers_k_GxDxN, q.dtype),
                         jnp.float32)
    logits = jnp.concatenate([logits, pers / math.sqrt(dh)], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  if span_z is not None:
    z = jnp.asarray(span_z, jnp.float32)  # (1|B, G, 1|M) -> (1|B, G, n|1, C|1, 1)
    z = z.reshape(z.shape[0], g, 1, 1, 1) if z.shape[2] == 1 else z.reshape(z.shape[0], g, n, c, 1)
    mask = span_mask.soft_mask(z, jnp.arange(w, 0, -1, dtype=jnp.float32).reshape(1, 1, 1, 1, w),
                               ramp)  # column s: distance W - s
    if pers_k_GxDxN is not None:  # the persistent vectors' mask is 1
      ones = jnp.ones(mask.shape[:-1] + (pers_k_GxDxN.shape[-1],), mask.dtype)
      mask = jnp.concatenate([mask, ones], axis=-1)
    probs = span_mask.renormalise(probs * mask)
  if dropout is not None:
    probs = dropout(probs)
  probs = probs.astype(v_BxGxTxD.dtype)
  out = matmul.einsum("bgnck,bgnkd->bgncd", skew(probs[..., :w]), v_win, jnp.float32)
  if pers_v_GxNxD is not None:
    out = out + matmul.einsum("bgncp,gpd->bgncd", probs[..., w:],
                              matmul.weight(pers_v_GxNxD, probs.dtype), jnp.float32)
  return out.reshape(b, g, m, dh).astype(q_BxGxMxD.dtype)


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
