"""Encoders on a GPU, one process (the `encoder` family of bench/gpu_run.py): bidirectional
adaptive-span attention with segment ids (packed sequences and padding) through the drop-in
layer's function (`span_lm.layers.core.span_attention`, the (batch, tokens, heads, head_dim)
layout of jax.nn.dot_product_attention):

  1. correctness: values and every gradient (query, key, value, both position embeddings, the
     spans, the spans ahead when learned apart) of attn_impl='pallas' (the fused kernel, windows
     ahead and segment ids) against attn_impl='plain' (the layer's dense definition: every query
     against every key, float32, exact dots), packed segments with padding, head dims 64 and 96,
     bf16 and float32, one span both sides and spans apart;
  2. timings, forward and forward+backward ms at an encoder's shapes (B=8, 2,048 tokens, 8 heads,
     head dim 64, max_span 256: 256 keys behind and 255 ahead, bf16, 4-6 packed segments per row
     and padding): the kernel (learned spans 3 to 0.7 S; every span at S), the XLA path
     (attn_impl='reference', the same door), and cuDNN's flash attention
     (jax.nn.dot_product_attention(implementation='cudnn')), which has no window to the right:
     dense over all 2,048 keys, with the segments as a dense mask (cudnn_mask) and with padding
     only as sequence lengths (cudnn_lengths: a lower bound, it does not separate packed
     sequences).

  python -m bench.gpu_encoder --out /tmp/enc.json      # a GPU machine (~1 minute)
  python -m bench.gpu_encoder --dry_run                # CPU rehearsal: tiny shapes, the kernel
      interpreted, cuDNN replaced by implementation='xla' (rows marked "cudnn_standin")

Rows are printed as they complete ("ROW {json}"); --deadline (epoch seconds) skips what would
start after it, each skip recorded.
"""
import jax
import jax.numpy as jnp
import numpy as np

from bench import gpu_families
from bench import gpu_kernel_check
from bench import harness
from span_lm.layers import core

TOL = gpu_kernel_check.TOL
RAMP = 32
NAMES = ("query", "key", "value", "span_ratio", "pos_back", "pos_ahead", "span_ratio_ahead")
# (name, dtype, head dim, spans ahead learned apart)
CASES = (("bf16/d64", "bfloat16", 64, False), ("bf16/d96/apart", "bfloat16", 96, True),
         ("f32/d64/apart", "float32", 64, True), ("f32/d96", "float32", 96, False))
DRY_CASES = ("bf16/d96/apart", "f32/d64/apart")
SMALL_HEAD_DIM = {64: 16, 96: 24}


