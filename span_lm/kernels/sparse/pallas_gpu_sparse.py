"""Block-sparse attention for the Sparse Transformer's patterns on GPUs (Pallas; Triton).

A flash-attention kernel that visits only the non-empty (query block, key block) tiles of each
head's connectivity (span_lm/kernels/sparse/block_sparse.py): strided and fixed patterns, merged,
split or interleaved, dense causal heads too. Per head and row an int32 table built at trace
time lists the FULL tiles (run without an element mask) and the PARTIAL ones (masked by the
pattern formula); tiles outside the list are never read. Softmax in float32; a query with no key
gives 0 and zero gradients, never NaN. Backward as FlashAttention-2: no atomics, deterministic.
Queries come pre-scaled.

Why each choice (the lists, the element mask, padding, the tiles in TILES and the work they
skip): docs/kernels.md, "The block-sparse kernel's design" (under "Block-sparse kernels for the
Sparse Transformer"). Interpret mode (`interpret=True`) runs the same kernels on CPU for tests.
"""
import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.sparse import block_sparse
from span_lm.kernels import pallas_common
from span_lm.kernels import target
from span_lm.kernels.sparse.block_sparse import HeadPattern

plt = target.pallas_triton()  # jax.experimental.pallas.triton

NEG = -1e30
BIG = 1e30  # the log-sum-exp of a row with no key: exp(s - BIG) = 0 on every key

# (compute capability major, dtype) -> (query tile, key tile, warps, stages). 64-row query tiles
# (wgmma), 32-key tiles (a quarter of the tiles at the fixed pattern's summary columns). float32:
# on an H100 16-key tiles (at 32, bwd_kv spills 16 + 12 B with 4 warps, 164 + 160 B with 8), the
# same tiles computed at the enwik8 shape; on an A100 32 x 32 (64 x 32: no spills but bwd_kv at
# the 255-register ceiling; 64 x 16: 220). bf16 64 x 64 (half the tiles skipped, not three
# quarters): an A100's bwd_kv spills 4 + 4 B. From deviceless ptxas compiles (docs/kernels.md,
# "Block-sparse kernels"): untimed on a device.
TILES = {
    (9, "bfloat16"): (64, 32, 4, 3), (9, "float16"): (64, 32, 4, 3),
    (9, "float32"): (64, 16, 4, 2),
    (8, "bfloat16"): (64, 32, 4, 2), (8, "float16"): (64, 32, 4, 2),
    (8, "float32"): (32, 32, 4, 2),
}
DEFAULT_TILES = (64, 32, 4, 2)  # interpret mode and unknown targets
MAX_HEAD_DIM = 256


def misfit(heads, n: int, head_dim: int) -> str:
  """'' when the kernel runs these heads at length n and head size head_dim, else why not."""
  if not heads:
    return "no head patterns"
  for h in heads:
    if not isinstance(h, HeadPattern):
      return f"{h!r} is not a block_sparse.HeadPattern"
    if h.kind not in ("strided", "fixed", "dense"):
      return f"unknown pattern kind {h.kind!r}"
    if h.kind != "dense" and not (h.local or h.summary):
      return f"head {h} attends to no part of its pattern"
    if h.kind != "dense" and h.stride < 1:
      return f"stride {h.stride} < 1"
  if n < 1:
    return f"length {n} < 1"
  if head_dim < 1 or head_dim > MAX_HEAD_DIM:
    return f"head size {head_dim} outside [1, {MAX_HEAD_DIM}] (the tiles would not fit)"
  return ""


def tiles(compute_capability, dtype) -> tuple[int, int, int, int]:
  """(query tile, key tile, warps, stages) for a target (None: not a GPU) and a dtype."""
  key = (None if compute_capability is None else int(compute_capability), jnp.dtype(dtype).name)
  return TILES.get(key, DEFAULT_TILES)


def _target_tiles(dtype):
  p = target.current()
  return tiles(p.compute_capability if p.name == "gpu" else None, dtype)


def computed_pairs(head: HeadPattern, n: int, dtype="bfloat16") -> int:
  """(query, key) pairs the kernel computes for one head over n positions at the target's tiles:
  its non-empty tiles (block_sparse.block_map) times the tile area, partial tiles whole."""
  bq, bk = _target_tiles(dtype)[:2]
  return int((block_sparse.block_map(head, n, bq, bk) != block_sparse.EMPTY).sum()) * bq * bk


def _pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def padded_head_dim(dh: int) -> int:
  return max(16, _pow2(dh))


# ------------------------------------------------------------------------------------- the lists


