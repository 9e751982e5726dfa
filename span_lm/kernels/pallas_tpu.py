"""Fused banded attention with per-head spans as runtime values (Pallas; Mosaic on TPUs).

The maths of `pallas_gpu.span_attention` (which is the spec; `banded_reference.banded_attention`
is the definition): relative positions, the soft span mask and its renormalisation
(kernels/span_mask.py), torch.clamp's subgradient; an online-softmax forward and a
FlashAttention-2 backward (one kernel per query block for dq, the span gradient and d pe; one per
key block for dk, dv). Scores live one (query block, key block) tile at a time in VMEM.

Tiles: keys are the last T = W + M positions; the query at block row i sits at key index W + i
and sees distances d = W + i - t in [1, w_i], w_i = min(W, floor(z_i) + R + 1). The position term
q_i . pe[:, W - d] is Toeplitz in a tile: one matmul G = q_blk @ pe_slice^T over the tile's
bq + bk distances, then a per-row lane rotation (`pltpu.roll` with stride 1 over the sublanes:
row r turns by bk + r) gives pos[r, c] = G[r, bq - r + c], in registers; nothing is written to
HBM. Mosaic rotates 32-bit data only, with few strides (of 1..32, 127, 255 on a 128 x 256 tile
for v5e: 1, 2, 4, 8, 16; v4 has no strided rotate), so the backward's inverse (dG[r, j] =
ds[r, j - bq + r], a stride of -1) is built as reverse-rows o roll(stride 1) o reverse-rows; a
row reversal is a reversal of the 8-row groups (static slices) and of the rows within each group
(an in-vreg sublane gather).

Work skipping: the grid's key axis (query axis in the dk/dv kernel) counts steps, not blocks.
Per (batch, head, query block) the first and last visited key block come in as scalar-prefetched
int32s (SMEM), computed from the spans at run time; the index maps clamp to them, so a step past
a block's range re-uses the block already in VMEM (no DMA) and `pl.when` skips its compute. One
compiled program serves every span; a skipped step costs the grid's per-step overhead only.

d pe: each (batch) accumulates its (W + 2 (bq + bk), Dh) float32 gradient in one output block
that stays in VMEM over the (head, query block, key step) axes (marked 'arbitrary'); the batch
partials are summed by XLA. key_pe (transposed, zero-padded) sits whole in VMEM.

Head sizes that are not a multiple of 32 are zero-padded to a multiple of 128 lanes
(`padded_head_dim`; 64 and 96 run as they are); the padded columns add nothing to any score and
are sliced off. Row statistics (running max, denominator, delta, span, span gradient) travel as
(rows, 128) lane-replicated blocks, as in jax.experimental.pallas.ops.tpu.flash_attention; the
residuals saved for the backward pass are (B, H, M) float32 (two of them), plus the inputs and
the output.

Not implemented (a ValueError says so): persistent memory (all-attention layers) and attention
dropout. `interpret=True` (or a pltpu.InterpretParams) runs the same kernels on CPU for tests.
"""
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from span_lm.kernels import span_mask

NEG = -1e30
LANES = 128
PRECISIONS = ("default", "highest")


class _Static(NamedTuple):
  w: int
  ramp: int
  eps: float
  bq: int
  bk: int
  scale: float
  precision: str
  interpret: bool | pltpu.InterpretParams
  vmem_limit_bytes: int | None