def segments(rng, b, n, pieces):
  """Packed sequences: `pieces` segments of random lengths per row, ids 1.., then padding (0)."""
  ids = np.zeros((b, n), np.int32)
  for r in range(b):
    used = int(n * rng.uniform(0.8, 0.95))
    cuts = np.sort(rng.choice(np.arange(1, used), pieces - 1, replace=False))
    ids[r, :used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
  return jnp.asarray(ids)


def inputs(b, n, h, dh, s, dtype, apart, seed=0, spans="learned"):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  rnd = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  x = {"query": rnd(ks[0], (b, n, h, dh)).astype(dtype),
       "key": rnd(ks[1], (b, n, h, dh)).astype(dtype),
       "value": rnd(ks[2], (b, n, h, dh)).astype(dtype),
       "pos_back": rnd(ks[3], (dh, s)), "pos_ahead": rnd(ks[4], (dh, s)),
       "span_ratio": (jnp.linspace(3.0 / s, 0.7, h) if spans == "learned"
                      else jnp.ones((h,))).astype(jnp.float32),
       "span_ratio_ahead": None}
  if apart:
    x["span_ratio_ahead"] = jnp.linspace(0.6, 5.0 / s, h).astype(jnp.float32)
  return x


def attention(impl, s, seg):
  def f(query, key, value, span_ratio, pos_back, pos_ahead, span_ratio_ahead):
    return core.span_attention(query, key, value, span_ratio, pos_back, pos_ahead, max_span=s,
                               causal=False, ramp=RAMP, segment_ids=seg,
                               span_ratio_ahead=span_ratio_ahead, attn_impl=impl)
  return f


def values_and_grads(f, x, g, precision=None):
  names = [n for n in NAMES if x[n] is not None]

  def run(*a):
    out, vjp = jax.vjp(lambda *a: f(**{**{n: None for n in NAMES}, **dict(zip(names, a))}
                                     ).astype(jnp.float32), *a)
    return out, vjp(g)
  with jax.default_matmul_precision(precision or "default"):
    out, grads = jax.jit(run)(*[x[n] for n in names])
  return {"out": out, **dict(zip(names, grads))}


def correctness(a, env, deadline):
  del env
  b, n, h, s = (2, 64, 2, 16) if a.small else (2, 512, 4, 128)
  use = gpu_families.gpu_kernel(a.interpret)
  for name, dtype, dh, apart in CASES:
    if a.dry_run and name not in DRY_CASES:
      continue
    dh = SMALL_HEAD_DIM[dh] if a.small else dh
    row = {"kind": "encoder_check", "case": name, "dtype": dtype, "head_dim": dh,
           "apart": apart, "shape": [b, n, h, s], "impl": use, "tol": TOL[dtype],
           "interpret": a.interpret}

    def check(dtype=dtype, dh=dh, apart=apart):
      seg = segments(np.random.default_rng(1), b, n, 3)
      x = inputs(b, n, h, dh, s, jnp.dtype(dtype), apart)
      g = jax.random.normal(jax.random.PRNGKey(9), (b, n, h, dh), jnp.float32)
      # the definition in float32 with exact dots (bf16 inputs as given)
      x32 = {k: (None if v is None else v.astype(jnp.float32)) for k, v in x.items()}
      want = values_and_grads(attention("plain", s, seg), x32, g, "highest")
      got = values_and_grads(attention(use, s, seg), x, g)
      r = harness.check_fields(got, want, TOL[dtype])
      padded = np.asarray(seg) == 0
      pad_out = float(jnp.max(jnp.abs(got["out"][padded]))) if padded.any() else 0.0
      if pad_out != 0.0:
        r["status"] = "FAIL"
      return dict(r, padding_out=pad_out)
    harness.CHILD.measure(row, deadline, check)


def timings(a, env, deadline):
  del env
  b, n, h, dh, s = (2, 64, 2, 16, 16) if a.small else (8, 2048, 8, 64, 256)
  reps = 2 if a.small else 10
  seg = segments(np.random.default_rng(2), b, n, 4 if a.small else 6)
  g = jax.random.normal(jax.random.PRNGKey(9), (b, n, h, dh), jnp.float32)
  use = gpu_families.gpu_kernel(a.interpret)
  cudnn = "cudnn_standin" if a.cudnn_standin else "cudnn"
  jobs = [(use, "learned"), (use, "all_S"), ("reference", "learned"), (cudnn + "_mask", "dense"),
          (cudnn + "_lengths", "dense")]
  shape = {"B": b, "N": n, "H": h, "Dh": dh, "max_span": s, "ahead": s - 1,
           "segments": int(jnp.max(seg)), "padding": float(jnp.mean(seg == 0))}
  for path, spans in jobs:
    row = {"kind": "encoder_time", "path": path, "spans": spans, "dtype": "bfloat16",
           "shape": shape, "interpret": path == "pallas_interpret"}
    if path.startswith("cudnn"):
      row["note"] = (f"dense over all {n} keys (cuDNN has no window ahead); " +
                     ("segments as a dense (B, 1, N, N) mask" if path.endswith("_mask") else
                      "padding only, as sequence lengths: packed sequences not separated") +
                     ("; STAND-IN: implementation='xla', not cuDNN" if a.cudnn_standin else ""))
    if path == "reference":
      row["note"] = "the XLA path behind the same door: the whole band whatever the spans"

    def time_path(path=path, spans=spans):
      x = inputs(b, n, h, dh, s, jnp.bfloat16, False, spans=spans)
      if path.startswith("cudnn"):
        kw = {}
        if path.endswith("_mask"):
          kw["mask"] = ((seg[:, None, :, None] == seg[:, None, None, :])
                        & (seg[:, None, None, :] != 0))
        else:
          kw["query_seq_lengths"] = kw["key_value_seq_lengths"] = jnp.sum(seg != 0, axis=1)
        fwd, bwd = gpu_kernel_check.cudnn_pair(jax.nn.dot_product_attention, a.cudnn_standin,
                                               g, **kw)
        qkv = (x["query"], x["key"], x["value"])
        return harness.fwd_bwd_ms(fwd, qkv, bwd, qkv, reps)
      f = attention(path, s, seg)
      fargs = [x[k] for k in NAMES[:6]]
      fwd = jax.jit(lambda *a: f(*a, None))
      bwd = jax.jit(jax.value_and_grad(
          lambda *a: jnp.sum(f(*a, None).astype(jnp.float32) * g), argnums=tuple(range(6))))
      return harness.fwd_bwd_ms(fwd, fargs, bwd, fargs, reps)
    harness.CHILD.measure(row, deadline, time_path)


def main():
  harness.child_main("gpu_encoder", __doc__, {"check": correctness, "timing": timings})


if __name__ == "__main__":
  main()
