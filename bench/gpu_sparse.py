"""The Sparse Transformer's attention on a GPU, one process (the `sparse` family of
bench/gpu_run.py): the block-sparse Pallas kernel (span_lm/kernels/sparse/pallas_gpu_sparse.py).

  1. first, at configs/enwik8_sparse_fixed.py's attention shape (12,288 tokens, 8 heads, head
     dim 64, fixed pattern, stride 128, c = 32, merged heads with distinct offsets, bf16;
     B = 1, one device's share of the batch being 8 / 8 GPUs in the paper): the kernel's and
     the jnp path's (model/sparse.py `sparse_attention`, sparse.impl='jnp') values and
     gradients against each other, the kernel with dense heads against cuDNN's dense causal
     flash attention (jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)),
     then forward and forward+backward ms of: the kernel (fixed merged), the jnp path, cuDNN
     dense causal, and the kernel with dense heads (its causal flash attention, for scale);
  2. then correctness at small shapes: values and every gradient (q, k, v) of the kernel
     against the dense masked reference (span_lm/model/sparse.py `reference_attention`, float32
     inputs, exact dots) for fixed merged (distinct offsets), fixed split, fixed A2 alone
     (interleaved, odd layer: rows with no key) and strided merged heads, bf16 and float32.

  python -m bench.gpu_sparse --out /tmp/sparse.json    # a GPU machine (~1-2 minutes, a guess)
  python -m bench.gpu_run --families sparse --out DIR  # the same as gpu_run.py's family alone
  python -m bench.gpu_sparse --dry_run                 # CPU rehearsal: tiny shapes, the kernel
      interpreted, cuDNN replaced by implementation='xla' (rows marked "cudnn_standin")

Rows are printed as they complete ("ROW {json}"); --deadline (epoch seconds) skips what would
start after it, each skip recorded.
"""
import jax
import jax.numpy as jnp

from bench import gpu_kernel_check
from bench import harness
from span_lm.kernels.sparse import block_sparse
from span_lm.kernels.sparse import pallas_gpu_sparse as ps
from span_lm.kernels.sparse import door as sparse_door
from span_lm.model import sparse

TOL = gpu_kernel_check.TOL
NAMES = ("out", "q", "k", "v")
# (case, pattern, combine, layer)
PATTERNS = (("fixed/merged", "fixed", "merged", 0), ("fixed/split", "fixed", "split", 0),
            ("fixed/A2_alone", "fixed", "interleaved", 1),
            ("strided/merged", "strided", "merged", 0))
# compare-at-scale tolerance between two bf16 implementations (each ~TOL from the definition)
PAIR_TOL = 2 * TOL["bfloat16"]


def sparse_kernel(interpret: bool) -> str:
  """The GPU block-sparse kernel's name in span_lm.kernels.sparse.door.SPARSE_IMPLS (compiled, or
  its interpreted twin); the XLA path is the table's `jnp`."""
  gpu = next(n for n, i in sparse_door.SPARSE_IMPLS.items() if i.platform == "gpu")
  twin = next(n for n, i in sparse_door.SPARSE_IMPLS.items()
              if i.interpret and i.module == sparse_door.SPARSE_IMPLS[gpu].module)
  return twin if interpret else gpu


def inputs(b, h, n, d, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  rnd = lambda k, s: jax.random.normal(k, s, jnp.float32)
  q = rnd(ks[0], (b, h, n, d)) * d ** -0.5
  k, v, g = rnd(ks[1], (b, h, n, d)), rnd(ks[2], (b, h, n, d)), rnd(ks[3], (b, h, n, d))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), g


def values_and_grads(f, q, k, v, g, precision=None):
  def run(q, k, v):
    out, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), q, k, v)
    return (out, *vjp(g))
  with jax.default_matmul_precision(precision or "default"):
    return dict(zip(NAMES, jax.jit(run)(q, k, v)))


def kernel_fn(heads, interpret, tiles=None):
  kw = {} if tiles is None else {"block_q": tiles[0], "block_k": tiles[1]}
  return lambda q, k, v: ps.block_sparse_attention(q, k, v, heads, interpret=interpret, **kw)


def cudnn_fn(standin):
  impl = "xla" if standin else "cudnn"

  def f(q, k, v):  # (B, H, N, D) -> cuDNN's (B, N, H, D) and back; queries pre-scaled
    t = lambda x: x.transpose(0, 2, 1, 3)
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), scale=1.0, is_causal=True,
                                          implementation=impl))
  return f


