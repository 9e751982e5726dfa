"""span_lm.layers.AdaptiveSpanAttention against flax's nn.MultiHeadDotProductAttention at a long
sequence, side by side in one process (docs/benchmarks.md, "The drop-in layer").

Causal self-attention over `--length` tokens, learned spans spread over `--spans` (z + R; the
window is max_span, the largest): Flax's layer with nn.make_causal_mask (dense, O(N^2)), ours
with mask=None (the kernels' path: span_lm.kernels' cpu implementation on a CPU, the fused kernel
on a GPU; O(N * max_span)) and ours on its plain dense path. Each case is a jitted forward, and a
jitted value_and_grad of sum(out^2) (parameters and inputs); the median of --reps timed runs.

  python bench/layer_speed.py              # N=4096, spans 64-256, batch 2, D=256, 4 heads
  python bench/layer_speed.py --length 8192 --reps 3
"""
import _repo  # first: the checkout's span_lm (bench/_repo.py)  # pylint: disable=unused-import
import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from span_lm import layers
from span_lm.train import cpu_host


def timed(fn, *args, reps: int):
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--spans", type=int, nargs=2, default=(64, 256), help="smallest, largest z + R")
  p.add_argument("--ramp", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--skip_plain", action="store_true", help="leave out our dense path")
  p.add_argument("--json", default="")
  cpu_host.add_flag(p)
  args = p.parse_args()
  cpu_host.apply_flags(args)  # before the backend starts

  lo, hi = args.spans
  x = jax.random.normal(jax.random.key(0), (args.batch, args.length, args.d_model))
  mha = nn.MultiHeadDotProductAttention(num_heads=args.heads)
  mha_params = mha.init(jax.random.key(1), x[:, :8])["params"]
  causal = nn.make_causal_mask(jnp.ones((args.batch, args.length)))
  ours = lambda impl: layers.AdaptiveSpanAttention(
      num_heads=args.heads, max_span=hi, ramp=args.ramp, attn_impl=impl)
  params = ours("auto").init(jax.random.key(1), x[:, :8])["params"]
  # the learned spans: z + R evenly from lo to hi over the heads
  params["span_ratio"] = jnp.asarray(np.linspace(lo, hi, args.heads) - args.ramp, jnp.float32) / hi

  cases = {"flax MultiHeadDotProductAttention (causal mask)":
           (lambda p, x: mha.apply({"params": p}, x, mask=causal), mha_params),
           f"AdaptiveSpanAttention, kernels ({jax.default_backend()})":
           (lambda p, x: ours("auto").apply({"params": p}, x), params)}
  if not args.skip_plain:
    cases["AdaptiveSpanAttention, plain dense path"] = (
        lambda p, x: ours("plain").apply({"params": p}, x), params)
  rows = {}
  print(f"causal self-attention, batch {args.batch}, length {args.length}, D {args.d_model}, "
        f"{args.heads} heads, spans z+R {lo}..{hi} (max_span {hi}), {jax.devices()[0]}")
  for name, (f, prm) in cases.items():
    fwd = timed(jax.jit(f), prm, x, reps=args.reps)
    grad = jax.jit(jax.value_and_grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
    bwd = timed(grad, prm, x, reps=args.reps)
    rows[name] = {"forward_s": fwd, "fwd_bwd_s": bwd}
    print(f"  {name:55s} forward {fwd * 1e3:8.1f} ms   forward+backward {bwd * 1e3:8.1f} ms",
          flush=True)
  base, fast = list(rows.values())[:2]
  print(f"speed-up of the layer over flax: forward {base['forward_s'] / fast['forward_s']:.1f}x, "
        f"forward+backward {base['fwd_bwd_s'] / fast['fwd_bwd_s']:.1f}x")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
