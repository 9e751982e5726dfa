"""Fused banded attention with per-head spans as runtime values (Pallas; Triton on GPUs).

The maths of `banded_reference.banded_attention` for one group of heads as a flash-attention
style kernel: scores are formed one (query block, key block) tile at a time and never stored;
each query block visits only the key blocks with a non-zero mask value for one of its rows, and
the spans come in as an array, so a span that changes changes the work done, not the program.
The position term is a rel-shift view of one matmul outside the kernels (read-only, so every
loop pipelines); the backward pass is FlashAttention-2's. Causal or two-sided, with segment ids,
persistent memory, dropout and grouped key/value heads, each behind a static flag, so the causal
unsegmented kernel traces none of it.

Why each choice (tiles and windows, the rel-shift view, segment masking and skipping, head
padding, the normaliser, dropout, GQA): docs/kernels.md, "The GPU kernel's design". Interpret
mode (`interpret=True`) runs the kernels on CPU for tests; names as in kernels/span/fused.py's.
"""
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.span import fused
from span_lm.kernels import hashed_dropout
from span_lm.kernels import pallas_common
from span_lm.kernels.span import span_mask
from span_lm.kernels.span.gpu_tiles import padded_head_dim
from span_lm.kernels import target

plt = target.pallas_triton()  # jax.experimental.pallas.triton

NEG = -1e30
MASKED = -1e30  # G's position score for a key of another segment: its logit is ~ -1e30 / sqrt(Dh)
EMPTY = -1e20  # a row maximum below this saw no key of its own segment (real logits are far above)
# What the kernels compute and how (autotune's cache key): the position term read from G's
# rel-shift view, pipelined loads.
VERSION = "relshift-1"


PRECISIONS = fused.PRECISIONS


_dot = pallas_common.dot  # f32-accumulating (shared with the block-sparse kernel)


def _xla_precision(precision: str, dtype):
  return lax.Precision.HIGHEST if precision == "highest" and dtype == jnp.float32 else None


def _pitched_pe(pe_DxW, dtype):
  """pe with one zero column: G = q @ it has row pitch W + 1 (the rel-shift layout)."""
  return jnp.pad(pe_DxW.astype(dtype), ((0, 0), (0, 1)))


def _band_pe(pe_DxW, pe_ahead_DxA, dtype):
  """[pe | pe_ahead] with one zero column (the causal kernel's: pe and the zero column)."""
  if pe_ahead_DxA is None:
    return _pitched_pe(pe_DxW, dtype)
  return _pitched_pe(jnp.concatenate([pe_DxW.astype(dtype), pe_ahead_DxA.astype(dtype)], -1),
                     dtype)


def position_scores(q_BxHxMxD, pe_Dx1W, precision: str = "default"):
  """G = q @ pe in the rel-shift layout, flat (B, H, M (W + 1)) in the queries' dtype (f32
  accumulation): element i W + t is query i's position score for key t (docs/kernels.md)."""
  b, h, n_rows, _ = q_BxHxMxD.shape
  s_pos = jnp.einsum("bhmd,dw->bhmw", q_BxHxMxD, pe_Dx1W, preferred_element_type=jnp.float32,
                 precision=_xla_precision(precision, q_BxHxMxD.dtype))
  return s_pos.astype(q_BxHxMxD.dtype).reshape(b, h, n_rows * pe_Dx1W.shape[-1])


def _view(i0, t0, *, w, bq, bk):
  """Flat indices of a tile's position scores (rows i0 + r, keys t0 + c) in G's layout: a plain
  tile with row stride w (the band's width, W + A), contiguous along the keys."""
  r = jnp.arange(bq, dtype=jnp.int32)[:, None]
  c = jnp.arange(bk, dtype=jnp.int32)[None, :]
  return (i0 * w + t0) + (r * w + c)


def _row_windows(z, *, w, ramp, bq):
  """Distances each row visits behind (z: spans in tokens, or None for a fixed span): every
  non-zero mask value and the clamp's lower boundary."""
  if z is None:
    return jnp.full((bq,), w, jnp.int32)
  return jnp.clip(span_mask.visited_distances(z, ramp), 1, w)


def _row_windows_ahead(z, *, a, ramp, bq):
  """Distances each row visits ahead (x = a): a <= floor(z) + R, at most A."""
  if z is None:
    return jnp.full((bq,), a, jnp.int32)
  return jnp.clip(span_mask.visited_distances(z, ramp) - 1, 0, a)


class _Rows:
  """Which distances a block's rows visit, by kind of kernel:
  causal (a = 0): win, the windows behind: dist in [1, win];
  two-sided, one span both sides: reach = floor(z) + R per row (None: a fixed span), the bound
    on the mask's x = |dist - 1| on both sides, within the band dist in [1 - A, W]: one row
    vector, and x is what the mask reads anyway;
  two-sided, spans ahead learned apart: win and wa, the windows ahead: dist in [1 - wa, win]."""

  def __init__(self, z, za, *, w, a, ramp, bq, asym):
    self.w, self.a, self.asym = w, a, asym
    self.win = self.wa = self.reach = None
    if not a or asym:
      self.win = _row_windows(z, w=w, ramp=ramp, bq=bq)
    if a and asym:
      self.wa = _row_windows_ahead(za, a=a, ramp=ramp, bq=bq)
    elif a and z is not None:
      self.reach = jnp.clip(span_mask.visited_distances(z, ramp) - 1, 0, max(w, a))

  def visited(self, dist):
    if not self.a:
      return (dist >= 1) & (dist <= self.win[:, None])
    if self.asym:
      return (dist >= 1 - self.wa[:, None]) & (dist <= self.win[:, None])
    inside = (dist >= 1 - self.a) & (dist <= self.w)
    return inside if self.reach is None else inside & (jnp.abs(dist - 1) <= self.reach[:, None])

  def key_blocks(self, i0, *, bq, bk):
    """[first, last + 1) key blocks with a visited key for some row of the query block (row r
    sees keys w + i0 + r - (its window behind) .. w + i0 + r - 1 + (its window ahead))."""
    w = self.w
    if not self.a:
      return _key_blocks(self.win, i0, w=w, bq=bq, bk=bk)
    if self.asym:
      back, ahead = jnp.max(self.win), jnp.max(self.wa)
    elif self.reach is None:
      back, ahead = w, self.a
    else:
      top = jnp.max(self.reach)
      back, ahead = jnp.minimum(top + 1, w), jnp.minimum(top, self.a)
    return lax.div(w + i0 - back, bk), lax.div(w + i0 + bq - 2 + ahead, bk) + 1


