"""Sampling speed: hidden-state caches (re-projected every token), key/value caches shifted by one
token per step, and key/value ring caches (one slot written per step; the default).

One jitted scan of `length` tokens after a 1-token prompt (span_lm.tools.sample.generate), random
weights, B streams; fixed span S (every window sees S cached states) or adaptive spans of
`--span_tokens` tokens. Median of `--reps` runs after a compile-and-warm-up run.

  python -m bench.sampling --span 1024 --length 256

Also times one evaluation block (--eval_batch x --block tokens, caches full), the unit of the full
evaluation, which caches keys/values too.
"""
import argparse
import time

import jax
import numpy as np

from bench import harness
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig, Span
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import sample


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.int_flags(p, layers=4, d_model=256, heads=4, d_ff=1024)
  p.add_argument("--span", type=int, nargs="+", default=[1024, 4096])
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--eval_batch", type=int, default=8)
  p.add_argument("--block", type=int, default=128)
  args = p.parse_args()
  print(f"device: {jax.devices()[0].device_kind}; {args.layers} layers, D={args.d_model}, "
        f"{args.length} tokens x {args.batch} streams, fixed span\n")
  print("| S | hidden-state caches: tokens/s | key/value caches, shifted | key/value ring caches "
        "| ring vs shifted | ring vs hidden |")
  print("|---|---|---|---|---|---|")
  for s in args.span:
    cfg = ModelConfig(vocab_size=205, d_model=args.d_model, n_layers=args.layers,
                      n_heads=args.heads, d_ff=args.d_ff, span=Span(size=s, mode="fixed"))
    plan = plan_lib.full_plan(cfg)
    params = SpanTransformer(cfg, plan).init(
        jax.random.key(0), np.zeros((1, 1), np.int32), caches_lib.init_caches(cfg, plan, 1))["params"]
    prompt = np.zeros((args.batch, 1), np.int32)
    rate = {}
    for kind in ("hidden", "shifted", "ring"):
      run = lambda kind=kind: sample.generate(cfg, params, plan, prompt, args.length,
                                              temperature=1.0, kv_cache=kind != "hidden",
                                              ring=kind == "ring")
      rate[kind] = args.length * args.batch / harness.median_s(run, args.reps)
    print(f"| {s} | {rate['hidden']:.0f} | {rate['shifted']:.0f} | {rate['ring']:.0f} | "
          f"{rate['ring'] / rate['shifted']:.1f}x | {rate['ring'] / rate['hidden']:.1f}x |",
          flush=True)
    x = np.zeros((args.eval_batch, args.block), np.int32)
    block_s = {}
    for kv in (False, True):
      model = SpanTransformer(cfg, plan, kv_cache=kv)
      f = jax.jit(lambda p, x, c, model=model: model.apply({"params": p}, x, c)[:2])
      caches = caches_lib.init_caches(cfg, plan, args.eval_batch, kv=kv)
      block_s[kv] = harness.median_s(lambda f=f, caches=caches: f(params, x, caches),
                                     args.reps + 2)
    print(f"|   | evaluation block {args.eval_batch} x {args.block}: {block_s[False] * 1e3:.0f} ms | "
          f"{block_s[True] * 1e3:.0f} ms (key/value caches) | | | {block_s[False] / block_s[True]:.2f}x |",
          flush=True)


if __name__ == "__main__":
  main()
