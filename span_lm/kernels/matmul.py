"""Mixed-precision matmuls: bf16/f16 operands with float32 accumulation, in both passes.

Why not plain `jnp.einsum`: a bf16 x bf16 dot that returns bf16 runs no faster than float32 on
XLA:CPU (its AVX512-BF16 kernels serve bf16 x bf16 -> f32 only; docs/benchmarks.md), and autodiff
of a dot with `preferred_element_type=float32` hands the backward dots a float32 cotangent, so two
thirds of a step's FLOPs run in float32 (mixed f32 x bf16 dots are upcast, on GPUs too). These
custom VJPs cast the cotangent to the operand dtype and accumulate in float32, so every matmul of
a training step is bf16 x bf16 -> f32 on every backend; on the CPU only, `contract` also lays out
each dot as XLA:CPU's fast kernels need (cpu_matmul.py). Float32 operands take the plain path (no
custom VJP, identical to jnp.einsum: there the layout copies cost a float32 step more than they
save). Weights: the second operand may be a float32 parameter with a bf16/f16 first operand,
cast to the compute dtype inside the custom VJP, whose weight cotangent is then the float32
product of the f32-accumulating backward dot, never rounded to bf16: parameters are float32 and
their gradients are summed (across pieces and devices) in float32, as the reference does.
"""
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from span_lm.kernels import cpu_matmul
from span_lm.kernels import target

LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def specs(spec: str) -> tuple[str, str, str]:
  """'ab,bc->ac' -> ('ab', 'bc', 'ac'); an index summed within one operand is refused."""
  ins, out = spec.replace(" ", "").split("->")
  a, b = ins.split(",")
  for name, s, other in (("first", a, b), ("second", b, a)):
    if any(c not in out and c not in other for c in s):
      raise ValueError(f"einsum {spec!r}: an index of the {name} operand is summed on its own")
  return a, b, out


def contract(spec: str, a, b):
  """jnp.einsum(spec, a, b) accumulated and returned in float32. On the CPU (bf16/f32 operands)
  through cpu_matmul's layouts; elsewhere, and for float16 (which YNNPACK does not take), the
  plain einsum that GPU and TPU compilers lay out themselves."""
  if target.name() == "cpu" and a.dtype != jnp.float16:
    return cpu_matmul.contract(spec, *specs(spec), a, b)
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(spec, a, b, out_dtype):
  return contract(spec, a, b.astype(a.dtype)).astype(out_dtype)


def _einsum_fwd(spec, a, b, out_dtype):
  # b as given (a float32 weight is the parameter itself: no extra buffer), cast again below.
  return _einsum(spec, a, b, out_dtype), (a, b)


def _einsum_bwd(spec, out_dtype, res, g):
  del out_dtype
  a, b = res
  sa, sb, so = specs(spec)
  g = g.astype(a.dtype)
  da = contract(f"{so},{sb}->{sa}", g, b.astype(a.dtype))
  db = contract(f"{sa},{so}->{sb}", a, g)  # float32: a float32 weight's gradient stays so
  return da.astype(a.dtype), db.astype(b.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def einsum(spec: str, a, b, out_dtype=None):
  """Two-operand einsum accumulating in float32; returns out_dtype (default: the operands' dtype).

  With bf16/f16 operands the backward pass is bf16 x bf16 -> f32 too (cotangent cast to the
  operand dtype); with float32 operands this is jnp.einsum with float32 accumulation.
  b may also be a float32 weight with a bf16/f16 `a`: it is cast to a's dtype inside the VJP and
  its gradient is the float32 accumulated product (not rounded to a's dtype).
  """
  if a.dtype != b.dtype and not (a.dtype in LOW and b.dtype == jnp.float32):
    raise ValueError(f"einsum {spec!r}: operand dtypes differ ({a.dtype}, {b.dtype})")
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if a.dtype not in LOW:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)
  specs(spec)
  return _einsum(spec, a, b, out_dtype)


def weight(w, dtype):
  """w as `einsum` takes it next to an operand of `dtype`: a float32 weight next to bf16/f16 stays
  float32 (cast inside the VJP, float32 gradient); anything else is cast to dtype, as before."""
  if jnp.dtype(dtype) in LOW and w.dtype == jnp.float32:
    return w
  return w.astype(dtype)


def dot(x, w, out_dtype=None):
  """x (..., K) @ w (K, N) as `einsum` (float32: jnp.dot itself); w may be a float32 weight with
  a bf16/f16 x (cast inside, float32 gradient: see `einsum`)."""
  if x.dtype not in LOW:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
  lead = x.shape[:-1]
  y = einsum("mk,kn->mn", x.reshape(-1, x.shape[-1]), w, out_dtype)
  return y.reshape(*lead, w.shape[-1])


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """For nn.Dense(dot_general=...): its (..., K) x (K, N) contraction through `dot` (float32:
  lax.dot_general itself). nn.Dense casts its float32 kernel to bf16 before calling this, which
  rounds the kernel's gradient to bf16: the model's bf16 layers call `dot` with the f32 kernel."""
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
    # bf16/f16: the float32 kernel itself, cast inside `dot`, so its gradient stays float32.
    y = dot(x.astype(dt), kernel if dt in LOW else kernel.astype(dt), out_dtype=jnp.float32)
    return (y + bias.reshape((1,) * (y.ndim - 1) + (-1,))).astype(dt)
