"""span_lm.layers.AdaptiveSpanAttention against flax's nn.MultiHeadDotProductAttention, causal
and bidirectional, with and without a key-padding mask, side by side in one process
(docs/benchmarks.md, "The drop-in layer").

For each length: Flax's layer (dense, O(N^2): a causal mask, none, or the padding mask as
nn.make_attention_mask builds it) and ours (the door: span_lm.kernels' cpu implementation on a
CPU, the fused kernel on a GPU/TPU where it takes the case; O(N * max_span)) back to back; then
ours bidirectional at several max_span (the cost should follow the span). Each case is a jitted
value_and_grad of sum(out^2) with respect to parameters and inputs: the median of --reps timed
runs, and XLA's compiled memory (arguments + outputs + temporaries) of that step.

  python -m bench.layer_speed                                  # N = 4096 and 8192
  python -m bench.layer_speed --lengths 4096 --reps 3 --max_spans 32 256 1024
"""
import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from span_lm import layers
from span_lm.train import cpu_host


def timed(fn, *args, reps: int):
  return harness.median_s(lambda: fn(*args), reps)


def step_bytes(fn, *args) -> int:
  """XLA's memory analysis of the compiled step: arguments + outputs + temporaries."""
  return harness.memory(fn.lower(*args).compile())["total"]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=(4096, 8192))
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--max_span", type=int, default=256)
  p.add_argument("--max_spans", type=int, nargs="*", default=(32, 1024),
                 help="bidirectional at these max_span too (first length only)")
  p.add_argument("--ramp", type=int, default=32)
  p.add_argument("--pad", type=float, default=0.25, help="padded fraction of each row (mask)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--skip_flax_above", type=int, default=1 << 30,
                 help="leave Flax's dense layer out above this length")
  p.add_argument("--json", default="")
  cpu_host.add_flag(p)
  args = p.parse_args()
  cpu_host.apply_flags(args)  # before the backend starts

  rows = []

  def run(name, length, f, prm, x, **extra):
    grad = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
    secs = timed(grad, prm, x, reps=args.reps)
    mem = step_bytes(grad, prm, x)
    rows.append(dict(case=name, length=length, fwd_bwd_s=secs, bytes=mem, **extra))
    print(f"  {name:58s} N={length:6d} fwd+bwd {secs * 1e3:9.1f} ms  {mem / 2**30:6.2f} GiB",
          flush=True)
    return secs

  print(f"forward + backward, batch {args.batch}, D {args.d_model}, {args.heads} heads, "
        f"max_span {args.max_span}, ramp {args.ramp}, {jax.devices()[0]}")
  for n in args.lengths:
    x = jax.random.normal(jax.random.key(0), (args.batch, n, args.d_model))
    keep = np.arange(n)[None, :] < n - int(args.pad * n)  # the last --pad of each row padded
    keep = np.broadcast_to(keep, (args.batch, n))
    mha = nn.MultiHeadDotProductAttention(num_heads=args.heads)
    mha_params = mha.init(jax.random.key(1), x[:, :8])["params"]
    ours = lambda causal, span=args.max_span: layers.AdaptiveSpanAttention(
        num_heads=args.heads, max_span=span, ramp=min(args.ramp, span), causal=causal)
    params = {c: ours(c).init(jax.random.key(1), x[:, :8])["params"] for c in (True, False)}
    for c in (True, False):  # learned spans spread over [R, max_span] (z + R)
      params[c]["span_ratio"] = jnp.asarray(
          np.linspace(args.ramp, args.max_span, args.heads) - args.ramp, jnp.float32) / args.max_span
    flax_ok = n <= args.skip_flax_above
    causal_mask = nn.make_causal_mask(jnp.ones((args.batch, n)))
    pad_mask = nn.make_attention_mask(keep, keep)
    key_pad = jnp.asarray(keep)[:, None, None, :]
    if flax_ok:
      run("flax MHA, causal mask", n, lambda p, x: mha.apply({"params": p}, x, mask=causal_mask),
          mha_params, x, layer="flax", direction="causal", mask=False)
    run("span layer, causal", n, lambda p, x: ours(True).apply({"params": p}, x), params[True], x,
        layer="span", direction="causal", mask=False)
    if flax_ok:
      run("flax MHA, bidirectional", n, lambda p, x: mha.apply({"params": p}, x), mha_params, x,
          layer="flax", direction="bidirectional", mask=False)
    run("span layer, bidirectional", n, lambda p, x: ours(False).apply({"params": p}, x),
        params[False], x, layer="span", direction="bidirectional", mask=False)
    if flax_ok:
      run("flax MHA, bidirectional, padding mask", n,
          lambda p, x: mha.apply({"params": p}, x, mask=pad_mask), mha_params, x, layer="flax",
          direction="bidirectional", mask=True)
    run("span layer, bidirectional, key-padding mask", n,
        lambda p, x: ours(False).apply({"params": p}, x, mask=key_pad), params[False], x,
        layer="span", direction="bidirectional", mask=True)
    run("span layer, causal, key-padding mask", n,
        lambda p, x: ours(True).apply({"params": p}, x, mask=key_pad), params[True], x,
        layer="span", direction="causal", mask=True)
    if n == args.lengths[0]:
      for span in args.max_spans:
        prm = ours(False, span).init(jax.random.key(1), x[:, :8])["params"]
        prm["span_ratio"] = jnp.ones_like(prm["span_ratio"])  # every head at its max_span
        run(f"span layer, bidirectional, max_span {span} (spans at max)", n,
            lambda p, x, s=span: ours(False, s).apply({"params": p}, x), prm, x, layer="span",
            direction="bidirectional", mask=False, max_span=span)

  def t(case, n):
    hit = [r["fwd_bwd_s"] for r in rows if r["case"] == case and r["length"] == n]
    return hit[0] if hit else float("nan")

  print("ratios (forward + backward):")
  for n in args.lengths:
    print(f"  N={n}: bidirectional / causal {t('span layer, bidirectional', n) / t('span layer, causal', n):.2f}x; "
          f"flax / ours: causal {t('flax MHA, causal mask', n) / t('span layer, causal', n):.1f}x, "
          f"bidirectional {t('flax MHA, bidirectional', n) / t('span layer, bidirectional', n):.1f}x, "
          f"padded {t('flax MHA, bidirectional, padding mask', n) / t('span layer, bidirectional, key-padding mask', n):.1f}x")
  spans = [r for r in rows if "max_span" in r]
  if len(spans) >= 2:
    print(f"  max_span {spans[0]['max_span']} vs {spans[-1]['max_span']}: "
          f"{spans[-1]['fwd_bwd_s'] / spans[0]['fwd_bwd_s']:.1f}x apart")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
