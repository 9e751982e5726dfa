"""The fused GPU kernel on a real GPU, in under two minutes: values and every gradient against the
plain definition (banded_reference, float32, exact dots) for bf16/float32, fixed/adaptive/
dynamic spans and persistent memory, then forward and forward+backward milliseconds at
configs/enwik8.py's layer shapes against the XLA path (`reference`).

  python bench/gpu_kernel_check.py --out /tmp/kcheck.json     # a GPU machine
  python bench/gpu_kernel_check.py --interpret --small        # CPU rehearsal (interpret mode)

Made for the bug the GPU suite found (docs/kernels.md, "Scratch read-back"): with num_stages=2
the backward kernels' gradients are wrong on the device although interpret mode agrees. The
first case also runs that pipelined variant, expected to FAIL: the check must see the bug to be
believed when the shipped kernel passes.
"""
import _repo  # first: the checkout's span_lm (bench/_repo.py)  # pylint: disable=unused-import
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import gpu_suite  # pylint: disable=wrong-import-position
from span_lm.kernels import banded_reference  # pylint: disable=wrong-import-position
from span_lm.kernels import pallas_gpu  # pylint: disable=wrong-import-position

RAMP = 32
TOL = gpu_suite.TOL  # the suite's tolerances: TF32 / bf16 against the float32 definition


