"""Attention alone, forward + backward: the plain banded path against the fused Pallas kernel.

One layer's attention (B, H heads, block M, head size Dh, window S) with a span profile:
  fixed   every head at S (no mask)
  short   every head at `--short` tokens (span + ramp)
  mixed   one head at S, the others short
The plain path (kernels/span/banded_reference.py, the GPU default without the kernel) gets the span plan's head groups as compile-time
windows, as the model gives it; the fused kernel gets the full window S and the spans as runtime
values (one compilation for every profile). Reports ms per call and, for the kernel, the
attention FLOPs it would do if it skipped exactly the keys outside each head's span.

  python -m bench.fused_attention                           # GPU: B=8, H=8, M=512, Dh=64, S=8192
  python -m bench.fused_attention --interpret --batch 1 --heads 2 --block 64 --span 256 --reps 1
      # CPU: the kernel interpreted (a smoke run: interpret-mode times mean nothing)
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from span_lm.kernels.span import banded_reference
from span_lm.kernels.span import pallas_gpu as fa


def profile(case, h, s, short):
  if case == "fixed":
    return None
  tokens = [short] * h
  if case == "mixed":
    tokens[0] = s
  return np.asarray(tokens, np.float64)


def timed(fn, args, reps):
  return harness.median_s(lambda: fn(*args), reps)


def run(a):
  dt = jnp.dtype(a.dtype)
  b, h, m, d, s, r = a.batch, a.heads, a.block, a.head_dim, a.span, a.ramp
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  q = jax.random.normal(ks[0], (b, h, m, d), dt)
  k = jax.random.normal(ks[1], (b, h, s + m, d), dt)
  v = jax.random.normal(ks[2], (b, h, s + m, d), dt)
  pe = jax.random.normal(ks[3], (d, s), dt)
  rows = []
  for case in a.cases:
    need = profile(case, h, s, a.short)
    z_H = None if need is None else jnp.asarray(need - r, jnp.float32)

    def fused(q, k, v, pe, z_H):
      z = None if z_H is None else jnp.broadcast_to(z_H[None, :, None], (b, h, m))
      return fa.span_attention(q, k, v, pe, z, ramp=r, block=a.tile, interpret=a.interpret)

    groups = [(tuple(range(h)), s)] if need is None else [
        (tuple(int(i) for i in np.nonzero(need == n)[0]), int(n)) for n in sorted(set(need))]

    def plain(q, k, v, pe, z_H):
      outs = []
      for heads, w in groups:  # the plan's compile-time windows, one call per head group
        idx = jnp.asarray(heads)
        span_z = None if z_H is None else z_H[idx][None, :, None]
        outs.append(banded_reference.banded_attention(
            q[:, idx], k[:, idx, s - w:], v[:, idx, s - w:], pe[:, s - w:], span_z=span_z,
            ramp=r))
      return jnp.concatenate(outs, axis=1)

    result = {"case": case, "spans": None if need is None else need.tolist()}
    for name, fn in (("plain", plain), ("fused", fused)):
      loss = lambda *x, fn=fn: jnp.sum(fn(*x).astype(jnp.float32))
      step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
      result[f"{name}_ms"] = 1e3 * timed(step, (q, k, v, pe, z_H), a.reps)
    keys = h * s if need is None else float(np.sum(need))
    result["attn_gflop"] = 3 * 3 * 2 * b * m * keys * d / 1e9  # QK, pos, AV; fwd + 2x bwd
    rows.append(result)
    print(json.dumps(result), flush=True)
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", nargs="+", default=["fixed", "short", "mixed"])
  harness.int_flags(p, batch=8, heads=8, block=512)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--span", type=int, default=8192)
  p.add_argument("--short", type=int, default=128, help="span + ramp of the short heads")
  p.add_argument("--ramp", type=int, default=32)
  p.add_argument("--tile", type=int, default=64, help="the kernel's query/key block")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--interpret", action="store_true", help="CPU: run the kernel interpreted")
  p.add_argument("--json", default=None)
  a = p.parse_args()
  if jax.default_backend() != "gpu" and not a.interpret:
    raise SystemExit("bench/fused_attention.py times the Triton kernel: it needs a GPU "
                     "(or --interpret for a CPU smoke run)")
  rows = run(a)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"args": vars(a), "device": jax.devices()[0].device_kind, "rows": rows}, f,
                indent=1)


if __name__ == "__main__":
  main()
