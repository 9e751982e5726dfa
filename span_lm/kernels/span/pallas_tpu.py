"""Fused banded attention with per-head spans as runtime values (Pallas; Mosaic on TPUs):
causal or two-sided (windows ahead), with segment ids, persistent memory, dropout, GQA.

The maths of `pallas_gpu.span_attention` (`banded_reference.banded_attention` is the definition)
as an online-softmax forward and a FlashAttention-2 backward, scores one (query block, key block)
tile at a time in VMEM. Keys and values come positions last in two parts, the cache's and the
block's (`project_kv`), as XLA:TPU's projection writes them: no transpose or concatenation in
HBM. The visited key blocks come in scalar-prefetched, computed from the spans at run time, so
one compiled program serves every span and skips the blocks no row sees.

Why each choice (the position term's lane rotation, layouts, work skipping, d pe, head padding,
row statistics, persistent memory, dropout, windows ahead, segment ids, grouped heads):
docs/kernels.md, "The TPU kernel's design". `interpret=True` runs the kernels on CPU for tests;
names as in kernels/span/fused.py's vocabulary.
"""
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.span import fused
from span_lm.kernels import hashed_dropout
from span_lm.kernels import pallas_common
from span_lm.kernels import matmul
from span_lm.kernels.span import span_mask
from span_lm.kernels.span.tpu_tiles import LANES, layout_window, padded_head_dim, vmem_bytes

NEG = -1e30
PRECISIONS = fused.PRECISIONS