def _key_blocks(win, i0, *, w, bq, bk):
  """[first, last + 1) key blocks with a visited key for some row of the causal query block
  (row r sees keys w + i0 + r - win_r .. w + i0 + r - 1)."""
  lo = lax.div(w + i0 - jnp.max(win), bk)
  hi = lax.div(w + i0 + bq - 2, bk) + 1
  return lo, hi


def _load_pos(s_pos_ref, i0, t0, *, w, bq, bk):
  """A tile's position scores, read from G's rel-shift view (w: its row stride)."""
  return s_pos_ref[_view(i0, t0, w=w, bq=bq, bk=bk)]


def _tile(q, k, s_pos, t0, i0, rows, *, w, bq, bk, scale, exact):
  """Scaled logits of one tile (s_pos: its position scores), its signed distances and which entries
  are visited (rows: a `_Rows`)."""
  cont = _dot(q, k, trans_b=True, exact=exact)  # bq x bk
  s_pos = s_pos.astype(jnp.float32)
  r = jnp.arange(bq)[:, None]
  c = jnp.arange(bk)[None, :]
  dist = (w + i0 - t0) + r - c
  visited = rows.visited(dist)
  logits = jnp.where(visited, (cont + s_pos) * scale, NEG)
  return logits, dist, visited


def _tile_dropout(seed, bh, t0, i0, *, bq, bk, n_rows, n_keys, rate):
  rows = i0 + jnp.arange(bq)[:, None]
  keys = t0 + jnp.arange(bk)[None, :]
  return hashed_dropout.dropout_scale(seed, bh, rows, keys, n_rows=n_rows, n_keys=n_keys,
                                      rate=rate)


def _two_sided_ramp(z, za, dist, ramp):
  """The soft mask's argument (before the clamp) of a two-sided tile: behind (dist >= 1) x =
  dist - 1 with the span z, ahead x = 1 - dist with za (None: z); so x = |dist - 1|, read by
  span_mask.ramp as the distance x + 1 (exact in float32)."""
  zz = z[:, None] if za is None else jnp.where(dist >= 1, z[:, None], za[:, None])
  return span_mask.ramp(zz, jnp.abs(dist - 1).astype(jnp.float32) + 1.0, ramp)


def _mask_value(z, dist, ramp, *, two_sided=False, za=None):
  if two_sided:
    return span_mask.clamp01(_two_sided_ramp(z, za, dist, ramp))
  return span_mask.soft_mask(z[:, None], dist, ramp)


def _weights_grad_two_sided(p, dp, delta, z, za, dist, *, renormalised, eps, ramp):
  """fused.weights_grad for a two-sided tile: (dS before the scale, the weights A, the span
  gradient per row behind (both sides when za is None) and ahead (None when za is None))."""
  delta = delta[:, None]
  dp_c = dp - delta
  if z is None:
    return (p * dp_c - eps * p * delta if renormalised else p * dp_c), p, None, None
  u = _two_sided_ramp(z, za, dist, ramp)
  wts = p * span_mask.clamp01(u)
  ds = wts * dp_c - eps * p * delta
  gs = p * dp_c * span_mask.clamp01_slope(u)
  if za is None:
    return ds, wts, jnp.sum(gs, axis=1) / ramp, None
  behind = dist >= 1
  return (ds, wts, jnp.sum(jnp.where(behind, gs, 0.0), axis=1) / ramp,
          jnp.sum(jnp.where(behind, 0.0, gs), axis=1) / ramp)


def _unpack(refs, n_first, asym, n_seg, n_last):
  """A kernel's refs: the first n_first, then the spans ahead (asym), then n_seg segment refs
  (the forward's: the block's query ids, then the tile range; the backward's: the tile range),
  then the last n_last (its outputs)."""
  first, rest = list(refs[:n_first]), list(refs[n_first:])
  last = rest[len(rest) - n_last:]
  rest = rest[:len(rest) - n_last]
  za_ref = rest.pop(0) if asym else None
  return first, za_ref, rest[:n_seg], last