def _split_lists(bmap):
  """Per row of a block map (R, C): (FULL counts, PARTIAL counts, (R, w) indices: the row's FULL
  columns, then its PARTIAL ones, each in increasing order, padded with the last index)."""
  full, part = bmap == block_sparse.FULL, bmap == block_sparse.PARTIAL
  nf, np_ = full.sum(-1).astype(np.int32), part.sum(-1).astype(np.int32)
  # stable sort by (FULL first, PARTIAL next, EMPTY last), column order within each
  rank = np.where(full, 0, np.where(part, 1, 2))
  order = np.argsort(rank, axis=-1, kind="stable").astype(np.int32)
  width = max(1, int((nf + np_).max(initial=0)))
  order = order[:, :width]
  last = np.take_along_axis(order, np.maximum(nf + np_ - 1, 0)[:, None], -1)
  pad = np.arange(width) >= (nf + np_)[:, None]
  return nf, np_, np.where(pad, last, order).astype(np.int32)


@functools.lru_cache(maxsize=256)
def _head_lists(head: HeadPattern, n: int, bq: int, bk: int):
  bmap = block_sparse.block_map(head, n, bq, bk)
  return _split_lists(bmap), _split_lists(bmap.T)


def _table(parts, offsets):
  """Per head (FULL counts (R,), PARTIAL counts (R,), indices (R, w)) and its summary offset ->
  (H, R, P) int32 rows [FULL count, PARTIAL count, offset, indices...], P a power of two."""
  w = max(p[2].shape[-1] for p in parts)
  r = parts[0][0].shape[0]
  p = _pow2(w + 3)
  t = np.zeros((len(parts), r, p), np.int32)
  for h, ((nf, np_, idx), off) in enumerate(zip(parts, offsets)):
    t[h, :, 0], t[h, :, 1], t[h, :, 2] = nf, np_, off
    t[h, :, 3:3 + idx.shape[-1]] = idx
    t[h, :, 3 + idx.shape[-1]:] = idx[:, -1:]
  return t


@functools.lru_cache(maxsize=64)
def tables(heads: tuple, n: int, bq: int, bk: int):
  """(forward table over query blocks, backward table over key blocks) of a group of heads, as
  numpy int32 (H, rows, P): [FULL count, PARTIAL count, summary offset, the FULL blocks' indices,
  the PARTIAL blocks' indices, padding]."""
  lists = [_head_lists(h, n, bq, bk) for h in heads]
  offsets = [h.offset for h in heads]
  return _table([f for f, _ in lists], offsets), _table([b for _, b in lists], offsets)


# ----------------------------------------------------------------------------------- the kernels


def _mask(head, offset, i0, t0, *, n, bq, bk):
  """(bq, bk) booleans: query i0 + r attends key t0 + c (and the key is a real one)."""
  i = i0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  j = t0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  pat = head
  if head.kind == "fixed" and head.summary:
    pat = dataclasses.replace(head, offset=offset)
  return block_sparse.allowed_in_kernel(pat, i, j) & (j < n)


def _loops(tab_ref, body, carry):
  """body(t, carry, masked) over the row's FULL blocks (no element mask), then its PARTIAL
  ones."""
  n_full, n_part = tab_ref[0], tab_ref[1]
  carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
  return lax.fori_loop(n_full, n_full + n_part, functools.partial(body, masked=True), carry)


def _fwd_kernel(tab_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, head, n, bq, bk, exact):
  i0 = pl.program_id(2) * bq
  offset = tab_ref[2]
  q = q_ref[...]

  def body(t, carry, masked):
    acc, m, l = carry
    t0 = tab_ref[3 + t] * bk
    k = k_ref[pl.ds(t0, bk), :]
    v = v_ref[pl.ds(t0, bk), :]
    logits = pallas_common.dot(q, k, trans_b=True, exact=exact)
    if masked:
      mask = _mask(head, offset, i0, t0, n=n, bq=bq, bk=bk)
      logits = jnp.where(mask, logits, NEG)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[:, None])
    if masked:
      p = jnp.where(mask, p, 0.0)
    acc = acc * corr[:, None] + pallas_common.dot(p.astype(v.dtype), v, exact=exact)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  e = o_ref.shape[-1]
  acc, m, l = _loops(tab_ref, body, (
      jnp.zeros((bq, e), jnp.float32), jnp.full((bq,), NEG, jnp.float32),
      jnp.zeros((bq,), jnp.float32)))
  live = l > 0
  o_ref[...] = (acc / jnp.where(live, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), BIG)