class _Static(NamedTuple):
  n_cached: int  # the cache part's positions L, a multiple of bk: the laid-out window
  w: int  # the window W (<= L): distances beyond it are never visited
  ramp: int
  eps: float
  bq: int
  bk: int
  scale: float
  precision: str
  interpret: bool | pltpu.InterpretParams
  vmem_limit_bytes: int | None
  rate: float = 0.0  # attention dropout
  n_pers: int = 0  # persistent keys and values per head
  a: int = 0  # the window ahead A (0: causal)
  ap: int = 0  # the block part's positions after the block: A rounded up to bk
  asym: bool = False  # spans ahead of their own (z_ahead); else z on both sides
  segmented: bool = False  # segment ids: a row sees only keys of its own nonzero segment


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
  """f32-accumulating matmul; float32 operands at `precision` ('highest': exact float32)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 and precision == "highest" else None
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _reverse_rows(x):
  """x[::-1] along the sublanes, in Mosaic-legal pieces (rows a multiple of 8)."""
  n = x.shape[0]
  idx = 7 - lax.broadcasted_iota(jnp.int32, (8, x.shape[1]), 0)
  rev8 = lambda y: jnp.take_along_axis(y, idx, axis=0, mode="promise_in_bounds")
  return jnp.concatenate([rev8(x[n - 8 * (i + 1):n - 8 * i]) for i in range(n // 8)], axis=0)


def _skew(s_pos_band, bq, bk):
  """(bq, bq + bk) G[r, j] -> (bq, bk) pos[r, c] = G[r, bq - r + c]."""
  return pltpu.roll(s_pos_band, bk, 1, stride=1, stride_axis=0)[:, :bk]


def _unskew(ds, bq, bk):
  """The adjoint of `_skew`: (bq, bk) ds -> (bq, bq + bk) dG[r, j] = ds[r, j - bq + r], zero
  outside. Reversed rows r' = bq - 1 - r turn by 1 + r' (a positive stride)."""
  x = jnp.concatenate([_reverse_rows(ds), jnp.zeros((bq, bq), ds.dtype)], axis=1)
  return _reverse_rows(pltpu.roll(x, 1, 1, stride=1, stride_axis=0))


def _windows(z, s: _Static):
  """Distances behind each row visits ((rows, 1) int32; z: (rows, 1) spans or None for fixed)."""
  if z is None:
    return s.w
  return jnp.clip(span_mask.visited_distances(z, s.ramp), 1, s.w)


def _windows_ahead(z, za, s: _Static):
  """Distances ahead each row visits, 1..w_a: 0 causal, A for a fixed span, else
  floor(z_a) + R (mask x = a: every nonzero value and the clamp's lower end), at most A; z_a is
  z where the spans ahead are not learned apart."""
  if not s.a:
    return 0
  if z is None:
    return s.a
  return jnp.clip(span_mask.visited_distances(za if s.asym else z, s.ramp) - 1, 0, s.a)


def _mask_dist(dist, s: _Static):
  """The distance the span mask reads (x = d - 1) as float32: d behind (dist >= 1); a + 1 for
  the key a = 1 - dist ahead (x = a)."""
  if s.a:
    dist = jnp.where(dist >= 1, dist, 2 - dist)
  return dist.astype(jnp.float32)


def _tile_z(z, za, dist, s: _Static):
  """Each entry's span: z behind, z_a ahead when learned apart, else z ((rows, 1))."""
  return jnp.where(dist >= 1, z, za) if s.asym else z


def _allowed(qs, ks):
  """(rows, keys): the key is in the row's segment and not padding (qs (rows, 1), ks (1, keys))."""
  return (qs == ks) & (ks != 0)


def _keep(seed, bh, i0, t0, n_rows, s: _Static):
  """Dropout's keep / (1 - rate) for the tile of rows i0.. and keys t0..: keys numbered as the
  door's rows (window, block, the A ahead: W + M + A), persistent vector n as key W + M + A + n,
  as the GPU kernel draws it (causal: A = 0)."""
  rows = i0 + lax.broadcasted_iota(jnp.int32, (s.bq, 1), 0)
  keys = t0 - (s.n_cached - s.w) + lax.broadcasted_iota(jnp.int32, (1, s.bk), 1)  # as if unpadded
  return hashed_dropout.dropout_scale(seed, bh, rows, keys, n_rows=n_rows,
                                      n_keys=s.w + n_rows + s.a + s.n_pers,
                                      rate=s.rate)


def _tile(q, k_t, pe_ref, t0, i0, win, s: _Static, win_a=0, allowed=None):
  """Scaled logits of one tile (k_t: its keys as (Dh, bk) columns), its distances (d >= 1
  behind; 1 - a for distance a ahead), which entries are visited (within the windows behind,
  win, and ahead, win_a; `allowed` by the segments), and the tile's bq + bk rows of key_pe (in
  q's dtype)."""
  bq, bk = s.bq, s.bk
  cont = _dot(q, k_t, s.precision)  # bq x bk
  start = pl.multiple_of(t0 - i0 + bk, math.gcd(bq, bk))  # padded pe rows: distance d at L - d + P
  pe = pe_ref[pl.ds(start, bq + bk), :].astype(q.dtype)
  s_pos = _skew(_dot(q, pe, s.precision, trans_b=True), bq, bk)
  r = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  c = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  dist = (s.n_cached + i0 - t0) + r - c
  visited = ((dist >= 1 - win_a) if s.a else (dist >= 1)) & (dist <= win)
  if allowed is not None:
    visited = visited & allowed
  logits = jnp.where(visited, (cont + s_pos) * s.scale, NEG)
  return logits, dist, visited, pe


def _tile_grads(q, do, k_t, v_t, pe_ref, t0, i0, z, za, m, den, delta, keep, allowed,
                s: _Static):
  """Recomputes one tile: (ds = d logits times the scale, the weights as applied to the values
  (wts, times dropout's keep), the span gradients per row (bq, 1), behind (both sides unless the
  spans ahead are learned apart) and ahead, or None, the tile's key_pe rows). keep: dropout's
  keep / (1 - rate) for the tile, or None; allowed: the segments' (bq, bk), or None."""
  logits, dist, visited, pe = _tile(q, k_t, pe_ref, t0, i0, _windows(z, s), s,
                                    _windows_ahead(z, za, s), allowed)
  p = jnp.where(visited, jnp.exp(logits - m), 0.0) / den
  dp = _dot(do, v_t, s.precision)
  if keep is not None:  # out = sum_j a_j keep_j v_j: the weights' gradient is keep_j (do . v_j)
    dp = dp * keep
  dza = None
  if s.asym:  # fused.weights_grad with the span gradient summed per side
    dp_c = dp - delta
    u = span_mask.ramp(_tile_z(z, za, dist, s), _mask_dist(dist, s), s.ramp)
    wts = p * span_mask.clamp01(u)
    ds_unscaled = wts * dp_c - s.eps * p * delta
    gs = p * dp_c * span_mask.clamp01_slope(u)
    behind = dist >= 1
    dz = jnp.sum(jnp.where(behind, gs, 0.0), axis=1, keepdims=True) / s.ramp
    dza = jnp.sum(jnp.where(behind, 0.0, gs), axis=1, keepdims=True) / s.ramp
  else:
    ds_unscaled, wts, dz = fused.weights_grad(p, dp, delta, z, _mask_dist(dist, s),
                                   renormalised=z is not None, eps=s.eps, ramp=s.ramp)
  return ds_unscaled * s.scale, wts if keep is None else wts * keep, dz, dza, pe


def _pers_logits(q, pk_ref, n0, s: _Static):
  """Scaled logits of the query rows against persistent keys n0 .. n0 + bk, and their values'
  rows (in q's dtype)."""
  rows = pl.ds(pl.multiple_of(n0, s.bk), s.bk)
  return _dot(q, pk_ref[rows, :].astype(q.dtype), s.precision, trans_b=True) * s.scale, rows


def _col(ref):
  return ref[:, 0:1]


def _rep(x):
  return jnp.broadcast_to(x, (x.shape[0], LANES))


def _kv_tile(kvc_ref, kvb_ref, kb, s: _Static):
  """Key block kb's keys and values, each (Dh, bk): from the cache's part below L / bk, the
  block's above (both blocks are in VMEM; the index maps fetch each only when it changes)."""
  kv = lax.cond(kb < s.n_cached // s.bk, lambda: kvc_ref[...], lambda: kvb_ref[...])  # one load
  return kv[0], kv[1]


def _split_refs(refs, has_mask, s: _Static):
  """(z_ref, za_ref, qs_ref, ks_ref, pk_ref, pv_ref, the rest) of a kernel's optional inputs
  (None where absent): spans, spans ahead, the rows' and the keys' segment ids, persistent keys
  and values."""
  refs = list(refs)
  take = lambda on: refs.pop(0) if on else None
  z_ref, za_ref = take(has_mask), take(s.asym)
  qs_ref, ks_ref = take(s.segmented), take(s.segmented)
  pk_ref, pv_ref = take(s.n_pers), take(s.n_pers)
  return z_ref, za_ref, qs_ref, ks_ref, pk_ref, pv_ref, refs


def _meets(bnd, n_cells, n_b, n_q, n_kb, b, qi, kb):
  """Whether query block qi and key block kb of batch row b share a nonzero segment id range
  (the scalar-prefetched [lo, hi] of each tile's nonzero ids, after the bounds and the seed:
  `_segment_ranges`); an all-padding tile has lo > hi and meets none."""
  base = 2 * n_cells + 1
  q0 = base + b * n_q + qi
  k0 = base + 2 * n_b * n_q + b * n_kb + kb
  qlo, qhi = bnd[q0], bnd[q0 + n_b * n_q]
  klo, khi = bnd[k0], bnd[k0 + n_b * n_kb]
  return (qlo <= qhi) & (klo <= khi) & (klo <= qhi) & (qlo <= khi)


def _fwd_kernel(bounds_ref, q_ref, kvc_ref, kvb_ref, pe_ref, *refs, s: _Static, has_mask,
                n_heads, n_q, n_kb, n_steps):
  z_ref, za_ref, qs_ref, ks_ref, pk_ref, pv_ref, refs = _split_refs(refs, has_mask, s)
  o_ref, m_out_ref, den_ref, acc_ref, m_ref, l_all_ref, l_mask_ref = refs
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  n_cells = pl.num_programs(0) * n_heads * n_q
  cell = (b * n_heads + h) * n_q + qi
  kb = bounds_ref[cell] + j
  seed, bh, n_rows = bounds_ref[2 * n_cells], b * n_heads + h, n_q * s.bq  # dropout's hash

  @pl.when(j == 0)
  def _():
    acc = jnp.zeros(acc_ref.shape, jnp.float32)
    m = jnp.full((s.bq, 1), NEG, jnp.float32)
    l = jnp.zeros((s.bq, 1), jnp.float32)
    if s.n_pers:  # persistent keys: no position term, mask 1, in the same softmax
      q = q_ref[...]

      def pers(c, carry):
        acc, m, l = carry
        logits, rows = _pers_logits(q, pk_ref, c * s.bk, s)
        m_new, corr, p = fused.online_softmax(m, logits)
        kept = p
        if s.rate:  # persistent key n is key W + M + A + n
          kept = p * _keep(seed, bh, qi * s.bq, s.n_cached + n_rows + s.a + c * s.bk, n_rows, s)
        acc = acc * corr + _dot(kept.astype(q.dtype), pv_ref[rows, :].astype(q.dtype),
                                s.precision)
        return acc, m_new, l * corr + jnp.sum(p, axis=1, keepdims=True)

      acc, m, l = lax.fori_loop(0, s.n_pers // s.bk, pers, (acc, m, l))
    acc_ref[...] = acc
    m_ref[...] = _rep(m)
    l_all_ref[...] = _rep(l)
    l_mask_ref[...] = _rep(l)  # the persistent weights' mask is 1

  run = kb < bounds_ref[n_cells + cell]
  if s.segmented:  # and the tiles share a segment
    run = run & _meets(bounds_ref, n_cells, pl.num_programs(0), n_q, n_kb, b, qi, kb)

  @pl.when(run)
  def _():
    q = q_ref[...]
    k_t, v_t = _kv_tile(kvc_ref, kvb_ref, kb, s)
    z = _col(z_ref) if has_mask else None
    za = _col(za_ref) if s.asym else None
    allowed = _allowed(_col(qs_ref), ks_ref[...]) if s.segmented else None
    logits, dist, visited, _ = _tile(q, k_t, pe_ref, kb * s.bk, qi * s.bq, _windows(z, s), s,
                                     _windows_ahead(z, za, s), allowed)
    m_new, corr, p = fused.online_softmax(_col(m_ref), logits, visited)
    pm = p * span_mask.soft_mask(_tile_z(z, za, dist, s), _mask_dist(dist, s),
                                 s.ramp) if has_mask else p
    kept = pm * _keep(seed, bh, qi * s.bq, kb * s.bk, n_rows, s) if s.rate else pm
    acc_ref[...] = acc_ref[...] * corr + _dot(kept.astype(v_t.dtype), v_t, s.precision,
                                              trans_b=True)
    m_ref[...] = _rep(m_new)
    l_all_ref[...] = _rep(_col(l_all_ref) * corr + jnp.sum(p, axis=1, keepdims=True))
    if has_mask:
      l_mask_ref[...] = _rep(_col(l_mask_ref) * corr + jnp.sum(pm, axis=1, keepdims=True))

  @pl.when(j == n_steps - 1)
  def _():
    l_all = _col(l_all_ref)
    den = span_mask.online_denominator(_col(l_mask_ref), l_all, s.eps) if has_mask else l_all
    if s.segmented:  # a row with no key in its segment: zeros (and 1 saved, never 0 / 0)
      den = jnp.where(den > 0, den, 1.0)
      o_ref[...] = jnp.where(_col(qs_ref) != 0, acc_ref[...] / den, 0.0).astype(o_ref.dtype)
    else:
      o_ref[...] = (acc_ref[...] / den).astype(o_ref.dtype)
    m_out_ref[...] = m_ref[...]
    den_ref[...] = _rep(den)


def _bwd_q_kernel(bounds_ref, q_ref, kvc_ref, kvb_ref, pe_ref, *refs, s: _Static, has_mask,
                  n_heads, n_q, n_kb, n_steps):
  """Per query block: dq, its rows' span gradients, and d pe (and the persistent vectors'
  gradients) into the batch's (batch and head's) resident blocks."""
  z_ref, za_ref, qs_ref, ks_ref, pk_ref, pv_ref, refs = _split_refs(refs, has_mask, s)
  do_ref, m_ref, den_ref, delta_ref, dq_ref, *refs = refs
  dz_ref = refs.pop(0) if has_mask else None
  dza_ref = refs.pop(0) if s.asym else None
  dpe_ref = refs.pop(0)
  dpk_ref, dpv_ref = (refs.pop(0), refs.pop(0)) if s.n_pers else (None, None)
  dq_acc, *refs = refs
  dz_acc = refs.pop(0) if has_mask else None
  dza_acc = refs.pop(0) if s.asym else None
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  n_cells = pl.num_programs(0) * n_heads * n_q
  cell = (b * n_heads + h) * n_q + qi
  kb = bounds_ref[cell] + j
  bq, bk = s.bq, s.bk
  seed, bh, n_rows = bounds_ref[2 * n_cells], b * n_heads + h, n_q * bq  # dropout's hash

  @pl.when((h == 0) & (qi == 0) & (j == 0))
  def _():
    dpe_ref[...] = jnp.zeros_like(dpe_ref)

  if s.n_pers:
    @pl.when((qi == 0) & (j == 0))
    def _():
      dpk_ref[...] = jnp.zeros_like(dpk_ref)
      dpv_ref[...] = jnp.zeros_like(dpv_ref)

  @pl.when(j == 0)
  def _():
    dq = jnp.zeros(dq_acc.shape, jnp.float32)
    if s.n_pers:  # the persistent keys: mask 1, so no span gradient
      q, do = q_ref[...], do_ref[...]
      if s.segmented:  # padding rows (segment 0) output zeros: no gradient reaches them
        do = jnp.where(_col(qs_ref) != 0, do, jnp.zeros_like(do))
      m, den, delta = _col(m_ref), _col(den_ref), _col(delta_ref)

      def pers(c, dq):
        logits, rows = _pers_logits(q, pk_ref, c * bk, s)
        p = jnp.exp(logits - m) / den
        dp = _dot(do, pv_ref[rows, :].astype(do.dtype), s.precision, trans_b=True)
        kept = p
        if s.rate:
          keep = _keep(seed, bh, qi * bq, s.n_cached + n_rows + s.a + c * bk, n_rows, s)
          dp, kept = dp * keep, p * keep
        ds = fused.weights_grad(p, dp, delta, renormalised=has_mask, eps=s.eps,
                                ramp=s.ramp)[0] * s.scale
        dpk_ref[rows, :] += _dot(ds.astype(q.dtype), q, s.precision, trans_a=True)
        dpv_ref[rows, :] += _dot(kept.astype(do.dtype), do, s.precision, trans_a=True)
        return dq + _dot(ds.astype(q.dtype), pk_ref[rows, :].astype(q.dtype), s.precision)

      dq = lax.fori_loop(0, s.n_pers // bk, pers, dq)
    dq_acc[...] = dq
    if has_mask:
      dz_acc[...] = jnp.zeros_like(dz_acc)
    if s.asym:
      dza_acc[...] = jnp.zeros_like(dza_acc)

  run = kb < bounds_ref[n_cells + cell]
  if s.segmented:  # and the tiles share a segment
    run = run & _meets(bounds_ref, n_cells, pl.num_programs(0), n_q, n_kb, b, qi, kb)

  @pl.when(run)
  def _():
    q, do = q_ref[...], do_ref[...]
    k_t, v_t = _kv_tile(kvc_ref, kvb_ref, kb, s)
    t0, i0 = kb * bk, qi * bq
    z = _col(z_ref) if has_mask else None
    za = _col(za_ref) if s.asym else None
    allowed = _allowed(_col(qs_ref), ks_ref[...]) if s.segmented else None
    keep = _keep(seed, bh, i0, t0, n_rows, s) if s.rate else None
    ds, _, dz, dza, pe = _tile_grads(q, do, k_t, v_t, pe_ref, t0, i0, z, za, _col(m_ref),
                                     _col(den_ref), _col(delta_ref), keep, allowed, s)
    if has_mask:
      dz_acc[...] = _rep(_col(dz_acc) + dz)
    if s.asym:
      dza_acc[...] = _rep(_col(dza_acc) + dza)
    ds_pos_band = _unskew(ds, bq, bk)  # bq x (bq + bk), over the tile's distances
    start = pl.multiple_of(t0 - i0 + bk, math.gcd(bq, bk))
    dq_acc[...] += (_dot(ds.astype(k_t.dtype), k_t, s.precision, trans_b=True)
                    + _dot(ds_pos_band.astype(pe.dtype), pe, s.precision))
    dpe_ref[pl.ds(start, bq + bk), :] += _dot(ds_pos_band.astype(q.dtype), q, s.precision,
                                              trans_a=True)

  @pl.when(j == n_steps - 1)
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
    if has_mask:
      dz_ref[...] = dz_acc[...]
    if s.asym:
      dza_ref[...] = dza_acc[...]


def _bwd_kv_kernel(bounds_ref, qb_ref, q_ref, kv_ref, pe_ref, do_ref, st_ref, *refs, s: _Static,
                   has_mask, n_heads, n_q, n_kb, kb0, n_steps, group=1):
  """Per key block kb0 + program_id(2) (of n_kb in all): its keys' and values' gradients,
  (2, Dh, bk), summed over the query blocks that see it (deterministic). The query rows'
  statistics come packed lane-dense, (8, bq) per step (`_packed_stats`), the rows' segment ids
  among them; the key block's segment ids as (1, bk). Grouped heads (group > 1): program_id(1)
  is the key/value head and the step axis runs over its group's query heads in turn, group *
  n_steps steps, so dk and dv sum over the group in the VMEM accumulators."""
  refs = list(refs)
  ks_ref = refs.pop(0) if s.segmented else None
  dkv_ref, dk_acc, dv_acc = refs
  b, h, kbl, j = (pl.program_id(i) for i in range(4))
  step = j
  if group > 1:  # query head h * group + step // n_steps, its step step % n_steps
    h, j = h * group + lax.div(step, n_steps), lax.rem(step, n_steps)
  kb = kb0 + kbl
  n_cells, n_kcells = (pl.num_programs(0) * n_heads * n for n in (n_q, n_kb))
  seed, bh, n_rows = bounds_ref[2 * n_cells], b * n_heads + h, n_q * s.bq  # dropout's hash
  qi = qb_ref[(b * n_heads + h) * n_kb + kb] + j
  cell = (b * n_heads + h) * n_q + qi
  # a query block inside [first, last] of this key block's readers that does not read it skips
  run = qi < qb_ref[n_kcells + (b * n_heads + h) * n_kb + kb]
  cell = jnp.where(run, cell, 0)
  run = run & (bounds_ref[cell] <= kb) & (kb < bounds_ref[n_cells + cell])
  if s.segmented:  # and the tiles share a segment
    run = run & _meets(bounds_ref, n_cells, pl.num_programs(0), n_q, n_kb, b,
                       jnp.where(run, qi, 0), kb)

  @pl.when(step == 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(run)
  def _():
    q, do = q_ref[...], do_ref[...]
    kv = kv_ref[...]
    st = st_ref[...].T  # (bq, 8): one column per statistic
    z = st[:, 3:4] if has_mask else None
    za = st[:, 4:5] if s.asym else None
    allowed = None
    if s.segmented:  # the rows' ids travel bitcast among the float32 statistics
      allowed = _allowed(lax.bitcast_convert_type(st[:, 5:6], jnp.int32), ks_ref[...])
    keep = _keep(seed, bh, qi * s.bq, kb * s.bk, n_rows, s) if s.rate else None
    ds, wts, _, _, _ = _tile_grads(q, do, kv[0], kv[1], pe_ref, kb * s.bk, qi * s.bq, z, za,
                                 st[:, 0:1], st[:, 1:2], st[:, 2:3], keep, allowed, s)
    dk_acc[...] += _dot(q, ds.astype(q.dtype), s.precision, trans_a=True)  # Dh x bk
    dv_acc[...] += _dot(do, wts.astype(do.dtype), s.precision, trans_a=True)

  @pl.when(step == group * n_steps - 1)
  def _():
    dkv_ref[0] = dk_acc[...].astype(dkv_ref.dtype)
    dkv_ref[1] = dv_acc[...].astype(dkv_ref.dtype)


def _key_bounds(z, b, h, n_rows, s: _Static, za=None, meets=None):
  """(2 B H nq,) int32: the first key block visited by some row of each query block, then the
  last + 1: the windows behind and (A > 0) ahead of its rows; with segments (`meets`, (B, nq,
  nkb): the tiles that share a segment id range) narrowed to the first and last key block that
  shares one (none: an empty range, first = last + 1)."""
  nq = n_rows // s.bq
  if z is None:
    win = jnp.full((b, h, n_rows), s.w, jnp.int32)
  else:
    win = jnp.clip(span_mask.visited_distances(lax.stop_gradient(z), s.ramp), 1, s.w)
  r = (jnp.arange(n_rows, dtype=jnp.int32) % s.bq).reshape(1, 1, n_rows)
  i0 = (jnp.arange(nq, dtype=jnp.int32) * s.bq).reshape(1, 1, nq)
  first = s.n_cached + i0 + jnp.min((r - win).reshape(b, h, nq, s.bq), axis=-1)
  lo = first // s.bk
  if s.a:  # the last key: distance 1 behind, or w_a ahead (key L + i + w_a - 1)
    if z is None:
      win_a = jnp.full((b, h, n_rows), s.a, jnp.int32)
    else:
      za = lax.stop_gradient(za if s.asym else z)
      win_a = jnp.clip(span_mask.visited_distances(za, s.ramp) - 1, 0, s.a)
    last = s.n_cached + i0 + jnp.max((r - 1 + win_a).reshape(b, h, nq, s.bq), axis=-1)
    hi = last // s.bk + 1
  else:
    hi = jnp.broadcast_to((s.n_cached + i0 + s.bq - 2) // s.bk + 1, lo.shape)
  if meets is not None:
    nkb = meets.shape[-1]
    kb = jnp.arange(nkb, dtype=jnp.int32).reshape(1, 1, 1, nkb)
    ok = (lo[..., None] <= kb) & (kb < hi[..., None]) & meets[:, None]  # B H nq nkb
    seg_lo = jnp.min(jnp.where(ok, kb, nkb), axis=-1)
    seg_hi = jnp.max(jnp.where(ok, kb, -1), axis=-1) + 1
    lo, hi = jnp.where(seg_hi > 0, seg_lo, lo), jnp.where(seg_hi > 0, seg_hi, lo)
  return jnp.concatenate([lo.reshape(-1), hi.reshape(-1)]).astype(jnp.int32)


_NONE = (np.iinfo(np.int32).max, np.iinfo(np.int32).min)  # an empty id range: lo > hi


def _segment_ranges(qs, ks, bq, bk):
  """(2 B nq + 2 B nkb,) int32: the lowest, then the highest nonzero segment id of each query
  block (qs (B, M)), then of each key block (ks (B, L + M + Ap), the laid-out keys'), per batch
  row; lo > hi where a block is all padding. Scalar-prefetched after the bounds and the seed
  (`_meets` reads them)."""
  def ranges(x, tile):
    x = x.reshape(x.shape[0], -1, tile)
    return (jnp.min(jnp.where(x != 0, x, _NONE[0]), axis=-1).reshape(-1),
            jnp.max(jnp.where(x != 0, x, _NONE[1]), axis=-1).reshape(-1))
  return jnp.concatenate([*ranges(qs, bq), *ranges(ks, bk)]).astype(jnp.int32)


def _tiles_meet(ranges, b, nq, nkb):
  """(B, nq, nkb) booleans from `_segment_ranges`: query and key block share a nonzero id
  range."""
  qlo, qhi = ranges[:b * nq].reshape(b, nq, 1), ranges[b * nq:2 * b * nq].reshape(b, nq, 1)
  k = ranges[2 * b * nq:]
  klo, khi = k[:b * nkb].reshape(b, 1, nkb), k[b * nkb:].reshape(b, 1, nkb)
  return (qlo <= qhi) & (klo <= khi) & (klo <= qhi) & (qlo <= khi)


def _scalars(z, za, qs, ks, seed, b, h, n_rows, s: _Static):
  """What the kernels scalar-prefetch into SMEM: the key bounds (`_key_bounds`), the dropout
  seed and, with segments, the blocks' id ranges (`_segment_ranges`); also the bounds alone."""
  if not s.segmented:
    bounds = _key_bounds(z, b, h, n_rows, s, za)
    return jnp.concatenate([bounds, seed]), bounds
  nkb = ks.shape[-1] // s.bk
  ranges = _segment_ranges(qs, ks, s.bq, s.bk)
  bounds = _key_bounds(z, b, h, n_rows, s, za, _tiles_meet(ranges, b, n_rows // s.bq, nkb))
  return jnp.concatenate([bounds, seed, ranges]), bounds


def _key_steps(n_rows, s: _Static):
  """Grid steps over key blocks: the most a query block can visit (every span = W, and A
  ahead)."""
  pad = s.n_cached - s.w
  return max((s.n_cached + i0 + s.bq - 2 + s.a) // s.bk + 1 - (pad + i0) // s.bk
             for i0 in range(0, n_rows, s.bq))


def _query_bounds(bounds, b, h, n_rows, s: _Static):
  """(2 B H nkb,) int32: [first..., last + 1...) query block that reads each key block."""
  nq, nkb = n_rows // s.bq, (s.n_cached + n_rows + s.ap) // s.bk
  lo, hi = bounds[:b * h * nq].reshape(b, h, nq, 1), bounds[b * h * nq:].reshape(b, h, nq, 1)
  kb = jnp.arange(nkb, dtype=jnp.int32).reshape(1, 1, 1, nkb)
  reads = (lo <= kb) & (kb < hi)  # B H nq nkb
  qi = jnp.arange(nq, dtype=jnp.int32).reshape(1, 1, nq, 1)
  first = jnp.min(jnp.where(reads, qi, nq), axis=2)
  last = jnp.max(jnp.where(reads, qi, -1), axis=2)
  first = jnp.where(last < 0, 0, first)
  return jnp.concatenate([first.reshape(-1), (last + 1).reshape(-1)]).astype(jnp.int32)


def _query_steps(n_rows, s: _Static, key_blocks: range):
  """Grid steps over query blocks: the most query blocks that read one of `key_blocks`
  (span = W, and A ahead)."""
  nq = n_rows // s.bq
  lo = [(s.n_cached - s.w + i0) // s.bk for i0 in range(0, n_rows, s.bq)]
  hi = [(s.n_cached + i0 + s.bq - 2 + s.a) // s.bk + 1 for i0 in range(0, n_rows, s.bq)]
  return max(1, max(sum(lo[q] <= kb < hi[q] for q in range(nq)) for kb in key_blocks))


def _cost(kind: str, q, nkb: int, s: _Static, steps: int, has_mask: bool,
          pers_itemsize: int = 4) -> pl.CostEstimate:
  """What one call does if every span is W (and A ahead: the grid's worst case; shorter spans
  and segments skip tiles), so XLA's scheduler and the compile mode's roofline see the kernel:
  its matmul FLOPs per visited tile (content, position over the tile's bq + bk distances,
  values; the backward's recompute and gradients), exp per score, and HBM bytes (blocks as the
  index maps fetch them); persistent vectors per query block (forward: logits, values; dq
  kernel: logits, dO v^T, dq, their two gradients), fetched once per (batch, head). nkb: the key
  blocks of the dk/dv call."""
  cost = _band_cost(kind, q, nkb, s, steps, has_mask)
  if not s.n_pers or kind == "bwd_kv":
    return cost
  b, h, n_rows, dp = q.shape
  cells, mm = b * h * (n_rows // s.bq), 2 * s.bq * s.n_pers * dp
  pers_bytes = b * h * 2 * s.n_pers * dp * (pers_itemsize + (4 if kind == "bwd_q" else 0))
  return pl.CostEstimate(
      flops=cost.flops + cells * mm * (2 if kind == "fwd" else 5),
      transcendentals=cost.transcendentals + cells * s.bq * s.n_pers,
      bytes_accessed=cost.bytes_accessed + pers_bytes)


def _band_cost(kind: str, q, nkb: int, s: _Static, steps: int, has_mask: bool
               ) -> pl.CostEstimate:
  b, h, n_rows, dp = q.shape
  isz, nq = jnp.dtype(q.dtype).itemsize, n_rows // s.bq
  qk, s_pos_flops = 2 * s.bq * s.bk * dp, 2 * s.bq * (s.bq + s.bk) * dp
  row, key, stat = s.bq * dp * isz, s.bk * dp * isz, s.bq * LANES * 4
  pe = (s.n_cached + s.a + 2 * (s.bq + s.bk)) * dp * 4
  # spans ahead: one more statistic in (and its gradient out of the dq kernel); segments: the
  # rows' ids (replicated like a statistic) per query block, the keys' (bk int32) per step
  extra_in = stat * (s.asym + s.segmented)
  key_ids = s.bk * 4 * s.segmented
  if kind == "fwd":  # per tile: content, position, values
    tiles, flops = b * h * nq * steps, 2 * qk + s_pos_flops
    byts = b * h * nq * (2 * row + 2 * stat + stat * has_mask + extra_in
                         + steps * (2 * key + key_ids)) + pe
  elif kind == "bwd_q":  # recompute, dO v^T, dq (content and position), d pe
    tiles, flops = b * h * nq * steps, 3 * qk + 3 * s_pos_flops
    byts = b * h * nq * (3 * row + 3 * stat + 2 * stat * has_mask + extra_in + stat * s.asym
                         + steps * (2 * key + key_ids)) + 2 * pe * b
  else:  # bwd_kv, per (key block, query step): recompute, dO v^T, dk, dv
    tiles, flops = b * h * nkb * steps, 4 * qk + s_pos_flops
    byts = b * h * nkb * (4 * key + key_ids + steps * (2 * row + 8 * s.bq * 4)) + pe
  return pl.CostEstimate(flops=int(tiles * flops), transcendentals=int(tiles * s.bq * s.bk),
                         bytes_accessed=int(byts))


def _packed_stats(m, den, delta, z, bq, za=None, qs=None):
  """(B, H, M / bq, 8, bq) float32: per query block, rows max, denominator, delta, span (zeros
  without), span ahead (spans learned apart), segment id (int32 bitcast; segments), then zeros.
  Read per step by the dk/dv kernel as one (8, bq) block, 32 bytes per query row where
  lane-replicated (bq, 128) blocks take 512 per statistic (docs/kernels.md)."""
  b, h, n_rows = m.shape
  rows = [m, den, delta, jnp.zeros_like(m) if z is None else z]
  if za is not None or qs is not None:
    ids = jnp.zeros_like(m) if qs is None else jnp.broadcast_to(
        lax.bitcast_convert_type(qs.astype(jnp.int32), jnp.float32)[:, None], (b, h, n_rows))
    rows += [jnp.zeros_like(m) if za is None else za, ids]
  packed = jnp.stack(rows + [jnp.zeros_like(m)] * (8 - len(rows)), axis=2)  # B H 8 M
  return jnp.swapaxes(packed.reshape(b, h, 8, n_rows // bq, bq), 2, 3)


def _params(s: _Static, semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=s.vmem_limit_bytes)


def _replicate(x_BxHxM):
  return jnp.broadcast_to(x_BxHxM[..., None], (*x_BxHxM.shape, LANES))


def _query_grid_specs(b, h, nq, dp, s: _Static, group: int = 1):
  """BlockSpecs of the (batch, head, query block, key step) grid of the forward and dq kernels:
  query rows, their row statistics, and the keys and values of each step's key block, clamped to
  the block's scalar-prefetched [first, last] (a step past it re-uses the block in VMEM: no DMA),
  from the cache's part (blocks below L / bk) and the block's part (the rest): each part's index
  stays at its nearest block while the other part is read, so it is fetched once. Then, with
  segments, the rows' ids (lane-replicated, per batch row) and the key block's ids (1, bk).
  Grouped heads: query head hi reads key/value head hi // group (the index map: no copy)."""
  n_wb = s.n_cached // s.bk
  if group > 1:
    specs = _query_grid_specs(b, h, nq, dp, s)
    kv_head = lambda spec: pl.BlockSpec(spec.block_shape, lambda bi, hi, *ix: (
        lambda at: at[:2] + (lax.div(hi, group),) + at[3:])(spec.index_map(bi, hi, *ix)))
    return specs[:2] + (kv_head(specs[2]), kv_head(specs[3])) + specs[4:]

  def key_block(bi, hi, qi, j, bnd):
    cell = (bi * h + hi) * nq + qi
    kb = jnp.minimum(bnd[cell] + j, bnd[b * h * nq + cell] - 1)
    return jnp.maximum(kb, bnd[cell]) if s.segmented else kb  # an empty range: its first

  here = lambda bi, hi, qi, j, bnd: (bi, hi, qi, 0)
  kv_block = (None, 2, None, dp, s.bk)
  cache = lambda *ix: (ix[0], 0, ix[1], 0, jnp.minimum(key_block(*ix), n_wb - 1))
  block = lambda *ix: (ix[0], 0, ix[1], 0, jnp.maximum(key_block(*ix) - n_wb, 0))
  specs = (pl.BlockSpec((None, None, s.bq, dp), here),
           pl.BlockSpec((None, None, s.bq, LANES), here),
           pl.BlockSpec(kv_block, cache), pl.BlockSpec(kv_block, block))
  if not s.segmented:
    return specs + (None, None)
  return specs + (pl.BlockSpec((None, s.bq, LANES), lambda bi, hi, qi, j, bnd: (bi, qi, 0)),
                  pl.BlockSpec((None, 1, s.bk), lambda *ix: (ix[0], 0, key_block(*ix))))


def _pers_spec(n, dp):
  """The head's persistent keys or values ((N, Dh) of (H, N, Dh)), whole, on a query grid."""
  return pl.BlockSpec((None, n, dp), lambda bi, hi, *_: (hi, 0, 0))


def _row_inputs(z, za, qs, ks, stat, seg_q, seg_k, s: _Static):
  """The optional per-row inputs of the forward and dq kernels, in `_split_refs`' order (before
  the persistent vectors): (specs, arrays)."""
  specs, arrays = [], []
  if z is not None:
    specs, arrays = specs + [stat], arrays + [_replicate(z)]
  if s.asym:
    specs, arrays = specs + [stat], arrays + [_replicate(za)]
  if s.segmented:
    specs, arrays = specs + [seg_q, seg_k], arrays + [_replicate(qs), ks[:, None, :]]
  return specs, arrays


def _forward(q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, s: _Static):
  b, h, n_rows, dp = q.shape
  nq, steps, nkb = n_rows // s.bq, _key_steps(n_rows, s), (s.n_cached + n_rows + s.ap) // s.bk
  has_mask = z is not None
  scalars, _ = _scalars(z, za, qs, ks, seed, b, h, n_rows, s)  # int32s in SMEM

  rows, stat, kv_cache, kv_block, seg_q, seg_k = _query_grid_specs(b, h, nq, dp, s,
                                                                   h // kvc.shape[2])
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  pers = [_pers_spec(s.n_pers, dp)] * 2 if s.n_pers else []
  opt_specs, opt_args = _row_inputs(z, za, qs, ks, stat, seg_q, seg_k, s)
  in_specs = [rows, kv_cache, kv_block, whole] + opt_specs + pers
  args = [q, kvc, kvb, pe_t] + opt_args + ([pk_t, pv] if s.n_pers else [])
  kernel = functools.partial(_fwd_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq, n_kb=nkb,
                             n_steps=steps)
  out, m, den = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, h, nq, steps), in_specs=in_specs,
          out_specs=[rows, stat, stat],
          scratch_shapes=[pltpu.VMEM((s.bq, dp), jnp.float32)]
          + [pltpu.VMEM((s.bq, LANES), jnp.float32)] * 3),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_rows, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, n_rows, LANES), jnp.float32)],
      compiler_params=_params(s, ("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=_cost("fwd", q, 0, s, steps, has_mask, _itemsize(pk_t)),
      interpret=s.interpret, name="span_attention_fwd")(scalars, *args)
  return out, m[..., 0], den[..., 0]


def _itemsize(x):
  return 4 if x is None else jnp.dtype(x.dtype).itemsize


def _bwd_q(s: _Static, res, do, delta, scalars):
  """dq, dz (dz ahead), d pe and the persistent vectors' gradients: one program per query block,
  on the forward's grid. Returns dq, dz, dza (None where absent), d pe per batch row, dpk, dpv."""
  q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, out, m, den = res
  b, h, n_rows, dp = q.shape
  nq, nkb = n_rows // s.bq, (s.n_cached + n_rows + s.ap) // s.bk
  has_mask = z is not None
  stats = [_replicate(m), _replicate(den), _replicate(delta)]
  pers_in = [pk_t, pv] if s.n_pers else []
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  steps = _key_steps(n_rows, s)
  group = h // kvc.shape[2]
  rows, stat, kv_cache, kv_block, seg_q, seg_k = _query_grid_specs(b, h, nq, dp, s, group)
  opt_specs, opt_args = _row_inputs(z, za, qs, ks, stat, seg_q, seg_k, s)
  dpe_spec = pl.BlockSpec((None, *pe_t.shape), lambda bi, hi, qi, j, bnd: (bi, 0, 0))
  pers = [_pers_spec(s.n_pers, dp)] * 2 if s.n_pers else []
  dpers = pl.BlockSpec((None, None, s.n_pers, dp), lambda bi, hi, qi, j, bnd: (bi, hi, 0, 0))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  n_dz = has_mask + s.asym
  out_specs = [rows] + [stat] * n_dz + [dpe_spec] + [dpers] * (2 * bool(pers))
  out_shape = ([jax.ShapeDtypeStruct(q.shape, q.dtype)] + [f32(b, h, n_rows, LANES)] * n_dz
               + [f32(b, *pe_t.shape)] + [f32(b, h, s.n_pers, dp)] * (2 * bool(pers)))
  scratch = [pltpu.VMEM((s.bq, dp), jnp.float32)]
  scratch += [pltpu.VMEM((s.bq, LANES), jnp.float32)] * n_dz
  kernel = functools.partial(_bwd_q_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq,
                             n_kb=nkb, n_steps=steps)
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, h, nq, steps),
          in_specs=[rows, kv_cache, kv_block, whole] + opt_specs + pers + [rows] + [stat] * 3,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      # d pe stays resident per batch row over heads, query blocks and key steps (the persistent
      # gradients per batch row and head, over query blocks and key steps)
      compiler_params=_params(s, ("parallel", "arbitrary", "arbitrary", "arbitrary")),
      cost_estimate=_cost("bwd_q", q, 0, s, steps, has_mask, _itemsize(pk_t)),
      interpret=s.interpret, name="span_attention_bwd_q")(
          scalars, q, kvc, kvb, pe_t, *opt_args, *pers_in, do, *stats)
  outs = list(outs)
  dq = outs.pop(0)
  dz = outs.pop(0)[..., 0] if has_mask else None
  dza = outs.pop(0)[..., 0] if s.asym else None
  dpe = outs.pop(0)
  dpk = dpv = None
  if s.n_pers:
    dpk, dpv = (jnp.sum(x, axis=0).astype(y.dtype) for x, y in zip(outs, (pk_t, pv)))
  return dq, dz, dza, dpe, dpk, dpv


def _bwd_kv(s: _Static, q, pe_t, do, ks, stats_k, scalars, qbounds, has_mask: bool, group: int,
            part, kb0: int):
  """dk, dv of one part of the keys (the cache's, or the block's from key block kb0): one program
  per (key/value head, key block), its steps walking the query blocks (and the group's query
  heads) that read it."""
  b, h, n_rows, dp = q.shape
  nq, nkb = n_rows // s.bq, (s.n_cached + n_rows + s.ap) // s.bk
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  n = part.shape[-1] // s.bk
  qsteps = _query_steps(n_rows, s, range(kb0, kb0 + n))

  def query_block(bi, hi, kbl, j, bnd, qbnd):
    cell = (bi * h + hi) * nkb + kb0 + kbl
    first = qbnd[cell]
    return jnp.maximum(jnp.minimum(first + j, qbnd[b * h * nkb + cell] - 1), first)

  if group == 1:
    rows_k = pl.BlockSpec((None, None, s.bq, dp),
                          lambda bi, hi, *ix: (bi, hi, query_block(bi, hi, *ix), 0))
    stat_k = pl.BlockSpec((None, None, None, 8, s.bq),
                          lambda bi, hi, *ix: (bi, hi, query_block(bi, hi, *ix), 0, 0))
  else:  # (key/value head, step) -> (query head, its step)
    head_step = lambda hk, kbl, j, bnd, qbnd: (
        hk * group + lax.div(j, qsteps), (kbl, lax.rem(j, qsteps), bnd, qbnd))
    rows_k = pl.BlockSpec((None, None, s.bq, dp), lambda bi, hk, *ix: (
        lambda hi, rest: (bi, hi, query_block(bi, hi, *rest), 0))(*head_step(hk, *ix)))
    stat_k = pl.BlockSpec((None, None, None, 8, s.bq), lambda bi, hk, *ix: (
        lambda hi, rest: (bi, hi, query_block(bi, hi, *rest), 0, 0))(*head_step(hk, *ix)))
  kv_k = pl.BlockSpec((None, 2, None, dp, s.bk),
                      lambda bi, hi, kbl, j, bnd, qbnd: (bi, 0, hi, 0, kbl))
  ids_k = [pl.BlockSpec((None, 1, s.bk), lambda bi, hi, kbl, j, bnd, qbnd:
                        (bi, 0, kb0 + kbl))] if s.segmented else []
  kernel = functools.partial(_bwd_kv_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq,
                             n_kb=nkb, kb0=kb0, n_steps=qsteps,
                             **({} if group == 1 else {"group": group}))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, h // group, n, group * qsteps),
          in_specs=[rows_k, kv_k, whole, rows_k, stat_k] + ids_k, out_specs=kv_k,
          scratch_shapes=[pltpu.VMEM((dp, s.bk), jnp.float32)] * 2),
      out_shape=jax.ShapeDtypeStruct(part.shape, part.dtype),
      compiler_params=_params(s, ("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=_cost("bwd_kv", q, n, s, qsteps, has_mask),
      interpret=s.interpret, name="span_attention_bwd_kv")(
          scalars, qbounds, q, part, pe_t, do, stats_k,
          *([ks[:, None, :]] if s.segmented else []))


def _backward(s: _Static, res, do):
  q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, out, m, den = res
  b, h, n_rows, _ = q.shape
  n_wb = s.n_cached // s.bk
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  scalars, bounds = _scalars(z, za, qs, ks, seed, b, h, n_rows, s)
  dq, dz, dza, dpe, dpk, dpv = _bwd_q(s, res, do, delta, scalars)

  # dk, dv per key block, over the query blocks that read it: one call for the cache's key
  # blocks, one for the block's (and the keys ahead), each writing its own part's gradient.
  # Grouped heads: one program per key/value head and key block, its steps walking the group's
  # query heads in turn (accumulated in VMEM: no group-times larger partial gradients).
  qbounds = _query_bounds(bounds, b, h, n_rows, s)
  stats_k = _packed_stats(m, den, delta, z, s.bq, za, qs)
  dkv = functools.partial(_bwd_kv, s, q, pe_t, do, ks, stats_k, scalars, qbounds, z is not None,
                          h // kvc.shape[2])
  zeros_of = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)
  return (dq, dkv(kvc, 0), dkv(kvb, n_wb), jnp.sum(dpe, axis=0).astype(pe_t.dtype), dz,
          zeros_of(seed), dpk, dpv, dza, zeros_of(qs), zeros_of(ks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _attention(q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, s):
  return _forward(q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, s)[0]


def _attention_fwd(q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, s):
  out, m, den = _forward(q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, s)
  return out, (q, kvc, kvb, pe_t, z, seed, pk_t, pv, za, qs, ks, out, m, den)


_attention.defvjp(_attention_fwd, _backward)


def project_kv(cache_BxLxD, h_BxMxD, w_kv_Dx2Z, w: int, n_heads: int):
  """The kernel's keys and values of n_heads heads (w_kv: their [key | value] columns): the last
  `layout_window(w)` cached states' (B, 2, G, Dh, L) and the block's (B, 2, G, Dh, M),
  positions last. This is the layout XLA:TPU's projection matmul writes (positions on the
  lanes), so no transpose or concatenation pass follows it. A cache shorter than L is padded
  with zero states on the left. The cache rows get no input gradient (a constant of the step)."""
  n = layout_window(w)
  x = cache_BxLxD[:, max(0, cache_BxLxD.shape[1] - n):]
  if x.shape[1] < n:
    x = jnp.pad(x, ((0, 0), (n - x.shape[1], 0), (0, 0)))
  d, z2 = w_kv_Dx2Z.shape
  w_Dx2xGxH = matmul.weight(w_kv_Dx2Z, x.dtype).reshape(d, 2, n_heads, z2 // (2 * n_heads))
  return (matmul.einsum("btd,dzgh->bzght", x, w_Dx2xGxH),
          matmul.einsum("btd,dzgh->bzght", h_BxMxD, w_Dx2xGxH))


def split_kv(kv_BxTx2Z, n_heads: int, w: int):
  """[keys | values] rows (B, W + M, 2 G Dh) of a key/value cache -> the kernel's two parts (the
  cache's padded on the left to `layout_window(w)`)."""
  b, n_key_rows, z = kv_BxTx2Z.shape
  kv = kv_BxTx2Z.reshape(b, n_key_rows, 2, n_heads, z // (2 * n_heads)).transpose(0, 2, 3, 4, 1)
  pad = [(0, 0)] * 4 + [(layout_window(w) - w, 0)]
  return jnp.pad(kv[..., :w], pad), kv[..., w:]


def span_attention(q_BxHxMxD, k_BxHxTxD, v_BxHxTxD, key_pe_DxW, z_BxHxM=None, *,
                   key_pe_ahead_DxA=None, **kwargs):
  """`span_attention_kv` for keys and values given as rows, each (B, H, W + M + A, Dh): the
  layout of the other implementations (the door's `KV`, tests, benchmarks); transposed and
  split here, the cache's part padded on the left to a whole number of key tiles, the block's
  (with the A rows ahead) on the right."""
  w = key_pe_DxW.shape[-1]
  a = 0 if key_pe_ahead_DxA is None else key_pe_ahead_DxA.shape[-1]
  n_rows = q_BxHxMxD.shape[2]
  hk = k_BxHxTxD.shape[1]  # grouped heads: hk divides H
  if k_BxHxTxD.shape != v_BxHxTxD.shape or k_BxHxTxD.shape[:1] + k_BxHxTxD.shape[3:] != (
      q_BxHxMxD.shape[:1] + q_BxHxMxD.shape[3:]) or k_BxHxTxD.shape[2] != w + n_rows + a or (
          hk < 1 or q_BxHxMxD.shape[1] % hk):
    raise ValueError(f"fused attention: keys {k_BxHxTxD.shape}, values {v_BxHxTxD.shape} for "
                     f"queries {q_BxHxMxD.shape}, window {w} and {a} ahead: want W + M + A = "
                     f"{w + n_rows + a} rows")
  bk = kwargs.get("block_k") or kwargs.get("block", 128)
  kv = jnp.swapaxes(jnp.stack([k_BxHxTxD, v_BxHxTxD], axis=1), -1, -2)  # B 2 H Dh T
  cache = jnp.pad(kv[..., :w], [(0, 0)] * 4 + [(-w % bk, 0)])
  block = kv[..., w:] if not a else jnp.pad(kv[..., w:], [(0, 0)] * 4 + [(0, -a % bk)])
  return span_attention_kv(q_BxHxMxD, cache, block, key_pe_DxW, z_BxHxM,
                           key_pe_ahead_DxA=key_pe_ahead_DxA, **kwargs)


def _check_kv_inputs(q_BxHxMxD, kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM, key_pe_DxW, z_BxHxM,
                     key_pe_ahead_DxA, z_ahead_BxHxM, q_seg_BxM, kv_seg_BxT, pers_k_HxDxN,
                     pers_v_HxNxD, bq: int, bk: int):
  """`span_attention_kv`'s shape checks: one ValueError that names what does not fit."""
  b, h, n_rows, dh = q_BxHxMxD.shape
  w = key_pe_DxW.shape[-1]
  n_pers = 0 if pers_k_HxDxN is None else pers_k_HxDxN.shape[-1]
  n_cached = kv_cache_Bx2xHxDxL.shape[-1]
  a = 0 if key_pe_ahead_DxA is None else key_pe_ahead_DxA.shape[-1]
  ap = kv_block_Bx2xHxDxM.shape[-1] - n_rows
  hk = kv_cache_Bx2xHxDxL.shape[2]  # key/value heads: H, or a divisor of it (grouped heads)
  if (kv_cache_Bx2xHxDxL.shape[:4] != (b, 2, hk, dh) or n_cached < w or hk < 1 or h % hk
      or kv_block_Bx2xHxDxM.shape[:4] != (b, 2, hk, dh) or ap < a or (ap and not a)):
    want = f"M = {n_rows}" if not a else f"M + Ap, Ap >= A = {a} a multiple of the key tile"
    raise ValueError(f"fused attention: keys and values {kv_cache_Bx2xHxDxL.shape} (cache), "
                     f"{kv_block_Bx2xHxDxM.shape} (block) for queries {q_BxHxMxD.shape} and "
                     f"window {w}: want {(b, 2, h, dh)} + (L >= {w},) and {(b, 2, h, dh)} + "
                     f"({want},), or key/value heads dividing {h} in place of {h}")
  if n_rows % bq or n_rows % bk or n_cached % bk or n_pers % bk or ap % bk:
    raise ValueError(f"fused attention: block {n_rows} must be a multiple of {bq} and {bk}, cached "
                     f"positions {n_cached}, {ap} positions ahead and {n_pers} persistent "
                     f"vectors of {bk}")
  if a and key_pe_ahead_DxA.shape[0] != key_pe_DxW.shape[0]:
    raise ValueError(f"fused attention: key_pe_ahead {key_pe_ahead_DxA.shape} for key_pe "
                     f"{key_pe_DxW.shape}")
  if z_ahead_BxHxM is not None and (z_BxHxM is None or not a
                                    or z_ahead_BxHxM.shape != (b, h, n_rows)):
    raise ValueError(f"fused attention: spans ahead {z_ahead_BxHxM.shape} need spans and a "
                     f"window ahead (A = {a}), and the shape {(b, h, n_rows)}")
  segmented = q_seg_BxM is not None
  if (kv_seg_BxT is None) == segmented or segmented and (
      q_seg_BxM.shape != (b, n_rows) or kv_seg_BxT.shape != (b, w + n_rows + a)):
    raise ValueError(f"fused attention: segment ids "
                     f"{None if q_seg_BxM is None else q_seg_BxM.shape}"
                     f" (queries), {None if kv_seg_BxT is None else kv_seg_BxT.shape} (keys): "
                     f"both or neither, want {(b, n_rows)} and {(b, w + n_rows + a)}")
  if bq % 8 or bk % 8:
    raise ValueError(f"fused attention: tiles {bq}, {bk} must be multiples of 8")
  if z_BxHxM is not None and z_BxHxM.shape != (b, h, n_rows):
    raise ValueError(f"fused attention: spans {z_BxHxM.shape}, want {(b, h, n_rows)}")
  if n_pers and (pers_k_HxDxN.shape != (h, dh, n_pers) or pers_v_HxNxD.shape != (h, n_pers, dh)):
    raise ValueError(f"fused attention: persistent keys {pers_k_HxDxN.shape}, values "
                     f"{pers_v_HxNxD.shape}, want {(h, dh, n_pers)} and {(h, n_pers, dh)}")


def _kernel_inputs(q_BxHxMxD, kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM, key_pe_DxW,
                   key_pe_ahead_DxA, z_BxHxM, z_ahead_BxHxM, q_seg_BxM, kv_seg_BxT, pers_k_HxDxN,
                   pers_v_HxNxD, dropout_seed, dp: int, s: _Static):
  """The kernels' inputs in their layouts: head sizes padded to dp, key_pe as padded rows, the
  spans in float32, the segment ids laid out as the keys, persistent keys as rows."""
  dh = q_BxHxMxD.shape[-1]
  w, a, n_cached, ap, asym, segmented = s.w, s.a, s.n_cached, s.ap, s.asym, s.segmented
  bq, bk = s.bq, s.bk
  n_pers = s.n_pers
  pad = lambda x: x if dp == dh else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - dh)])
  pad_kv = lambda x: x if dp == dh else jnp.pad(x, [(0, 0)] * 3 + [(0, dp - dh), (0, 0)])
  # key_pe as rows (distance d at row L - d + P; ahead, distance a at row L + a - 1 + P, right
  # after distance 1), zero rows on both sides (and for the L - W distances past the window) so
  # that every tile's bq + bk distances are one in-bounds slice
  p_rows = bq + bk
  pe_rows = key_pe_DxW.T
  if a:
    dt = jnp.result_type(key_pe_DxW.dtype, key_pe_ahead_DxA.dtype)
    pe_rows = jnp.concatenate([pe_rows.astype(dt), key_pe_ahead_DxA.T.astype(dt)], axis=0)
  pe_t = jnp.pad(pe_rows, ((p_rows + n_cached - w, p_rows), (0, dp - dh)))
  z = None if z_BxHxM is None else z_BxHxM.astype(jnp.float32)
  za = None if not asym else z_ahead_BxHxM.astype(jnp.float32)
  qs = ks = None
  if segmented:  # the keys' ids laid out as the keys: padding (0) where no row is
    qs = q_seg_BxM.astype(jnp.int32)
    ks = jnp.pad(kv_seg_BxT.astype(jnp.int32), ((0, 0), (n_cached - w, ap - a)))
  # persistent keys as rows, like the keys (H, N, Dh); float32 parameters stay float32 here and
  # are cast in the kernel, so their gradients are summed in float32
  pers = (None, None) if not n_pers else (pad(jnp.swapaxes(pers_k_HxDxN, 1, 2)),
                                          pad(pers_v_HxNxD))
  args = (pad(q_BxHxMxD), pad_kv(kv_cache_Bx2xHxDxL), pad_kv(kv_block_Bx2xHxDxM), pe_t, z,
          pallas_common.seed_array(dropout_seed), *pers, za, qs, ks)
  return args


def span_attention_kv(q_BxHxMxD, kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM, key_pe_DxW, z_BxHxM=None,
                      *, key_pe_ahead_DxA=None, z_ahead_BxHxM=None, q_seg_BxM=None,
                      kv_seg_BxT=None, ramp: int = 32, pers_k_HxDxN=None, pers_v_HxNxD=None,
                      eps: float = span_mask.EPS, block: int = 128, block_k: int | None = None,
                      dropout_rate: float = 0.0, dropout_seed=None, interpret: bool = False,
                      precision: str = "default", vmem_limit_bytes: int | None = None):
  """Banded attention over the W distances before each query (and the A after it), spans given
  at run time (TPU).

  Args:
    q_BxHxMxD: queries. Grouped heads: the keys and values have H_kv heads, H_kv dividing H;
      query head h reads key/value head h // (H / H_kv) through the index maps (no copy).
    kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM: [keys; values] of the last L >= W cached positions
      (L a multiple of the key tile; the L - W oldest are never visited, but share tiles with
      visited ones at zero weight, so they must be finite: `project_kv` pads with zero states)
      and of the block's M (then, with A > 0, the A rows ahead, padded with finite rows to a
      multiple of the key tile: M + Ap positions), positions last (`project_kv` writes them so).
      Query i is key L + i of the two parts together; distance d behind is key L + i - d,
      distance a ahead key L + i + a - 1 (the door's rows, kernels.Spec).
    key_pe_DxW: relative position embeddings, column W - d for distance d (its gradient comes
      back in its own dtype; the matmuls run in q's dtype). key_pe_ahead_DxA: those of the
      distances a = 1..A ahead, column a - 1, or None (causal).
    z_BxHxM: span in tokens per query row (broadcast an adaptive span (H,) to it), or None for a
      fixed span (no mask). Differentiable. Behind, distance d reads the mask at x = d - 1;
      ahead, distance a at x = a. z_ahead_BxHxM: the spans ahead where learned apart (needs z
      and A > 0), else None: z on both sides.
    q_seg_BxM, kv_seg_BxT: segment ids (int32) of the queries and of the door's W + M + A key
      rows, or None: a query sees only keys of its own nonzero segment (softmax over those
      only), a query of segment 0 gives zeros (persistent memory included), a query with no
      key gives zeros (or persistent memory alone). Key tiles whose ids cannot meet a query
      tile's are skipped.
    ramp: R of the soft mask. block: query tile bq (divides M); block_k: key tile bk (divides W,
      M and N; default: block). Compiled for a TPU, both multiples of 128 (lanes), or at least
      multiples of 8 with bq + bk a multiple of 128.
    pers_k_HxDxN, pers_v_HxNxD: N persistent keys and values per head (all-attention layers),
      or None. Their gradients come back in their own dtype (float32 parameters: float32).
    dropout_rate, dropout_seed: dropout on the attention weights (after the mask), the keep mask
      drawn by `hashed_dropout.dropout_scale` from a 32-bit seed; a rate of 0 compiles none.
    precision: float32 dots: 'default' (Mosaic's default) or 'highest' (exact float32).
    interpret: True (Pallas' interpreter) or a pltpu.InterpretParams (the TPU interpreter, which
      simulates VMEM and the pipeline) to run on CPU.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the three kernels (None: an estimate from
      the shapes, `vmem_bytes`).
  Returns:
    (B, H, M, Dh) in the dtype of q.
  """
  fused.check_inputs(pers_k_HxDxN, pers_v_HxNxD, dropout_rate, dropout_seed, precision)
  b, h, n_rows, dh = q_BxHxMxD.shape
  w = key_pe_DxW.shape[-1]
  bq, bk = block, block_k or block
  n_pers = 0 if pers_k_HxDxN is None else pers_k_HxDxN.shape[-1]
  n_cached = kv_cache_Bx2xHxDxL.shape[-1]
  a = 0 if key_pe_ahead_DxA is None else key_pe_ahead_DxA.shape[-1]
  ap = kv_block_Bx2xHxDxM.shape[-1] - n_rows
  _check_kv_inputs(q_BxHxMxD, kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM, key_pe_DxW, z_BxHxM,
                   key_pe_ahead_DxA, z_ahead_BxHxM, q_seg_BxM, kv_seg_BxT, pers_k_HxDxN,
                   pers_v_HxNxD, bq, bk)
  segmented = q_seg_BxM is not None
  dp = padded_head_dim(dh)
  pers_dtype = None if not n_pers else pers_k_HxDxN.dtype
  asym = z_ahead_BxHxM is not None
  if vmem_limit_bytes is None and not interpret:
    vmem_limit_bytes = vmem_bytes(n_cached + a, dp, bq, bk, q_BxHxMxD.dtype, key_pe_DxW.dtype,
                                  n_pers, pers_dtype or jnp.float32,
                                  row_stats=2 * asym + segmented, key_ids=segmented)
  s = _Static(n_cached=n_cached, ramp=int(ramp), eps=float(eps), bq=bq, bk=bk,
              scale=1.0 / math.sqrt(dh), precision=precision, interpret=interpret,
              vmem_limit_bytes=vmem_limit_bytes, rate=float(dropout_rate), n_pers=n_pers,
              w=w, a=a, ap=ap, asym=asym, segmented=segmented)
  args = _kernel_inputs(q_BxHxMxD, kv_cache_Bx2xHxDxL, kv_block_Bx2xHxDxM, key_pe_DxW,
                        key_pe_ahead_DxA, z_BxHxM, z_ahead_BxHxM, q_seg_BxM, kv_seg_BxT,
                        pers_k_HxDxN, pers_v_HxNxD, dropout_seed, dp, s)

  def kernel(q, kvc, kvb, pe, z, seed, pk, pv, za, qs, ks):
    return _attention(q, kvc, kvb, pe, z, lax.bitcast_convert_type(seed, jnp.int32), pk, pv,
                      za, qs, ks, s)

  # q, the keys and values, the spans and segment ids by batch rows; key_pe, the seed and
  # persistent vectors replicated
  return pallas_common.per_device(kernel, args, (True, True, True, False, True, False, False,
                                                 False, True, True, True), seed_at=5)[..., :dh]
