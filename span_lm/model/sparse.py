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
the one formula in span_lm/kernels/sparse/block_sparse.py; the fast path never builds it. Each head is a sum of parts, each part O(n sqrt n) when l ~ sqrt n:
  local part    queries of block b against keys of blocks b-1 and b: (n/l, l, 2l) scores;
  strided part  the sequence transposed to (l, n/l): column r attends causally along its n/l rows;
  summary part  the c summary keys of every block gathered into (n/l * c) keys.
A merged head (A1 u A2) drops the overlap from its summary part (strided: j = i; fixed: summary
keys of the query's own block) and combines the parts' softmaxes exactly, by their running maxima.
Scores and softmax are float32 whatever the input dtype; a query with no key outputs zeros.
"""
import math

import numpy as np

from span_lm.kernels.sparse.block_sparse import HeadPattern, connectivity  # noqa: F401 (the API)
from span_lm.model.config import SPARSE_COMBINES as COMBINES
from span_lm.model.config import SPARSE_PATTERNS as PATTERNS



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


def grouped_order(heads) -> tuple[int, ...]:
  """A head order with equal patterns adjacent, each group where its first head is (stable):
  fixed heads with distinct offsets 0, c, 2c, 3c, 0, c, ... become 0, 0, c, c, ..."""
  first = {}
  for h, head in enumerate(heads):
    first.setdefault(head, h)
  return tuple(sorted(range(len(heads)), key=lambda h: (first[heads[h]], h)))


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


# The dense reference and the jnp fast path live with the other implementations (the 'dense'
# and 'jnp' rows of kernels/sparse/door.py); named here too, as the model's own API.
from span_lm.kernels.sparse.sparse_jnp import masked_attention, reference_attention, sparse_attention  # noqa: E402,F401  pylint: disable=g-import-not-at-top,wrong-import-position


def attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, impl: str = "auto"):
  """impl: a row of kernels/sparse/door.py's SPARSE_IMPLS or 'auto' (its `select`)."""
  from span_lm.kernels.sparse import door as sparse_door  # pylint: disable=g-import-not-at-top
  chosen = sparse_door.select(door_spec(impl, heads, q_BxHxNxD.shape[2], q_BxHxNxD.shape[3]))
  return chosen(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads)


def door_spec(impl: str, heads, n: int, head_dim: int):
  """What the sparse door reads of a layer (kernels/sparse/door.py's SparseSpec): every caller
  builds it here, so an old implementation name warns from one place."""
  from span_lm.kernels.sparse import door as sparse_door  # pylint: disable=g-import-not-at-top
  return sparse_door.SparseSpec(impl=impl, heads=heads, n=n, head_dim=head_dim)


def attended_keys(heads, n: int) -> int:
  """Keys summed over heads and queries: the exact sparse work (for benchmarks and reports)."""
  return int(sum(connectivity(h, n).sum() for h in heads))


def default_stride(n: int) -> int:
  """sqrt(n) rounded to a power of two, the paper's 'close to sqrt(n)'."""
  return 2 ** round(math.log2(math.sqrt(n)))