def _bwd_q_kernel(tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, head, n,
                  bq, bk, exact):
  i0 = pl.program_id(2) * bq
  offset = tab_ref[2]
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def body(t, dq, masked):
    t0 = tab_ref[3 + t] * bk
    k = k_ref[pl.ds(t0, bk), :]
    v = v_ref[pl.ds(t0, bk), :]
    p = jnp.exp(pallas_common.dot(q, k, trans_b=True, exact=exact) - lse[:, None])
    if masked:
      p = jnp.where(_mask(head, offset, i0, t0, n=n, bq=bq, bk=bk), p, 0.0)
    dp = pallas_common.dot(do, v, trans_b=True, exact=exact)
    ds = p * (dp - delta[:, None])
    return dq + pallas_common.dot(ds.astype(k.dtype), k, exact=exact)

  dq = _loops(tab_ref, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _bwd_kv_kernel(tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                   head, n, bq, bk, exact):
  t0 = pl.program_id(2) * bk
  offset = tab_ref[2]
  k, v = k_ref[...], v_ref[...]

  def body(t, carry, masked):
    dk_t, dv_t = carry
    i0 = tab_ref[3 + t] * bq
    rows = pl.ds(i0, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    lse, delta = lse_ref[rows], delta_ref[rows]
    p = jnp.exp(pallas_common.dot(q, k, trans_b=True, exact=exact) - lse[:, None])
    if masked:
      p = jnp.where(_mask(head, offset, i0, t0, n=n, bq=bq, bk=bk), p, 0.0)
    dv_t = dv_t + pallas_common.dot(do, p.astype(do.dtype), trans_a=True, exact=exact)
    dp = pallas_common.dot(do, v, trans_b=True, exact=exact)
    ds = p * (dp - delta[:, None])
    return dk_t + pallas_common.dot(q, ds.astype(q.dtype), trans_a=True, exact=exact), dv_t

  # dK and dV accumulate transposed, (head size, bk): the dots' rows are the head size (64 or
  # more), so a 32-key tile still runs Hopper's wgmma (64-row operands), not mma.sync.
  dk_t, dv_t = _loops(tab_ref, body, (jnp.zeros(k.shape[::-1], jnp.float32),
                                      jnp.zeros(v.shape[::-1], jnp.float32)))
  dk_ref[...] = dk_t.T.astype(dk_ref.dtype)
  dv_ref[...] = dv_t.T.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------- the calls


def _specs(tab, nrow):
  """BlockSpecs over the grid (batch, head, row block): the row's table entry, a block of rows,
  every row (the tiles the lists name are sliced inside), a block's statistics, every row's."""
  table = pl.BlockSpec((None, None, tab.shape[-1]), lambda b, h, r: (h, r, 0))
  own = lambda rows, d: pl.BlockSpec((None, None, rows, d), lambda b, h, r: (b, h, r, 0))
  every = lambda d: pl.BlockSpec((None, None, nrow, d), lambda b, h, r: (b, h, 0, 0))
  own_stat = lambda rows: pl.BlockSpec((None, None, rows), lambda b, h, r: (b, h, r))
  every_stat = pl.BlockSpec((None, None, nrow), lambda b, h, r: (b, h, 0))
  return table, own, every, own_stat, every_stat


def _forward(q, k, v, heads, n, cfg):
  bq, bk, warps, stages, interpret, exact = cfg
  b, h, npad, d = q.shape
  e = v.shape[-1]
  tab_f, _ = tables(heads, n, bq, bk)
  table, own, every, own_stat, _ = _specs(tab_f, npad)
  kernel = functools.partial(_fwd_kernel, head=heads[0], n=n, bq=bq, bk=bk, exact=exact)
  return pl.pallas_call(
      kernel, grid=(b, h, npad // bq),
      in_specs=[table, own(bq, d), every(d), every(e)],
      out_specs=[own(bq, e), own_stat(bq)],
      out_shape=[jax.ShapeDtypeStruct((b, h, npad, e), q.dtype),
                 jax.ShapeDtypeStruct((b, h, npad), jnp.float32)],
      interpret=interpret, name="block_sparse_attention_fwd",
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
  )(jnp.asarray(tab_f), q, k, v)


def _backward(q, k, v, o, lse, do, heads, n, cfg):
  bq, bk, warps, stages, interpret, exact = cfg
  b, h, npad, d = q.shape
  e = v.shape[-1]
  tab_f, tab_b = tables(heads, n, bq, bk)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  params = plt.CompilerParams(num_warps=warps, num_stages=stages)
  static = dict(head=heads[0], n=n, bq=bq, bk=bk, exact=exact)
  table, own, every, own_stat, every_stat = _specs(tab_f, npad)
  dq = pl.pallas_call(
      functools.partial(_bwd_q_kernel, **static), grid=(b, h, npad // bq),
      in_specs=[table, own(bq, d), every(d), every(e), own(bq, e), own_stat(bq), own_stat(bq)],
      out_specs=own(bq, d),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
      interpret=interpret, name="block_sparse_attention_bwd_q", compiler_params=params,
  )(jnp.asarray(tab_f), q, k, v, do, lse, delta)
  table_b = pl.BlockSpec((None, None, tab_b.shape[-1]), lambda b_, h_, r: (h_, r, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_bwd_kv_kernel, **static), grid=(b, h, npad // bk),
      in_specs=[table_b, every(d), own(bk, d), own(bk, e), every(e), every_stat, every_stat],
      out_specs=[own(bk, d), own(bk, e)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=interpret, name="block_sparse_attention_bwd_kv", compiler_params=params,
  )(jnp.asarray(tab_b), q, k, v, do, lse, delta)
  return dq.astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _group_attention(q, k, v, heads, n, cfg):
  return _forward(q, k, v, heads, n, cfg)[0]


def _group_fwd(q, k, v, heads, n, cfg):
  o, lse = _forward(q, k, v, heads, n, cfg)
  return o, (q, k, v, o, lse)


def _group_bwd(heads, n, cfg, res, do):
  q, k, v, o, lse = res
  return _backward(q, k, v, o, lse, do, heads, n, cfg)


_group_attention.defvjp(_group_fwd, _group_bwd)


def block_sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret: bool = False,
                           block_q: int | None = None, block_k: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           precision: str = "default"):
  """Causal attention of each head under its Sparse Transformer pattern, visiting only the
  non-empty tiles (queries pre-scaled).

  Args:
    q_BxHxNxD, k_BxHxNxD, v_BxHxNxE: queries (already scaled), keys, values.
    heads: one block_sparse.HeadPattern per head.
    interpret: run the Pallas kernels in interpret mode (CPU tests).
    block_q, block_k, num_warps, num_stages: override the target's TILES entry.
    precision: float32 dots 'default' (TF32 tensor cores on sm_80+) or 'highest' (exact).
  Returns:
    (B, H, N, E) in the dtype of q; float32 softmax; a query with no key gives zeros.
  """
  heads = tuple(heads)
  b, h, n, d = q_BxHxNxD.shape
  e = v_BxHxNxE.shape[-1]
  if len(heads) != h:
    raise ValueError(f"{len(heads)} head patterns for {h} heads")
  why = misfit(heads, n, max(d, e))
  if why:
    raise ValueError(f"block-sparse attention: {why}")
  tq, tk, tw, ts = _target_tiles(q_BxHxNxD.dtype)
  bq, bk = block_q or tq, block_k or tk
  warps, stages = num_warps or tw, num_stages or ts
  if bq < 16 or bk < 16 or bq & (bq - 1) or bk & (bk - 1):
    raise ValueError(f"block-sparse attention: tiles {bq} x {bk} must be powers of two >= 16")
  cfg = (bq, bk, warps, stages, bool(interpret), precision == "highest")
  npad = -(-n // max(bq, bk)) * max(bq, bk)
  dp, ep = padded_head_dim(d), padded_head_dim(e)

  def pad(x, last):
    return jnp.pad(x, ((0, 0), (0, 0), (0, npad - n), (0, last - x.shape[-1])))

  q, k, v = pad(q_BxHxNxD, dp), pad(k_BxHxNxD, dp), pad(v_BxHxNxE.astype(q_BxHxNxD.dtype), ep)
  k = k.astype(q.dtype)
  # Under a mesh each device runs the kernels on its own batch rows (a pallas_call is opaque to
  # the partitioner, which would gather the batch); the placeholder seed is unused.
  run = lambda q, k, v, _: _heads_attention(q, k, v, heads, n, cfg)
  o = pallas_common.per_device(run, (q, k, v, pallas_common.seed_array(None)),
                               (True, True, True, False), seed_at=3)
  return o[:, :, :n, :e]


def _heads_attention(q, k, v, heads, n, cfg):
  """One call per group of heads with the same pattern kind, parts, stride and c."""
  h = len(heads)
  groups: dict = {}
  for i, hp in enumerate(heads):
    groups.setdefault(hp.group, []).append(i)
  outs = [None] * h
  for idx in groups.values():
    hs = tuple(heads[i] for i in idx)
    if len(idx) == h:
      sel = lambda x: x
    else:
      sel = lambda x, idx=np.asarray(idx): x[:, idx]
    o = _group_attention(sel(q), sel(k), sel(v), hs, n, cfg)
    if len(idx) == h:
      return o
    for j, i in enumerate(idx):
      outs[i] = o[:, j]
  return jnp.stack(outs, axis=1)
