"""Banded span attention as XLA:CPU runs it fastest: the same maths as `banded_reference`, laid
out for the CPU's matmul kernels and memory passes (docs/benchmarks.md, "CPU attention").

Long bands (`long_band`: W >= 2C) keep their scores in key coordinates, (C, W + C) with -inf off
the band, skew only the position term, by a gather, and without persistent memory run as one
custom VJP (`_keyed_attention`) whose backward takes the softmax's row sums from dO . out. Short
bands keep band coordinates and plain autodiff. The key/value projection may be laid out with
positions last (`project_kv`), which is why the door has two calls.
"""
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from span_lm import kernels
from span_lm.kernels import cpu_matmul
from span_lm.kernels import matmul
from span_lm.kernels.span import span_mask
from span_lm.kernels.span.banded_reference import choose_chunk
from span_lm.kernels.span.banded_reference import skew as _skew_pad
from span_lm.kernels.span.banded_reference import split_kv as _split_kv_rows
from span_lm.kernels.span.banded_reference import unskew as _unskew_pad


def _skew_take(x):
  # out[r, j] = x[r, j - r] on the band, 0 off it: one gather from the flattened (C * W) rows
  # with a constant (C, W + C) index. Full-rank indices (take_along_axis) cost more than they
  # save: XLA builds them at run time, (B, H, C, W + C, 4) int32.
  *lead, c, w = x.shape
  j_CxT = _band_column(c, w)
  idx_CxT = np.arange(c)[:, None] * w + np.clip(j_CxT, 0, w - 1)
  taken = jnp.take(x.reshape(*lead, c * w), jnp.asarray(idx_CxT, jnp.int32), axis=-1,
                   mode="clip", indices_are_sorted=True)
  return jnp.where(_on_band(c, w), taken, jnp.zeros((), x.dtype))


def _band_column(c: int, w: int) -> np.ndarray:
  """(C, W + C): the band column t - r of key t for query r (on the band where in [0, W))."""
  return np.arange(w + c)[None, :] - np.arange(c)[:, None]


def _on_band(c: int, w: int) -> np.ndarray:
  """(C, W + C) bool: key t is one of the W before query r."""
  j_CxT = _band_column(c, w)
  return (j_CxT >= 0) & (j_CxT < w)


def long_band(c: int, w: int) -> bool:
  """W >= 2C: bands whose scores stay in key coordinates (the C extra columns per row cost at most
  half the row) and whose skew is a gather, which XLA:CPU runs faster than the pad-flatten-slice
  skew; short bands keep band coordinates and the pad form (docs/benchmarks.md, "CPU attention: why each piece")."""
  return w >= 2 * c


