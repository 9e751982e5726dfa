"""Factorized sparse attention (Sparse Transformer, Child et al. 2019, Sec. 4-5): patterns, kernels.

Positions are 0-based; query i may see key j only if j <= i. With stride l and summary width c:

  strided  A1 (local):    i - j < l            (the l most recent positions, i itself included)
           A2 (strided):  (i - j) mod l == 0
  fixed    A1 (block):    floor(j / l) == floor(i / l)
           A2 (summary):  j mod l in [l - c - o, l - o), o = the head's sub-block offset (Sec. 4.3:
                          heads attend to distinct sub-blocks of c; o = 0 is the paper's last c)
  local    A1 of strided alone;  dense: every j <= i.

Sec. 4.3 writes A1 of strided as {max(0, i - l), ..., i}, l + 1 positions; the reference code's
`local` mask (openai/sparse_attention, band of width l) keeps l. We follow the code: the position
i - l is reached by A2 anyway, and a window of l spans at most two blocks of l.

`connectivity` gives the boolean (n, n) matrix of a head (the dense reference and Figure 3), from
the one formula in span_lm/kernels/block_sparse.py; the fast path never builds it. Each head is a sum of parts, each part O(n sqrt n) when l ~ sqrt n:
  local part    queries of block b against keys of blocks b-1 and b: (n/l, l, 2l) scores;
  strided part  the sequence transposed to (l, n/l): column r attends causally along its n/l rows;
  summary part  the c summary keys of every block gathered into (n/l * c) keys.
A merged head (A1 u A2) drops the overlap from its summary part (strided: j = i; fixed: summary
keys of the query's own block) and combines the parts' softmaxes exactly, by their running maxima.
Scores and softmax are float32 whatever the input dtype; a query with no key outputs zeros.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.block_sparse import HeadPattern, connectivity  # noqa: F401 (the API)
from span_lm.model.config import SPARSE_COMBINES as COMBINES
from span_lm.model.config import SPARSE_PATTERNS as PATTERNS

_NEG = -1e30  # finite: an all-masked part gives exp(0) * 0 = 0, never a NaN


def layer_heads(pattern: str, combine: str, n_heads: int, layer: int, stride: int, c: int,
                distinct: bool = True) -> tuple[HeadPattern, ...]:
  """The heads of residual block `layer` for a pattern and a combination (Sec. 5.1).

  interleaved (eq. 6): block r uses A^(r mod 2) in every head; merged (eq. 7): every head uses
  A1 u A2; split (eq. 8): head h uses A^(h mod 2). With the fixed pattern and `distinct`, the
  heads that attend to summaries take consecutive sub-blocks of c, cycling after l / c of them.
  """
  if pattern == "dense":
    return (HeadPattern("dense"),) * n_heads
  if pattern == "local":
    return (HeadPattern("strided", local=True, stride=stride),) * n_heads
  kind = pattern
  parts = []
  for h in range(n_heads):
    if combine == "merged":
      parts.append((True, True))
    elif combine == "interleaved":
      parts.append((layer % 2 == 0, layer % 2 == 1))
    elif combine == "split":
      parts.append((h % 2 == 0, h % 2 == 1))
    else:
      raise ValueError(f"unknown combination {combine!r}; choose one of {COMBINES}")
  heads, k = [], 0
  for local, summary in parts:
    offset = 0
    if kind == "fixed" and summary:
      offset = c * (k % max(1, stride // c)) if distinct else 0
      k += 1
    heads.append(HeadPattern(kind, local, summary, stride, c if kind == "fixed" else 1, offset))
  return tuple(heads)


def reachable(layer_masks: list[np.ndarray]) -> np.ndarray:
  """Which keys reach each query through the layers in order (residual path included).

  layer_masks: (n, n) boolean per layer (the union over its heads), first layer first.
  """
  n = layer_masks[0].shape[0]
  reach = np.eye(n, dtype=bool)
  for m in layer_masks:
    step = (m | np.eye(n, dtype=bool)).astype(np.int32)
    reach = (step @ reach.astype(np.int32)) > 0
  return reach


# ------------------------------------------------------------------------------- dense reference


def _softmax_parts(s, mask):
  """Masked float32 scores -> (unnormalised weights, running max) for an exact combination."""
  s = jnp.where(mask, s, _NEG)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  p = jnp.exp(s - m) * mask.astype(s.dtype)
  return p, m[..., 0]


def _pv(p, v, eq):
  return jnp.einsum(eq, p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _scores(q, k, eq):
  return jnp.einsum(eq, q, k, preferred_element_type=jnp.float32)


def _finish(parts, dtype):
  """Combines (o_unnorm, denominator, max) parts of one softmax over the union of their keys."""
  m = parts[0][2]
  for _, _, mk in parts[1:]:
    m = jnp.maximum(m, mk)
  o = den = 0.0
  for ok, dk, mk in parts:
    w = jnp.exp(mk - m)
    o = o + ok * w[..., None]
    den = den + dk * w
  return (o / jnp.maximum(den, 1e-30)[..., None]).astype(dtype)


def masked_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, mask_HxNxN):
  """Dense attention under a boolean mask: the O(n^2) reference (queries pre-scaled)."""
  s = _scores(q_BxHxNxD, k_BxHxNxD, "bhqd,bhkd->bhqk")
  p, m = _softmax_parts(s, jnp.asarray(mask_HxNxN)[None])
  o = _pv(p, v_BxHxNxE, "bhqk,bhkd->bhqd")
  return _finish([(o, jnp.sum(p, -1), m)], q_BxHxNxD.dtype)


def reference_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads):
  """`masked_attention` under the heads' connectivity matrices."""
  n = q_BxHxNxD.shape[2]
  mask = np.stack([connectivity(h, n) for h in heads])
  return masked_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, mask)


