"""The 'jnp' and 'dense' rows of kernels/sparse/door.py: the factorized attention without an
(n, n) matrix (model/sparse.py's docstring has the parts) and its masked O(n^2) reference (any
backend, any shape). Scores and softmax are float32 whatever the input dtype; a query with no key
outputs zeros."""
import jax
import jax.numpy as jnp
import numpy as np

from span_lm.kernels.sparse.block_sparse import HeadPattern, connectivity

_NEG = -1e30  # finite: an all-masked part gives exp(0) * 0 = 0, never a NaN


def block_sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret=False):
  del interpret
  return sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)


def misfit(heads, n, head_dim) -> str:
  del heads, n, head_dim
  return ""


def dense_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret=False):
  del interpret
  return reference_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)


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
