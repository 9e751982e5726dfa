"""Forward+backward time of the layer stack versus the maximum span S, fixed vs learned spans.

Shapes default to the reference measurement in issue 2: 4 layers, D=256, 4 heads, FF 1024,
block 128, batch 16. Cases per S:
  fixed     every head attends to all S positions (the reference's fixed-span model)
  short     adaptive, every head's span + ramp within 64 tokens
  mixed     adaptive, one head per layer at the full S, the others short (head grouping on)
  mixed_nogroup  the same spans with head grouping off: the reference's per-layer trimming
  long      adaptive, every head at the full S (an all-long layer with the span mask's costs)
Issue 8's criteria are printed after the table: short spans' time at each S against the
smallest S, and the mixed layer's attention time against what its heads' spans add up to (time
per head-token-key of an all-long layer - `long`, else `fixed` - times the mixed plan's keys).
Each case is a jitted value_and_grad of the training loss (span loss included) at its span plan;
the compile time of each plan is reported too (the cost of one plan change).

  python -m bench.attention_span                       # S = 1024 2048 4096 8192
  python -m bench.attention_span --spans 1024 --reps 5 --json out.json
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig, Plan, Span
from span_lm.model.transformer import SpanTransformer
from span_lm.train import cpu_host
from span_lm.train import steps as steps_lib


def make_case(case: str, s: int, args):
  mode = "fixed" if case == "fixed" else "adaptive"
  cfg = ModelConfig(vocab_size=205, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, d_ff=args.d_ff, dtype=args.dtype,
                    span=Span(size=s, mode=mode, ramp=32),
                    plan=Plan(head_grouping=case != "mixed_nogroup"))
  model = SpanTransformer(cfg, plan_lib.full_plan(cfg))
  tok = jnp.zeros((1, 1), jnp.int32)
  params = model.init(jax.random.key(0), tok, caches_lib.init_caches(cfg, None, 1))["params"]
  if mode == "adaptive":
    short = (args.short_span - cfg.span.ramp) / s  # z' such that z + R = short_span
    z = np.full(cfg.n_heads, short, np.float32)
    if case.startswith("mixed"):
      z[0] = 1.0
    if case == "long":
      z[:] = 1.0
    params = plan_lib.with_span_ratios(params, [jnp.asarray(z)] * cfg.n_layers)
  plan = plan_lib.plan_from_params(cfg, params)
  plan_lib.check_plan(cfg, params, plan)
  return cfg, plan, params


def compile_case(cfg, plan, params, args):
  """The jitted value_and_grad of the training loss (span loss included) at `plan`, compiled;
  returns (compiled, compile seconds)."""
  model = SpanTransformer(cfg, plan)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.block)), jnp.int32)
  y = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.block)), jnp.int32)
  caches = tuple(jnp.asarray(rng.standard_normal(c.shape), jnp.float32)
                 for c in caches_lib.init_caches(cfg, plan, args.batch))

  def loss_fn(p):
    logp, new_caches, aux = model.apply({"params": p}, x, caches, train=False)
    total, count = steps_lib.nll(logp, y)
    return total / count + aux["span_loss"], new_caches

  return harness.compile_timed(jax.jit(jax.value_and_grad(loss_fn, has_aux=True)), params)


def time_compiled(compiled, params, reps: int) -> list[float]:
  """Seconds per call after one warm-up call."""
  return harness.time_calls(lambda: compiled(params), reps)


def time_case(cfg, plan, params, args):
  compiled, compile_s = compile_case(cfg, plan, params, args)
  return float(np.median(time_compiled(compiled, params, args.reps))), compile_s


def criteria(rows) -> list[str]:
  """Issue 8's two cost-follows-spans criteria from the measured rows (see the docstring)."""
  at = {(r["span"], r["case"]): r for r in rows}
  spans = sorted({r["span"] for r in rows})
  lines = []
  short = [s for s in spans if (s, "short") in at]
  for s in short[1:]:
    ratio = at[(s, "short")]["seconds"] / at[(short[0], "short")]["seconds"]
    lines.append(f"short spans, S={s} against S={short[0]}: {ratio:.2f}x (target <= 1.15x)")
  for s in spans:
    short_row, mixed = at.get((s, "short")), at.get((s, "mixed"))
    for ref in ("long", "fixed"):
      full = at.get((s, ref))
      if not (short_row and mixed and full):
        continue
      rate = ((full["seconds"] - short_row["seconds"])
              / (full["attention_keys"] - short_row["attention_keys"]))
      other = short_row["seconds"] - short_row["attention_keys"] * rate  # not attention
      ratio = (mixed["seconds"] - other) / (mixed["attention_keys"] * rate)
      lines.append(f"S={s} mixed layer: attention {mixed['seconds'] - other:.3f} s against "
                   f"{mixed['attention_keys']} keys x {rate * 1e6:.1f} us per key ({ref}): "
                   f"{ratio:.2f}x (target <= 1.3x)")
  return lines


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--spans", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  p.add_argument("--cases", nargs="+", default=["fixed", "short", "mixed", "mixed_nogroup"],
                 choices=["fixed", "short", "mixed", "mixed_nogroup", "long"])
  harness.int_flags(p, layers=4, d_model=256, heads=4, d_ff=1024, block=128, batch=16)
  p.add_argument("--short_span", type=int, default=64, help="span + ramp of the short heads")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--json", default=None)
  cpu_host.add_flag(p)
  args = p.parse_args()
  cpu_host.apply_flags(args)  # before the backend starts

  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
  print(f"shapes: {args.layers} layers, D={args.d_model}, {args.heads} heads, FF {args.d_ff}, "
        f"block {args.block}, batch {args.batch}, {args.dtype}\n")
  print("| S | case | plan (keys per token, all heads and layers) | fwd+bwd s/step | compile s |")
  print("|---|---|---|---|---|")
  rows = []
  for s in args.spans:
    for case in args.cases:
      cfg, plan, params = make_case(case, s, args)
      sec, comp = time_case(cfg, plan, params, args)
      rows.append({"span": s, "case": case, "seconds": sec, "compile_seconds": comp,
                   "attention_keys": plan.attention_keys(), "plan": plan.describe()})
      print(f"| {s} | {case} | {plan.attention_keys()} | {sec:.3f} | {comp:.1f} |", flush=True)
  print()
  for line in criteria(rows):
    print(line)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
