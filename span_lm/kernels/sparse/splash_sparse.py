"""The 'splash' rows of kernels/sparse/door.py: jax's splash attention (TPU) with each head's
Sparse Transformer pattern as a computable mask (kernels/sparse/block_sparse.py `allowed` on the
kernel's index tiles), one call per run of heads that share a pattern (`runs`). Splash's
MaskInfo skips the all-zero blocks in the forward and both backward passes and evaluates the
mask in the kernel, only in partial blocks.

What it cannot do (misfit says so): sequence lengths that are not a multiple of 128 (its
blocks are multiples of 128 lanes; we pad n up to the block and slice, padded keys lie in every
real query's future); attention-weight dropout (the sparse model applies none). Head sizes
below 128 are padded by splash itself to whole lanes (head_dim 64 does twice the q.k lanes).
It does not scale q (our queries are pre-scaled) and softmax is float32. Its masked score is
finite, so queries with no key (fixed summary-only heads) are zeroed after (`first_query`).
"""
import functools

import numpy as np

from span_lm.kernels.sparse.block_sparse import HeadPattern, allowed, allowed_in_kernel, first_query

LANES = 128


def block_size(n: int) -> int:
  """The splash block (queries and keys) for n positions: up to 512, a multiple of 128."""
  padded = -(-n // LANES) * LANES
  for b in (512, 256, 128):
    if padded % b == 0:
      return b
  return LANES


@functools.lru_cache(maxsize=256)
def computed_pairs(head: HeadPattern, n: int) -> int:
  """(query, key) pairs the kernel computes for one head over n positions: its non-empty blocks
  (block_sparse.block_map) times the block area, partial blocks computed whole."""
  from span_lm.kernels.sparse.block_sparse import EMPTY, block_map  # pylint: disable=g-import-not-at-top
  b = block_size(n)
  return int((block_map(head, n, b, b) != EMPTY).sum()) * b * b


def misfit(heads, n, head_dim) -> str:
  if n is not None and n < 1:
    return f"sequence length {n}"
  if head_dim is not None and head_dim % 8:
    return f"head size {head_dim}: splash needs a multiple of 8"
  return ""


@functools.lru_cache(maxsize=64)
def _mask(head: HeadPattern, n: int, n_heads: int):
  """n_heads heads of one pattern as splash's MultiHeadMask: one computable mask (never an
  (n, n) array), which splash evaluates in the kernel on its index tiles (its mask_function path:
  every head has the same mask). Cached (equal masks also hit splash's own cache of their
  block tables)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # pylint: disable=g-import-not-at-top

  def fn(i, j):  # numpy on the host (splash's block tables), int32 tiles in the kernel
    return (allowed if isinstance(i, np.ndarray) else allowed_in_kernel)(head, i, j)

  class PatternMask(sm._ComputableMask):  # pylint: disable=protected-access
    pattern = head

    def __eq__(self, other):
      return (getattr(other, "pattern", None) == self.pattern
              and isinstance(other, sm._ComputableMask) and self.shape == other.shape)  # pylint: disable=protected-access

    def __hash__(self):
      return hash((self.pattern, self.shape))

  return sm.MultiHeadMask((PatternMask((n, n), fn),) * n_heads)


def _kernel(head: HeadPattern, n_heads: int, n: int, block: int, interpret: bool):
  """Built per call, not cached: the kernel holds its block tables as jax arrays, and one made
  inside a trace (a Flax layer scan) holds that trace's values."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # pylint: disable=g-import-not-at-top
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  return sk.make_splash_mha(_mask(head, n, n_heads), block_sizes=sizes, head_shards=1,
                            q_seq_shards=1, interpret=interpret)


def runs(heads) -> list[tuple[int, int]]:
  """[start, stop) of each run of consecutive heads with one pattern: one splash call each.

  Splash evaluates a mask in the kernel only when all of a call's heads share it; heads with
  different masks in one call make it load each partial block's mask from HBM, an int32
  block x block array (1 MiB at 512) per block it visits, five times a block's keys and values
  at head size 64-128, and unseen by XLA's byte count. Runs are sliced, not gathered (a
  static slice of the head axis). Laying the heads end to end as one sequence instead would
  make splash's grid (H n / block)^2 steps, most of them empty."""
  out = []
  for h, head in enumerate(heads):
    if out and heads[out[-1][0]] == head:
      out[-1] = (out[-1][0], h + 1)
    else:
      out.append((h, h + 1))
  return out


def block_sparse_attention(q_BxHxNxD, k_BxHxNxD, v_BxHxNxE, heads, *, interpret=False):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  n = q_BxHxNxD.shape[2]
  if len(heads) != q_BxHxNxD.shape[1]:
    raise ValueError(f"{len(heads)} head patterns for {q_BxHxNxD.shape[1]} heads")
  block = block_size(n)
  padded = -(-n // block) * block
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, padded - n), (0, 0)))
  q, k, v = pad(q_BxHxNxD), pad(k_BxHxNxD), pad(v_BxHxNxE)
  from span_lm.kernels import pallas_common  # pylint: disable=g-import-not-at-top
  outs = []
  for start, stop in runs(heads):
    kernel = _kernel(heads[start], stop - start, padded, block, interpret)
    # A Mosaic call is not partitioned by XLA: each device runs it on its own batch rows.
    run = lambda q, k, v, seed, kernel=kernel: jax.vmap(kernel)(q, k, v)
    part = lambda x, start=start, stop=stop: x[:, start:stop]
    args = (part(q), part(k), part(v), pallas_common.seed_array(None))
    outs.append(pallas_common.per_device(run, args, (True, True, True, False), seed_at=3))
  o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  # Splash's masked score is finite, so a query with no key would average the values: zero them.
  first = np.array([first_query(h) for h in heads])
  if first.any():
    o = jnp.where((np.arange(padded)[None, :] >= first[:, None])[:, :, None], o, 0)
  return o[:, :, :n].astype(q_BxHxNxD.dtype)