def padded_head_dim(dh: int) -> int:
  """The head size the kernels run with: dh itself when a multiple of 32 (32, 64, 96, 128 compile
  unpadded for v5e), else the next multiple of 128 lanes."""
  return dh if dh % 32 == 0 else -(-dh // LANES) * LANES


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


def _skew(g, bq, bk):
  """(bq, bq + bk) G[r, j] -> (bq, bk) pos[r, c] = G[r, bq - r + c]."""
  return pltpu.roll(g, bk, 1, stride=1, stride_axis=0)[:, :bk]


def _unskew(ds, bq, bk):
  """The adjoint of `_skew`: (bq, bk) ds -> (bq, bq + bk) dG[r, j] = ds[r, j - bq + r], zero
  outside. Reversed rows r' = bq - 1 - r turn by 1 + r' (a positive stride)."""
  x = jnp.concatenate([_reverse_rows(ds), jnp.zeros((bq, bq), ds.dtype)], axis=1)
  return _reverse_rows(pltpu.roll(x, 1, 1, stride=1, stride_axis=0))


def _windows(z, s: _Static):
  """Distances each row visits ((rows, 1) int32; z: (rows, 1) spans or None for fixed)."""
  if z is None:
    return s.w
  return jnp.clip(span_mask.visited_distances(z, s.ramp), 1, s.w)


def _tile(q, k, pe_ref, t0, i0, win, s: _Static):
  """Scaled logits of one tile, its distances, which entries are visited, and the tile's
  bq + bk rows of key_pe (in q's dtype)."""
  bq, bk = s.bq, s.bk
  cont = _dot(q, k, s.precision, trans_b=True)  # bq x bk
  start = pl.multiple_of(t0 - i0 + bk, math.gcd(bq, bk))  # padded pe rows: distance d at W - d + P
  pe = pe_ref[pl.ds(start, bq + bk), :].astype(q.dtype)
  pos = _skew(_dot(q, pe, s.precision, trans_b=True), bq, bk)
  r = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  c = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  dist = (s.w + i0 - t0) + r - c
  visited = (dist >= 1) & (dist <= win)
  logits = jnp.where(visited, (cont + pos) * s.scale, NEG)
  return logits, dist, visited, pe


def _tile_grads(q, g, k, v, pe_ref, t0, i0, z, mx, den, delta, s: _Static):
  """Recomputes one tile: (ds = d logits times the scale, the weights a, the span gradient per
  row (bq, 1) or None, the tile's key_pe rows)."""
  logits, dist, visited, pe = _tile(q, k, pe_ref, t0, i0, _windows(z, s), s)
  p = jnp.where(visited, jnp.exp(logits - mx), 0.0) / den
  gv = _dot(g, v, s.precision, trans_b=True) - delta
  if z is None:
    return p * gv * s.scale, p, None, pe
  u = span_mask.ramp(z, dist.astype(jnp.float32), s.ramp)
  a = p * span_mask.clamp01(u)
  dl = a * gv - s.eps * p * delta
  dz = jnp.sum(p * gv * span_mask.clamp01_slope(u), axis=1, keepdims=True) / s.ramp
  return dl * s.scale, a, dz, pe


def _col(ref):
  return ref[:, 0:1]


def _rep(x):
  return jnp.broadcast_to(x, (x.shape[0], LANES))


def _fwd_kernel(bounds_ref, q_ref, k_ref, v_ref, pe_ref, *refs, s: _Static, has_mask, n_heads,
                n_q, n_steps):
  if has_mask:
    z_ref, o_ref, mx_ref, den_ref, acc_ref, m_ref, all_ref, msk_ref = refs
  else:
    z_ref = None
    o_ref, mx_ref, den_ref, acc_ref, m_ref, all_ref, msk_ref = refs
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  n_cells = pl.num_programs(0) * n_heads * n_q
  cell = (b * n_heads + h) * n_q + qi
  kb = bounds_ref[cell] + j

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, NEG)
    all_ref[...] = jnp.zeros_like(all_ref)
    msk_ref[...] = jnp.zeros_like(msk_ref)

  @pl.when(kb < bounds_ref[n_cells + cell])
  def _():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    z = _col(z_ref) if has_mask else None
    logits, dist, visited, _ = _tile(q, k, pe_ref, kb * s.bk, qi * s.bq, _windows(z, s), s)
    m_prev = _col(m_ref)
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.where(visited, jnp.exp(logits - m_new), 0.0)
    pm = p * span_mask.soft_mask(z, dist.astype(jnp.float32), s.ramp) if has_mask else p
    acc_ref[...] = acc_ref[...] * corr + _dot(pm.astype(v.dtype), v, s.precision)
    m_ref[...] = _rep(m_new)
    all_ref[...] = _rep(_col(all_ref) * corr + jnp.sum(p, axis=1, keepdims=True))
    if has_mask:
      msk_ref[...] = _rep(_col(msk_ref) * corr + jnp.sum(pm, axis=1, keepdims=True))

  @pl.when(j == n_steps - 1)
  def _():
    z_all = _col(all_ref)
    den = span_mask.online_denominator(_col(msk_ref), z_all, s.eps) if has_mask else z_all
    o_ref[...] = (acc_ref[...] / den).astype(o_ref.dtype)
    mx_ref[...] = m_ref[...]
    den_ref[...] = _rep(den)


