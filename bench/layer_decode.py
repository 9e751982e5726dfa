"""The NNX layer's decoding, grouped heads and NNX against Linen, side by side in one process
(docs/benchmarks.md, "The drop-in layer: NNX, grouped heads, decoding").

1. Decode: the time of one jitted decoding step (one token, after `context` tokens) and the cache
   bytes, span_lm.layers.nnx.AdaptiveSpanAttention (learned windows 64-256, max_span 256: a ring
   of 256 slots per KV head, each KV head reading its window) against flax.nnx.MultiHeadAttention
   (a dense cache of `context` slots, every step reading all of it).
2. Grouped heads: forward and forward + backward of the layer with 8 query heads over 2 KV heads
   against 8 over 8, causal, through the door.
3. NNX against Linen: the same layer and weights, forward + backward.

  python -m bench.layer_decode                        # contexts 1k 8k 64k; 4k and 8k tokens
  python -m bench.layer_decode --contexts 1024 --lengths 4096 --reps 3
"""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import harness
from span_lm import layers
from span_lm.train import cpu_host


def _nbytes(*arrays) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in arrays))


def decode_rows(args):
  d, h, s, r = args.d_model, args.heads, args.max_span, args.ramp
  x = jax.random.normal(jax.random.key(0), (args.batch, 1, d))
  def span_layer():
    m = layers.nnx.AdaptiveSpanAttention(h, d, max_span=s, ramp=r, rngs=nnx.Rngs(0))
    # learned windows ceil(z) + R from 64 to 256
    m.span_ratio[...] = jnp.asarray(np.linspace(64 - r, s - r, h) / s, jnp.float32)
    return m

  ours = span_layer()
  print(f"decode: batch {args.batch}, D {d}, {h} heads, max_span {s}, ramp {r}, windows "
        f"{np.asarray(layers.learned_spans(ours)['']).round(0) + r}, {jax.devices()[0]}")
  rows = []
  for ctx in args.contexts:
    mha = nnx.MultiHeadAttention(h, d, decode=True, rngs=nnx.Rngs(0))
    mha.init_cache((args.batch, ctx, d))
    ours = span_layer()
    ours.init_cache((args.batch, ctx, d))
    rng = np.random.default_rng(0)
    for m in (mha, ours):  # a cache as full as `context` tokens leave it
      m.cached_key[...] = jnp.asarray(rng.standard_normal(m.cached_key.shape), jnp.float32)
      m.cached_value[...] = jnp.asarray(rng.standard_normal(m.cached_value.shape), jnp.float32)
      m.cache_index[...] = jnp.array(ctx - args.decode_reps - 3, jnp.int32)
    ours.cached_segment[...] = jnp.ones_like(ours.cached_segment[...])
    for name, m, cache in (
        ("nnx.MultiHeadAttention", mha, (mha.cached_key, mha.cached_value)),
        ("layers.nnx.AdaptiveSpanAttention", ours,
         (ours.cached_key, ours.cached_value, ours.cached_segment))):
      cache_bytes = _nbytes(*(c.get_value() for c in cache))
      reads = getattr(m, "read_windows", None)
      graph, state = nnx.split(m)

      # one token; the state donated and returned (the cache updated in place), as a loop runs
      step = jax.jit(lambda state, x, graph=graph: (lambda m: (m(x, decode=True), nnx.state(m)))(
          nnx.merge(graph, state)), donate_argnums=0)
      held = [state]

      def call(step=step, held=held):
        y, held[0] = step(held[0], x)
        return y

      secs = harness.median_s(call, args.decode_reps)
      row = dict(case=f"decode {name}", context=ctx, step_s=secs,
                 cache_bytes=cache_bytes, reads=reads)
      rows.append(row)
      print(f"  {name:36s} context {ctx:6d}: {secs * 1e3:8.3f} ms/token, cache "
            f"{row['cache_bytes'] / 2**20:8.2f} MiB", flush=True)
  return rows


def layer_rows(args):
  """The variants timed interleaved (one call of each per round, the median over rounds), so a
  shared machine's load drifts over all of them alike."""
  d, s, r = args.d_model, args.max_span, args.ramp
  rows = []
  print(f"forward / forward + backward: batch {args.batch}, D {d}, max_span {s}, ramp {r}, "
        f"medians of {args.reps} interleaved rounds")
  for n in args.lengths:
    x = jax.random.normal(jax.random.key(0), (args.batch, n, d))
    cases = {}
    for kv in (8, 2):
      layer = layers.AdaptiveSpanAttention(num_heads=8, num_kv_heads=kv, max_span=s, ramp=r)
      params = layer.init(jax.random.key(1), x[:, :8])["params"]
      params["span_ratio"] = jnp.asarray(np.linspace(64 - r, s - r, 8) / s, jnp.float32)
      f = lambda p, x, layer=layer: layer.apply({"params": p}, x, deterministic=True)
      cases[f"Linen, 8 query heads, {kv} KV heads"] = (f, params)
      if kv == 8:  # the same layer and weights as NNX
        model = layers.nnx.AdaptiveSpanAttention.from_linen(layer, params)
        graph, _ = nnx.split(model)
        g = lambda p, x, graph=graph: nnx.merge(graph, nnx.State(p))(x, deterministic=True)
        cases["NNX, 8 query heads, 8 KV heads"] = (g, nnx.state(model, nnx.Param))
    calls = {}
    for name, (f, p) in cases.items():
      fwd = jax.jit(f)
      grad = jax.jit(jax.value_and_grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
      calls[(name, "fwd")] = lambda fwd=fwd, p=p: fwd(p, x)
      calls[(name, "fwd_bwd")] = lambda grad=grad, p=p: grad(p, x)
    for c in calls.values():  # compile and warm
      jax.block_until_ready(c())
    times = {k: [] for k in calls}
    for _ in range(args.reps):
      for k, c in calls.items():
        times[k] += harness.time_calls(c, 1, warmup=0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for name in cases:
      rows.append(dict(case=name, length=n, fwd_s=med[(name, "fwd")],
                       fwd_bwd_s=med[(name, "fwd_bwd")]))
      print(f"  {name:40s} N={n:6d} fwd {med[(name, 'fwd')] * 1e3:9.1f} ms  fwd+bwd "
            f"{med[(name, 'fwd_bwd')] * 1e3:9.1f} ms", flush=True)
    mha, nnx_, gqa = list(cases)  # Linen MHA, NNX MHA, Linen GQA
    for kind in ("fwd", "fwd_bwd"):
      print(f"  N={n} {kind}: GQA / MHA {med[(gqa, kind)] / med[(mha, kind)]:.2f}x; NNX / Linen "
            f"{med[(nnx_, kind)] / med[(mha, kind)]:.3f}x")
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--contexts", type=int, nargs="+", default=(1024, 8192, 65536))
  p.add_argument("--lengths", type=int, nargs="+", default=(4096, 8192))
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--max_span", type=int, default=256)
  p.add_argument("--ramp", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--decode_reps", type=int, default=21)
  p.add_argument("--skip", nargs="*", default=(), choices=("decode", "layers"))
  p.add_argument("--json", default="")
  cpu_host.add_flag(p)
  args = p.parse_args()
  cpu_host.apply_flags(args)
  rows = []
  if "decode" not in args.skip:
    rows += decode_rows(args)
  if "layers" not in args.skip:
    rows += layer_rows(args)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