def _fwd_kernel(*refs, w, a, band, ramp, has_mask, asym, segmented, bq, bk, eps, rate, n_heads,
                scale, n_rows, n_pers, exact):
  (q_ref, k_ref, v_ref, s_pos_ref, z_ref, seed_ref, pk_ref, pv_ref), za_ref, seg, outs = _unpack(
      refs, 8, asym, 2 if segmented else 0, 3)
  qseg_ref, range_ref = seg if segmented else (None, None)
  o_ref, m_ref, den_ref = outs
  n_keys = w + n_rows + a + n_pers  # the dropout hash's keys: the T rows, then persistent ones
  i0 = pl.program_id(2) * bq
  bh = pl.program_id(0) * n_heads + pl.program_id(1)  # for the dropout hash
  seed = seed_ref[0]
  q = q_ref[...]
  dh = q.shape[-1]
  z = z_ref[...].astype(jnp.float32) if has_mask else None
  za = za_ref[...].astype(jnp.float32) if asym else None
  rows = _Rows(z, za, w=w, a=a, ramp=ramp, bq=bq, asym=asym)
  lo, hi = rows.key_blocks(i0, bq=bq, bk=bk)
  if segmented:  # the key tiles whose segments meet the block's
    lo, hi = jnp.maximum(lo, range_ref[0]), jnp.minimum(hi, range_ref[1])
  view = functools.partial(_load_pos, s_pos_ref, i0, w=band, bq=bq, bk=bk)

  def body(kb, carry):
    acc, m, l_all, l_mask, s_pos = carry
    t0 = kb * bk
    k = k_ref[pl.ds(t0, bk), :]
    v = v_ref[pl.ds(t0, bk), :]
    nxt = view(jnp.minimum(kb + 1, hi - 1) * bk)  # the next tile's, issued a tile ahead
    logits, dist, visited = _tile(q, k, s_pos, t0, i0, rows, w=w, bq=bq, bk=bk, scale=scale,
                                  exact=exact)
    m_new, corr, p = fused.online_softmax(m, logits, visited, keepdims=False)
    pm = p * _mask_value(z, dist, ramp, two_sided=bool(a), za=za) if has_mask else p
    kept = pm
    if rate:
      kept = pm * _tile_dropout(seed, bh, t0, i0, bq=bq, bk=bk, n_rows=n_rows,
                                n_keys=n_keys, rate=rate)
    acc = acc * corr[:, None] + _dot(kept.astype(v.dtype), v, exact=exact)
    return (acc, m_new, l_all * corr + jnp.sum(p, axis=1), l_mask * corr + jnp.sum(pm, axis=1),
            nxt)

  def pers_body(c, carry):  # persistent keys: no position term, mask 1, in the same softmax
    acc, m, l_all, l_mask = carry
    n0 = c * bk
    logits = _dot(q, pk_ref[:, pl.ds(n0, bk)], exact=exact) * scale
    m_new, corr, p = fused.online_softmax(m, logits, keepdims=False)
    kept = p
    if rate:  # persistent key n is key T + n of the dropout hash
      kept = p * _tile_dropout(seed, bh, w + n_rows + a + n0, i0, bq=bq, bk=bk, n_rows=n_rows,
                               n_keys=n_keys, rate=rate)
    pv = pv_ref[pl.ds(n0, bk), :]
    acc = acc * corr[:, None] + _dot(kept.astype(pv.dtype), pv, exact=exact)
    l_tile = jnp.sum(p, axis=1)
    return acc, m_new, l_all * corr + l_tile, l_mask * corr + l_tile

  init = (jnp.zeros((bq, dh), jnp.float32), jnp.full((bq,), NEG, jnp.float32),
          jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32))
  carry = lax.fori_loop(lo, hi, body, (*init, view(lo * bk)))[:4]
  acc, m, l_all, l_mask = lax.fori_loop(0, n_pers // bk, pers_body, carry)
  den = span_mask.online_denominator(l_mask, l_all, eps) if has_mask else l_all
  if segmented:
    # A query of segment 0, or one that saw no key of its segment (nor a persistent vector),
    # gives 0, with a normaliser of 1 and a maximum no logit reaches: the backward pass's
    # exp(S - m) / den is 0 on every key of its row, persistent ones included.
    live = (qseg_ref[...] != 0) & ~(m < EMPTY)  # (a NaN row stays NaN)
    den = jnp.where(live, den, 1.0)
    acc = jnp.where(live[:, None], acc, 0.0)
    m = jnp.where(live, m, -NEG)
  o_ref[...] = (acc / den[:, None]).astype(o_ref.dtype)
  m_ref[...] = m
  den_ref[...] = den


def _tile_grads(q, do, k, v, s_pos, t0, i0, rows, z, m, den, delta, seed, bh, *,
                w, a, ramp, has_mask, bq, bk, eps, rate, n_rows, n_keys, scale, exact, za=None):
  """Recomputes one tile and returns (ds: d (q.k + q.pe), the weights as applied to the
  values, the tile's span gradient per row (behind, and ahead when learned apart, else None),
  which entries are visited)."""
  logits, dist, visited = _tile(q, k, s_pos, t0, i0, rows, w=w, bq=bq, bk=bk, scale=scale,
                                exact=exact)
  p = jnp.where(visited, jnp.exp(logits - m[:, None]), 0.0) / den[:, None]
  dp = _dot(do, v, trans_b=True, exact=exact)
  keep = None
  if rate:  # out = sum_j a_j keep_j v_j: the weights' gradient is keep_j (do . v_j)
    keep = _tile_dropout(seed, bh, t0, i0, bq=bq, bk=bk, n_rows=n_rows, n_keys=n_keys,
                         rate=rate)
    dp = dp * keep
  dza = None
  if a:
    ds_unscaled, wts, dz, dza = _weights_grad_two_sided(
        p, dp, delta, z if has_mask else None, za, dist, renormalised=has_mask, eps=eps,
        ramp=ramp)
  else:
    ds_unscaled, wts, dz = fused.weights_grad(p, dp, delta, z, dist, renormalised=has_mask,
                                              eps=eps, ramp=ramp, keepdims=False)
  kept = wts if keep is None else wts * keep
  return ds_unscaled * scale, kept, dz, dza, visited


def _bwd_q_kernel(*refs, w, a, band, ramp, has_mask, asym, segmented, bq, bk, eps, rate,
                  n_heads, scale, n_rows, n_pers, exact):
  """Per query block: dq's key term, the span gradient of its rows, the position-score
  gradient of its rows (stored once per visited cell; the buffer comes in zeroed), and
  (atomically) the persistent keys' and values' gradients."""
  ins, za_ref, seg, outs = _unpack(refs, 15, asym, 1 if segmented else 0, 6 if asym else 5)
  (q_ref, k_ref, v_ref, s_pos_ref, z_ref, seed_ref, pk_ref, pv_ref, do_ref, m_ref, den_ref,
   delta_ref, _, _, _) = ins  # zeros, aliased to ds_pos_ref, dpk_ref, dpv_ref: never read
  dq_ref, dz_ref, ds_pos_ref, dpk_ref, dpv_ref = outs[:5]
  dza_ref = outs[5] if asym else None
  n_keys = w + n_rows + a + n_pers
  i0 = pl.program_id(2) * bq
  bh = pl.program_id(0) * n_heads + pl.program_id(1)  # for the dropout hash
  seed = seed_ref[0]
  q = q_ref[...]
  do = do_ref[...]
  dh = q.shape[-1]
  z = z_ref[...].astype(jnp.float32) if has_mask else None
  za = za_ref[...].astype(jnp.float32) if asym else None
  rows = _Rows(z, za, w=w, a=a, ramp=ramp, bq=bq, asym=asym)
  m, den, delta = m_ref[...], den_ref[...], delta_ref[...]
  lo, hi = rows.key_blocks(i0, bq=bq, bk=bk)
  if segmented:  # the key tiles whose segments meet the block's
    lo, hi = jnp.maximum(lo, seg[0][0]), jnp.minimum(hi, seg[0][1])
  view = functools.partial(_load_pos, s_pos_ref, i0, w=band, bq=bq, bk=bk)

  def body(kb, carry):
    dq, dz, dza, s_pos = carry
    t0 = kb * bk
    k = k_ref[pl.ds(t0, bk), :]
    nxt = view(jnp.minimum(kb + 1, hi - 1) * bk)  # the next tile's, issued a tile ahead
    ds, _, dz_tile, dza_tile, visited = _tile_grads(
        q, do, k, v_ref[pl.ds(t0, bk), :], s_pos, t0, i0, rows, z, m, den, delta, seed, bh,
        w=w, a=a, ramp=ramp, has_mask=has_mask, bq=bq, bk=bk, eps=eps, rate=rate,
        n_rows=n_rows, n_keys=n_keys, scale=scale, exact=exact, za=za)
    if dz_tile is not None:
      dz = dz + dz_tile
    if dza_tile is not None:
      dza = dza + dza_tile
    plt.store(ds_pos_ref.at[_view(i0, t0, w=band, bq=bq, bk=bk)], ds.astype(ds_pos_ref.dtype),
              mask=visited)
    return dq + _dot(ds.astype(k.dtype), k, exact=exact), dz, dza, nxt

  def pers_body(c, dq):  # the persistent keys: mask 1, so no span gradient
    n0 = c * bk
    pk = pk_ref[:, pl.ds(n0, bk)]
    pv = pv_ref[pl.ds(n0, bk), :]
    # (a query of segment 0 has m = -NEG, from the forward pass: p = 0)
    p = jnp.exp(_dot(q, pk, exact=exact) * scale - m[:, None]) / den[:, None]
    dp = _dot(do, pv, trans_b=True, exact=exact)
    kept = p
    if rate:
      keep = _tile_dropout(seed, bh, w + n_rows + a + n0, i0, bq=bq, bk=bk, n_rows=n_rows,
                           n_keys=n_keys, rate=rate)
      dp, kept = dp * keep, p * keep
    ds_unscaled, _, _ = fused.weights_grad(p, dp, delta, renormalised=has_mask, eps=eps, ramp=ramp,
                                  keepdims=False)
    ds = ds_unscaled * scale
    plt.atomic_add(dpk_ref, (slice(None), pl.ds(n0, bk)),
                   _dot(q, ds.astype(q.dtype), trans_a=True, exact=exact))
    plt.atomic_add(dpv_ref, (pl.ds(n0, bk), slice(None)),
                   _dot(kept.astype(do.dtype), do, trans_a=True, exact=exact))
    return dq + _dot(ds.astype(pk.dtype), pk, trans_b=True, exact=exact)

  dq, dz, dza, _ = lax.fori_loop(lo, hi, body, (
      jnp.zeros((bq, dh), jnp.float32), jnp.zeros((bq,), jnp.float32),
      jnp.zeros((bq,), jnp.float32) if asym else None, view(lo * bk)))
  dq = lax.fori_loop(0, n_pers // bk, pers_body, dq)
  dq_ref[...] = dq
  dz_ref[...] = dz
  if asym:
    dza_ref[...] = dza


def _bwd_kv_kernel(*refs, w, a, band, ramp, has_mask, asym, segmented, bq, bk, eps, rate,
                   n_heads, n_rows, n_pers, scale, exact, group=1):
  """Per key block: dk and dv, summed over the query blocks that see it (no atomics, so the
  key and value gradients are deterministic). Grouped heads (group > 1): the program's key/value
  head serves `group` query heads, whose rows (queries, output gradients, row statistics, G's
  view) come as one run of group * n_rows rows; dk and dv sum over all of them in registers."""
  ins, za_ref, seg, outs = _unpack(refs, 11, asym, 1 if segmented else 0, 2)
  (q_ref, k_ref, v_ref, s_pos_ref, z_ref, seed_ref, do_ref, m_ref, den_ref, delta_ref,
   wmax_ref) = ins
  dk_ref, dv_ref = outs
  n_keys = w + n_rows + a + n_pers
  t0 = pl.program_id(2) * bk
  bh = pl.program_id(0) * n_heads + (pl.program_id(1) if group == 1 else pl.program_id(1) * group)
  seed = seed_ref[0]
  k = k_ref[...]
  v = v_ref[...]
  dh = k.shape[-1]
  # Rows i see key t at distance w + i - t in [1 - wa_i, w_i], w_i <= wmax, wa_i <= wamax:
  # i in [t0 - w + 1 - wamax, t0 + bk - 1 - w + wmax].
  wmax = wmax_ref[0] if has_mask else w
  first, last = t0 - w + 1, t0 + bk - 1 - w + wmax
  if a:
    first = first - (wmax_ref[1] if has_mask else a)
  lo = lax.div(jnp.maximum(first, 0), bq)
  hi = jnp.where(last < 0, 0, lax.div(jnp.minimum(last, n_rows - 1), bq) + 1)
  if segmented:  # the query tiles whose segments meet the key tile's
    lo, hi = jnp.maximum(lo, seg[0][0]), jnp.minimum(hi, seg[0][1])

  def body(qb, carry, g=None):
    dk, dv = carry
    i0 = qb * bq
    # grouped heads: query head g's rows start at g * n_rows, its view of G at g * n_rows * (band
    # + 1); i0 stays the row within the head (distances, the dropout hash)
    rows = pl.ds(i0, bq) if g is None else pl.ds(g * n_rows + i0, bq)
    q = q_ref[rows, :]
    do = do_ref[rows, :]
    z = z_ref[rows].astype(jnp.float32) if has_mask else None
    za = za_ref[rows].astype(jnp.float32) if asym else None
    seen = _Rows(z, za, w=w, a=a, ramp=ramp, bq=bq, asym=asym)
    if g is None:
      s_pos = _load_pos(s_pos_ref, i0, t0, w=band, bq=bq, bk=bk)  # pipelined by Triton: a cp.async
    else:
      s_pos = s_pos_ref[g * (n_rows * (band + 1)) + _view(i0, t0, w=band, bq=bq, bk=bk)]
    ds, kept, _, _, _ = _tile_grads(
        q, do, k, v, s_pos, t0, i0, seen, z, m_ref[rows], den_ref[rows], delta_ref[rows],
        seed, bh if g is None else bh + g, w=w, a=a, ramp=ramp, has_mask=has_mask, bq=bq, bk=bk,
        eps=eps, rate=rate, n_rows=n_rows, n_keys=n_keys, scale=scale, exact=exact, za=za)
    dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True, exact=exact)
    dv = dv + _dot(kept.astype(do.dtype), do, trans_a=True, exact=exact)
    return dk, dv

  zeros = (jnp.zeros((bk, dh), jnp.float32), jnp.zeros((bk, dh), jnp.float32))
  if group == 1:
    dk, dv = lax.fori_loop(lo, hi, body, zeros)
  else:  # the query heads of the group in turn, each over the query blocks that see the keys
    dk, dv = lax.fori_loop(
        0, group, lambda g, c: lax.fori_loop(lo, hi, functools.partial(body, g=g), c), zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(n_rows, n_key_rows, dh, w, bq, group=1):
  """BlockSpecs over the grid (batch, head, query block): a block of rows, every key, a block's
  row statistics, G's flat view (whole; w: the band's width), the seed. Grouped heads: query
  head hh reads key/value head hh // group (the index map: no copy)."""
  row = pl.BlockSpec((None, None, bq, dh), lambda i, hh, qi: (i, hh, qi, 0))
  keys = pl.BlockSpec((None, None, n_key_rows, dh), lambda i, hh, qi: (i, hh, 0, 0)) if (
      group == 1) else pl.BlockSpec((None, None, n_key_rows, dh),
                                    lambda i, hh, qi: (i, lax.div(hh, group), 0, 0))
  stat = pl.BlockSpec((None, None, bq), lambda i, hh, qi: (i, hh, qi))
  view = pl.BlockSpec((None, None, n_rows * (w + 1)), lambda i, hh, qi: (i, hh, 0))
  seed = pl.BlockSpec((1,), lambda i, hh, qi: (0,))
  return row, keys, stat, view, seed


_RANGE = pl.BlockSpec((None, None, 2), lambda i, hh, x: (i, x, 0))  # a tile's range of tiles


def masked_position_scores(q_BxHxMxD, pe_Dx1W, q_seg_BxM, kv_seg_BxT,
                           precision: str = "default"):
  """position_scores, with MASKED where the key is of another segment than the query's (or
  padding: id 0): G's cell (i, s) is key row i + s, so it reads the key ids as a band of the
  rows (T = M + the band's width). Without segment ids: position_scores."""
  if q_seg_BxM is None:
    return position_scores(q_BxHxMxD, pe_Dx1W, precision)
  b, h, n_rows, _ = q_BxHxMxD.shape
  n = pe_Dx1W.shape[-1]  # the band's width + its zero column
  s_pos = jnp.einsum("bhmd,dw->bhmw", q_BxHxMxD, pe_Dx1W, preferred_element_type=jnp.float32,
                 precision=_xla_precision(precision, q_BxHxMxD.dtype))
  rows = (lax.broadcasted_iota(jnp.int32, (n_rows, n), 0)
          + lax.broadcasted_iota(jnp.int32, (n_rows, n), 1))
  kv_band = jnp.take(kv_seg_BxT, rows, axis=1, mode="clip")  # B M n (the last column: padding)
  same = (kv_band == q_seg_BxM[:, :, None]) & (kv_band != 0)
  s_pos = jnp.where(same[:, None], s_pos.astype(q_BxHxMxD.dtype),
                jnp.asarray(MASKED, q_BxHxMxD.dtype))
  return s_pos.reshape(b, h, n_rows * n)


def segment_tile_ranges(q_seg_BxM, kv_seg_BxT, bq: int, bk: int):
  """(key tiles per query tile, query tiles per key tile): int32 (B, M / bq, 2) and
  (B, T / bk, 2), [first, last + 1) of the tiles whose range of non-zero segment ids meets the
  tile's own ([0, 0) when none does). Tiles outside the range hold no pair of equal non-zero ids,
  so the kernels skip them; tiles inside it are masked entry by entry."""
  b, n_rows = q_seg_BxM.shape
  n_key_rows = kv_seg_BxT.shape[1]
  top, bottom = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min

  def bounds(ids, tile):
    x = ids.astype(jnp.int32).reshape(b, -1, tile)
    return (jnp.min(jnp.where(x != 0, x, top), axis=-1),
            jnp.max(jnp.where(x != 0, x, bottom), axis=-1))

  q_lo, q_hi = bounds(q_seg_BxM, bq)  # (B, nq)
  k_lo, k_hi = bounds(kv_seg_BxT, bk)  # (B, nk)
  meet = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])

  def first_last(x):  # x (B, n, n'): [first, last + 1) along the last axis, [0, 0) if none
    n = x.shape[-1]
    some = jnp.any(x, axis=-1)
    first = jnp.argmax(x, axis=-1)
    last = n - jnp.argmax(x[..., ::-1], axis=-1)
    return jnp.stack([jnp.where(some, first, 0), jnp.where(some, last, 0)],
                     axis=-1).astype(jnp.int32)

  return first_last(meet), first_last(jnp.swapaxes(meet, 1, 2))