def _bwd_q_kernel(bounds_ref, q_ref, k_ref, v_ref, pe_ref, *refs, s: _Static, has_mask, n_heads,
                  n_q, n_steps):
  """Per query block: dq, its rows' span gradient, and d pe into the batch's resident block."""
  if has_mask:
    z_ref, g_ref, mx_ref, den_ref, delta_ref, dq_ref, dz_ref, dpe_ref, dq_acc, dz_acc = refs
  else:
    g_ref, mx_ref, den_ref, delta_ref, dq_ref, dpe_ref, dq_acc = refs
    z_ref = dz_ref = dz_acc = None
  b, h, qi, j = (pl.program_id(i) for i in range(4))
  n_cells = pl.num_programs(0) * n_heads * n_q
  cell = (b * n_heads + h) * n_q + qi
  kb = bounds_ref[cell] + j
  bq, bk = s.bq, s.bk

  @pl.when((h == 0) & (qi == 0) & (j == 0))
  def _():
    dpe_ref[...] = jnp.zeros_like(dpe_ref)

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros_like(dq_acc)
    if has_mask:
      dz_acc[...] = jnp.zeros_like(dz_acc)

  @pl.when(kb < bounds_ref[n_cells + cell])
  def _():
    q, k, g = q_ref[...], k_ref[...], g_ref[...]
    t0, i0 = kb * bk, qi * bq
    z = _col(z_ref) if has_mask else None
    ds, _, dz, pe = _tile_grads(q, g, k, v_ref[...], pe_ref, t0, i0, z, _col(mx_ref),
                                _col(den_ref), _col(delta_ref), s)
    if has_mask:
      dz_acc[...] = _rep(_col(dz_acc) + dz)
    dg = _unskew(ds, bq, bk)  # bq x (bq + bk), over the tile's distances
    start = pl.multiple_of(t0 - i0 + bk, math.gcd(bq, bk))
    dq_acc[...] += (_dot(ds.astype(k.dtype), k, s.precision)
                    + _dot(dg.astype(pe.dtype), pe, s.precision))
    dpe_ref[pl.ds(start, bq + bk), :] += _dot(dg.astype(q.dtype), q, s.precision, trans_a=True)

  @pl.when(j == n_steps - 1)
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
    if has_mask:
      dz_ref[...] = dz_acc[...]


