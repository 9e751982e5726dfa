"""The Sparse Transformer's head patterns as masks: one formula per pattern, read by the dense
reference (`connectivity`), by the block maps the kernels skip by (`block_map`), and inside the
kernels on iota tiles (`allowed`). span_lm/model/sparse.py builds a layer's heads, kernels/sparse/sparse_jnp.py
holds the jnp fast path; nothing here imports jax, so the config and the selection table load without it.

Positions are 0-based; query i may see key j only if j <= i. With stride l and summary width c:

  strided  A1 (local):    i - j < l
           A2 (strided):  (i - j) mod l == 0
  fixed    A1 (block):    floor(j / l) == floor(i / l)
           A2 (summary):  j mod l in [l - c - o, l - o), o = the head's sub-block offset
  dense:   every j <= i.
"""
import dataclasses
import functools
import operator

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2  # a block of the (queries x keys) plane: no key, some, every one


@dataclasses.dataclass(frozen=True)
class HeadPattern:
  """The connectivity of one head: which parts of its pattern it attends to."""
  kind: str  # 'strided' | 'fixed' | 'dense'
  local: bool = False  # A1
  summary: bool = False  # A2
  stride: int = 1
  c: int = 1  # fixed: summary width
  offset: int = 0  # fixed: summary sub-block offset from the block end

  @property
  def group(self):
    """Heads with the same group run together (offsets may differ within a group)."""
    return (self.kind, self.local, self.summary, self.stride, self.c)


def allowed(head: HeadPattern, i, j, div=operator.floordiv, mod=operator.mod):
  """[i, j]: query i attends to key j, on broadcastable integer arrays (numpy, or jnp inside a
  kernel: only comparisons, +, -, and `div` / `mod` by the stride, which matter only where both
  operands are non-negative: a kernel passes truncating ones, whose lowering needs no sign)."""
  causal = j <= i
  if head.kind == "dense":
    return causal
  l = head.stride
  out = None
  if head.local:
    out = (i - j < l) if head.kind == "strided" else (div(i, l) == div(j, l))
  if head.summary:
    if head.kind == "strided":
      a2 = mod(i - j, l) == 0
    else:
      col = mod(j, l)
      a2 = (col >= l - head.c - head.offset) & (col < l - head.offset)
    out = a2 if out is None else out | a2
  return causal if out is None else out & causal


def allowed_in_kernel(head: HeadPattern, i, j):
  """`allowed` on int32 index tiles inside a kernel (Triton or Mosaic): truncating division
  (lax.div, lax.rem), exact where the formula divides non-negative operands (a negative i - j
  only meets mod where causality masks it); jnp's floor division lowers through a sign op that
  a deviceless Mosaic compile cannot lower."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  return allowed(head, i, j, div=lambda a, b: lax.div(a, lax.full_like(a, b)),
                 mod=lambda a, b: lax.rem(a, lax.full_like(a, b)))


def connectivity(head: HeadPattern, n: int) -> np.ndarray:
  """Boolean (n, n) matrix: [i, j] is True when query i attends to key j."""
  return np.asarray(allowed(head, np.arange(n)[:, None], np.arange(n)[None, :]), bool)


@functools.lru_cache(maxsize=512)
def block_map(head: HeadPattern, n: int, block_q: int, block_k: int) -> np.ndarray:
  """int8 (ceil(n / block_q), ceil(n / block_k)): EMPTY, PARTIAL or FULL per block of the
  head's (n, n) connectivity (positions past n count as masked). Built a query block row at a
  time: O(n * block_q) memory, never the (n, n) matrix. Cached and read-only: every layer of a
  model asks for the same few heads (the FLOPs count of a 30-layer step asked 240 times, half a
  second each at 12,288 positions and 64-wide tiles)."""
  nq, nk = -(-n // block_q), -(-n // block_k)
  out = np.zeros((nq, nk), np.int8)
  j = np.arange(nk * block_k)
  for b in range(nq):
    i = np.arange(b * block_q, (b + 1) * block_q)[:, None]
    m = np.asarray(allowed(head, i, j[None, :]), bool) & (i < n) & (j[None, :] < n)
    m = m.reshape(block_q, nk, block_k)
    some, every = m.any(axis=(0, 2)), m.all(axis=(0, 2))
    out[b] = np.where(every, FULL, np.where(some, PARTIAL, EMPTY))
  out.setflags(write=False)
  return out


def block_lists(bmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per row of a block map (…, R, C): (counts (…, R) int32, indices (…, R, max count) int32)
  of its non-empty columns in increasing order, the tail padded with the last index (a kernel
  that loops over `counts` never reads the padding; a pipelined one re-reads a block it has).
  Transpose the map first for the key blocks' lists of query blocks (the dK/dV pass)."""
  nz = bmap != EMPTY
  counts = nz.sum(-1).astype(np.int32)
  width = max(1, int(counts.max(initial=0)))
  order = np.argsort(~nz, axis=-1, kind="stable")[..., :width].astype(np.int32)
  last = np.take_along_axis(order, np.maximum(counts - 1, 0)[..., None], -1)
  pad = np.arange(width) >= counts[..., None]
  return counts, np.where(pad, last, order).astype(np.int32)


def computed_fraction(heads, n: int, block_q: int, block_k: int) -> float:
  """Blocks a block-sparse kernel computes over the causal blocks a dense flash kernel would:
  what the FLOPs accounting counts for it."""
  dense = block_map(HeadPattern("dense"), n, block_q, block_k)
  done = sum(int((block_map(h, n, block_q, block_k) != EMPTY).sum()) for h in heads)
  return done / (len(heads) * int((dense != EMPTY).sum()))


def first_query(head: HeadPattern) -> int:
  """The first query that attends to any key (earlier ones output zeros): 0 for every pattern
  that keeps the query itself; for a fixed summary-only head (A2 alone), the first summary
  column l - c - o, which every later query sees as well (A2 depends on the key alone)."""
  if head.kind == "fixed" and head.summary and not head.local:
    return max(0, head.stride - head.c - head.offset)
  return 0
