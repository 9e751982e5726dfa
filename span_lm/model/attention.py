"""Sequential self-attention over a hidden-state cache, with banded (M, W) scores.

Queries of the current block attend to the W distances strictly before them (W <= S is the head
group's window from the span plan). Scores are laid out as bands: column s of a query's row is the
key at distance W - s, so the learned relative position embeddings `key_pe` (Dh, S) line up with
columns by a plain slice, and the span mask is one vector per head.

The band comes from the reference's pad-and-reshape "skew", applied per chunk of C queries: a
chunk needs only the W + C keys ending at its last query, so the work per query is O(W + C)
instead of O(M + W). With C ~ W this is what makes short learned spans cheap (the reference
computes the full (M, M + L) score matrix of every head and only then drops the unused part).
Long bands (`long_band`: W >= 2C) keep their scores in key coordinates instead, (C, W + C) with
-inf off the band, and skew only the position term, by a gather; without persistent memory they
run as one custom VJP (`_keyed_attention`), whose backward takes the softmax's row sums from
dO . out and writes the scores' gradient once.
"""
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from span_lm.model import fused_attention
from span_lm.model import precision
from span_lm.model import spans as spans_lib
from span_lm.model.config import ModelConfig
from span_lm.model.spans import LayerPlan


def torch_linear_init():
  """torch.nn.Linear's weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
  bound = 1.0 / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _unskew_pad(x, w: int):
  *lead, c, n = x.shape
  x = x.reshape(*lead, c * n)
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, c)])
  return x.reshape(*lead, c, n + 1)[..., :w]


def _skew_pad(x):
  *lead, c, w = x.shape
  x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, c + 1)])
  x = x.reshape(*lead, c * (w + c + 1))[..., : c * (w + c)]
  return x.reshape(*lead, c, w + c)


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
  """W >= 2C: bands whose scores stay in key coordinates in banded_attention (the C extra columns
  per row cost at most half the row) and whose skew is a gather: XLA:CPU runs the reference's
  pad-flatten-slice skew, whose fused loop divides per element, ~3x slower there (one core,
  (16, 4, 128, 1024) float32 -> bf16: 7.5 against 23.6 ms; the fixed-span bf16 step
  0.637-0.647 against 0.709-0.724 s on two cores). Short bands keep band coordinates, the pad
  form and plain autodiff: the gather, which XLA:CPU does not split over threads, made the
  short-span step slower on two cores (0.261-0.303 against 0.232-0.257 s)."""
  return w >= 2 * c


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


def choose_chunk(m: int, w: int, requested: int = 0) -> int:
  """Queries per chunk: the smallest divisor of M that is >= W (M itself when W >= M)."""
  if requested >= m:  # also init's one-token block
    return m
  if requested:
    if m % requested:
      raise ValueError(f"config.model.attn_chunk={requested} must divide the block length {m}")
    return requested
  for c in range(min(w, m), m + 1):
    if m % c == 0:
      return c
  return m


def prefer_positions_last(m: int, w: int, chunk: int = 0, dtype=jnp.float32) -> bool:
  """The key/value layout banded_attention runs fastest with: positions last, (B, G, Dh, T), when
  one chunk covers the block (windows >= the block, e.g. a fixed span of 1024); (B, G, T, Dh)
  for several chunks, whose overlapping windows are cut along T.

  Positions last, every matmul of both passes reads and writes keys and values as XLA:CPU's fast
  kernels want them (q k^T reads (Dh, T) rows; the key/value gradients come out (Dh, T)), and the
  key/value projection W^T @ cache^T and its weight gradient need no transpose of the cache
  (fixed-span bf16 step on two cores 0.616-0.628 against 0.633-0.700 s); with several chunks it
  cost 13 %. Not for bf16/f16 traced over several devices: `precision.contract` may not move the
  sharded dim 0 there and would run the projection in float32 (0.84 against 0.72-0.73 s)."""
  if jnp.dtype(dtype) in precision.LOW and precision.batch_sharded():
    return False
  return choose_chunk(m, w, chunk) == m


def key_windows(y_BxGxTxD, w: int, c: int):
  """(B, G, W + M, Dh) keys -> (B, G, M/C, W + C, Dh): the keys each chunk of C queries needs.

  bf16/f16 keys get a backward pass that adds the overlapping windows' gradients in float32 and
  rounds once (autodiff would round after every pad and add: a long chain of converts that
  XLA:CPU ran at a few ns per element)."""
  if y_BxGxTxD.dtype in precision.LOW:
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
                     eps: float = 1e-8):
  """Attention of M queries over the W distances before each of them, for one head group.

  Args:
    q_BxGxMxD: queries. k, v: keys/values of the last T = W + M positions (window + block),
      (B, G, T, Dh), or (B, G, Dh, T) with positions_last (see `prefer_positions_last`).
    key_pe_DxW: relative position embeddings for distances W..1 (column W-1 is distance 1).
    mask: soft span mask broadcastable to (B, G, M, W) (None: fixed span).
    span_z, ramp: instead of mask, the spans in tokens, (1 or B, G, 1 or M), of the soft mask
      spans.soft_mask(z, distance, ramp). Per-head spans of several heads on long bands are then
      evaluated at each key's distance (`_key_mask`) instead of skewing the band mask.
    pers_k_GxDxN, pers_v_GxNxD: persistent memory (already multiplied by sqrt(Dh), sqrt(N)).
    chunk: queries per chunk (0: automatic).
    dropout: applied to the attention weights.
  Returns:
    (out_BxGxMxD, probs_BxGxMx(W+N)) in float32 probabilities; the caller drops probs.
  """
  b, g, m, dh = q_BxGxMxD.shape
  w = key_pe_DxW.shape[-1]
  t = k.shape[3] if positions_last else k.shape[2]
  if t != w + m:
    raise ValueError(f"banded_attention: got {t} keys for window {w} and block {m}")
  c = choose_chunk(m, w, chunk)
  n = m // c
  if positions_last and n > 1:  # windows are cut along T
    k, v, positions_last = k.swapaxes(2, 3), v.swapaxes(2, 3), False
  q = q_BxGxMxD.reshape(b, g, n, c, dh)
  if positions_last:  # one chunk: its window is every key
    k_win, v_win, kd = k[:, :, None], v[:, :, None], "dk"  # B G 1 Dh T
  else:
    k_win, v_win, kd = key_windows(k, w, c), key_windows(v, w, c), "kd"  # B G n (W+C) Dh

  # Long bands (W >= 2C) stay in key coordinates (C, W + C), off-band logits at -inf: only the
  # position term is skewed there, and its gradient unskewed, where band coordinates would skew
  # the scores, the weights and both their gradients (two gathers fewer per layer, for 1 + C/W
  # times the row-wise work). Short bands (W + C up to 2W) take band coordinates.
  keyed = long_band(c, w)
  cont = precision.einsum(f"bgncd,bgn{kd}->bgnck", q, k_win, jnp.float32)
  pos = precision.einsum("bgncd,dw->bgncw", q, key_pe_DxW.astype(q.dtype), jnp.float32)
  scores = cont + skew(pos) if keyed else unskew(cont, w) + pos
  kw = scores.shape[-1]  # W + C keyed, W in bands
  per_key = False  # the mask already 5-D in key coordinates (see _key_mask)
  if span_z is not None:
    if mask is not None or ramp <= 0:
      raise ValueError("banded_attention: give either mask or span_z with a ramp > 0")
    z = jnp.asarray(span_z, jnp.float32)
    per_key = keyed and z.shape[2] == 1 and g > 1
    if per_key:
      mask = _key_mask(z.reshape(z.shape[0], g, 1, 1, 1), ramp, c, w)
    else:
      dist_W = jnp.arange(w, 0, -1, dtype=jnp.float32)  # column s -> distance w - s
      mask = spans_lib.soft_mask(z[..., None], dist_W[None, None, None, :], ramp)
  if mask is not None and not per_key:  # (1 or B, G, 1 or M, W) -> 5-D, broadcast unmaterialised
    mb = mask.shape[0]
    mask = (mask.reshape(mb, g, 1, 1, w) if mask.shape[2] == 1
            else jnp.broadcast_to(mask, (mb, g, m, w)).reshape(mb, g, n, c, w))
    if keyed:  # zero off the band
      mask = skew(jnp.broadcast_to(mask, mask.shape[:3] + (c, w)))
  logits = scores / math.sqrt(dh)
  if keyed:  # a select (an added -inf constant: XLA:CPU kept the broadcast constant, +107 MiB)
    logits = jnp.where(_on_band(c, w), logits, -jnp.inf)

  if pers_k_GxDxN is not None:
    n_pers = pers_k_GxDxN.shape[-1]
    pers = precision.einsum("bgncd,gdp->bgncp", q, pers_k_GxDxN.astype(q.dtype), jnp.float32)
    probs = jax.nn.softmax(jnp.concatenate([logits, pers / math.sqrt(dh)], axis=-1), axis=-1)
    if mask is not None:
      ones = jnp.ones((b, g, n, c, n_pers), probs.dtype)
      probs = probs * jnp.concatenate([jnp.broadcast_to(mask, (b, g, n, c, kw)), ones], axis=-1)
      probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + eps)
  else:
    # Row-wise work on a 2-D (rows, W) view: XLA:CPU reduces a 5-D array with unit dims (one
    # head in a group) several times slower than the same rows laid out flat.
    rows = b * g * n * c
    probs = jax.nn.softmax(logits.reshape(rows, kw), axis=-1)
    if mask is not None:
      probs = (probs.reshape(b, g, n, c, kw) * mask).reshape(rows, kw)
      probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + eps)
    probs = probs.reshape(b, g, n, c, kw)

  if keyed and pers_k_GxDxN is None:  # one custom VJP (the scores above are for `probs` only)
    keep = None if dropout is None else dropout(jnp.ones(probs.shape, jnp.float32))
    out = _keyed_attention(q, k_win, v_win, key_pe_DxW.astype(q.dtype), mask, keep, kd, eps)
  else:
    dropped = dropout(probs) if dropout is not None else probs
    dropped = dropped.astype(v.dtype)
    p_band = dropped[..., :kw] if keyed else skew(dropped[..., :kw])
    out = precision.einsum(f"bgnck,bgn{kd}->bgncd", p_band, v_win, jnp.float32)
  if pers_k_GxDxN is not None:
    out = out + precision.einsum("bgncp,gpd->bgncd", dropped[..., kw:],
                                 pers_v_GxNxD.astype(dropped.dtype), jnp.float32)
  if keyed:  # the weights in band coordinates, as returned (callers that drop them pay nothing)
    probs = jnp.concatenate([unskew(probs[..., :kw], w), probs[..., kw:]], axis=-1)
  return out.reshape(b, g, m, dh), probs.reshape(b, g, m, -1)


def _key_ramp(z, ramp: int, c: int, w: int):
  """spans.soft_mask_ramp at each key's distance W - (t - r) (key t, query r)."""
  dist = jnp.asarray(w - _band_column(c, w), jnp.float32)[None, None, None]
  return spans_lib.soft_mask_ramp(z, dist, ramp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _key_mask(z, ramp: int, c: int, w: int):
  """soft_mask(z, distance) in key coordinates, zero off the band, for per-head z (B, G, 1, 1, 1).

  Why: skewing the band mask's (G, W) vectors with the gather, XLA:CPU redid the gather's
  select and transpose per batch row inside each fusion reading the mask (two forward fusions
  9.0 / 8.7 -> 5.5 / 5.5 ms per layer, 8 heads, S = 1024); evaluated per key it is iota
  arithmetic that fuses into its readers. One head keeps the gather, whose output needs no
  transpose and is computed once (mixed layer, S = 8192: 0.673-0.679 against 0.686-0.697 s), and
  so do per-query (dynamic) spans, whose mask is as large as the scores either way. A custom VJP
  so that autodiff saves no (G, C, W + C) clip residuals: the backward recomputes the ramp."""
  return jnp.where(_on_band(c, w), spans_lib.clamp01(_key_ramp(z, ramp, c, w)), 0.0)


def _key_mask_fwd(z, ramp, c, w):
  return _key_mask(z, ramp, c, w), z


def _key_mask_bwd(ramp, c, w, z, g):
  x = _key_ramp(z, ramp, c, w)
  slope = spans_lib.clamp01_slope(x)  # as autodiff of the band mask gives it
  on = jnp.asarray(_on_band(c, w))[None, None, None]
  return (jnp.sum(jnp.where(on, g * slope, 0.0), axis=(3, 4), keepdims=True) / ramp,)


_key_mask.defvjp(_key_mask_fwd, _key_mask_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _keyed_attention(q, k_win, v_win, pe, mask, keep, kd: str, eps: float):
  """Attention of one chunk per (b, g, n) in key coordinates, (B, G, N, C, Dh) in float32:
  logits = (q k^T + skew(q pe)) / sqrt(Dh), -inf off the band; p = softmax(logits), masked and
  renormalised (p m / (sum p m + eps)) when mask is given, times keep (the dropout's scaled keep
  mask) when given; out = p @ v. k_win/v_win are (B, G, N, Dh, W + C) for kd = "dk" (positions
  last), else (B, G, N, W + C, Dh); pe is (Dh, W).

  Why a custom VJP: (1) the softmax backward needs each row's sum(dP * p), which is dO . out
  (FlashAttention's identity, also with the mask and dropout): a sum over Dh columns instead of
  W + C. Autodiff read the weights and their gradient twice for it, and YNNPACK fused that
  reduction into the dO v^T matmul at 71-113 GFLOP/s. (2) The scores' gradient is written once,
  scaled and in the operands' dtype, for both its matmuls and the position term's unskew;
  autodiff wrote it in float32 and converted it twice (two passes at ~4 GB/s per layer).
  (3) bf16/f16 without dropout keep the weights once, as the value matmul reads them. Fixed-span
  bf16 step, two cores: 0.353-0.355 against 0.363-0.364 s (one custom VJP over the weights only)
  and 0.388-0.395 s (autodiff)."""
  return _keyed_fwd(q, k_win, v_win, pe, mask, keep, kd, eps)[0]


def _mm(spec, a, b):
  """precision.einsum of "bgn..,bgn..->bgn.." in float32 with (b, g, n) merged into one batch
  dim: the dot's output then keeps a row-major layout (with n = 1 as its own dim, XLA:CPU laid
  out the output of the dO v^T matmul with n outermost and copied it back, 5 ms per layer on
  one core)."""
  lead = a.shape[:3]
  out = precision.einsum(spec.replace("bgn", "z"), a.reshape((-1,) + a.shape[3:]),
                         b.reshape((-1,) + b.shape[3:]), jnp.float32)
  return out.reshape(lead + out.shape[1:])


def _weights_fwd(logits, mask, keep, v_win, kd, eps):
  """softmax, mask, dropout, p @ v; returns out and the residuals of _weights_bwd."""
  shape = logits.shape
  e = jax.nn.softmax(logits.reshape(-1, shape[-1]), axis=-1).reshape(shape)
  p, den = e, None
  if mask is not None:
    u = e * mask
    den = jnp.sum(u, axis=-1, keepdims=True) + eps
    p = u / den
  p_v = (p if keep is None else p * keep).astype(v_win.dtype)
  out = _mm(f"bgnck,bgn{kd}->bgncd", p_v, v_win)
  if keep is None and p_v.dtype != p.dtype:  # bf16/f16: the weights are kept once, as cast
    p = None
  return out, (p, e if mask is not None else None, den, mask, keep, p_v, v_win, out)


def _weights_bwd(kd, eps, res, d_out, scale: float = 1.0):
  """Gradients of _weights_fwd: d_logits (times scale), d_mask, None for keep, dv."""
  p, e, den, mask, keep, p_v, v_win, out = res
  if p is None:  # every consumer of d_logits rounds it to bf16/f16 anyway
    p = p_v.astype(jnp.float32)
  d_v = d_out.astype(v_win.dtype)
  dv = _mm(f"bgnck,bgncd->bgn{kd}", p_v, d_v).astype(v_win.dtype)
  if mask is None and keep is None:  # d_logits * scale, the scale folded into dO (small)
    dp = _mm(f"bgncd,bgn{kd}->bgnck", (d_out * scale).astype(v_win.dtype), v_win)
    rowdot = jnp.sum(d_out * out, axis=-1, keepdims=True) * scale
    return p * (dp - rowdot), None, None, dv
  dp = _mm(f"bgncd,bgn{kd}->bgnck", d_v, v_win)  # gradient of the weights as multiplied
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
  (batch) dim of a (B, G, 1, C, W + C) array, fused with the mask skew's transpose, as a
  one-thread YNNPACK fusion at 50-60 ms per layer; the slices' sum is one two-thread loop
  (adaptive bf16 step with every span at S = 1024: 0.376-0.378 against 0.600-0.602 s)."""
  total = x[:1]
  for i in range(1, x.shape[0]):
    total = total + x[i:i + 1]
  return total


def _keyed_fwd(q, k_win, v_win, pe, mask, keep, kd, eps):
  c, dh, w = q.shape[3], q.shape[4], pe.shape[1]
  cont = _mm(f"bgncd,bgn{kd}->bgnck", q, k_win)
  pos = precision.einsum("bgncd,dw->bgncw", q, pe, jnp.float32)
  logits = jnp.where(_on_band(c, w), (cont + _skew_take(pos)) / math.sqrt(dh), -jnp.inf)
  out, res = _weights_fwd(logits, mask, keep, v_win, kd, eps)
  return out, (res, q, k_win, pe)


def _keyed_bwd(kd, eps, res, d_out):
  res, q, k_win, pe = res
  dh, w = q.shape[4], pe.shape[1]
  d_logits, d_mask, _, dv = _weights_bwd(kd, eps, res, d_out, 1 / math.sqrt(dh))
  ds = d_logits.astype(q.dtype)  # zero off the band, where the weights are (no select)
  d_pos = _unskew_pad(ds, w)
  dq = (_mm(f"bgnck,bgn{kd}->bgncd", ds, k_win)
        + precision.einsum("bgncw,dw->bgncd", d_pos, pe, jnp.float32))
  dk = _mm(f"bgncd,bgnck->bgn{kd}", q, ds)
  dpe = precision.einsum("bgncd,bgncw->dw", q, d_pos, jnp.float32)
  return (dq.astype(q.dtype), dk.astype(k_win.dtype), dv, dpe.astype(pe.dtype), d_mask, None)


_keyed_attention.defvjp(_keyed_fwd, _keyed_bwd)


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
  if a.dtype in precision.LOW:
    return precision.contract(spec, a, b).astype(a.dtype)
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _rows_fwd(cache_BxWxD, h_BxMxD, w_DxZ):
  x_BxTxD = jnp.concatenate([cache_BxWxD, h_BxMxD], axis=1)
  return _rows_dot("btd,dz->zbt", x_BxTxD, w_DxZ), (cache_BxWxD, h_BxMxD, w_DxZ)


def _rows_bwd(res, g_ZxBxT):
  cache_BxWxD, h_BxMxD, w_DxZ = res
  g_ZxBxT = g_ZxBxT.astype(w_DxZ.dtype)
  x_BxTxD = jnp.concatenate([cache_BxWxD, h_BxMxD], axis=1)  # saved as its parts: the cache is
  dw = _rows_dot("btd,zbt->dz", x_BxTxD, g_ZxBxT)  # the step's argument, no extra buffer
  w = cache_BxWxD.shape[1]
  dcache = _rows_dot("zbw,dz->bwd", g_ZxBxT[:, :, :w], w_DxZ)
  dh = _rows_dot("zbm,dz->bmd", g_ZxBxT[:, :, w:], w_DxZ)
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
  -> bf16 converts around the add): passes at 1-9 GB/s, 2.4-6.2 ms per layer on one core."""
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


def _selector(ids, width: int = 1):
  """(a, axis=1) -> the entries ids * width ... (ids + 1) * width - 1 of a along axis: a slice
  when the ids are contiguous, else a gather."""
  lo, hi = ids[0] * width, (ids[-1] + 1) * width
  if tuple(range(ids[0], ids[0] + len(ids))) == tuple(ids):
    return lambda a, ax=1: jax.lax.slice_in_dim(a, lo, hi, axis=ax)
  cols = jnp.asarray([c for i in ids for c in range(i * width, (i + 1) * width)])
  return lambda a, ax=1: jnp.take(a, cols, axis=ax)


class _DenseKernel(nn.Module):
  """Holds `kernel` exactly as nn.Dense(use_bias=False) would (same path, same init), so the
  key and value projections can run as one matmul without changing the parameter tree."""
  features: int

  @nn.compact
  def __call__(self):
    return self.param("kernel", torch_linear_init(), (self.features, self.features))


class SeqAttention(nn.Module):
  """Multi-head sequential attention of one layer, with its span parameters and persistent memory.

  Parameters (reference state_dict names in brackets, torch weights are (out, in)):
    proj_query/proj_key/proj_val/proj_out.kernel (D, D)   [attn.proj_*.weight, transposed]
    span_ratio (H,)                       [attn.attn.adaptive_span._mask.current_val (H, 1, 1)]
    span_predictor.kernel (D, H), .bias   [none: dynamic span is not in the reference]
    pers_key (H, Dh, N), pers_val (H, N, Dh)  [attn.attn.persistent_memory.key / .val]
  """
  cfg: ModelConfig
  plan: LayerPlan
  kv_cache: bool = False  # inference: the cache holds projected [keys | values] (B, L, 2D)

  @nn.compact
  def __call__(self, h_BxMxD, cache_BxLxD, key_pe_DxS, train: bool, ring_pos=None):
    """ring_pos (kv_cache, one token): the cache is a ring of projected keys|values, slot j
    holding the token at the position congruent to j mod L, and ring_pos is this token's
    position; nothing is copied per token (see `_ring`)."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    b, m, d = h_BxMxD.shape
    nh, dh, s = cfg.n_heads, cfg.head_dim, cfg.span
    dense = lambda name: nn.Dense(d, use_bias=False, kernel_init=torch_linear_init(), dtype=dt,
                                  dot_general=precision.dense_dot_general, name=name)
    w_max = max(w for _, w in self.plan.groups)
    cache_len = cache_BxLxD[0].shape[2] if ring_pos is not None else cache_BxLxD.shape[1]
    if cache_len < w_max:
      raise ValueError(f"cache of {cache_len} states is shorter than the window {w_max}")
    q = dense("proj_query")(h_BxMxD).reshape(b, m, nh, dh).transpose(0, 2, 1, 3)  # B H M Dh
    k_kernel = _DenseKernel(d, name="proj_key")().astype(dt)
    v_kernel = _DenseKernel(d, name="proj_val")().astype(dt)
    h_in = h_BxMxD.astype(dt)
    cache = cache_BxLxD if ring_pos is not None else cache_BxLxD.astype(dt)

    aux = {}
    if self.kv_cache:  # the block's keys and values for every head, for the next cache
      aux["kv"] = precision.dot(h_in, jnp.concatenate([k_kernel, v_kernel], axis=1))  # B M 2D
    z_H = z_BxMxH = None
    if cfg.span_mode == "adaptive":
      ratio = self.param("span_ratio", nn.initializers.constant(cfg.span_init), (nh,))
      z_H = ratio.astype(jnp.float32) * s
      aux["span_loss"] = cfg.span_loss * s * jnp.mean(ratio)
      aux["span_avg"], aux["span_max"] = spans_lib.span_stats(z_H, cfg)
      aux["span_z"] = z_H
    elif cfg.span_mode == "dynamic":
      pred = nn.Dense(nh, kernel_init=torch_linear_init(),
                      bias_init=nn.initializers.constant(cfg.dynamic_bias_init),
                      name="span_predictor")
      sig = jax.nn.sigmoid(pred(h_BxMxD.astype(jnp.float32)))
      z_BxMxH = s * sig
      aux["span_loss"] = cfg.span_loss * s * jnp.mean(sig)
      aux["span_avg"], aux["span_max"] = spans_lib.span_stats(z_BxMxH, cfg)
      aux["dyn_spans"] = z_BxMxH
    else:
      aux["span_loss"] = jnp.zeros((), jnp.float32)
      aux["span_avg"] = aux["span_max"] = jnp.asarray(s, jnp.float32)

    pers_k = pers_v = None
    if cfg.pers_mem:
      n = cfg.pers_mem
      pers_k = self.param("pers_key", nn.initializers.normal(1.0 / math.sqrt(dh)), (nh, dh, n))
      pers_v = self.param("pers_val", nn.initializers.normal(1.0 / math.sqrt(n)), (nh, n, dh))
      pers_k = pers_k * math.sqrt(dh)
      pers_v = pers_v * math.sqrt(n)

    drop = nn.Dropout(cfg.dropout)
    dropout = (lambda p: drop(p, deterministic=False)) if (train and cfg.dropout > 0) else None

    if ring_pos is not None:
      if not self.kv_cache or m != 1:
        raise ValueError("ring caches are for decoding one token at a time with kv_cache=True")
      out = self._ring(q, cache, key_pe_DxS, ring_pos, z_H, z_BxMxH, pers_k, pers_v)
      return dense("proj_out")(out), aux

    # The kernel tiles blocks of attn_block queries; others (init's one-token block) take the
    # jnp path, the same maths.
    if cfg.attn_impl != "xla" and m % cfg.attn_block == 0:
      seed = None
      if dropout is not None:  # the kernel hashes its own keep mask from this
        seed = jax.random.bits(self.make_rng("dropout"), (), jnp.uint32)
      w = max(w for _, w in self.plan.groups)  # one group of every head: spans at run time
      kv = self._group_kv(cache, h_in, k_kernel, v_kernel, aux.get("kv"), w, nh,
                          lambda a, ax=1: a, positions_last=False)
      out = self._fused(q, kv, key_pe_DxS, z_H, z_BxMxH, seed, pers_k, pers_v)
      return dense("proj_out")(out), aux

    outs, order = [], []
    for head_ids, w in self.plan.groups:
      take = _selector(head_ids)  # this group's heads along an axis
      # Keys and values of this group only: its heads' columns of the projections, applied to
      # the last w cached states plus the block, in one matmul. A long head thus costs its own
      # projections, and the cache margin beyond the window is kept but never computed with.
      g = len(head_ids)
      # This group's heads' columns (of a kernel, or of cached [keys | values] halves).
      pick = _selector(head_ids, dh)
      last = prefer_positions_last(m, w, cfg.attn_chunk, dt)
      kv = self._group_kv(cache, h_in, k_kernel, v_kernel, aux.get("kv"), w, g, pick, last)
      span_z = None  # (1 or B, G, 1 or M) tokens: banded_attention builds the soft mask
      if z_H is not None:
        span_z = take(z_H, 0)[None, :, None]
      elif z_BxMxH is not None:
        span_z = take(z_BxMxH, 2).transpose(0, 2, 1)
      out, _ = banded_attention(
          take(q, 1), kv[0], kv[1], key_pe_DxS[:, s - w:],
          span_z=span_z, ramp=cfg.ramp, pers_k_GxDxN=None if pers_k is None else take(pers_k, 0),
          pers_v_GxNxD=None if pers_v is None else take(pers_v, 0), chunk=cfg.attn_chunk,
          dropout=dropout, positions_last=last)
      outs.append(out.astype(dt))
      order.extend(head_ids)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    if tuple(order) != tuple(range(nh)):
      inv = [0] * nh
      for pos, hid in enumerate(order):
        inv[hid] = pos
      out = jnp.take(out, jnp.asarray(inv), axis=1)
    out = out.transpose(0, 2, 1, 3).reshape(b, m, d)
    return dense("proj_out")(out), aux

  def _group_kv(self, cache, h_in, k_kernel, v_kernel, kv_blk_BxMx2D, w, g, pick,
                positions_last: bool):
    """(keys, values) of a group of g heads (`pick` takes their columns) over the last w cached
    states and the block: each (B, G, W + M, Dh), or (B, G, Dh, W + M) positions_last.

    Cache rows and block rows are two matmuls: the cache is a constant of the step, so the
    backward pass then computes no input gradient for it (one matmul over the concatenation
    would compute it and throw it away). Positions last, the projection is W_kv^T @ cache^T
    reading the cache as it lies, and its weight gradient dKV^T @ cache needs no transpose of
    either. With kv_cache the cached keys/values were projected with these same (frozen)
    weights."""
    b, m, d = h_in.shape
    dh = d // self.cfg.n_heads
    if self.kv_cache:
      both = jnp.concatenate([cache[:, cache.shape[1] - w:], kv_blk_BxMx2D], axis=1)  # B T 2D
      kv = both if g == self.cfg.n_heads else jnp.concatenate(
          [pick(both[..., :d], 2), pick(both[..., d:], 2)], axis=-1)  # [k | v] of the group
      kv = kv.reshape(b, w + m, 2, g, dh)
      return kv.transpose(2, 0, 3, 4, 1) if positions_last else kv.transpose(2, 0, 3, 1, 4)
    w_kv = jnp.concatenate([pick(k_kernel), pick(v_kernel)], axis=1)  # D x 2gDh
    if not positions_last:
      kv = jnp.concatenate([precision.dot(cache[:, cache.shape[1] - w:], w_kv),
                            precision.dot(h_in, w_kv)], axis=1)
      return _split_rows_first(kv, g)
    if h_in.dtype in precision.LOW:
      kv_ZxBxT = _project_rows_last(cache[:, cache.shape[1] - w:], h_in, w_kv)
    else:  # float32 concatenates without converts; two matmuls keep XLA's memory lower
      kv_ZxBxT = jnp.concatenate(
          [precision.einsum("btd,dz->zbt", cache[:, cache.shape[1] - w:], w_kv),
           precision.einsum("bmd,dz->zbm", h_in, w_kv)], axis=2)
    return _split_rows_last(kv_ZxBxT, g)

  def _ring(self, q, ring, key_pe_DxS, pos, z_H, z_BxMxH, pers_k, pers_v,
            eps: float = 1e-8):
    """One query per stream over a ring cache ((keys, values), each head-major (B, H, L, Dh)):
    slot j holds the token at distance d_j = ((pos - j - 1) mod L) + 1, so keys are used where
    they lie and the position term is gathered by distance. Equal to banded attention over each
    head's plan window (keys with d_j > W get zero weight); returns (B, 1, D) before the output
    projection."""
    cfg = self.cfg
    k_BxHxLxD, v_BxHxLxD = ring
    b, l = k_BxHxLxD.shape[0], k_BxHxLxD.shape[2]
    nh, dh, s = cfg.n_heads, cfg.head_dim, cfg.span
    q_BxHxD = q[:, :, 0]
    dist_L = (pos - 1 - jnp.arange(l)) % l + 1  # slot -> distance in [1, L]
    win_H = jnp.asarray(self.plan.head_windows(nh))
    valid_HxL = dist_L[None, :] <= win_H[:, None]
    cont = precision.einsum("bhd,bhld->bhl", q_BxHxD, k_BxHxLxD, jnp.float32)
    qpe = precision.einsum("bhd,ds->bhs", q_BxHxD, key_pe_DxS.astype(q.dtype), jnp.float32)
    pos_BxHxL = jnp.take(qpe, jnp.clip(s - dist_L, 0, s - 1), axis=2)
    logits = jnp.where(valid_HxL[None], (cont + pos_BxHxL) / math.sqrt(dh), -jnp.inf)
    mask = None
    dist_f = dist_L.astype(jnp.float32)[None, None, :]
    if z_H is not None:
      mask = spans_lib.soft_mask(z_H[None, :, None], dist_f, cfg.ramp)
    elif z_BxMxH is not None:
      mask = spans_lib.soft_mask(z_BxMxH[:, 0, :, None], dist_f, cfg.ramp)
    if pers_k is not None:
      pers = precision.einsum("bhd,hdp->bhp", q_BxHxD, pers_k.astype(q.dtype), jnp.float32)
      probs = jax.nn.softmax(jnp.concatenate([logits, pers / math.sqrt(dh)], axis=-1), axis=-1)
      p_L, p_N = probs[..., :l], probs[..., l:]
    else:
      p_L, p_N = jax.nn.softmax(logits, axis=-1), None
    if mask is not None:
      p_L = p_L * mask
      den = jnp.sum(p_L, axis=-1, keepdims=True) + (
          0.0 if p_N is None else jnp.sum(p_N, axis=-1, keepdims=True)) + eps
      p_L = p_L / den
      p_N = None if p_N is None else p_N / den
    dt = v_BxHxLxD.dtype
    out = precision.einsum("bhl,bhld->bhd", p_L.astype(dt), v_BxHxLxD, jnp.float32)
    if p_N is not None:
      out = out + precision.einsum("bhp,hpd->bhd", p_N.astype(dt), pers_v.astype(dt), jnp.float32)
    return out.astype(jnp.dtype(cfg.dtype)).reshape(b, 1, nh * dh)

  def _fused(self, q, kv, key_pe_DxS, z_H, z_BxMxH, seed, pers_k, pers_v):
    """All heads in one fused-kernel call over the window of kv (keys, values: (B, H, W + M, Dh));
    spans at run time. Returns the heads' outputs as (B, M, D), before the output projection."""
    cfg = self.cfg
    b, nh, m, dh = q.shape
    w, s = kv[0].shape[2] - m, cfg.span
    z = None
    if z_H is not None:
      z = jnp.broadcast_to(z_H[None, :, None], (b, nh, m))
    elif z_BxMxH is not None:
      z = z_BxMxH.transpose(0, 2, 1)
    out = fused_attention.span_attention(
        q, kv[0], kv[1], key_pe_DxS[:, s - w:].astype(q.dtype), z, ramp=cfg.ramp,
        block=cfg.attn_block, pers_k_HxDxN=None if pers_k is None else pers_k.astype(q.dtype),
        pers_v_HxNxD=None if pers_v is None else pers_v.astype(q.dtype),
        dropout_rate=cfg.dropout if seed is not None else 0.0,
        dropout_seed=seed, interpret=cfg.attn_impl == "pallas_interpret")
    return out.astype(jnp.dtype(cfg.dtype)).transpose(0, 2, 1, 3).reshape(b, m, nh * dh)
