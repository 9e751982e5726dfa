"""Time and memory of one attention layer, dense vs strided vs fixed, versus the sequence length n.

Each case is a jitted forward+backward of sum(attention(q, k, v)) over random (B, H, n, Dh)
inputs, merged heads (eq. 7). dense is causal attention over the full (n, n) matrix; strided and
fixed are the O(n sqrt n) paths of span_lm/model/sparse.py with stride l = sqrt(n) rounded to a
power of two (or --stride) and c = --c. Memory is XLA's own accounting of the compiled program
(temporaries + outputs + arguments, `memory_analysis`), plus the device's peak where it reports one
(GPU), and XLA's flop count. Exponents: slopes of log(time), log(flops) and log(bytes) against
log(n) over the lengths measured (on a shared CPU the flop and byte exponents are the stable ones).

  python -m bench.sparse_attention                            # n = 1024 2048 4096 (CPU-sized)
  python -m bench.sparse_attention --n 1024 4096 12288 --json out.json   # the issue's lengths
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from span_lm.model import sparse

CASES = ("dense", "strided", "fixed")


def make_fn(case: str, n: int, args):
  stride = args.stride or sparse.default_stride(n)
  heads = sparse.layer_heads(case, "merged", args.heads, 0, stride, args.c)

  def loss(q, k, v):
    return jnp.sum(sparse.sparse_attention(q, k, v, heads).astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), heads, stride


def measure(case: str, n: int, args) -> dict:
  fn, heads, stride = make_fn(case, n, args)
  dt = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (args.batch, args.heads, n, args.head_dim), dt) for kk in keys)
  compiled, compile_s = harness.compile_timed(fn, q, k, v)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
  xla_bytes = harness.compiled_bytes(compiled)  # nothing donated: arguments + outputs + temps
  times = harness.time_calls(lambda: compiled(q, k, v), args.reps)
  stats = jax.devices()[0].memory_stats() or {}
  return {"case": case, "n": n, "stride": stride if case != "dense" else None,
          "c": args.c if case == "fixed" else None, "ms": 1000 * float(np.median(times)),
          "gflop": flops / 1e9,
          "compile_s": compile_s, "xla_bytes": xla_bytes,
          "device_peak_bytes": stats.get("peak_bytes_in_use"),
          "keys_per_query": sparse.attended_keys(heads[:1], n) / n if n <= 4096 else None}


def exponents(rows, key: str = "ms") -> dict:
  """Slope of log(rows[key]) against log(n) per case."""
  out = {}
  for case in {r["case"] for r in rows}:
    pts = sorted((r["n"], r[key]) for r in rows if r["case"] == case)
    if len(pts) >= 2:
      x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
      out[case] = float(np.polyfit(x, y, 1)[0])
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096])
  p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--stride", type=int, default=0, help="0: sqrt(n) as a power of two")
  p.add_argument("--c", type=int, default=8)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  rows = []
  print(f"device: {jax.devices()[0].device_kind}; B={args.batch} H={args.heads} "
        f"Dh={args.head_dim} {args.dtype}, forward+backward")
  print(f"{'case':8s} {'n':>6s} {'l':>4s} {'ms':>9s} {'GFLOP':>8s} {'XLA MiB':>9s} "
        f"{'keys/query':>10s}")
  for n in args.n:
    for case in args.cases:
      r = measure(case, n, args)
      rows.append(r)
      mib = "-" if r["xla_bytes"] is None else f"{r['xla_bytes'] / 2**20:.1f}"
      kq = "-" if r["keys_per_query"] is None else f"{r['keys_per_query']:.0f}"
      print(f"{case:8s} {n:6d} {r['stride'] or '-':>4} {r['ms']:9.2f} {r['gflop']:8.3f} "
            f"{mib:>9s} {kq:>10s}", flush=True)
  exp = {key: exponents(rows, key) for key in ("ms", "gflop", "xla_bytes")
         if all(r[key] is not None for r in rows)}
  for key, e in exp.items():
    print(f"{key} ~ n^k: " + ", ".join(f"{c} k={k:.2f}" for c, k in sorted(e.items())))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "exponents": exp, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
  main()