def _bwd_kv_kernel(bounds_ref, qb_ref, q_ref, k_ref, v_ref, pe_ref, *refs, s: _Static, has_mask,
                   n_heads, n_q, n_kb, n_steps):
  """Per key block: dk and dv, summed over the query blocks that see it (deterministic)."""
  if has_mask:
    z_ref, g_ref, mx_ref, den_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
  else:
    g_ref, mx_ref, den_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
    z_ref = None
  b, h, kb, j = (pl.program_id(i) for i in range(4))
  n_cells, n_kcells = (pl.num_programs(0) * n_heads * n for n in (n_q, n_kb))
  qi = qb_ref[(b * n_heads + h) * n_kb + kb] + j
  cell = (b * n_heads + h) * n_q + qi
  # a query block inside [first, last] of this key block's readers that does not read it skips
  run = qi < qb_ref[n_kcells + (b * n_heads + h) * n_kb + kb]
  cell = jnp.where(run, cell, 0)
  run = run & (bounds_ref[cell] <= kb) & (kb < bounds_ref[n_cells + cell])

  @pl.when(j == 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(run)
  def _():
    q, k, g = q_ref[...], k_ref[...], g_ref[...]
    z = _col(z_ref) if has_mask else None
    ds, a, _, _ = _tile_grads(q, g, k, v_ref[...], pe_ref, kb * s.bk, qi * s.bq, z,
                              _col(mx_ref), _col(den_ref), _col(delta_ref), s)
    dk_acc[...] += _dot(ds.astype(q.dtype), q, s.precision, trans_a=True)
    dv_acc[...] += _dot(a.astype(g.dtype), g, s.precision, trans_a=True)

  @pl.when(j == n_steps - 1)
  def _():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _key_bounds(z, b, h, m, s: _Static):
  """(2 B H nq,) int32: the first key block visited by some row of each query block, then the
  last + 1."""
  nq = m // s.bq
  if z is None:
    win = jnp.full((b, h, m), s.w, jnp.int32)
  else:
    win = jnp.clip(span_mask.visited_distances(lax.stop_gradient(z), s.ramp), 1, s.w)
  r = (jnp.arange(m, dtype=jnp.int32) % s.bq).reshape(1, 1, m)
  i0 = (jnp.arange(nq, dtype=jnp.int32) * s.bq).reshape(1, 1, nq)
  first = s.w + i0 + jnp.min((r - win).reshape(b, h, nq, s.bq), axis=-1)
  lo = first // s.bk
  hi = jnp.broadcast_to((s.w + i0 + s.bq - 2) // s.bk + 1, lo.shape)
  return jnp.concatenate([lo.reshape(-1), hi.reshape(-1)]).astype(jnp.int32)


def _key_steps(m, s: _Static):
  """Grid steps over key blocks: the most a query block can visit (every span = W)."""
  return max((s.w + i0 + s.bq - 2) // s.bk + 1 - i0 // s.bk for i0 in range(0, m, s.bq))


def _query_bounds(bounds, b, h, m, s: _Static):
  """(2 B H nkb,) int32: [first..., last + 1...) query block that reads each key block."""
  nq, nkb = m // s.bq, (s.w + m) // s.bk
  lo, hi = bounds[:b * h * nq].reshape(b, h, nq, 1), bounds[b * h * nq:].reshape(b, h, nq, 1)
  kb = jnp.arange(nkb, dtype=jnp.int32).reshape(1, 1, 1, nkb)
  reads = (lo <= kb) & (kb < hi)  # B H nq nkb
  qi = jnp.arange(nq, dtype=jnp.int32).reshape(1, 1, nq, 1)
  first = jnp.min(jnp.where(reads, qi, nq), axis=2)
  last = jnp.max(jnp.where(reads, qi, -1), axis=2)
  first = jnp.where(last < 0, 0, first)
  return jnp.concatenate([first.reshape(-1), (last + 1).reshape(-1)]).astype(jnp.int32)


def _query_steps(m, s: _Static):
  """Grid steps over query blocks: the most query blocks that read one key block (span = W)."""
  nq, nkb = m // s.bq, (s.w + m) // s.bk
  lo = [i0 // s.bk for i0 in range(0, m, s.bq)]
  hi = [(s.w + i0 + s.bq - 2) // s.bk + 1 for i0 in range(0, m, s.bq)]
  return max(1, max(sum(lo[q] <= kb < hi[q] for q in range(nq)) for kb in range(nkb)))


def _cost(kind: str, q, k, s: _Static, steps: int, has_mask: bool) -> pl.CostEstimate:
  """What one call does if every span is W (the grid's worst case; shorter spans skip tiles), so
  XLA's scheduler and the compile mode's roofline see the kernel: its matmul FLOPs per visited
  tile (content, position over the tile's bq + bk distances, values; the backward's recompute and
  gradients), exp per score, and HBM bytes (blocks as the index maps fetch them)."""
  b, h, m, dp = q.shape
  isz, t = jnp.dtype(q.dtype).itemsize, k.shape[2]
  nq, nkb = m // s.bq, t // s.bk
  qk, pos = 2 * s.bq * s.bk * dp, 2 * s.bq * (s.bq + s.bk) * dp
  row, key, stat = s.bq * dp * isz, s.bk * dp * isz, s.bq * LANES * 4
  pe = (s.w + 2 * (s.bq + s.bk)) * dp * 4
  if kind == "fwd":  # per tile: content, position, values
    tiles, flops = b * h * nq * steps, 2 * qk + pos
    byts = b * h * nq * (2 * row + 2 * stat + stat * has_mask + steps * 2 * key) + pe
  elif kind == "bwd_q":  # recompute, g.v, dq (content and position), d pe
    tiles, flops = b * h * nq * steps, 3 * qk + 3 * pos
    byts = b * h * nq * (3 * row + 3 * stat + 2 * stat * has_mask + steps * 2 * key) + 2 * pe * b
  else:  # bwd_kv, per (key block, query step): recompute, g.v, dk, dv
    tiles, flops = b * h * nkb * steps, 4 * qk + pos
    byts = b * h * nkb * (4 * key + steps * (2 * row + 3 * stat + stat * has_mask)) + pe
  return pl.CostEstimate(flops=int(tiles * flops), transcendentals=int(tiles * s.bq * s.bk),
                         bytes_accessed=int(byts))


def _params(s: _Static, semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=s.vmem_limit_bytes)


def _replicate(x_BxHxM):
  return jnp.broadcast_to(x_BxHxM[..., None], (*x_BxHxM.shape, LANES))


def _query_grid_specs(b, h, nq, dp, s: _Static):
  """BlockSpecs of the (batch, head, query block, key step) grid of the forward and dq kernels:
  query rows, their row statistics, and the key block of each step, clamped to the block's
  scalar-prefetched [first, last] (a step past it re-uses the block in VMEM: no DMA)."""
  def key_map(bi, hi, qi, j, bnd):
    cell = (bi * h + hi) * nq + qi
    return bi, hi, jnp.minimum(bnd[cell] + j, bnd[b * h * nq + cell] - 1), 0

  here = lambda bi, hi, qi, j, bnd: (bi, hi, qi, 0)
  return (pl.BlockSpec((None, None, s.bq, dp), here),
          pl.BlockSpec((None, None, s.bq, LANES), here),
          pl.BlockSpec((None, None, s.bk, dp), key_map))


def _forward(q, k, v, pe_t, z, s: _Static):
  b, h, m, dp = q.shape
  nq, steps = m // s.bq, _key_steps(m, s)
  has_mask = z is not None
  bounds = _key_bounds(z, b, h, m, s)

  rows, stat, keys = _query_grid_specs(b, h, nq, dp, s)
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  in_specs = [rows, keys, keys, whole] + ([stat] if has_mask else [])
  args = [q, k, v, pe_t] + ([_replicate(z)] if has_mask else [])
  kernel = functools.partial(_fwd_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq,
                             n_steps=steps)
  out, mx, den = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, h, nq, steps), in_specs=in_specs,
          out_specs=[rows, stat, stat],
          scratch_shapes=[pltpu.VMEM((s.bq, dp), jnp.float32)]
          + [pltpu.VMEM((s.bq, LANES), jnp.float32)] * 3),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, m, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, m, LANES), jnp.float32)],
      compiler_params=_params(s, ("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=_cost("fwd", q, k, s, steps, has_mask),
      interpret=s.interpret, name="span_attention_fwd")(bounds, *args)
  return out, mx[..., 0], den[..., 0]


def _backward(s: _Static, res, g):
  q, k, v, pe_t, z, out, mx, den = res
  b, h, m, dp = q.shape
  t = k.shape[2]
  nq, nkb = m // s.bq, t // s.bk
  has_mask = z is not None
  delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
  bounds = _key_bounds(z, b, h, m, s)
  stats = [_replicate(mx), _replicate(den), _replicate(delta)]
  zr = [_replicate(z)] if has_mask else []
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)

  # dq, dz, d pe: the forward's grid
  steps = _key_steps(m, s)

  rows, stat, keys = _query_grid_specs(b, h, nq, dp, s)
  dpe_spec = pl.BlockSpec((None, *pe_t.shape), lambda bi, hi, qi, j, bnd: (bi, 0, 0))
  out_specs = [rows] + ([stat] if has_mask else []) + [dpe_spec]
  out_shape = ([jax.ShapeDtypeStruct(q.shape, q.dtype)]
               + ([jax.ShapeDtypeStruct((b, h, m, LANES), jnp.float32)] if has_mask else [])
               + [jax.ShapeDtypeStruct((b, *pe_t.shape), jnp.float32)])
  scratch = [pltpu.VMEM((s.bq, dp), jnp.float32)]
  scratch += [pltpu.VMEM((s.bq, LANES), jnp.float32)] if has_mask else []
  kernel = functools.partial(_bwd_q_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq,
                             n_steps=steps)
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, h, nq, steps),
          in_specs=[rows, keys, keys, whole] + ([stat] if has_mask else []) + [rows] + [stat] * 3,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      # d pe stays resident per batch row over heads, query blocks and key steps
      compiler_params=_params(s, ("parallel", "arbitrary", "arbitrary", "arbitrary")),
      cost_estimate=_cost("bwd_q", q, k, s, steps, has_mask),
      interpret=s.interpret, name="span_attention_bwd_q")(
          bounds, q, k, v, pe_t, *zr, g, *stats)
  dq, dpe = outs[0], outs[-1]
  dz = outs[1][..., 0] if has_mask else None

  # dk, dv: per key block, over the query blocks that read it
  qbounds = _query_bounds(bounds, b, h, m, s)
  qsteps = _query_steps(m, s)

  def query_map(bi, hi, kb, j, bnd, qbnd):
    cell = (bi * h + hi) * nkb + kb
    first = qbnd[cell]
    return bi, hi, jnp.maximum(jnp.minimum(first + j, qbnd[b * h * nkb + cell] - 1), first), 0

  rows_k = pl.BlockSpec((None, None, s.bq, dp), query_map)
  stat_k = pl.BlockSpec((None, None, s.bq, LANES), query_map)
  keys_k = pl.BlockSpec((None, None, s.bk, dp), lambda bi, hi, kb, j, bnd, qbnd: (bi, hi, kb, 0))
  kernel = functools.partial(_bwd_kv_kernel, s=s, has_mask=has_mask, n_heads=h, n_q=nq,
                             n_kb=nkb, n_steps=qsteps)
  dk, dv = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, h, nkb, qsteps),
          in_specs=[rows_k, keys_k, keys_k, whole] + ([stat_k] if has_mask else [])
          + [rows_k] + [stat_k] * 3,
          out_specs=[keys_k, keys_k],
          scratch_shapes=[pltpu.VMEM((s.bk, dp), jnp.float32)] * 2),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(s, ("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=_cost("bwd_kv", q, k, s, qsteps, has_mask),
      interpret=s.interpret, name="span_attention_bwd_kv")(
          bounds, qbounds, q, k, v, pe_t, *zr, g, *stats)
  return dq, dk, dv, jnp.sum(dpe, axis=0).astype(pe_t.dtype), dz


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, pe_t, z, s):
  return _forward(q, k, v, pe_t, z, s)[0]


