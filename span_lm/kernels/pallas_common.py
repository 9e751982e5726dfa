"""What every Pallas kernel shares, span or sparse: the Triton kernels' float32-accumulating dot,
the dropout seed as the kernels read it, and running a kernel on each device's own rows under a
mesh. Shared, so neither kernel family imports the other."""
import math

import jax
from jax import lax
import jax.numpy as jnp

from span_lm.kernels import hashed_dropout


def dot(a, b, trans_a=False, trans_b=False, *, exact: bool):
  """f32-accumulating matmul. exact (precision='highest'): float32 operands as exact float32,
  which Triton runs as scalar FMAs (no tensor cores; docs/kernels.md); else float32 dots may use
  TF32 tensor cores (sm_80+), as XLA does for float32 matmuls by default."""
  if trans_a:
    a = a.T
  if trans_b:
    b = b.T
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 and exact else None
  return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=prec)


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