def inputs(b, h, m, w, dh, dtype, spans, n_pers, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  rnd = lambda k, s: jax.random.normal(k, s, jnp.float32)
  q, k, v = rnd(ks[0], (b, h, m, dh)), rnd(ks[1], (b, h, w + m, dh)), rnd(ks[2], (b, h, w + m, dh))
  pe = rnd(ks[3], (dh, w))
  if spans == "fixed":
    z = None
  elif spans == "adaptive":
    z = jnp.broadcast_to(jnp.linspace(3.0, 0.7 * w, h)[None, :, None], (b, h, m))
  elif spans == "all_S":
    z = jnp.full((b, h, m), float(w))
  else:  # dynamic
    z = jax.random.uniform(ks[4], (b, h, m), minval=0.0, maxval=float(w))
  pk = pv = None
  if n_pers:
    pk, pv = rnd(ks[5], (h, dh, n_pers)), rnd(ks[6], (h, n_pers, dh))
  cast = lambda x: x.astype(dtype)
  return dict(q=cast(q), k=cast(k), v=cast(v), pe=pe, z=z, pk=pk, pv=pv)


def loss_fn(attn, g):
  def loss(q, k, v, pe, z, pk, pv):
    return jnp.sum(attn(q, k, v, pe, z, pk, pv).astype(jnp.float32) * g)
  return loss


def grads(attn, x, g):
  names = [n for n in ("q", "k", "v", "pe", "z", "pk", "pv") if x[n] is not None]
  argnums = tuple(("q", "k", "v", "pe", "z", "pk", "pv").index(n) for n in names)
  f = jax.jit(jax.value_and_grad(loss_fn(attn, g), argnums=argnums))
  args = [x[n] for n in ("q", "k", "v", "pe", "z", "pk", "pv")]
  return f, args, names


def fused(block, warps, stages, interpret):
  def attn(q, k, v, pe, z, pk, pv):
    return pallas_gpu.span_attention(q, k, v, pe, z, ramp=RAMP, pers_k_HxDxN=pk,
                                     pers_v_HxNxD=pv, block=block, num_warps=warps,
                                     num_stages=stages, interpret=interpret)
  return attn


def plain(q, k, v, pe, z, pk, pv):
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    return banded_reference.banded_attention(f32(q), f32(k), f32(v), pe, span_z=z, ramp=RAMP,
                                             pers_k_GxDxN=pk, pers_v_GxNxD=pv)


def out_and_grads(attn, x, g):
  f, args, names = grads(attn, x, g)
  out = jax.jit(attn)(*[x[n] for n in ("q", "k", "v", "pe", "z", "pk", "pv")])
  _, gs = f(*args)
  return out, dict(zip(names, gs)), f, args


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def timed(f, args, reps):
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    r = f(*args)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / reps * 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU rehearsal)")
  ap.add_argument("--no_timing", action="store_true")
  a = ap.parse_args()
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  cc = float(cc) if cc else None
  rows = []
  emit = lambda r: (rows.append(r), print(json.dumps(r), flush=True))
  emit({"device": dev.device_kind, "jax": jax.__version__, "cc": cc})
  if a.small:
    b, h, m, w, dh, n_pers, block = 1, 2, 32, 64, 16, 16, 16
  else:
    b, h, m, w, dh, n_pers, block = 2, 4, 256, 1024, 64, 64, 64
  cases = [("bfloat16", "adaptive", 0), ("bfloat16", "dynamic", 0), ("bfloat16", "fixed", 0),
           ("bfloat16", "adaptive", n_pers), ("float32", "adaptive", 0),
           ("float32", "dynamic", n_pers)]
  for ci, (dtype, spans, np_) in enumerate(cases):
    x = inputs(b, h, m, w, dh, jnp.dtype(dtype), spans, np_)
    g = jax.random.normal(jax.random.PRNGKey(9), (b, h, m, dh), jnp.float32)
    want_out, want, _, _ = out_and_grads(plain, x, g)
    tile, warps, stages0 = pallas_gpu.tiles(cc, dh, jnp.dtype(dtype), block)
    # the shipped launch (pallas_gpu.TILES), and on the first case the pipelined one too
    for variant, stages in [("shipped", stages0)] + ([("pipelined", 2)] if ci == 0 else []):
      pallas_gpu._ALLOW_PIPELINING[0] = stages > 1  # pylint: disable=protected-access
      t0 = time.perf_counter()
      try:
        out, got, _, _ = out_and_grads(fused(tile, warps, stages, a.interpret), x, g)
        errs = {"out": rel(out, want_out), **{n: rel(got[n], want[n]) for n in want}}
        worst = max(errs.values())
        status = "pass" if worst <= TOL[dtype] else "FAIL"
        if variant == "pipelined":
          status = ("FAIL as expected" if status == "FAIL" else
                    "pass (interpret mode cannot show it)" if a.interpret else
                    "pass: the check misses the bug")
      except Exception as e:  # pylint: disable=broad-except
        errs, status = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, "error"
      emit({"check": f"{dtype}/{spans}/pers{np_}", "variant": variant, "tile": tile, "warps": warps,
            "stages": stages, "status": status, "s": round(time.perf_counter() - t0, 1),
            **{k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in errs.items()}})
  if not a.no_timing:
    # enwik8's layer shapes on one GPU's share: B=8 streams, H=8, M=512, W=8192, Dh=64, bf16.
    tb, th, tm, tw = (1, 2, 32, 64) if a.small else (8, 8, 512, 8192)
    for spans in ("adaptive", "all_S"):
      x = inputs(tb, th, tm, tw, dh, jnp.bfloat16, spans, 0)
      g = jax.random.normal(jax.random.PRNGKey(9), (tb, th, tm, dh), jnp.float32)
      tile, warps, stages0 = pallas_gpu.tiles(cc, dh, jnp.bfloat16, block)
      pallas_gpu._ALLOW_PIPELINING[0] = False  # pylint: disable=protected-access
      for impl in ("pallas", "reference"):
        attn = (lambda q, k, v, pe, z, pk, pv: banded_reference.banded_attention(
            q, k, v, pe, span_z=z, ramp=RAMP)) if impl == "reference" else fused(
                tile, warps, stages0, a.interpret)
        try:
          f, args, _ = grads(attn, x, g)
          fwd = jax.jit(attn)
          fargs = [x[n] for n in ("q", "k", "v", "pe", "z", "pk", "pv")]
          emit({"time": f"bf16/{spans}", "impl": impl, "tiles": [tile, warps, stages0],
                "fwd_ms": round(timed(fwd, fargs, 3 if a.small else 10), 3),
                "fwd_bwd_ms": round(timed(f, args, 3 if a.small else 10), 3)})
        except Exception as e:  # pylint: disable=broad-except
          emit({"time": f"bf16/{spans}", "impl": impl,
                "error": f"{type(e).__name__}: {str(e)[:300]}"})
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)
  bad = [r for r in rows if r.get("status") in ("FAIL", "error", "pass: the check misses the bug")]
  if bad:
    raise SystemExit(f"gpu_kernel_check: {len(bad)} row(s) failed: {[r['check'] for r in bad]}")


if __name__ == "__main__":
  main()
