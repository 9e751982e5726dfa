"""The fused TPU kernel as XLA:TPU sees it, compiled deviceless (libtpu, no TPU): per tile choice,
the FLOPs and HBM bytes of value_and_grad of `pallas_tpu.span_attention` for one layer's head
group (XLA's cost analysis, which reads each kernel's pl.CostEstimate), the matmul and HBM
rooflines on the chip, its peak memory, and compile time.

The default shape is configs/enwik8.py's layer on one chip of a v5p-8 (8 sequences, 8 heads, a
block of 512, every head at span 8192, head size 64, bfloat16). Needs: pip install
"jax[tpu]==<jax version>". Runs with JAX_PLATFORMS=cpu.

  JAX_PLATFORMS=cpu python bench/tpu_kernel_cost.py --target v5p --tiles 128x128 128x256 256x512
"""
import _repo  # first: the checkout's span_lm (bench/_repo.py)  # pylint: disable=unused-import
import argparse
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

from span_lm.kernels import pallas_tpu  # pylint: disable=wrong-import-position
from span_lm.tools import chips  # pylint: disable=wrong-import-position

TOPOLOGY = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def measure(target, bq, bk, b, h, m, w, d, dtype, n_pers, rate):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name=TOPOLOGY[target], platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sd = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rep)
  # keys and values as the door projects them: positions last, the cache's and the block's parts
  args = [sd((b, h, m, d)), sd((b, 2, h, d, w)), sd((b, 2, h, d, m)), sd((d, w), "float32"),
          sd((b, h, m), "float32")]
  if n_pers:
    args += [sd((h, d, n_pers), "float32"), sd((h, n_pers, d), "float32")]

  def loss(q, kvc, kvb, pe, z, pk=None, pv=None):
    out = pallas_tpu.span_attention_kv(q, kvc, kvb, pe, z, ramp=32, block=bq, block_k=bk,
                                    pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=rate,
                                    dropout_seed=jnp.uint32(1) if rate else None)
    return jnp.sum(out.astype(jnp.float32))

  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(
      *args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  return {"flops": cost["flops"], "bytes": cost["bytes accessed"], "compile_s": seconds,
          "temp": mem.temp_size_in_bytes}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--target", default="v5p", choices=sorted(TOPOLOGY))
  p.add_argument("--tiles", nargs="+", default=["128x128", "128x256", "256x512"])
  p.add_argument("--shape", default="8,8,512,8192,64", help="B,H,M,W,Dh")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--pers", type=int, default=0)
  p.add_argument("--dropout", type=float, default=0.0)
  args = p.parse_args()
  b, h, m, w, d = (int(x) for x in args.shape.split(","))
  chip = chips.get(args.target)
  print(f"{args.target}: B={b} H={h} M={m} W={w} Dh={d} {args.dtype} N={args.pers} "
        f"dropout={args.dropout}, value_and_grad (spans are runtime inputs; the grid's worst "
        f"case, every span W, is what XLA counts)")
  print("| tiles (bq x bk) | GFLOP | HBM GB | matmul roofline ms | bytes / HBM ms | bound | "
        "temporaries MiB | compile s |")
  print("|---|---|---|---|---|---|---|---|")
  for tile in args.tiles:
    bq, bk = (int(x) for x in tile.split("x"))
    r = measure(args.target, bq, bk, b, h, m, w, d, args.dtype, args.pers, args.dropout)
    t_mm = r["flops"] / chip.peak_flops[args.dtype] * 1e3
    t_hbm = r["bytes"] / chip.hbm_bytes_per_s * 1e3
    print(f"| {bq} x {bk} | {r['flops'] / 1e9:.0f} | {r['bytes'] / 1e9:.2f} | {t_mm:.2f} | "
          f"{t_hbm:.2f} | {'HBM' if t_hbm > t_mm else 'matmul'} | {r['temp'] / 2**20:.0f} | "
          f"{r['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
  main()