# ------------------------------------------------------------------------------------- fast path


def _blocks(x, l):
  """(B, H, N, D) -> (B, H, N/l, l, D)."""
  b, h, n, d = x.shape
  return x.reshape(b, h, n // l, l, d)


def _local_part(q, k, v, head: HeadPattern):
  """A1: strided -> the window i - j < l (blocks b-1 and b); fixed -> the query's own block."""
  l = head.stride
  qb, kb, vb = _blocks(q, l), _blocks(k, l), _blocks(v, l)
  nb = qb.shape[2]
  r = jnp.arange(l)[:, None]
  if head.kind == "strided":
    prev = lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))[:, :, :nb]
    kb = jnp.concatenate([prev(kb), kb], axis=3)  # (B, H, nb, 2l, D): key t is at t - l
    vb = jnp.concatenate([prev(vb), vb], axis=3)
    t = jnp.arange(2 * l)[None, :]
    dist = r + l - t
    first = (jnp.arange(nb)[:, None, None] == 0) & (t < l)[None]  # block 0 has no previous block
    mask = ((dist >= 0) & (dist < l))[None] & ~first
  else:
    mask = (jnp.arange(l)[None, :] <= r)[None]
  s = _scores(qb, kb, "bhnqd,bhnkd->bhnqk")
  p, m = _softmax_parts(s, mask[None, None])
  o = _pv(p, vb, "bhnqk,bhnkd->bhnqd")
  shape = q.shape[:3]
  return o.reshape(*shape, -1), jnp.sum(p, -1).reshape(shape), m.reshape(shape)


def _strided_part(q, k, v, head: HeadPattern):
  """A2 of strided: transpose to (l, n/l) and attend causally along each column's rows."""
  l = head.stride
  tr = lambda x: _blocks(x, l).swapaxes(2, 3)  # (B, H, l, nb, D)
  qt, kt, vt = tr(q), tr(k), tr(v)
  nb = qt.shape[3]
  row = jnp.arange(nb)
  mask = (row[None, :] < row[:, None]) if head.local else (row[None, :] <= row[:, None])
  s = _scores(qt, kt, "bhrqd,bhrkd->bhrqk")
  p, m = _softmax_parts(s, mask[None, None, None])
  o = _pv(p, vt, "bhrqk,bhrkd->bhrqd").swapaxes(2, 3)
  back = lambda x: x.swapaxes(2, 3).reshape(*q.shape[:3])
  return o.reshape(*q.shape[:3], -1), back(jnp.sum(p, -1)), back(m)