def _check(q, k, pe, block, block_k, a_rows=0):
  b, h, n_rows, dh = q.shape
  w = pe.shape[-1]
  if k.shape[1] < 1 or h % k.shape[1] or k.shape != (b, k.shape[1], w + n_rows + a_rows, dh):
    raise ValueError(f"fused attention: keys {k.shape} for queries {q.shape}, window {w} and "
                     f"{a_rows} rows ahead")
  if n_rows % block or w % block or n_rows % block_k or w % block_k:
    raise ValueError(f"fused attention: block {n_rows} and window {w} must be multiples of the "
                     f"tiles {block} and {block_k}")
  if dh < 16 or dh & (dh - 1):
    raise ValueError(f"fused attention: padded head size {dh} must be a power of two >= 16")


def _pers_inputs(pk, pv, h, dh, block, dtype):
  """(keys (H, Dh, N), values (H, N, Dh), N, their BlockSpecs); placeholders when N = 0, in the
  queries' dtype: their loop never runs, but Triton still types its dots (bf16 x f32 is refused)."""
  n = 0 if pk is None else pk.shape[-1]
  if pk is None:
    pk, pv = jnp.zeros((h, dh, block), dtype), jnp.zeros((h, block, dh), dtype)
  pk, pv = pk.astype(dtype), pv.astype(dtype)  # float32 parameters: their gradients stay float32
  width = pk.shape[-1]
  specs = (pl.BlockSpec((None, dh, width), lambda i, hh, x: (hh, 0, 0)),
           pl.BlockSpec((None, width, dh), lambda i, hh, x: (hh, 0, 0)))
  return pk, pv, n, specs


