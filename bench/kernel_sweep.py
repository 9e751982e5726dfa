"""The fused GPU kernel's tile candidates compiled deviceless for NVIDIA targets: registers, spills
and shared memory per kernel as ptxas and XLA's Triton pipeline report them, what the PTX does
(tensor-core instructions, asynchronous copies, loads issued a tile ahead, buffers read back:
span_lm/tools/ptx.py), and compile time.

Each candidate (target, dtype, head size, tile, warps, stages) compiles value_and_grad of
`pallas_gpu.span_attention` (B=2, H=8, M=512, W=1024, adaptive spans, no persistent memory) in a
child process with the CUDA toolchain (pip install "jax[cuda12]==<jax version>"; no GPU needed).
The table `gpu_tiles.TILES` is chosen from its results (docs/kernels.md).

  python -m bench.kernel_sweep --targets h100 a100_80 --dtypes bfloat16 float32 \
      --head_dims 64 128 --warps 4 8 --stages 2 3 --out docs/kernel_sweep.json
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import harness
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.tools import compile as compile_lib
from span_lm.tools import ptx
from span_lm.kernels.span import gpu_tiles


def child(target, dtype, dh, tile, warps, stages, precision, key_tile=0):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.span import pallas_gpu  # pylint: disable=g-import-not-at-top
  chip = chips.get(target)
  topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=chips.gpu_target_config(chip))
  sh = NamedSharding(Mesh(np.asarray(topo.devices), ("x",)), P())
  # jax >= 0.11: Pallas-Triton lowers for the default device's GPU (target.compiling_for)
  jax.config.update("jax_default_device", topo.devices[0])
  b, h, m, w = 2, 8, 512, 1024
  dt = jnp.dtype(dtype)
  if tile == 0:  # what the door runs on this target (gpu_tiles.TILES) for attn_block=64
    tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64)
    key_tile = gpu_tiles.key_tile(chip.cc, dh, dt, tile)
  key_tile = key_tile or tile
  sds = lambda *s, d=dt: jax.ShapeDtypeStruct(s, d, sharding=sh)

  def loss(q, k, v, pe, z):
    out = pallas_gpu.span_attention(q, k, v, pe, z, ramp=32, block=tile, block_k=key_tile,
                                    num_warps=warps,
                                    num_stages=stages, precision=precision)
    return jnp.sum(out.astype(jnp.float32))

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  args = (sds(b, h, m, dh), sds(b, h, w + m, dh), sds(b, h, w + m, dh), sds(dh, w),
          sds(b, h, m, d=jnp.float32))
  if precision == "anchor":  # jax's own Pallas flash attention (causal, BTHD), the same tokens
    from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=g-import-not-at-top
    sizes = attention.BlockSizes(block_q=tile, block_k=tile, block_q_dkv=tile,
                                 block_kv_dkv=tile, block_q_dq=tile, block_kv_dq=tile)
    mha = lambda q, k, v: jnp.sum(attention.mha(q, k, v, None, causal=True, block_sizes=sizes,
                                                num_warps=warps, num_stages=stages)
                                  .astype(jnp.float32))
    f = jax.jit(jax.value_and_grad(mha, argnums=(0, 1, 2)))
    args = (sds(b, w + m, h, dh),) * 3
  t0 = time.perf_counter()
  row = {"target": target, "dtype": dtype, "head_dim": dh, "tile": tile, "key_tile": key_tile,
         "warps": warps, "stages": stages, "precision": precision}
  try:
    # as the training step compiles it (kernels.compiler_options: ptxas' occupancy floor)
    f.lower(*args).compile(compiler_options=None if precision == "anchor" else
                           dict(kernels.GPU_COMPILER_OPTIONS))
    row["compiled"] = True
  except Exception as e:  # pylint: disable=broad-except
    row["compiled"] = False
    row["error"] = compile_lib._one_line(e)  # pylint: disable=protected-access
  row["compile_s"] = time.perf_counter() - t0
  print("ROW " + json.dumps(row), flush=True)


def run(args):
  rows = []
  for target, dtype, dh, tile, key_tile, warps, stages in itertools.product(
      args.targets, args.dtypes, args.head_dims, args.tiles, args.key_tiles, args.warps,
      args.stages):
    if key_tile > tile > 0:
      continue
    cmd = [sys.executable, "-m", "bench.kernel_sweep", "--child", target, dtype, str(dh),
           str(tile), str(warps), str(stages), args.precision, str(key_tile)]
    t0 = time.perf_counter()
    env = compile_lib.child_env("gpu")
    dump = tempfile.mkdtemp(prefix="kernel_sweep_")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=harness.REPO)
    text = p.stdout + p.stderr
    row = next((json.loads(l[4:]) for l in text.splitlines() if l.startswith("ROW ")), None)
    if row is None:
      row = {"target": target, "dtype": dtype, "head_dim": dh, "tile": tile, "warps": warps,
             "stages": stages, "compiled": False,
             "error": ([l for l in text.splitlines() if l.strip()] or ["?"])[-1][:300]}
    row["wall_s"] = time.perf_counter() - t0
    facts = {f["kernel"]: f for f in ptx.dumped_kernels(dump)}
    row["kernels"] = [dict(k, ptx=facts.get(k["kernel"], {}))
                      for k in compile_lib.parse_ptxas(text)
                      if "span_attention" in k["kernel"] or "mha" in k["kernel"]]
    subprocess.run(["rm", "-rf", dump], check=False)
    rows.append(row)
    ks = " ".join(f"{k['kernel'].replace('span_attention_', '')}:{k['registers']}r/"
                  f"{k['spill_store']}s/{k['ptx'].get('wgmma', 0) + k['ptx'].get('mma', 0)}tc/"
                  f"{k['ptx'].get('cp_async', 0)}async" for k in row["kernels"])
    print(f"{target} {dtype} dh={dh} tile={row.get('tile', tile)}/{row.get('key_tile', key_tile)} "
          f"warps={row.get('warps', warps)} stages={row.get('stages', stages)}: "
          f"{'ok' if row['compiled'] else 'FAIL ' + row.get('error', '')} {ks} "
          f"({row['compile_s'] if 'compile_s' in row else row['wall_s']:.0f}s)", flush=True)
  if args.out:
    harness.write_json(args.out, {"command": " ".join(sys.argv), "rows": rows})
  return rows


def _tc(kernel: dict) -> str:
  f = kernel.get("ptx", {})
  if not f:
    return "?"
  return f"{f['wgmma']} wgmma" if f["wgmma"] else f"{f['mma']} mma"


def markdown(rows) -> str:
  """One line per candidate: its kernels' registers and spill stores/loads, or the failure."""
  head = ("| target | dtype | Dh | tile / key tile | warps | stages | fwd: regs / spills B / tensor-core ops / "
          "cp.async | bwd_q | bwd_kv | "
          "compile s |\n|---|---|---|---|---|---|---|---|---|---|")
  out = [head]
  for r in rows:
    ks = {k["kernel"].replace("span_attention_", ""): k for k in r.get("kernels", [])}
    cell = lambda n: (f"{ks[n]['registers']} / {ks[n]['spill_store']}+{ks[n]['spill_load']} / "
                      f"{_tc(ks[n])} / {ks[n].get('ptx', {}).get('cp_async', '?')}"
                      if n in ks else "")
    if not r["compiled"]:
      err = r.get("error", "").replace("RESOURCE_EXHAUSTED: ", "").split(", context")[0]
      out.append(f"| {r['target']} | {r['dtype']} | {r['head_dim']} | {r['tile']}/{r.get('key_tile', r['tile'])} | {r['warps']} "
                 f"| {r['stages']} | {err} | | | {r.get('compile_s', 0):.0f} |")
      continue
    out.append(f"| {r['target']} | {r['dtype']} | {r['head_dim']} | {r['tile']}/{r.get('key_tile', r['tile'])} | {r['warps']} | "
               f"{r['stages']} | {cell('fwd')} | {cell('bwd_q')} | {cell('bwd_kv')} | "
               f"{r['compile_s']:.0f} |")
  return "\n".join(out)


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    a = sys.argv[2:]
    return child(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6], int(a[7]))
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--targets", nargs="+", default=["h100", "a100_80"])
  p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  p.add_argument("--head_dims", nargs="+", type=int, default=[64, 128])
  p.add_argument("--tiles", nargs="+", type=int, default=[64],
                 help="0: the table's choice (gpu_tiles.TILES), whatever --warps/--stages say")
  p.add_argument("--key_tiles", nargs="+", type=int, default=[0],
                 help="0: the query tile (the table's own with --tiles 0)")
  p.add_argument("--warps", nargs="+", type=int, default=[4])
  p.add_argument("--stages", nargs="+", type=int, default=[2])
  p.add_argument("--precision", default="default", choices=["default", "highest", "anchor"],
                 help="anchor: compile jax's own Pallas flash attention (causal) instead, for "
                      "comparison at the same tiles")
  p.add_argument("--out", default="")
  p.add_argument("--md", default="", help="print the markdown table of an --out JSON and exit")
  missing = compile_lib.missing_toolchain("gpu")
  args = p.parse_args()
  if args.md:
    print(markdown(json.load(open(args.md))["rows"]))
    return
  if missing:
    raise SystemExit(f"error: {missing}")
  run(args)


if __name__ == "__main__":
  main()
