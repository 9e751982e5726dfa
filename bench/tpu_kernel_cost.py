"""The fused TPU kernel as XLA:TPU sees it, compiled deviceless (libtpu, no TPU): per tile choice,
the FLOPs and HBM bytes of value_and_grad of `pallas_tpu.span_attention` for one layer's head
group (XLA's cost analysis, which reads each kernel's pl.CostEstimate), the matmul and HBM
rooflines on the chip, its peak memory, and compile time.

The default shape is configs/enwik8.py's layer on one chip of a v5p-8 (8 sequences, 8 heads, a
block of 512, every head at span 8192, head size 64, bfloat16). Needs: pip install
"jax[tpu]==<jax version>". Runs with JAX_PLATFORMS=cpu.

  JAX_PLATFORMS=cpu python -m bench.tpu_kernel_cost --target v5p --tiles 128x128 128x256 256x512

Two-sided (windows ahead, the drop-in layer's A = W - 1) with segment ids, and the smallest
scoped VMEM limit Mosaic compiles the three kernels in (bisected, to 1 MiB):

  JAX_PLATFORMS=cpu python -m bench.tpu_kernel_cost --target v5p --ahead 8191 --segments --vmem
"""
import argparse
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp

from bench import harness
from span_lm.kernels import chips
from span_lm.kernels.span import pallas_tpu
from span_lm.kernels.span import tpu_tiles

TOPOLOGY = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def measure(target, bq, bk, b, h, m, w, d, dtype, n_pers, rate, ahead=0, segments=False,
            asym=False, vmem_limit=None):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name=TOPOLOGY[target], platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rep)
  # keys and values as the kernel lays them out: positions last, the cache's part and the
  # block's (with the rows ahead, padded to whole key tiles)
  ap = -(-ahead // bk) * bk
  args = [sd((b, h, m, d)), sd((b, 2, h, d, w)), sd((b, 2, h, d, m + ap)), sd((d, w), "float32"),
          sd((b, h, m), "float32")]
  if ahead:
    args += [sd((d, ahead), "float32")] + ([sd((b, h, m), "float32")] if asym else [])
  if n_pers:
    args += [sd((h, d, n_pers), "float32"), sd((h, n_pers, d), "float32")]
  segs = (sd((b, m), "int32"), sd((b, w + m + ahead), "int32")) if segments else (None, None)

  def loss(segs, q, kvc, kvb, pe, z, *rest):
    rest = list(rest)
    pe_a = rest.pop(0) if ahead else None
    za = rest.pop(0) if ahead and asym else None
    pk, pv = rest if n_pers else (None, None)
    out = pallas_tpu.span_attention_kv(q, kvc, kvb, pe, z, key_pe_ahead_DxA=pe_a,
                                       z_ahead_BxHxM=za, q_seg_BxM=segs[0],
                                       kv_seg_BxT=segs[1], ramp=32, block=bq, block_k=bk,
                                       pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=rate,
                                       dropout_seed=jnp.uint32(1) if rate else None,
                                       vmem_limit_bytes=vmem_limit)
    return jnp.sum(out.astype(jnp.float32))

  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1, len(args) + 1)))).lower(
      segs, *args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"flops": cost["flops"], "bytes": cost["bytes accessed"], "compile_s": seconds,
          "temp": harness.memory(compiled)["temp"]}


def smallest_vmem(run) -> int:
  """The smallest scoped VMEM limit (MiB) the three kernels compile in: Mosaic refuses a kernel
  whose blocks and scratch do not fit its limit at compile time (CompileTimeScopedVmemOom)."""
  lo, hi = 0, 128  # lo fails, hi compiles
  while hi - lo > 1:
    mid = (lo + hi) // 2
    try:
      run(mid << 20)
      hi = mid
    except Exception as e:  # pylint: disable=broad-except
      if "Vmem" not in str(e) and "vmem" not in str(e):
        raise
      lo = mid
  return hi


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--target", default="v5p", choices=sorted(TOPOLOGY))
  p.add_argument("--tiles", nargs="+", default=["128x128", "128x256", "256x512"])
  p.add_argument("--shape", default="8,8,512,8192,64", help="B,H,M,W,Dh")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--pers", type=int, default=0)
  p.add_argument("--dropout", type=float, default=0.0)
  p.add_argument("--ahead", type=int, default=0, help="keys ahead, A (0: causal)")
  p.add_argument("--asym", action="store_true", help="spans ahead learned apart")
  p.add_argument("--segments", action="store_true", help="segment ids")
  p.add_argument("--vmem", action="store_true",
                 help="also bisect the smallest scoped VMEM limit that compiles")
  args = p.parse_args()
  b, h, m, w, d = (int(x) for x in args.shape.split(","))
  chip = chips.get(args.target)
  two = dict(ahead=args.ahead, segments=args.segments, asym=args.asym)
  print(f"{args.target}: B={b} H={h} M={m} W={w} A={args.ahead} Dh={d} {args.dtype} "
        f"N={args.pers} dropout={args.dropout} segments={args.segments} asym={args.asym}, "
        f"value_and_grad (spans are runtime inputs; the grid's worst case, every span W (and A "
        f"ahead), is what XLA counts)")
  vmem_col = " scoped VMEM limit set / needed MiB |" if args.vmem else ""
  print("| tiles (bq x bk) | GFLOP | HBM GB | matmul roofline ms | bytes / HBM ms | bound | "
        f"temporaries MiB | compile s |{vmem_col}")
  print("|---|---|---|---|---|---|---|---|" + ("---|" if args.vmem else ""))
  for tile in args.tiles:
    bq, bk = (int(x) for x in tile.split("x"))
    run = lambda limit=None, bq=bq, bk=bk: measure(args.target, bq, bk, b, h, m, w, d,
                                                    args.dtype, args.pers, args.dropout,
                                                    vmem_limit=limit, **two)
    r = run()
    t_mm = r["flops"] / chip.peak_flops[args.dtype] * 1e3
    t_hbm = r["bytes"] / chip.hbm_bytes_per_s * 1e3
    vmem = ""
    if args.vmem:
      dp = tpu_tiles.padded_head_dim(d)
      pers_dt = "float32"
      set_mib = tpu_tiles.vmem_bytes(w + args.ahead, dp, bq, bk, args.dtype, n_pers=args.pers,
                                      pers_dtype=pers_dt,
                                      row_stats=2 * args.asym + args.segments,
                                      key_ids=args.segments) / 2**20
      vmem = f" {set_mib:.0f} / {smallest_vmem(run)} |"
    print(f"| {bq} x {bk} | {r['flops'] / 1e9:.0f} | {r['bytes'] / 1e9:.2f} | {t_mm:.2f} | "
          f"{t_hbm:.2f} | {'HBM' if t_hbm > t_mm else 'matmul'} | {r['temp'] / 2**20:.0f} | "
          f"{r['compile_s']:.1f} |{vmem}", flush=True)


if __name__ == "__main__":
  main()