def _attention_fwd(q, k, v, pe_t, z, s):
  out, mx, den = _forward(q, k, v, pe_t, z, s)
  return out, (q, k, v, pe_t, z, out, mx, den)


_attention.defvjp(_attention_fwd, _backward)


def span_attention(q_BxHxMxD, k_BxHxTxD, v_BxHxTxD, key_pe_DxW, z_BxHxM=None, *, ramp: int = 32,
                   pers_k_HxDxN=None, pers_v_HxNxD=None, eps: float = span_mask.EPS,
                   block: int = 128, block_k: int | None = None, dropout_rate: float = 0.0,
                   dropout_seed=None, interpret: bool = False, precision: str = "default",
                   vmem_limit_bytes: int | None = None):
  """Banded attention over the W distances before each query, spans given at run time (TPU).

  Args:
    q_BxHxMxD: queries. k/v_BxHxTxD: keys/values of the last T = W + M positions.
    key_pe_DxW: relative position embeddings, column W - d for distance d (its gradient comes
      back in its own dtype; the matmuls run in q's dtype).
    z_BxHxM: span in tokens per query row (broadcast an adaptive span (H,) to it), or None for a
      fixed span (no mask). Differentiable.
    ramp: R of the soft mask. block: query tile bq (divides M); block_k: key tile bk (divides W
      and M; default: block). Compiled for a TPU, both multiples of 128 (lanes), or at least
      multiples of 8 with bq + bk a multiple of 128.
    pers_k_HxDxN, pers_v_HxNxD, dropout_rate, dropout_seed: not implemented here (ValueError
      unless None / 0).
    precision: float32 dots: 'default' (Mosaic's default) or 'highest' (exact float32).
    interpret: True (Pallas' interpreter) or a pltpu.InterpretParams (the TPU interpreter, which
      simulates VMEM and the pipeline) to run on CPU.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the three kernels (None: an estimate from
      the shapes, `vmem_bytes`).
  Returns:
    (B, H, M, Dh) in the dtype of q.
  """
  if pers_k_HxDxN is not None or pers_v_HxNxD is not None:
    raise ValueError("pallas_tpu.span_attention: persistent memory is not implemented in the TPU "
                     "kernel (use pallas_gpu or banded_reference)")
  if dropout_rate:
    raise ValueError("pallas_tpu.span_attention: attention dropout is not implemented in the TPU "
                     "kernel (use pallas_gpu or banded_reference)")
  del dropout_seed
  if precision not in PRECISIONS:
    raise ValueError(f"fused attention: precision={precision!r}: choose one of {PRECISIONS}")
  b, h, m, dh = q_BxHxMxD.shape
  w = key_pe_DxW.shape[-1]
  bq, bk = block, block_k or block
  if k_BxHxTxD.shape != (b, h, w + m, dh) or v_BxHxTxD.shape != (b, h, w + m, dh):
    raise ValueError(f"fused attention: keys {k_BxHxTxD.shape}, values {v_BxHxTxD.shape} for "
                     f"queries {q_BxHxMxD.shape} and window {w}")
  if m % bq or m % bk or w % bk:
    raise ValueError(f"fused attention: block {m} must be a multiple of {bq} and {bk}, window "
                     f"{w} of {bk}")
  if bq % 8 or bk % 8:
    raise ValueError(f"fused attention: tiles {bq}, {bk} must be multiples of 8")
  if z_BxHxM is not None and z_BxHxM.shape != (b, h, m):
    raise ValueError(f"fused attention: spans {z_BxHxM.shape}, want {(b, h, m)}")
  dp = padded_head_dim(dh)
  if vmem_limit_bytes is None and not interpret:
    vmem_limit_bytes = vmem_bytes(w, dp, bq, bk, q_BxHxMxD.dtype, key_pe_DxW.dtype)
  s = _Static(w=w, ramp=int(ramp), eps=float(eps), bq=bq, bk=bk, scale=1.0 / math.sqrt(dh),
              precision=precision, interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)
  pad = lambda x: x if dp == dh else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - dh)])
  # key_pe as rows (distance d at row W - d + P), zero rows on both sides so that every tile's
  # bq + bk distances are one in-bounds slice
  p_rows = bq + bk
  pe_t = jnp.pad(key_pe_DxW.T, ((p_rows, p_rows), (0, dp - dh)))
  z = None if z_BxHxM is None else z_BxHxM.astype(jnp.float32)
  args = (pad(q_BxHxMxD), pad(k_BxHxTxD), pad(v_BxHxTxD), pe_t)

  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
  if math.prod(mesh.shape[a] for a in axes) == 1:
    return _attention(*args, z, s)[..., :dh]

  # A pallas_call is opaque to XLA's partitioner: under a mesh each device runs the kernel on
  # its own batch rows (as pallas_gpu.span_attention).
  rows, rep = jax.sharding.PartitionSpec(axes), jax.sharding.PartitionSpec()
  in_specs = (rows, rows, rows, rep, None if z is None else rows)
  local = lambda q, k, v, pe, z: _attention(q, k, v, pe, z, s)
  return jax.shard_map(local, mesh=mesh, out_specs=rows, check_vma=False, in_specs=in_specs,
                       axis_names=frozenset(axes))(*args, z)[..., :dh]


def vmem_bytes(w: int, dp: int, bq: int, bk: int, dtype, pe_dtype=jnp.float32) -> int:
  """A scoped-VMEM limit for the kernels at these shapes: the resident key_pe and (twice, as
  an output block) its float32 gradient, the double-buffered tiles, the tile temporaries; with
  half again for Mosaic's own, and at least 32 MiB."""
  rows = w + 2 * (bq + bk)
  act = jnp.dtype(dtype).itemsize
  resident = rows * dp * (jnp.dtype(pe_dtype).itemsize + 2 * 4)
  tiles = 2 * (4 * bq * dp * act + 2 * bk * dp * act + 6 * bq * LANES * 4)
  temps = 12 * bq * (bq + bk) * 4 + 4 * (bq + bk) * dp * 4
  return int(max(32 << 20, 1.5 * (resident + tiles + temps) + (4 << 20)))