def _summary_part(q, k, v, heads):
  """A2 of fixed: each head's c summary keys of every block, gathered to (n/l * c) keys."""
  head = heads[0]
  l, c = head.stride, head.c
  cols = np.array([[l - c - h.offset + t for t in range(c)] for h in heads])  # (H, c)
  nb = q.shape[2] // l

  def gather(x):  # static slices (a cheap backward), one per head's sub-block
    xb = _blocks(x, l)
    sub = [xb[:, i, :, l - c - h.offset:l - h.offset] for i, h in enumerate(heads)]
    return jnp.stack(sub, axis=1).reshape(x.shape[0], x.shape[1], nb * c, x.shape[3])

  ks, vs = gather(k), gather(v)
  key_blk = jnp.repeat(jnp.arange(nb), c)  # (K,)
  key_pos = (key_blk[None, :] * l + jnp.tile(jnp.asarray(cols), (1, nb)))  # (H, K)
  qpos = jnp.arange(q.shape[2])
  if head.local:  # the own block's summaries are already in the block part
    mask = (key_blk[None, :] < (qpos // l)[:, None])[None]
  else:
    mask = key_pos[:, None, :] <= qpos[None, :, None]
  s = _scores(q, ks, "bhqd,bhkd->bhqk")
  p, m = _softmax_parts(s, mask[None])
  o = _pv(p, vs, "bhqk,bhkd->bhqd")
  return o, jnp.sum(p, -1), m


def _dense_part(q, k, v):
  n = q.shape[2]
  pos = jnp.arange(n)
  s = _scores(q, k, "bhqd,bhkd->bhqk")
  p, m = _softmax_parts(s, (pos[None, :] <= pos[:, None])[None, None])
  return _pv(p, v, "bhqk,bhkd->bhqd"), jnp.sum(p, -1), m


def _group_attention(q, k, v, heads):
  head = heads[0]
  if head.kind == "dense":
    return _finish([_dense_part(q, k, v)], q.dtype)
  parts = []
  if head.local:
    parts.append(_local_part(q, k, v, head))
  if head.summary:
    parts.append(_strided_part(q, k, v, head) if head.kind == "strided"
                 else _summary_part(q, k, v, heads))
  return _finish(parts, q.dtype)


def sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads):
  """Factorized attention of each head, without an (n, n) matrix (queries pre-scaled).

  Heads with the same parts run together; lengths that are not a multiple of the stride are
  padded at the end (padded keys lie in every real query's future, so causality drops them).
  """
  if len(heads) != q_BxHxNxD.shape[1]:
    raise ValueError(f"{len(heads)} head patterns for {q_BxHxNxD.shape[1]} heads")
  n = q_BxHxNxD.shape[2]
  groups: dict = {}
  for i, h in enumerate(heads):
    groups.setdefault(h.group, []).append(i)
  outs = [None] * len(heads)
  for idx in groups.values():
    hs = [heads[i] for i in idx]
    l = hs[0].stride if hs[0].kind != "dense" else 1
    pad = -n % l
    take = lambda x: jnp.pad(x[:, np.array(idx)], ((0, 0), (0, 0), (0, pad), (0, 0)))
    o = _group_attention(take(q_BxHxNxD), take(k_BxHxNxD), take(v_BxHxNxE), hs)[:, :, :n]
    for j, i in enumerate(idx):
      outs[i] = o[:, j]
  return jnp.stack(outs, axis=1)


def attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, impl: str = "auto"):
  """impl: a row of kernels/sparse_door.py's SPARSE_IMPLS or 'auto' (its `select`)."""
  from span_lm.kernels import sparse_door  # pylint: disable=g-import-not-at-top
  chosen = sparse_door.select(impl, heads, q_BxHxNxD.shape[2], q_BxHxNxD.shape[3])
  return chosen(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)


def attended_keys(heads, n: int) -> int:
  """Keys summed over heads and queries: the exact sparse work (for benchmarks and reports)."""
  return int(sum(connectivity(h, n).sum() for h in heads))


def default_stride(n: int) -> int:
  """sqrt(n) rounded to a power of two, the paper's 'close to sqrt(n)'."""
  return 2 ** round(math.log2(math.sqrt(n)))