class _Static(NamedTuple):
  """A call's static facts: one hashable argument of the custom_vjp (its nondiff argument)."""
  ramp: int
  eps: float
  bq: int  # the query tile (span_attention's block)
  bk: int  # the key tile (block_k)
  interpret: bool
  num_warps: int
  num_stages: int
  rate: float  # attention dropout
  scale: float
  precision: str
  a: int  # the window ahead A (0: causal)


def _layout(q, pe, pe_a, z, z_a, q_seg, ahead):
  """The static facts a call's kernels are traced with."""
  w = pe.shape[-1]
  a_rows = 0 if pe_a is None else pe_a.shape[-1]  # A rounded up to the key tile
  return dict(w=w, a=ahead, band=w + a_rows, has_mask=z is not None,
              asym=z is not None and z_a is not None and ahead > 0, segmented=q_seg is not None,
              n_rows=q.shape[2])


def _forward(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, s: _Static):
  lay = _layout(q, pe, pe_a, z, z_a, q_seg, s.a)
  band = lay["band"]
  _check(q, k, pe, s.bq, s.bk, band - lay["w"])
  b, h, n_rows, dh = q.shape
  n_key_rows = k.shape[2]
  z_in = z if lay["has_mask"] else jnp.zeros((b, h, n_rows), jnp.float32)
  pk_in, pv_in, n_pers, pers_specs = _pers_inputs(pk, pv, h, dh, s.bk, q.dtype)
  row, keys, stat, view, seed_spec = _specs(n_rows, n_key_rows, dh, band, s.bq,
                                            h // k.shape[1])
  extra_specs, extra = [], []
  if lay["asym"]:
    extra_specs.append(stat)
    extra.append(z_a)
  if lay["segmented"]:
    extra_specs += [pl.BlockSpec((None, s.bq), lambda i, hh, qi: (i, qi)), _RANGE]
    extra += [q_seg, segment_tile_ranges(q_seg, kv_seg, s.bq, s.bk)[0]]
  kernel = functools.partial(_fwd_kernel, **lay, ramp=s.ramp, bq=s.bq, bk=s.bk, eps=s.eps,
                             rate=s.rate, n_heads=h, n_pers=n_pers, scale=s.scale,
                             exact=s.precision == "highest")
  call = pl.pallas_call(
      kernel, grid=(b, h, n_rows // s.bq),
      in_specs=[row, keys, keys, view, stat, seed_spec, *pers_specs, *extra_specs],
      out_specs=[row, stat, stat],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, n_rows), jnp.float32)],
      interpret=s.interpret, name="span_attention_fwd",
      compiler_params=plt.CompilerParams(num_warps=s.num_warps, num_stages=s.num_stages))
  s_pos = masked_position_scores(q, _band_pe(pe, pe_a, q.dtype), q_seg, kv_seg, s.precision)
  out, m, den = call(q, k, v, s_pos, z_in, seed, pk_in, pv_in, *extra)
  return out, m, den


