"""Mixed-precision matmuls: bf16/f16 operands with float32 accumulation, in both passes.

Why not plain `jnp.einsum`: a bf16 x bf16 dot that returns bf16 runs no faster than float32 on
XLA:CPU (its AVX512-BF16 kernels are used for bf16 x bf16 -> f32 only; docs/benchmarks.md), and autodiff of a dot with `preferred_element_type=float32` hands the backward
dots a float32 cotangent, so two thirds of a step's FLOPs ran in float32 (mixed f32 x bf16 dots
are upcast). These custom VJPs cast the cotangent to the operand dtype and accumulate in float32,
so every matmul of a training step is bf16 x bf16 -> f32. On the CPU, `contract` also lays out
each of these dots the way XLA:CPU's fast kernels need (the backward dots most of all). Float32
operands take the plain path (no custom VJP, identical to jnp.einsum: there the layout copies
cost a float32 step more than they save).
"""
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _specs(spec: str) -> tuple[str, str, str]:
  ins, out = spec.replace(" ", "").split("->")
  a, b = ins.split(",")
  for name, s, other in (("first", a, b), ("second", b, a)):
    if any(c not in out and c not in other for c in s):
      raise ValueError(f"einsum {spec!r}: an index of the {name} operand is summed on its own")
  return a, b, out


def _physical(x, perm, keep_dim0: bool = False):
  """jnp.transpose(x, perm), materialised: XLA folds a plain transpose into the dot that reads
  it, and the folded dot is one XLA:CPU's fast (YNNPACK) kernels refuse. keep_dim0: flatten only
  the trailing dims (a batch-sharded dim 0 stays whole on its device)."""
  y = jnp.transpose(x, perm)
  if list(perm) == sorted(perm):
    return y
  flat = y.reshape(y.shape[0], -1) if keep_dim0 else y.reshape(-1)
  return jax.lax.optimization_barrier(flat).reshape(y.shape)


def contract(spec: str, a, b):
  """jnp.einsum(spec, a, b) in float32, laid out for XLA:CPU's matmul kernels.

  XLA:CPU sends a dot to YNNPACK (bf16 x bf16 -> f32 at ~2x the float32 rate, float32 at ~2x
  Eigen's) only when the left operand is stored (batch, free, contracted) and the right one
  (batch, contracted, free) or (batch, free, contracted); other dots (the weight gradients
  x^T g, contracting the token axis; the key/value gradients of banded attention) go to Eigen,
  which upcasts bf16 to float32 and runs at a third of the speed. Here the operand whose copy is
  smallest is transposed physically first (a memory pass, far cheaper than the slow dot). Off
  the CPU, and for float16 (which YNNPACK does not take), this is jnp.einsum.
  """
  if jax.default_backend() != "cpu" or a.dtype == jnp.float16:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  sa, sb, so = _specs(spec)
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
    # 3-D one a transpose pass of its own before the dot (the cache in kernels/banded_cpu.project_kv).
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(spec, a, b, out_dtype):
  return contract(spec, a, b).astype(out_dtype)


def _einsum_fwd(spec, a, b, out_dtype):
  return _einsum(spec, a, b, out_dtype), (a, b)


def _einsum_bwd(spec, out_dtype, res, g):
  del out_dtype
  a, b = res
  sa, sb, so = _specs(spec)
  g = g.astype(a.dtype)
  da = contract(f"{so},{sb}->{sa}", g, b)
  db = contract(f"{sa},{so}->{sb}", a, g)
  return da.astype(a.dtype), db.astype(b.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def einsum(spec: str, a, b, out_dtype=None):
  """Two-operand einsum accumulating in float32; returns out_dtype (default: the operands' dtype).

  With bf16/f16 operands the backward pass is bf16 x bf16 -> f32 too (cotangent cast to the
  operand dtype); with float32 operands this is jnp.einsum with float32 accumulation.
  """
  if a.dtype != b.dtype:
    raise ValueError(f"einsum {spec!r}: operand dtypes differ ({a.dtype}, {b.dtype})")
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if a.dtype not in LOW:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)
  _specs(spec)
  return _einsum(spec, a, b, out_dtype)


def dot(x, w, out_dtype=None):
  """x (..., K) @ w (K, N) as `einsum` (float32: jnp.dot itself)."""
  if x.dtype not in LOW:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
  lead = x.shape[:-1]
  y = einsum("mk,kn->mn", x.reshape(-1, x.shape[-1]), w, out_dtype)
  return y.reshape(*lead, w.shape[-1])


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """For nn.Dense(dot_general=...): its (..., K) x (K, N) contraction through `dot` (float32:
  lax.dot_general itself)."""
  if lhs.dtype not in LOW:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,) or lb or rb or rhs.ndim != 2:
    raise ValueError(f"dense_dot_general: unsupported dimension numbers {dimension_numbers}")
  return dot(lhs, rhs)


class Dense(nn.Module):
  """nn.Dense's parameters and maths (kernel (K, N), bias (N,)), the bias added in float32.

  nn.Dense(dtype=bfloat16) adds the bias in bf16, so the bias gradient is a sum over every token
  accumulated in bf16 (rounded at each of thousands of adds), and XLA:CPU runs that reduction as a
  slow reduce-window (docs/benchmarks.md). Added to the float32 matmul output
  instead, the gradient is a float32 sum. Float32 models compute exactly what nn.Dense does.
  """
  features: int
  kernel_init: Callable
  bias_init: Callable
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
    bias = self.param("bias", self.bias_init, (self.features,))
    dt = jnp.dtype(self.dtype)
    y = dot(x.astype(dt), kernel.astype(dt), out_dtype=jnp.float32)
    return (y + bias.reshape((1,) * (y.ndim - 1) + (-1,))).astype(dt)
