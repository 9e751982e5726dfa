"""What the fused kernels (pallas_gpu, pallas_tpu) share: the span maths of one tile in
FlashAttention-2's names, the checks at their entry, and running them per device under a mesh.

One tile is a block of query rows against a block of keys. S is its scaled logits, m the running
row maximum, P = exp(S - m) and l the running row sum of P. The soft span mask adds a second
running sum, of P times the mask: the renormalised weights are P mask / (sum P mask + eps sum P)
(`span_mask.online_denominator`). The backward pass recomputes P from the saved m and
normaliser, with dP = dO V^T and delta = rowsum(dO * O).

The kernels' vocabulary (one meaning per name: z is a span, m a row maximum, den a normaliser,
bq, bk the tiles, ...) and the row statistics' layouts: docs/kernels.md, "What the fused kernels
share". These helpers are traced into each kernel's body, so sharing them costs nothing at run
time.
"""
import math

import jax
import jax.numpy as jnp

from span_lm.kernels import hashed_dropout
from span_lm.kernels import span_mask

PRECISIONS = ("default", "highest")


def _col(x, keepdims: bool):
  return x if keepdims else x[:, None]


def online_softmax(m_prev, logits, visited=None, *, keepdims: bool = True):
  """One key tile of the online softmax: (m_new, alpha = exp(m_prev - m_new), which rescales
  what the rows accumulated so far, and P = exp(S - m_new), 0 off `visited`)."""
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=keepdims))
  p = jnp.exp(logits - _col(m_new, keepdims))
  if visited is not None:
    p = jnp.where(visited, p, 0.0)
  return m_new, jnp.exp(m_prev - m_new), p


def weights_grad(p, dp, delta, z=None, dist=None, *, renormalised: bool, eps: float, ramp: int,
                 keepdims: bool = True):
  """The backward pass of one tile's weights: (dS before the logits' scale, the weights A as
  they multiply the values, before dropout, and the rows' span gradient, or None).

  p: the softmax weights P / den (the saved normaliser); dp: dO V^T (times dropout's keep);
  z, dist: the rows' spans and the tile's distances, or None where the mask is 1 (a fixed span,
  persistent keys); renormalised: whether the weights were renormalised by the span mask (then
  the normaliser's eps sum P term has a gradient too). With u = span_mask.ramp(z, dist) and
  A = P clamp(u): dS = A (dP - delta) - eps P delta, dz = rowsum(P (dP - delta) clamp'(u)) / R.
  The operations run in this order on purpose: ptxas allocates registers along it, and computing
  dz first spilled in the A100 kernel's bwd_q (tests/kernels/test_pallas_gpu.py's PTX test)."""
  delta = _col(delta, keepdims)
  dp_c = dp - delta
  if z is None:
    return (p * dp_c - eps * p * delta if renormalised else p * dp_c), p, None
  u = span_mask.ramp(_col(z, keepdims), dist, ramp)
  wts = p * span_mask.clamp01(u)
  ds = wts * dp_c - eps * p * delta
  dz = jnp.sum(p * dp_c * span_mask.clamp01_slope(u), axis=1, keepdims=keepdims) / ramp
  return ds, wts, dz


def check_inputs(pers_k, pers_v, dropout_rate: float, dropout_seed, precision: str):
  """The fused kernels' common argument rules, as one ValueError each."""
  if (pers_k is None) != (pers_v is None):
    raise ValueError("fused attention: persistent keys and values come together")
  if dropout_rate and dropout_seed is None:
    raise ValueError("fused attention: dropout_rate > 0 needs a dropout_seed")
  if precision not in PRECISIONS:
    raise ValueError(f"fused attention: precision={precision!r}: choose one of {PRECISIONS}")


def seed_array(dropout_seed):
  """The dropout seed as the (1,) uint32 array the kernels read (0 without dropout)."""
  if dropout_seed is None:
    return jnp.zeros((1,), jnp.uint32)
  return jnp.asarray(dropout_seed, jnp.uint32).reshape(1)


def per_device(kernel, args, batched, seed_at: int):
  """kernel(*args) on each device's own batch rows under the current mesh.

  A pallas_call is opaque to XLA's partitioner, which would gather the whole batch onto every
  device. Under a mesh (the trainer sets one and shards batches over all of its axes) each
  device runs the kernel on its rows, with its own dropout seed (`hashed_dropout.shard_seed`).
  Axes already manual (inside a shard_map: the train step with batch_split > 1) hold this
  device's rows already; with none left, the kernel runs as it is.
  batched: per argument, whether it has the batch as its leading axis (else it is replicated);
  seed_at: the index of the (1,) uint32 seed in args. None arguments stay None."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(ax for ax in mesh.axis_names if ax not in mesh.manual_axes)
  if math.prod(mesh.shape[ax] for ax in axes) == 1:
    return kernel(*args)

  def local(*xs):
    xs = list(xs)
    xs[seed_at] = hashed_dropout.shard_seed(xs[seed_at], axes)
    return kernel(*xs)

  rows, rep = jax.sharding.PartitionSpec(axes), jax.sharding.PartitionSpec()
  in_specs = tuple(None if x is None else rows if b else rep for x, b in zip(args, batched))
  return jax.shard_map(local, mesh=mesh, out_specs=rows, check_vma=False, in_specs=in_specs,
                       axis_names=frozenset(axes))(*args)