def _bwd_q_extras(z_a, q_seg, kv_seg, stat, asym: bool, segmented: bool, s: _Static):
  """The dq kernel's optional inputs (spans ahead, query tiles' segment ranges) and their specs;
  with the key tiles' ranges for the dk/dv kernel: (k_ranges, extra_specs, extra)."""
  q_ranges = k_ranges = None
  if segmented:
    q_ranges, k_ranges = segment_tile_ranges(q_seg, kv_seg, s.bq, s.bk)
  extra_specs, extra = [], []
  if asym:
    extra_specs.append(stat)
    extra.append(z_a)
  if segmented:
    extra_specs.append(_RANGE)
    extra.append(q_ranges)
  return k_ranges, extra_specs, extra


def _bwd_kv(q, k, v, s_pos, z_in, z_a, seed, do, m, den, delta, k_ranges, lay, static, params,
            seed_spec, view, s: _Static):
  """dk, dv: one program per key block, over every query row of its (batch, key/value head)."""
  b, h, n_rows, dh = q.shape
  n_key_rows = k.shape[2]
  group = h // k.shape[1]
  w, band, asym, segmented = lay["w"], lay["band"], lay["asym"], lay["segmented"]
  # Per key block: every row of its (b, h), and the largest row windows there (behind, ahead).
  # Grouped heads: per key/value head, the rows of its group's query heads as one run (a free
  # reshape of (B, H, M, ...) to (B, H_kv, group M, ...)), so dk and dv sum over the group in
  # the kernel, not as group-times larger partials summed by XLA.
  grouped = (lambda x: x) if group == 1 else (
      lambda x: x.reshape(b, h // group, group * x.shape[2], *x.shape[3:]))
  g_rows = group * n_rows
  all_rows = pl.BlockSpec((None, None, g_rows, dh), lambda i, hh, kb: (i, hh, 0, 0))
  all_stat = pl.BlockSpec((None, None, g_rows), lambda i, hh, kb: (i, hh, 0))
  key_blk = pl.BlockSpec((None, None, s.bk, dh), lambda i, hh, kb: (i, hh, kb, 0))
  n_win = 2 if lay["a"] else 1
  wmax_spec = pl.BlockSpec((None, None, n_win), lambda i, hh, kb: (i, hh, 0))
  wmax = _row_windows(jnp.max(grouped(z_in), axis=-1, keepdims=True), w=w, ramp=s.ramp, bq=1)
  if lay["a"]:
    za_max = jnp.max(grouped(z_a if asym else z_in), axis=-1, keepdims=True)
    wmax = jnp.concatenate([wmax, _row_windows_ahead(za_max, a=lay["a"], ramp=s.ramp, bq=1)], -1)
  kv_extra_specs, kv_extra = [], []
  if asym:
    kv_extra_specs.append(all_stat)
    kv_extra.append(grouped(z_a))
  if segmented:
    kv_extra_specs.append(_RANGE)
    kv_extra.append(k_ranges)
  kv_static = static if group == 1 else dict(static, group=group)
  kv_view = view if group == 1 else pl.BlockSpec((None, None, g_rows * (band + 1)),
                                                 lambda i, hh, kb: (i, hh, 0))
  call_kv = pl.pallas_call(
      functools.partial(_bwd_kv_kernel, **kv_static), grid=(b, h // group, n_key_rows // s.bk),
      in_specs=[all_rows, key_blk, key_blk, kv_view, all_stat, seed_spec, all_rows, all_stat,
                all_stat, all_stat, wmax_spec, *kv_extra_specs],
      out_specs=[key_blk, key_blk],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=s.interpret, name="span_attention_bwd_kv", compiler_params=params)
  dk, dv = call_kv(grouped(q), k, v, grouped(s_pos), grouped(z_in), seed, grouped(do),
                   grouped(m), grouped(den), grouped(delta), wmax, *kv_extra)
  return dk, dv


def _position_grads(q, pe, pe_a, pe1, ds_pos, dq, dk, dv, w: int, band: int, s: _Static):
  """The position term's share of dq and d pe (d pe ahead), and the barrier that has d pe done
  when dq, dk and dv are: (dq, dk, dv, dpe, dpe_a)."""
  b, h, n_rows, _ = q.shape
  # The position term's share, two plain matmuls over G's layout (its pad column is zero).
  prec = _xla_precision(s.precision, q.dtype)
  ds_pos = ds_pos.reshape(b, h, n_rows, band + 1)
  dq = dq + jnp.einsum("bhmw,dw->bhmd", ds_pos, pe1, preferred_element_type=jnp.float32,
                       precision=prec)
  dpe_all = jnp.einsum("bhmd,bhmw->dw", q, ds_pos, preferred_element_type=jnp.float32,
                       precision=prec)
  dpe = dpe_all[:, :w].astype(pe.dtype)
  # d pe is not needed until the optimizer step: without the barrier XLA computes it late and
  # every layer's dG stays alive until then. With it, d pe is done when dq, dk and dv are.
  dpe_a = None
  if pe_a is None:
    dq, dk, dv, dpe = lax.optimization_barrier((dq, dk, dv, dpe))
  else:
    dpe_a = dpe_all[:, w:band].astype(pe_a.dtype)
    dq, dk, dv, dpe, dpe_a = lax.optimization_barrier((dq, dk, dv, dpe, dpe_a))
  return dq, dk, dv, dpe, dpe_a


def _backward(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, out, m, den, do,
              s: _Static):
  lay = _layout(q, pe, pe_a, z, z_a, q_seg, s.a)
  w, band, has_mask, asym, segmented = (lay[f] for f in ("w", "band", "has_mask", "asym",
                                                         "segmented"))
  b, h, n_rows, dh = q.shape
  n_key_rows = k.shape[2]
  z_in = z if has_mask else jnp.zeros((b, h, n_rows), jnp.float32)
  # G is recomputed here, not saved: the barrier ties its inputs and its gradient's zeroed
  # buffer to this layer's cotangent, so XLA neither merges the recomputation with the forward's
  # G (which would keep every layer's G alive until its backward) nor hoists it (or the zeros)
  # ahead of the layer's own backward pass.
  if pe_a is None:
    q, pe, do, zero = lax.optimization_barrier((q, pe, do, jnp.zeros((), q.dtype)))
  else:
    q, pe, pe_a, do, zero = lax.optimization_barrier((q, pe, pe_a, do, jnp.zeros((), q.dtype)))
  # after the barrier: not hoisted
  zeros_ds_pos = jnp.broadcast_to(zero, (b, h, n_rows * (band + 1)))
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  pe1 = _band_pe(pe, pe_a, q.dtype)  # pe may be float32: d pe is returned as such
  s_pos = masked_position_scores(q, pe1, q_seg, kv_seg, s.precision)
  group = h // k.shape[1]
  row, keys, stat, view, seed_spec = _specs(n_rows, n_key_rows, dh, band, s.bq, group)
  pk_in, pv_in, n_pers, pers_specs = _pers_inputs(pk, pv, h, dh, s.bk, q.dtype)
  static = dict(lay, ramp=s.ramp, bq=s.bq, bk=s.bk, eps=s.eps, rate=s.rate, n_heads=h,
                n_pers=n_pers, scale=s.scale, exact=s.precision == "highest")
  params = plt.CompilerParams(num_warps=s.num_warps, num_stages=s.num_stages)
  zeros_pk, zeros_pv = jnp.zeros(pk_in.shape, jnp.float32), jnp.zeros(pv_in.shape, jnp.float32)
  k_ranges, extra_specs, extra = _bwd_q_extras(z_a, q_seg, kv_seg, stat, asym, segmented, s)
  stat_shape = jax.ShapeDtypeStruct((b, h, n_rows), jnp.float32)
  call_q = pl.pallas_call(
      functools.partial(_bwd_q_kernel, **static), grid=(b, h, n_rows // s.bq),
      in_specs=[row, keys, keys, view, stat, seed_spec, *pers_specs, row, stat, stat, stat,
                view, *pers_specs, *extra_specs],
      out_specs=[row, stat, view, *pers_specs] + ([stat] if asym else []),
      out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), stat_shape,
                 jax.ShapeDtypeStruct(s_pos.shape, s_pos.dtype),
                 jax.ShapeDtypeStruct(zeros_pk.shape, jnp.float32),
                 jax.ShapeDtypeStruct(zeros_pv.shape, jnp.float32)]
                + ([stat_shape] if asym else []),
      input_output_aliases={12: 2, 13: 3, 14: 4}, interpret=s.interpret,
      name="span_attention_bwd_q", compiler_params=params)
  dq, dz, ds_pos, dpk, dpv, *dza = call_q(q, k, v, s_pos, z_in, seed, pk_in, pv_in, do, m, den,
                                          delta, zeros_ds_pos, zeros_pk, zeros_pv, *extra)

  dk, dv = _bwd_kv(q, k, v, s_pos, z_in, z_a, seed, do, m, den, delta, k_ranges, lay, static,
                   params, seed_spec, view, s)
  dq, dk, dv, dpe, dpe_a = _position_grads(q, pe, pe_a, pe1, ds_pos, dq, dk, dv, w, band, s)
  dseed = np.zeros(seed.shape, jax.dtypes.float0)
  dpk = None if pk is None else dpk.astype(pk.dtype)
  dpv = None if pv is None else dpv.astype(pv.dtype)
  return (dq.astype(q.dtype), dk, dv, dpe, (dz if has_mask else None), dseed, dpk, dpv, dpe_a,
          (dza[0] if asym else None), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def _span_attention(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, s: _Static):
  return _forward(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, s)[0]


def _span_attention_fwd(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, s: _Static):
  out, m, den = _forward(q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, s)
  return out, (q, k, v, pe, z, seed, pk, pv, pe_a, z_a, q_seg, kv_seg, out, m, den)


def _span_attention_bwd(s: _Static, res, do):
  return _backward(*res, do, s)


_span_attention.defvjp(_span_attention_fwd, _span_attention_bwd)


def _check_call(num_stages: int, pers_k_HxDxN, pers_v_HxNxD, dropout_rate, dropout_seed,
                precision: str, block_k: int, q_segments_BxM, kv_segments_BxT):
  """`span_attention`'s argument checks that need no shapes of the keys."""
  if num_stages < 1:
    raise ValueError(f"fused attention: num_stages={num_stages}: Triton's pipeline depth is >= 1")
  fused.check_inputs(pers_k_HxDxN, pers_v_HxNxD, dropout_rate, dropout_seed, precision)
  if pers_k_HxDxN is not None and pers_k_HxDxN.shape[-1] % block_k:
    raise ValueError(f"fused attention: {pers_k_HxDxN.shape[-1]} persistent vectors must be a "
                     f"multiple of {block_k}")
  if (q_segments_BxM is None) != (kv_segments_BxT is None):
    raise ValueError("fused attention: segment ids of the queries and of the keys come together")


def _pad_ahead(k, v, pe_a, q_segments_BxM, kv_segments_BxT, b: int, n_rows: int, w: int, a: int,
               block_k: int):
  """The rows ahead (keys, values, pe_a's columns, key segment ids) zero-padded to whole key
  tiles, and the segment ids as int32 (checked): (k, v, pe_a, q_seg, kv_seg)."""
  kv_seg = kv_segments_BxT
  a_rows = -(-a // block_k) * block_k  # rows ahead in whole key tiles, zero-padded
  if a_rows > a:
    rows = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, a_rows - a), (0, 0)))
    k, v = rows(k), rows(v)
    pe_a = jnp.pad(pe_a, ((0, 0), (0, a_rows - a)))
    if kv_seg is not None:
      kv_seg = jnp.pad(kv_seg, ((0, 0), (0, a_rows - a)))
  q_seg = None
  if kv_seg is not None:
    q_seg, kv_seg = (jnp.asarray(x, jnp.int32) for x in (q_segments_BxM, kv_seg))
    if q_seg.shape != (b, n_rows) or kv_seg.shape != (b, k.shape[2]):
      raise ValueError(f"fused attention: segment ids {q_seg.shape} and "
                       f"{kv_segments_BxT.shape} for {n_rows} queries and {w + n_rows + a} key "
                       f"rows")
  return k, v, pe_a, q_seg, kv_seg


def span_attention(q_BxHxMxD, k_BxHxTxD, v_BxHxTxD, key_pe_DxW, z_BxHxM=None, *, ramp: int = 32,
                   pers_k_HxDxN=None, pers_v_HxNxD=None, eps: float = span_mask.EPS,
                   block: int = 64, block_k: int | None = None,
                   dropout_rate: float = 0.0, dropout_seed=None, interpret: bool = False,
                   num_warps: int = 4, num_stages: int = 2, precision: str = "default",
                   key_pe_ahead_DxA=None, z_ahead_BxHxM=None, q_segments_BxM=None,
                   kv_segments_BxT=None):
  """Banded attention over the W distances before each query (and the A after), spans given at
  run time.

  Args:
    q_BxHxMxD: queries. k/v_BxHxTxD: keys/values of the T = W + M + A rows (window, block, rows
      ahead): query i is row W + i, distance d behind is row W + i - d, distance a ahead is row
      W + i + a - 1. Grouped heads: (B, H_kv, T, Dh), H_kv dividing H; query head h reads
      key/value head h // (H / H_kv) through the kernels' index maps (no repeated copy), and the
      dk/dv kernel runs per key/value head, summing its group's query heads in registers.
    key_pe_DxW: relative position embeddings, column W - d for distance d. key_pe_ahead_DxA:
      those ahead, column a - 1 for distance a (None: causal, A = 0). A may be any size: the
      kernels pad it to whole key tiles.
    z_BxHxM: span in tokens per query row (broadcast an adaptive span (H,) to it), or None for a
      fixed span (no mask). Differentiable. z_ahead_BxHxM: the spans ahead where they are learned
      apart (None: z_BxHxM on both sides; ignored with a fixed span, as the reference does).
    q_segments_BxM, kv_segments_BxT: segment ids (int) of the queries and of the T rows, or None:
      a query attends only keys of its own non-zero segment; a query of segment 0 gives zeros.
    ramp: R of the soft mask. block: the query tile (divides M and W); block_k: the key tile
      (divides M, W and N; default: block).
    pers_k_HxDxN, pers_v_HxNxD: persistent memory (already scaled), in the same softmax with
      mask 1; or None.
    dropout_rate, dropout_seed: dropout on the attention weights (after the mask), the keep
      mask drawn by `hashed_dropout.dropout_scale` from a uint32 seed (key t: row t of the T
      rows; persistent vector n: key T + n); a rate of 0 compiles no dropout.
    num_stages: Triton's pipeline depth (2 or more: the loops' loads become asynchronous
      copies issued ahead of the tile that needs them).
    precision: float32 dots: 'default' (TF32 tensor cores on sm_80+, XLA's own default for
      float32 matmuls) or 'highest' (exact float32, no tensor cores). bf16 is unaffected.
  Returns:
    (B, H, M, Dh) in the dtype of q.
  """
  block_k = block_k or block
  _check_call(num_stages, pers_k_HxDxN, pers_v_HxNxD, dropout_rate, dropout_seed, precision,
              block_k, q_segments_BxM, kv_segments_BxT)
  pe_a, z_a = key_pe_ahead_DxA, z_ahead_BxHxM
  if pe_a is not None and pe_a.shape[-1] == 0:
    pe_a = None
  a = 0 if pe_a is None else pe_a.shape[-1]
  if z_BxHxM is None or not a:
    z_a = None  # a fixed span has no spans ahead (the reference ignores them too)
  dh = q_BxHxMxD.shape[-1]
  b, _, n_rows, _ = q_BxHxMxD.shape
  w = key_pe_DxW.shape[-1]
  if k_BxHxTxD.shape[2] != w + n_rows + a:
    raise ValueError(f"fused attention: {k_BxHxTxD.shape[2]} key rows for window {w}, "
                     f"block {n_rows} and {a} ahead (W + M + A)")
  k, v, pe_a, q_seg, kv_seg = _pad_ahead(k_BxHxTxD, v_BxHxTxD, pe_a, q_segments_BxM,
                                         kv_segments_BxT, b, n_rows, w, a, block_k)
  s = _Static(ramp=ramp, eps=eps, bq=block, bk=block_k, interpret=interpret, num_warps=num_warps,
              num_stages=num_stages, rate=float(dropout_rate), scale=1.0 / math.sqrt(dh),
              precision=precision, a=a)
  args = _pad_head_dim(padded_head_dim(dh), q_BxHxMxD, k, v, key_pe_DxW, pers_k_HxDxN,
                       pers_v_HxNxD, pe_a)
  args = (*args[:4], z_BxHxM, pallas_common.seed_array(dropout_seed), *args[4:], z_a, q_seg,
          kv_seg)
  # q, k, v, z (and the spans ahead, the segment ids) by batch rows; key_pe, the seed and the
  # persistent vectors replicated
  return pallas_common.per_device(lambda *xs: _span_attention(*xs, s), args,
                                  (True, True, True, False, True, False, False, False, False,
                                   True, True, True), seed_at=5)[..., :dh]



def _pad_head_dim(dp, q, k, v, pe, pk, pv, pe_a=None):
  """Zero-pads the head dim to dp: the padded columns add 0 to every score and give 0 outputs,
  which the caller slices off (so their gradients are sliced off too)."""
  dh = q.shape[-1]
  if dp == dh:
    return q, k, v, pe, pk, pv, pe_a
  last = lambda x: None if x is None else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - dh)])
  rows = lambda x: None if x is None else jnp.pad(x, ((0, dp - dh), (0, 0)))
  pk = None if pk is None else jnp.pad(pk, ((0, 0), (0, dp - dh), (0, 0)))
  return last(q), last(k), last(v), rows(pe), pk, last(pv), rows(pe_a)
