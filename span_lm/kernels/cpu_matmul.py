"""Two-operand contractions laid out for XLA:CPU's fast matmul kernels (YNNPACK).

CPU-only tuning behind `matmul.contract`'s backend choice: GPU and TPU never run this file.
Why each copy pays for itself: docs/benchmarks.md ("Every bf16 matmul in YNNPACK", 2026-11-21).
"""
import math

import jax
import jax.numpy as jnp


def _physical(x, perm, keep_dim0: bool = False):
  """jnp.transpose(x, perm), materialised: XLA folds a plain transpose into the dot that reads
  it, and the folded dot is one XLA:CPU's fast (YNNPACK) kernels refuse. keep_dim0: flatten only
  the trailing dims (a batch-sharded dim 0 stays whole on its device)."""
  y = jnp.transpose(x, perm)
  if list(perm) == sorted(perm):
    return y
  flat = y.reshape(y.shape[0], -1) if keep_dim0 else y.reshape(-1)
  return jax.lax.optimization_barrier(flat).reshape(y.shape)


def contract(spec: str, sa: str, sb: str, so: str, a, b):
  """jnp.einsum(spec, a, b) in float32, laid out for XLA:CPU's matmul kernels (sa, sb -> so:
  the spec as matmul.specs parses it).

  XLA:CPU sends a dot to YNNPACK (bf16 x bf16 -> f32 at ~2x the float32 rate, float32 at ~2x
  Eigen's) only when the left operand is stored (batch, free, contracted) and the right one
  (batch, contracted, free) or (batch, free, contracted); other dots (the weight gradients
  x^T g, contracting the token axis; the key/value gradients of banded attention) go to Eigen,
  which upcasts bf16 to float32 and runs at a third of the speed. Here the operand whose copy is
  smallest is transposed physically first (a memory pass, far cheaper than the slow dot).
  """
  size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
  batch = [c for c in so if c in sa and c in sb]
  summed = [c for c in sa if c in sb and c not in so]
  if (any(c not in sa and c not in sb for c in so) or not summed
      or len(set(sa)) < len(sa) or len(set(sb)) < len(sb)):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

  def elems(s):
    return math.prod(size[c] for c in s)

  best = None
  for (x, sx), (y, sy) in (((a, sa), (b, sb)), ((b, sb), (a, sa))):
    fx = [c for c in so if c in sx and c not in batch]
    fy = [c for c in so if c in sy and c not in batch]
    lhs = batch + fx + summed
    out = batch + fx + fy
    for rhs in (batch + summed + fy, batch + fy + summed):
      cost = ((list(sx) != lhs) * elems(sx) + (list(sy) != rhs) * elems(sy)
              + (out != list(so)) * elems(out))
      if best is None or cost < best[0]:
        best = (cost, x, sx, lhs, y, sy, rhs, out)
  _, x, sx, lhs, y, sy, rhs, out = best
  perms = ([sx.index(c) for c in lhs], [sy.index(c) for c in rhs], [out.index(c) for c in so])
  sharded = batch_sharded()
  if sharded and any(p[0] != 0 and p != sorted(p) for p in perms):
    # Under a mesh dim 0 is the (sharded) batch: a copy that moves it would gather the batch.
    # Float32 operands: XLA:CPU upcasts such bf16 dots anyway (and fails on some of them).
    return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
  x = _physical(x, perms[0], sharded)
  y = _physical(y, perms[1], sharded)
  nb = len(batch)
  if not batch and rhs[-len(summed):] == summed and len(rhs) > len(summed) + 1:
    # Several free dims of a (free, contracted) right operand flattened into one: XLA:CPU gave a
    # 3-D one a transpose pass of its own before the dot (the cache in
    # kernels/span/banded_cpu.project_kv).
    fy = rhs[:len(rhs) - len(summed)]
    shape = [size[c] for c in lhs[:len(lhs) - len(summed)]] + [size[c] for c in fy]
    y = y.reshape(math.prod(size[c] for c in fy), -1)
    rhs = ["".join(fy)] + summed
    dims = (([lhs.index(c) for c in summed], [rhs.index(c) for c in summed]), ([], []))
    z = jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32).reshape(shape)
  else:
    dims = (([lhs.index(c) for c in summed], [rhs.index(c) for c in summed]),
            (list(range(nb)), list(range(nb))))
    z = jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)
  if out == list(so):
    return z
  # A transpose of the dot's output may be folded into it too, which XLA:CPU then cannot run.
  return _physical(jax.lax.optimization_barrier(z), perms[2], sharded)


def batch_sharded() -> bool:
  """Traced under a mesh of several devices (the trainer's: the batch sharded on dim 0), where
  `contract` makes no layout copy that moves dim 0 and falls back to a float32 einsum instead."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1