def correctness(a, env, deadline):
  del env
  b, h, n, d, l, c = (1, 4, 80, 16, 16, 4) if a.small else (2, 8, 1000, 64, 128, 32)
  for name, pattern, combine, layer in PATTERNS:
    heads = sparse.layer_heads(pattern, combine, h, layer, l, c)
    for dtype in ("bfloat16", "float32"):
      row = {"kind": "sparse_check", "case": name, "dtype": dtype, "tol": TOL[dtype],
             "shape": {"B": b, "H": h, "N": n, "D": d, "stride": l, "c": c},
             "interpret": a.interpret}

      def check(heads=heads, dtype=dtype):
        q, k, v, g = inputs(b, h, n, d, jnp.dtype(dtype))
        want = values_and_grads(lambda q, k, v: sparse.reference_attention(q, k, v, heads),
                                *(x.astype(jnp.float32) for x in (q, k, v)), g, "highest")
        got = values_and_grads(kernel_fn(heads, a.interpret), q, k, v, g)
        return harness.check_fields(got, want, TOL[dtype], zeros=False)
      harness.CHILD.measure(row, deadline, check)


def at_scale(a, env, deadline):
  del env
  b, h, n, d, l, c = (1, 2, 256, 16, 32, 4) if a.small else (1, 8, 12_288, 64, 128, 32)
  reps = 2 if a.small else 10
  heads = sparse.layer_heads("fixed", "merged", h, 0, l, c)
  dense = (block_sparse.HeadPattern("dense"),) * h
  bq, bk, warps, stages = ps._target_tiles(jnp.bfloat16)  # pylint: disable=protected-access
  tiles = None
  if a.small:  # tiles below the stride, so that the rehearsal skips tiles too
    bq, bk, tiles = 16, 16, (16, 16)
  shape = {"B": b, "H": h, "N": n, "D": d, "stride": l, "c": c, "pattern": "fixed merged",
           "computed_fraction": round(block_sparse.computed_fraction(heads, n, bq, bk), 4),
           "tiles": [bq, bk, warps, stages]}
  q, k, v, g = inputs(b, h, n, d, jnp.bfloat16, seed=1)
  cudnn = "cudnn_standin" if a.cudnn_standin else "cudnn"
  kern = sparse_kernel(a.interpret)
  paths = {kern: kernel_fn(heads, a.interpret, tiles),
           "jnp": lambda q, k, v: sparse.sparse_attention(q, k, v, heads),
           cudnn + "_dense": cudnn_fn(a.cudnn_standin),
           kern + "_dense": kernel_fn(dense, a.interpret, tiles)}
  # values checked against each other: the kernel against the jnp path (the same pattern), the
  # kernel with dense heads against cuDNN (both dense causal)
  for x, y in ((kern, "jnp"), (kern + "_dense", cudnn + "_dense")):
    row = {"kind": "sparse_pair", "paths": [x, y], "shape": shape, "tol": PAIR_TOL,
           "dtype": "bfloat16"}

    def pair(x=x, y=y):
      gx, gy = values_and_grads(paths[x], q, k, v, g), values_and_grads(paths[y], q, k, v, g)
      return harness.check_fields(gx, gy, PAIR_TOL, zeros=False)
    harness.CHILD.measure(row, deadline, pair)
  notes = {"jnp": "model/sparse.py sparse_attention (impl='jnp'): gathered blocks and "
                  "summaries, XLA",
           cudnn + "_dense": "dense causal over all keys" + (
               "; STAND-IN: implementation='xla', not cuDNN" if a.cudnn_standin else ""),
           kern + "_dense": "the kernel with dense causal heads (a flash kernel), for scale"}
  for path, f in paths.items():
    row = {"kind": "sparse_time", "path": path, "dtype": "bfloat16", "shape": shape,
           "interpret": path.startswith("pallas_interpret"), "note": notes.get(path, "")}

    def time_path(f=f):
      fwd = jax.jit(f)
      bwd = jax.jit(jax.value_and_grad(
          lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * g), argnums=(0, 1, 2)))
      return harness.fwd_bwd_ms(fwd, (q, k, v), bwd, (q, k, v), reps)
    harness.CHILD.measure(row, deadline, time_path)


def main():
  # "scale" first: the comparison at 12,288 tokens checks the kernel's values too
  harness.child_main("gpu_sparse", __doc__, {"scale": at_scale, "check": correctness})


if __name__ == "__main__":
  main()