def two_sided_chunk(m: int, w: int) -> int:
  """Queries per chunk of a band with keys ahead (W = behind + ahead): the largest divisor of M
  up to W / 2, in band coordinates (`_band_attention`). The band's (C, W + C) scores then cost
  at most 1.5 times the band, against twice for C >= W, and the four skews of band coordinates
  stay cheaper than key coordinates' row-wise work over W + C (docs/benchmarks.md, "The drop-in
  layer"; causal bands keep `choose_chunk`: the language model's shapes were tuned on it)."""
  for c in range(min(m, max(1, w // 2)), 0, -1):
    if m % c == 0:
      return c
  return m


def unskew(x, w: int):
  """(..., C, W + C) query-by-key scores -> (..., C, W) bands (column s: distance W - s)."""
  return _unskew_long(x, w) if long_band(x.shape[-2], w) else _unskew_pad(x, w)


def skew(x):
  """(..., C, W) bands -> (..., C, W + C) query-by-key weights, zeros off the band."""
  return _skew_long(x) if long_band(*x.shape[-2:]) else _skew_pad(x)


# Long bands: skew as a gather, unskew as the pad form, each the other's transpose (autodiff
# of the gather would scatter-add).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unskew_long(x, w: int):
  return _unskew_pad(x, w)


def _unskew_long_fwd(x, w):
  return _unskew_pad(x, w), None


def _unskew_long_bwd(w, _, g):
  return (_skew_take(g),)


_unskew_long.defvjp(_unskew_long_fwd, _unskew_long_bwd)


@jax.custom_vjp
def _skew_long(x):
  return _skew_take(x)


def _skew_long_fwd(x):
  return _skew_take(x), None


def _skew_long_bwd(_, g):
  return (_unskew_pad(g, g.shape[-1] - g.shape[-2]),)


_skew_long.defvjp(_skew_long_fwd, _skew_long_bwd)


def prefer_positions_last(m: int, w: int, chunk: int = 0, dtype=jnp.float32) -> bool:
  """The key/value layout banded_attention runs fastest with: positions last, (B, G, Dh, T), when
  one chunk covers the block (windows >= the block, e.g. a fixed span of 1024); (B, G, T, Dh)
  for several chunks, whose overlapping windows are cut along T.

  Positions last, every matmul of both passes reads and writes keys and values as XLA:CPU's fast
  kernels want them and the projection needs no transpose of the cache. Not for bf16/f16 traced
  over several devices, where `cpu_matmul.contract` may not move the sharded dim 0
  (docs/benchmarks.md, "CPU attention: why each piece")."""
  if jnp.dtype(dtype) in matmul.LOW and cpu_matmul.batch_sharded():
    return False
  return choose_chunk(m, w, chunk) == m


def key_windows(y_BxGxTxD, w: int, c: int):
  """(B, G, W + M, Dh) keys -> (B, G, M/C, W + C, Dh): the keys each chunk of C queries needs.

  bf16/f16 keys get a backward pass that adds the overlapping windows' gradients in float32 and
  rounds once (autodiff would round after every pad and add: a long chain of converts that
  XLA:CPU ran at a few ns per element)."""
  if y_BxGxTxD.dtype in matmul.LOW:
    return _key_windows_low(y_BxGxTxD, w, c)
  return _key_windows(y_BxGxTxD, w, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _key_windows_low(y, w, c):
  return _key_windows(y, w, c)


def _key_windows_low_fwd(y, w, c):
  return _key_windows(y, w, c), None


def _key_windows_low_bwd(w, c, _, g):
  b, gr, n, _, d = g.shape
  zero = jnp.zeros((b, gr, w + n * c, d), jnp.float32)
  dy, = jax.linear_transpose(lambda y: _key_windows(y, w, c), zero)(g.astype(jnp.float32))
  return (dy.astype(g.dtype),)


_key_windows_low.defvjp(_key_windows_low_fwd, _key_windows_low_bwd)


def _key_windows(y_BxGxTxD, w: int, c: int):
  b, g, t, d = y_BxGxTxD.shape
  m = t - w
  n = m // c
  if n == 1:
    return y_BxGxTxD[:, :, None]
  if w <= c:  # two strided views, no gather
    head = y_BxGxTxD[:, :, :m].reshape(b, g, n, c, d)[:, :, :, :w]
    body = y_BxGxTxD[:, :, w:].reshape(b, g, n, c, d)
    return jnp.concatenate([head, body], axis=3)
  idx = jnp.arange(n)[:, None] * c + jnp.arange(w + c)[None, :]
  return y_BxGxTxD[:, :, idx]


def banded_attention(q_BxGxMxD, k, v, key_pe_DxW, *, mask=None, span_z=None, ramp: int = 0,
                     pers_k_GxDxN=None, pers_v_GxNxD=None, chunk: int = 0,
                     dropout: Callable | None = None, positions_last: bool = False,
                     eps: float = span_mask.EPS, key_pe_ahead_DxA=None, span_z_ahead=None,
                     segments=None):
  """Attention of M queries over the W distances before each of them (and the A after), for one
  head group.

  Args:
    q_BxGxMxD: queries. k, v: keys/values of the T = W + M + A rows (window, block, ahead),
      (B, G, T, Dh), or (B, G, Dh, T) with positions_last (see `prefer_positions_last`).
      Grouped heads: G_kv key/value heads, G_kv dividing G; query head h reads key/value head
      h // (G / G_kv). The queries then get a group axis after the chunk axis, (B, G_kv, n, r,
      C, Dh), which every matmul reads as r C rows against the shared keys: no repeated keys,
      and dk, dv sum the group inside their matmul.
    key_pe_DxW: relative position embeddings for distances W..1 (column W-1 is distance 1);
      key_pe_ahead_DxA: for distances 1..A ahead (None: causal). Band column s is then key row
      r + s of query r: W + A columns, behind for s < W, ahead for s >= W (banded_reference).
    span_z_ahead: the spans ahead (None: span_z). segments: kernels.Segments or None (a query
      sees keys of its own nonzero segment only; segment 0's queries give zeros).
    mask: soft span mask broadcastable to (B, G, M, W) (None: fixed span).
    span_z, ramp: instead of mask, the spans in tokens, (1 or B, G, 1 or M), of the soft mask
      span_mask.soft_mask(z, distance, ramp). Per-head spans of several heads on long bands are then
      evaluated at each key's distance (`_key_mask`) instead of skewing the band mask.
    pers_k_GxDxN, pers_v_GxNxD: persistent memory (already multiplied by sqrt(Dh), sqrt(N)).
    chunk: queries per chunk (0: automatic).
    dropout: applied to the attention weights.
  Returns:
    (out_BxGxMxD, probs_BxGxMx(W+N)) in float32 probabilities; the caller drops probs.
  """
  b, g, m, dh = q_BxGxMxD.shape
  w_back = key_pe_DxW.shape[-1]
  a = 0 if key_pe_ahead_DxA is None else key_pe_ahead_DxA.shape[-1]
  w = w_back + a  # the band's width
  t = k.shape[3] if positions_last else k.shape[2]
  if t != w + m:
    raise ValueError(f"banded_attention: got {t} keys for window {w_back}, block {m}, ahead {a}")
  if a:
    key_pe_DxW = jnp.concatenate([key_pe_DxW.astype(jnp.float32),
                                  key_pe_ahead_DxA.astype(jnp.float32)], axis=-1)
  c = two_sided_chunk(m, w) if a and not chunk else choose_chunk(m, w, chunk)
  n = m // c
  if positions_last and n > 1:  # windows are cut along T
    k, v, positions_last = k.swapaxes(2, 3), v.swapaxes(2, 3), False
  # Grouped heads: R names the queries' group axis in the einsums (none when ungrouped, so the
  # ungrouped program is what it always was); `grouped` moves a per-head array to that layout.
  r = kernels.kv_group(g, k.shape[1])
  R = "r" if r > 1 else ""
  grouped = (lambda x: x) if r == 1 else (
      lambda x: jnp.moveaxis(x.reshape(x.shape[0], g // r, r, *x.shape[2:]), 2, 3))
  q = grouped(q_BxGxMxD.reshape(b, g, n, c, dh))
  if positions_last:  # one chunk: its window is every key
    k_win, v_win, kd = k[:, :, None], v[:, :, None], "dk"  # B G 1 Dh T
  else:
    k_win, v_win, kd = key_windows(k, w, c), key_windows(v, w, c), "kd"  # B G n (W+C) Dh

  # Long bands (W >= 2C) stay in key coordinates (C, W + C), off-band logits at -inf: only the
  # position term is skewed there, and its gradient unskewed, where band coordinates would skew
  # the scores, the weights and both their gradients (two gathers fewer per layer, for 1 + C/W
  # times the row-wise work). Short bands (W + C up to 2W) take band coordinates.
  keyed = long_band(c, w) and not a
  cont = matmul.einsum(f"bgn{R}cd,bgn{kd}->bgn{R}ck", q, k_win, jnp.float32)
  # float32 parameters (key_pe, persistent vectors) go in as they are: matmul.einsum (and
  # _keyed_attention) cast them to q's dtype and keep their gradients in float32
  pe = matmul.weight(key_pe_DxW, q.dtype)
  pos = matmul.einsum(f"bgn{R}cd,dw->bgn{R}cw", q, pe, jnp.float32)
  scores = cont + skew(pos) if keyed else unskew(cont, w) + pos
  kw = scores.shape[-1]  # W + C keyed, W in bands
  band = _Band(b=b, g=g, m=m, n=n, c=c, w=w, a=a, r=r, R=R, keyed=keyed, grouped=grouped)
  mask = _band_mask(mask, span_z, span_z_ahead, ramp, band)
  logits = scores / math.sqrt(dh)
  logits, allowed, row_ok = _segment_logits(logits, segments, pers_k_GxDxN is None, band)
  if keyed:  # a select: with an added -inf constant XLA:CPU kept the broadcast constant in memory
    logits = jnp.where(_on_band(c, w), logits, -jnp.inf)
  probs = _band_probs(logits, q, mask, pers_k_GxDxN, kw, eps, band)
  out = _band_out(q, k_win, v_win, pe, mask, probs, allowed, pers_k_GxDxN is not None,
                  pers_v_GxNxD, dropout, v.dtype, kd, kw, eps, band)
  if keyed:  # the weights in band coordinates, as returned (callers that drop them pay nothing)
    probs = jnp.concatenate([unskew(probs[..., :kw], w), probs[..., kw:]], axis=-1)
  if r > 1:  # back to (B, G, n, C, ...): query head h = its key/value head's h_kv r + j
    out, probs = (jnp.moveaxis(x, 3, 2).reshape(b, g, n, c, x.shape[-1]) for x in (out, probs))
  out = out.reshape(b, g, m, dh)
  if segments is not None:  # segment 0's queries, and rows with no key of their segment: zeros
    out = jnp.where(row_ok, out, 0.0)
  return out, probs.reshape(b, g, m, -1)


class _Band(NamedTuple):
  """One call's static band layout: batch, heads, block, chunks, chunk, band width, rows ahead,
  the query group (r, its einsum letter R) and whether the band stays in key coordinates."""
  b: int
  g: int
  m: int
  n: int
  c: int
  w: int
  a: int
  r: int
  R: str
  keyed: bool
  grouped: Callable


def _band_mask(mask, span_z, span_z_ahead, ramp: int, s: _Band):
  """The soft span mask as the logits read it (5-D, broadcast unmaterialised; None: fixed span),
  from `mask` or from the spans (per key for per-head spans on long bands: `_key_mask`)."""
  per_key = False  # the mask already 5-D in key coordinates (see _key_mask)
  if span_z is not None:
    if mask is not None or ramp <= 0:
      raise ValueError("banded_attention: give either mask or span_z with a ramp > 0")
    z = jnp.asarray(span_z, jnp.float32)
    per_key = s.keyed and z.shape[2] == 1 and s.g > 1 and span_z_ahead is None
    if per_key:
      mask = _key_mask(s.grouped(z.reshape(z.shape[0], s.g, 1, 1, 1)), ramp, s.c, s.w, s.a)
    else:
      dist_W = _band_distances(s.w, s.a)  # column s -> its distance as the mask reads it
      z = z[..., None]
      if span_z_ahead is not None and s.a:
        z = jnp.where(jnp.arange(s.w) < s.w - s.a, z,
                      jnp.asarray(span_z_ahead, jnp.float32)[..., None])
      mask = span_mask.soft_mask(z, dist_W[None, None, None, :], ramp)
  if mask is not None and not per_key:  # (1 or B, G, 1 or M, W) -> 5-D, broadcast unmaterialised
    mb = mask.shape[0]
    mask = s.grouped(mask.reshape(mb, s.g, 1, 1, s.w) if mask.shape[2] == 1
                     else jnp.broadcast_to(mask, (mb, s.g, s.m, s.w)).reshape(
                         mb, s.g, s.n, s.c, s.w))
    if s.keyed:  # zero off the band
      mask = skew(jnp.broadcast_to(mask, mask.shape[:-2] + (s.c, s.w)))
  return mask


def _segment_logits(logits, segments, no_pers: bool, s: _Band):
  """Logits outside each row's nonzero segment at float32's minimum: (logits, allowed, row_ok),
  row_ok the rows that keep their output (None, None without segments)."""
  allowed = row_ok = None
  if segments is not None:  # same nonzero segment: in key coordinates, or as bands
    # A finite minimum: exp gives exactly 0 at other segments' keys wherever a row has a key of
    # its own, and no NaN where it has none (those rows are zeroed below). The span mask stays
    # small (per head), not multiplied out to (B, G, n, C, W + C).
    allowed = _segment_allowed(segments, s.w, s.a, s.c, s.keyed)  # B 1 n C (W+C | W)
    if s.r > 1:
      allowed = allowed[:, :, :, None]  # B 1 n 1 C (W+C | W)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    row_ok = (segments.q != 0)[:, None, :, None]  # with persistent memory every row has keys
    if no_pers:  # `allowed` holds on-band keys only (_segment_allowed)
      row_ok = row_ok & jnp.any(allowed, axis=-1).reshape(s.b, 1, s.m, 1)
  return logits, allowed, row_ok


def _pers_heads(x, s: _Band):
  """A persistent memory's (G, ...) as the grouped queries read it, (G_kv, r, ...)."""
  return x if s.r == 1 else x.reshape(s.g // s.r, s.r, *x.shape[1:])


def _band_probs(logits, q, mask, pers_k_GxDxN, kw: int, eps: float, s: _Band):
  """The renormalised attention weights over the band (then the persistent vectors)."""
  R = s.R
  if pers_k_GxDxN is not None:
    n_pers = pers_k_GxDxN.shape[-1]
    pers = matmul.einsum(f"bgn{R}cd,g{R}dp->bgn{R}cp", q,
                         matmul.weight(_pers_heads(pers_k_GxDxN, s), q.dtype), jnp.float32)
    probs = jax.nn.softmax(jnp.concatenate([logits, pers / math.sqrt(q.shape[-1])], axis=-1),
                           axis=-1)
    if mask is not None:
      ones = jnp.ones(logits.shape[:-1] + (n_pers,), probs.dtype)
      probs = probs * jnp.concatenate([jnp.broadcast_to(mask, logits.shape[:-1] + (kw,)), ones],
                                      axis=-1)
      probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + eps)
    return probs
  # Row-wise work on a 2-D (rows, W) view: XLA:CPU reduces a 5-D array with unit dims (one
  # head in a group) several times slower than the same rows laid out flat.
  rows = s.b * s.g * s.n * s.c
  probs = jax.nn.softmax(logits.reshape(rows, kw), axis=-1)
  if mask is not None:
    probs = (probs.reshape(logits.shape[:-1] + (kw,)) * mask).reshape(rows, kw)
    probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + eps)
  return probs.reshape(logits.shape[:-1] + (kw,))


def _band_out(q, k_win, v_win, pe, mask, probs, allowed, has_pers: bool, pers_v_GxNxD, dropout,
              v_dtype, kd: str, kw: int, eps: float, s: _Band):
  """The weighted values: one custom VJP without persistent memory (the weights above are for
  `probs` only), else the dropped weights times the window's values and the persistent ones."""
  R = s.R
  if not has_pers:
    keep = None if dropout is None else dropout(jnp.ones(probs.shape, jnp.float32))
    return (_keyed_attention if s.keyed else _band_attention)(q, k_win, v_win, pe, mask, keep,
                                                              allowed, kd, eps, R)
  dropped = dropout(probs) if dropout is not None else probs
  dropped = dropped.astype(v_dtype)
  p_band = dropped[..., :kw] if s.keyed else skew(dropped[..., :kw])
  out = matmul.einsum(f"bgn{R}ck,bgn{kd}->bgn{R}cd", p_band, v_win, jnp.float32)
  return out + matmul.einsum(f"bgn{R}cp,g{R}pd->bgn{R}cd", dropped[..., kw:],
                             matmul.weight(_pers_heads(pers_v_GxNxD, s), dropped.dtype),
                             jnp.float32)


def _band_distances(w: int, a: int):
  """The distance each of the W + A band columns stands for as the mask reads it (x = d - 1):
  W - A..1 behind, then 2..A + 1 ahead (banded_reference.band_distances)."""
  return jnp.asarray(np.concatenate([np.arange(w - a, 0, -1), np.arange(2, a + 2)]), jnp.float32)


def _segment_allowed(segments, w: int, a: int, c: int, keyed: bool):
  """(B, 1, n, C, W + C) keyed, else (B, 1, n, C, W) bands: may query r attend the key (same
  segment, not padding). W: the band's width (behind and ahead)."""
  q_seg, kv_seg = segments
  b, m = q_seg.shape
  n = m // c
  idx = np.arange(n)[:, None] * c + np.arange(w + c)[None, :]
  kv_win = kv_seg[:, idx]  # B n (W+C)
  same = (q_seg.reshape(b, n, c, 1) == kv_win[:, :, None, :]) & (kv_win[:, :, None, :] != 0)
  if keyed:  # keys off the band are not the query's: a row whose segment has keys only there
    same = same & _on_band(c, w)[None, None]  # has none (its output is zero, `row_ok`)
  else:
    same = _unskew_pad(same.astype(jnp.int8), w).astype(bool)
  return same[:, None]


def _key_ramp(z, ramp: int, c: int, w: int, a: int = 0):
  """span_mask.ramp at each key's distance (key t, query r: band column t - r; behind W - A -
  (t - r), ahead (t - r) - (W - A) + 2 as the mask reads it)."""
  col = _band_column(c, w)
  dist = np.where(col < w - a, w - a - col, col - (w - a) + 2)
  lead = (None,) * (z.ndim - 2)  # z (B, G, 1, 1, 1); grouped heads (B, G_kv, 1, r, 1, 1)
  return span_mask.ramp(z, jnp.asarray(dist, jnp.float32)[lead], ramp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _key_mask(z, ramp: int, c: int, w: int, a: int = 0):
  """soft_mask(z, distance) in key coordinates, zero off the band, for per-head z (B, G, 1, 1, 1).

  Why: the skewed band mask's gather was redone per batch row in each fusion reading it; per key
  it is iota arithmetic that fuses into its readers. One head and per-query (dynamic) spans keep
  the gather (docs/benchmarks.md, "CPU attention: why each piece"). A custom VJP so that autodiff saves no (G, C, W + C) clamp
  residuals: the backward recomputes the ramp."""
  return jnp.where(_on_band(c, w), span_mask.clamp01(_key_ramp(z, ramp, c, w, a)), 0.0)


def _key_mask_fwd(z, ramp, c, w, a=0):
  return _key_mask(z, ramp, c, w, a), z


def _key_mask_bwd(ramp, c, w, a, z, g):
  x = _key_ramp(z, ramp, c, w, a)
  slope = span_mask.clamp01_slope(x)  # as autodiff of the band mask gives it
  on = jnp.asarray(_on_band(c, w))[(None,) * (z.ndim - 2)]
  return (jnp.sum(jnp.where(on, g * slope, 0.0), axis=(-2, -1), keepdims=True) / ramp,)


_key_mask.defvjp(_key_mask_fwd, _key_mask_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _keyed_attention(q, k_win, v_win, pe, mask, keep, allowed, kd: str, eps: float, qr: str):
  """Attention of one chunk per (b, g, n) in key coordinates, (B, G, N, C, Dh) in float32:
  logits = (q k^T + skew(q pe)) / sqrt(Dh), -inf off the band; p = softmax(logits), masked and
  renormalised (p m / (sum p m + eps)) when mask is given, times keep (the dropout's scaled keep
  mask) when given; out = p @ v. k_win/v_win are (B, G, N, Dh, W + C) for kd = "dk" (positions
  last), else (B, G, N, W + C, Dh); pe is (Dh, W) (float32 next to bf16/f16 q: the position
  parameter itself, cast inside; its gradient stays float32).

  Why a custom VJP: (1) the softmax backward needs each row's sum(dP * p), which is dO . out
  (FlashAttention's identity, also with the mask and dropout): a sum over Dh columns instead of
  W + C. (2) The scores' gradient is written once, scaled and in the operands' dtype, for both
  its matmuls and the position term's unskew. (3) bf16/f16 without dropout keep the weights
  once, as the value matmul reads them (docs/benchmarks.md, "CPU attention: why each piece").
  allowed: None, or where the keys may be attended (segments; the mask is zero elsewhere).
  qr: 'r' where q has a group axis after the chunk axis (grouped heads: (B, G_kv, N, r, C, Dh)
  against the shared keys), else ''."""
  return _keyed_fwd(q, k_win, v_win, pe, mask, keep, allowed, kd, eps, qr)[0]


def _mm(spec, a, b):
  """matmul.einsum of "bgn..,bgn..->bgn.." in float32 with (b, g, n) merged into one batch
  dim: the dot's output then keeps a row-major layout (with n = 1 as its own dim, XLA:CPU laid
  out the output of the dO v^T matmul with n outermost and copied it back)."""
  lead = a.shape[:3]
  out = matmul.einsum(spec.replace("bgn", "z"), a.reshape((-1,) + a.shape[3:]),
                         b.reshape((-1,) + b.shape[3:]), jnp.float32)
  return out.reshape(lead + out.shape[1:])


def _weights_fwd(logits, mask, keep, v_win, kd, eps, to_keys=None, qr=""):
  """softmax, mask, dropout, p @ v; returns out and the residuals of _weights_bwd. to_keys: the
  weights' skew to key coordinates when logits are bands (None: logits are in key coordinates)."""
  shape = logits.shape
  e = jax.nn.softmax(logits.reshape(-1, shape[-1]), axis=-1).reshape(shape)
  p, den = e, None
  if mask is not None:
    u = e * mask
    den = jnp.sum(u, axis=-1, keepdims=True) + eps
    p = u / den
  p_v = p if keep is None else p * keep
  p_v = (p_v if to_keys is None else to_keys(p_v)).astype(v_win.dtype)
  out = _mm(f"bgn{qr}ck,bgn{kd}->bgn{qr}cd", p_v, v_win)
  if keep is None and p_v.dtype != p.dtype and to_keys is None:  # bf16/f16: kept once, as cast
    p = None
  return out, (p, e if mask is not None else None, den, mask, keep, p_v, v_win, out)


def _weights_bwd(kd, eps, res, d_out, scale: float = 1.0, from_keys=None, qr=""):
  """Gradients of _weights_fwd: d_logits (times scale), d_mask, None for keep, dv. from_keys:
  the unskew back to bands (the transpose of _weights_fwd's to_keys)."""
  p, e, den, mask, keep, p_v, v_win, out = res
  if p is None:  # every consumer of d_logits rounds it to bf16/f16 anyway
    p = p_v.astype(jnp.float32)
  from_keys = from_keys or (lambda x: x)
  d_v = d_out.astype(v_win.dtype)
  dv = _mm(f"bgn{qr}ck,bgn{qr}cd->bgn{kd}", p_v, d_v).astype(v_win.dtype)
  if mask is None and keep is None:  # d_logits * scale, the scale folded into dO (small)
    dp = from_keys(_mm(f"bgn{qr}cd,bgn{kd}->bgn{qr}ck", (d_out * scale).astype(v_win.dtype),
                       v_win))
    rowdot = jnp.sum(d_out * out, axis=-1, keepdims=True) * scale
    return p * (dp - rowdot), None, None, dv
  dp = from_keys(_mm(f"bgn{qr}cd,bgn{kd}->bgn{qr}ck", d_v, v_win))  # of the weights as multiplied
  if keep is not None:
    dp = dp * keep
  rowdot = jnp.sum(d_out * out, axis=-1, keepdims=True)  # = sum(dp * p) over the row
  if mask is None:
    return p * (dp - rowdot) * scale, None, None, dv
  # p = e m / den: d(e m) = (dp - rowdot) / den; the softmax's own row sum is rowdot eps / den.
  du = (dp - rowdot) / den
  d_logits = (p * (dp - rowdot) - e * (rowdot * eps / den)) * scale
  d_mask = du * e
  if mask.shape[0] == 1 and d_mask.shape[0] > 1:
    d_mask = _sum_leading(d_mask)
  axes = tuple(a for a in range(d_mask.ndim) if mask.shape[a] == 1 and d_mask.shape[a] > 1)
  if axes:
    d_mask = jnp.sum(d_mask, axis=axes, keepdims=True)
  return d_logits, d_mask, None, dv


def _sum_leading(x):
  """x.sum(0, keepdims=True) as a sum of the slices: XLA:CPU ran the reduction over the leading
  (batch) dim, fused with the mask skew's transpose, on one thread; the slices' sum is a
  multi-threaded loop (docs/benchmarks.md, "CPU attention: why each piece")."""
  total = x[:1]
  for i in range(1, x.shape[0]):
    total = total + x[i:i + 1]
  return total


def _keyed_fwd(q, k_win, v_win, pe, mask, keep, allowed, kd, eps, qr):
  c, dh, w = q.shape[-2], q.shape[-1], pe.shape[1]
  cont = _mm(f"bgn{qr}cd,bgn{kd}->bgn{qr}ck", q, k_win)
  pos = matmul.einsum(f"bgn{qr}cd,dw->bgn{qr}cw", q, pe, jnp.float32)
  logits = (cont + _skew_take(pos)) / math.sqrt(dh)
  if allowed is not None:  # finite: a row with no key of its segment gives zeros, not NaN
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
  logits = jnp.where(_on_band(c, w), logits, -jnp.inf)
  out, res = _weights_fwd(logits, mask, keep, v_win, kd, eps, qr=qr)
  return out, (res, q, k_win, pe)


def _keyed_bwd(kd, eps, qr, res, d_out):
  res, q, k_win, pe = res
  dh, w = q.shape[-1], pe.shape[1]
  d_logits, d_mask, _, dv = _weights_bwd(kd, eps, res, d_out, 1 / math.sqrt(dh), qr=qr)
  ds = d_logits.astype(q.dtype)  # zero off the band, where the weights are (no select)
  d_pos = _unskew_pad(ds, w)
  dq = (_mm(f"bgn{qr}ck,bgn{kd}->bgn{qr}cd", ds, k_win)
        + matmul.einsum(f"bgn{qr}cw,dw->bgn{qr}cd", d_pos, pe, jnp.float32))
  dk = _mm(f"bgn{qr}cd,bgn{qr}ck->bgn{kd}", q, ds)
  return (dq.astype(q.dtype), dk.astype(k_win.dtype), dv, _pe_grad(q, d_pos).astype(pe.dtype),
          d_mask, None, None)


_keyed_attention.defvjp(_keyed_fwd, _keyed_bwd)


def _pe_grad(q, d_pos):
  """dL/d(key_pe) = sum over rows of q^T d_pos, (Dh, W) in float32, as one (Dh, rows) x (rows,
  W) matmul: written as an einsum over (b, g, n, c), XLA:CPU copied the (rows, W) gradient to
  (W, rows) first, a transpose as slow as the product (the (rows, Dh) queries are W / Dh times
  smaller to transpose)."""
  rows = math.prod(q.shape[:-1])
  return matmul.einsum("dr,rw->dw", q.reshape(rows, q.shape[-1]).T,
                       d_pos.reshape(rows, d_pos.shape[-1]), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _band_attention(q, k_win, v_win, pe, mask, keep, allowed, kd: str, eps: float, qr: str):
  """`_keyed_attention` for short bands (W < 2C), whose logits, weights and their gradients stay
  in band coordinates (C, W): the scores q k^T are unskewed once, the weights skewed once for
  p @ v, and the backward mirrors that (dp unskewed, d_logits skewed for dq and dk). Autodiff of
  the same expressions broadcast the mask's and the softmax's row factors to full (C, W) arrays,
  and transposed the (rows, W) position gradient (docs/benchmarks.md, "The drop-in layer")."""
  return _band_fwd(q, k_win, v_win, pe, mask, keep, allowed, kd, eps, qr)[0]


def _band_fwd(q, k_win, v_win, pe, mask, keep, allowed, kd, eps, qr):
  dh, w = q.shape[-1], pe.shape[1]
  cont = _mm(f"bgn{qr}cd,bgn{kd}->bgn{qr}ck", q, k_win)
  pos = matmul.einsum(f"bgn{qr}cd,dw->bgn{qr}cw", q, pe, jnp.float32)
  logits = (_unskew_pad(cont, w) + pos) / math.sqrt(dh)
  if allowed is not None:  # finite: a row with no key of its segment gives zeros, not NaN
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
  out, res = _weights_fwd(logits, mask, keep, v_win, kd, eps, to_keys=_skew_pad, qr=qr)
  return out, (res, q, k_win, pe)


def _band_bwd(kd, eps, qr, res, d_out):
  res, q, k_win, pe = res
  dh, w = q.shape[-1], pe.shape[1]
  d_logits, d_mask, _, dv = _weights_bwd(kd, eps, res, d_out, 1 / math.sqrt(dh),
                                         from_keys=lambda x: _unskew_pad(x, w), qr=qr)
  d_pos = d_logits.astype(q.dtype)
  ds = _skew_pad(d_pos)  # zero off the band
  dq = (_mm(f"bgn{qr}ck,bgn{kd}->bgn{qr}cd", ds, k_win)
        + matmul.einsum(f"bgn{qr}cw,dw->bgn{qr}cd", d_pos, pe, jnp.float32))
  dk = _mm(f"bgn{qr}cd,bgn{qr}ck->bgn{kd}", q, ds)
  return (dq.astype(q.dtype), dk.astype(k_win.dtype), dv, _pe_grad(q, d_pos).astype(pe.dtype),
          d_mask, None, None)


_band_attention.defvjp(_band_fwd, _band_bwd)


@jax.custom_vjp
def _project_rows_last(cache_BxWxD, h_BxMxD, w_DxZ):
  """[cache; block] rows projected, positions last: (Z, B, W + M) = W^T [cache; h]^T.

  One matmul over the concatenated inputs rather than two whose outputs are concatenated (an
  output twice the inputs' size, upcast to float32 for XLA:CPU's concatenate). The backward
  pass takes the input gradients of cache rows and block rows as two matmuls, so that of the
  cache rows, unused in training (the cache is a constant of the step), is dead code XLA
  drops; autodiff of the one matmul would compute both and slice."""
  return _rows_fwd(cache_BxWxD, h_BxMxD, w_DxZ)[0]


def _rows_dot(spec, a, b):
  if a.dtype in matmul.LOW:
    return matmul.contract(spec, a, b).astype(a.dtype)
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _rows_fwd(cache_BxWxD, h_BxMxD, w_DxZ):
  """w_DxZ may be a float32 weight (bf16/f16 rows): cast here, its gradient kept float32."""
  x_BxTxD = jnp.concatenate([cache_BxWxD, h_BxMxD], axis=1)
  return (_rows_dot("btd,dz->zbt", x_BxTxD, w_DxZ.astype(x_BxTxD.dtype)),
          (cache_BxWxD, h_BxMxD, w_DxZ))


def _rows_bwd(res, g_ZxBxT):
  cache_BxWxD, h_BxMxD, w_DxZ = res
  w_low = w_DxZ.astype(h_BxMxD.dtype)
  g_ZxBxT = g_ZxBxT.astype(w_low.dtype)
  x_BxTxD = jnp.concatenate([cache_BxWxD, h_BxMxD], axis=1)  # saved as its parts: the cache is
  # the step's argument, no extra buffer; dw in float32 (a float32 weight's gradient stays so)
  dw = matmul.contract("btd,zbt->dz", x_BxTxD, g_ZxBxT).astype(w_DxZ.dtype)
  w = cache_BxWxD.shape[1]
  dcache = _rows_dot("zbw,dz->bwd", g_ZxBxT[:, :, :w], w_low)
  dh = _rows_dot("zbm,dz->bmd", g_ZxBxT[:, :, w:], w_low)
  return dcache, dh, dw


_project_rows_last.defvjp(_rows_fwd, _rows_bwd)


def _split_rows_last(kv_ZxBxT, g: int):
  """(2 G Dh, B, T) projections -> keys, values, each (B, G, Dh, T) (rows of T move whole)."""
  z, b, t = kv_ZxBxT.shape
  return _split_pair(kv_ZxBxT, (2, g, z // (2 * g), b, t), (0, 3, 1, 2, 4))


def _split_rows_first(kv_BxTxZ, g: int):
  """(B, T, 2 G Dh) projections -> keys, values, each (B, G, T, Dh)."""
  b, t, z = kv_BxTxZ.shape
  return _split_pair(kv_BxTxZ, (b, t, 2, g, z // (2 * g)), (2, 0, 3, 1, 4))


def _split_pair(x, shape, perm):
  """x.reshape(shape).transpose(perm), whose leading dim of 2 is split into two arrays.

  The backward pass writes both gradients back into x's layout in one pass; autodiff of the
  split padded each to the stacked shape, added them and transposed the sum (with bf16 -> f32
  -> bf16 converts around the add) (docs/benchmarks.md, "CPU attention: why each piece")."""
  return _split_pair_vjp(x, x.shape, tuple(shape), tuple(perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _split_pair_vjp(x, x_shape, shape, perm):
  return _split_pair_fwd(x, x_shape, shape, perm)[0]


def _split_pair_fwd(x, x_shape, shape, perm):
  del x_shape
  y = x.reshape(shape).transpose(perm)
  return (y[0], y[1]), None


def _split_pair_bwd(x_shape, shape, perm, _, cts):
  del shape
  both = jnp.stack(cts).transpose(np.argsort(perm))
  return (both.reshape(x_shape),)


_split_pair_vjp.defvjp(_split_pair_fwd, _split_pair_bwd)


def project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, w: int, g: int, positions_last: bool):
  """(keys, values) of g heads over the last w cached states and the block: each
  (B, G, W + M, Dh), or (B, G, Dh, W + M) positions_last (see `prefer_positions_last`).

  Cache rows and block rows are two matmuls: the cache is a constant of the step, so the
  backward pass computes no input gradient for it. Positions last, the projection is
  W_kv^T @ cache^T reading the cache as it lies, and its weight gradient needs no transpose."""
  cache = cache_BxLxD[:, cache_BxLxD.shape[1] - w:]
  if not positions_last:
    kv = jnp.concatenate([matmul.dot(cache, w_kv_Dx2Z), matmul.dot(h_BxMxD, w_kv_Dx2Z)],
                         axis=1)
    return _split_rows_first(kv, g)
  if h_BxMxD.dtype in matmul.LOW:
    kv_ZxBxT = _project_rows_last(cache, h_BxMxD, w_kv_Dx2Z)
  else:  # float32 concatenates without converts; two matmuls keep XLA's memory lower
    kv_ZxBxT = jnp.concatenate(
        [matmul.einsum("btd,dz->zbt", cache, w_kv_Dx2Z),
         matmul.einsum("bmd,dz->zbm", h_BxMxD, w_kv_Dx2Z)], axis=2)
  return _split_rows_last(kv_ZxBxT, g)


def split_kv(kv_BxTx2Z, g: int, positions_last: bool):
  """Already projected [keys | values] rows (B, T, 2 G Dh) -> (keys, values) as project_kv's."""
  if not positions_last:
    return _split_kv_rows(kv_BxTx2Z, g)
  b, t, z = kv_BxTx2Z.shape
  kv = kv_BxTx2Z.reshape(b, t, 2, g, z // (2 * g)).transpose(2, 0, 3, 4, 1)
  return kv[0], kv[1]


def residual_bytes(span_mode: str, pers_mem: int, dtype, batch: int, m: int, g: int, w: int,
                   dh: int, chunk: int, dropout: bool) -> dict:
  """Bytes one head group's attention keeps for the backward pass (JAX's residuals), by kind:
  the key/value windows the chunks read, the score bands and the weights. What autodiff and
  this module's custom VJPs save (checked against jax's saved residuals in tests)."""
  b, f32 = batch, 4
  act = jnp.dtype(dtype).itemsize
  c = choose_chunk(m, w, chunk)
  bands = {"fixed": 1, "adaptive": 3, "dynamic": 6}[span_mode]
  width = (w + c if long_band(c, w) else w) + pers_mem  # score rows, keyed or banded
  out = {"keys_values": 2 * b * g * (m // c) * (w + c) * dh * act, "score_bands": 0, "weights": 0}
  if long_band(c, w) and not pers_mem:  # _keyed_attention's own residuals
    band = b * g * m * (w + c)
    # with a mask: the exponentiated scores (+ the per-token mask, dynamic) and row sums
    out["score_bands"] += band * {"fixed": 0, "adaptive": 1, "dynamic": 2}[span_mode] * f32
    if span_mode != "fixed":
      out["score_bands"] += b * g * m * f32
    if span_mode == "adaptive":  # the per-head span mask, in key coordinates
      out["score_bands"] += g * c * (w + c) * f32
    if span_mode == "dynamic":  # the per-token clamp's slope (span_mask.clamp01), band coordinates
      out["score_bands"] += b * g * m * w * f32
    # the weights as the value matmul reads them (float32: the probabilities themselves);
    # with dropout also the float32 probabilities and the keep mask
    out["weights"] += band * act + (2 * band * f32 if dropout else 0)
    return out
  out["score_bands"] += b * g * m * (width * bands + (2 if bands == 1 else 4)) * f32
  out["weights"] += b * g * m * (w + c) * act
  if long_band(c, w):  # the select putting -inf off the band keeps its mask and output
    out["score_bands"] += b * g * m * (w + c) * (1 + f32)
    if span_mode == "adaptive":  # the per-head span mask, in key coordinates
      out["score_bands"] += g * c * (w + c) * f32
  if dropout:
    out["weights"] += b * g * m * width * (1 + f32)
  return out
