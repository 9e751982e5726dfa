"""The fused GPU kernel's compile facts per kernel, causal and two-sided, deviceless for NVIDIA
targets: registers and spills (ptxas), shared memory (XLA's launch of the Triton kernel), and
what the PTX does (tensor-core instructions, asynchronous copies, buffers read back, position
tiles loaded a tile ahead: span_lm/tools/ptx.py).

Cases (each bf16 and float32, head sizes 64 and 96 (run as 128), at the door's tiles:
gpu_tiles.TILES causal, TILES_TWO_SIDED with windows ahead), value_and_grad of one call:
  causal            B=1, H=2, M=128, W=256, adaptive spans, persistent memory (64), dropout 0.1:
                    tests/kernels/test_pallas_gpu.py's PTX case, what the span model runs
  causal_segmented  the same with segment ids: what the drop-in layer runs causal
  two_sided         A=255 ahead (not a whole key tile), one span both sides, segment ids,
                    persistent memory, dropout: what the layer runs bidirectional
  two_sided_apart   the same with the spans ahead learned apart (asymmetric=True)
  causal_gqa        causal_segmented with grouped key/value heads: 8 query heads, 2 key/value
                    heads (the dk/dv kernel loops over the group's query heads)
  two_sided_gqa     two_sided with 8 query heads, 2 key/value heads
  encoder_step      jit(grad) of an encoder built from the drop-in layer (4 heads, max_span 64,
                    bidirectional, segment ids, dropout 0.1, 2 x 256 tokens), attn_impl='pallas'
  sparse_enwik8     the block-sparse kernel (kernels/sparse/pallas_gpu_sparse.py), value_and_grad at
                    configs/enwik8_sparse_fixed.py's attention shape: B=1, 8 heads, n=12,288,
                    fixed pattern, stride 128, c=32, merged (distinct offsets), at its TILES
                    (head size 64 only: --head_dims 64)
  sparse_split      the same kernel, strided pattern split across heads (two groups: two calls
                    of each kernel, the same code), n=12,288

  python -m bench.kernel_facts --targets h100 a100_80 --cases sparse_enwik8 --head_dims 64 \
      --out docs/kernel_sparse.json

  python -m bench.kernel_facts --targets h100 a100_80 --out docs/kernel_two_sided.json
  python -m bench.kernel_facts --md docs/kernel_two_sided.json     # the table again

Needs the CUDA toolchain (pip install -e .[gpu-compile]); no GPU. One child process per case,
dtype and head size (its own XLA dump).
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from bench import harness
from span_lm.tools import compile as compile_lib
from span_lm.tools import ptx

CASES = ("causal", "causal_segmented", "two_sided", "two_sided_apart", "causal_gqa",
         "two_sided_gqa", "encoder_step", "sparse_enwik8", "sparse_split")
_SMEM = re.compile(r"\b((?:span|block_sparse)_attention_\w+) grid: \[([^\]]*)\] "
                   r"threads: \[([^\]]*)\]\s+shared_memory: (\d+) bytes")

_PRELUDE = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.kernels.span import pallas_gpu
from span_lm.kernels.span import gpu_tiles
chip = chips.get(sys.argv[1])
case, dt, dh = sys.argv[2], jnp.dtype(sys.argv[3]), int(sys.argv[4])
topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                    target_config=chips.gpu_target_config(chip))
sh = NamedSharding(Mesh(np.asarray(topo.devices), ("x",)), P())
# jax >= 0.11: Pallas-Triton lowers for the default device's GPU (target.compiling_for)
jax.config.update("jax_default_device", topo.devices[0])
opts = dict(kernels.GPU_COMPILER_OPTIONS)
"""

_KERNEL = _PRELUDE + """
b, h, m, w, n = 1, 2, 128, 256, 64
hk = h
if case.endswith("_gqa"):  # grouped key/value heads: 4 query heads per key/value head
  h, hk = 8, 2
a = 255 if case.startswith("two_sided") else 0
seg, apart = case != "causal", case == "two_sided_apart"
tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64, two_sided=a > 0)
bk = gpu_tiles.key_tile(chip.cc, dh, dt, tile, two_sided=a > 0)
print("TILES " + json.dumps([tile, bk, warps, stages]), flush=True)
sds = lambda *s, d=dt: jax.ShapeDtypeStruct(s, d, sharding=sh)
f32, i32 = jnp.float32, jnp.int32
def loss(q, k, v, pe, pe_a, z, z_a, pk, pv, qs, ks):
  return jnp.sum(pallas_gpu.span_attention(
      q, k, v, pe, z, ramp=32, block=tile, block_k=bk, num_warps=warps, num_stages=stages,
      pers_k_HxDxN=pk, pers_v_HxNxD=pv, dropout_rate=0.1, dropout_seed=jnp.uint32(3),
      key_pe_ahead_DxA=pe_a if a else None, z_ahead_BxHxM=z_a if apart else None,
      q_segments_BxM=qs if seg else None, kv_segments_BxT=ks if seg else None
      ).astype(jnp.float32))
t = w + m + a
jax.jit(jax.value_and_grad(loss, argnums=tuple(range(9)))).lower(
    sds(b, h, m, dh), sds(b, hk, t, dh), sds(b, hk, t, dh), sds(dh, w), sds(dh, max(a, 1)),
    sds(b, h, m, d=f32), sds(b, h, m, d=f32), sds(h, dh, n, d=f32), sds(h, n, dh, d=f32),
    sds(b, m, d=i32), sds(b, t, d=i32)).compile(compiler_options=opts)
"""

_ENCODER = _PRELUDE + """
import flax.linen as nn
from span_lm import layers
from span_lm.kernels import target

class Encoder(nn.Module):
  @nn.compact
  def __call__(self, tokens, seg, rng):
    x = nn.Embed(256, 4 * dh, dtype=dt)(tokens)
    x = x + layers.AdaptiveSpanAttention(num_heads=4, max_span=64, causal=False, dtype=dt,
                                         attn_impl="pallas", dropout_rate=0.1,
                                         deterministic=False)(x, segment_ids=seg, dropout_rng=rng)
    return nn.Dense(256, dtype=jnp.float32)(x)

with target.compiling_for("gpu", chip.cc, chip.device_kind):
  tile, warps, stages = gpu_tiles.tiles(chip.cc, dh, dt, 64, two_sided=True)
  bk = gpu_tiles.key_tile(chip.cc, dh, dt, tile, two_sided=True)
  print("TILES " + json.dumps([tile, bk, warps, stages]), flush=True)
  model = Encoder()
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sh)
  tokens, seg = sds((2, 256), jnp.int32), sds((2, 256), jnp.int32)
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sh)
  params = jax.eval_shape(lambda t, s, r: model.init(jax.random.key(0), t, s, r), tokens, seg, rng)
  params = jax.tree.map(lambda p: sds(p.shape, p.dtype), params)
  def loss(params, tokens, seg, rng):
    logits = model.apply(params, tokens, seg, rng, mutable=["intermediates"])[0]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1) * (seg[..., None] > 0))
  jax.jit(jax.grad(loss)).lower(params, tokens, seg, rng).compile(compiler_options=opts)
"""


_SPARSE = _PRELUDE + """
from span_lm.kernels.sparse import pallas_gpu_sparse as ps
from span_lm.kernels import target
from span_lm.model import sparse
b, h, n = 1, 8, 12288
heads = (sparse.layer_heads("fixed", "merged", h, 0, 128, 32) if case == "sparse_enwik8" else
         sparse.layer_heads("strided", "split", h, 0, 128, 1))
with target.compiling_for("gpu", chip.cc, chip.device_kind):
  bq, bk, warps, stages = ps._target_tiles(dt)
  print("TILES " + json.dumps([bq, bk, warps, stages]), flush=True)
  sds = lambda *s: jax.ShapeDtypeStruct(s, dt, sharding=sh)
  def loss(q, k, v):
    return jnp.sum(ps.block_sparse_attention(q, k, v, heads).astype(jnp.float32) ** 2)
  jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
      sds(b, h, n, dh), sds(b, h, n, dh), sds(b, h, n, dh)).compile(compiler_options=opts)
"""


def shared_memory(dump_dir) -> dict:
  """{kernel: (shared memory bytes, threads)} of the span_attention (and block_sparse_attention)
  launches in XLA's thunk sequences (Triton's dynamic shared memory; ptxas' static count is 0
  for these kernels)."""
  out = {}
  for f in sorted(pathlib.Path(dump_dir).glob("*thunk_sequence.txt")):
    for m in _SMEM.finditer(f.read_text()):
      out[m.group(1)] = (int(m.group(4)), m.group(3).split(",")[0].strip())
  return out


def run_one(target, case, dtype, dh):
  with tempfile.TemporaryDirectory() as tmp:
    env = compile_lib.child_env("gpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp}"
    t0 = time.time()
    child = (_ENCODER if case == "encoder_step" else _SPARSE if case.startswith("sparse")
             else _KERNEL)
    prefix = "block_sparse_attention" if case.startswith("sparse") else "span_attention"
    r = subprocess.run([sys.executable, "-c", child,
                        target, case, dtype, str(dh)], cwd=harness.REPO, env=env,
                       capture_output=True, text=True, timeout=1800, check=False)
    row = {"target": target, "case": case, "dtype": dtype, "head_dim": dh,
           "compile_s": round(time.time() - t0, 1)}
    if r.returncode:
      return [dict(row, error=r.stderr[-1500:])]
    tiles = next((json.loads(l[6:]) for l in r.stdout.splitlines() if l.startswith("TILES ")),
                 None)
    facts = {f["kernel"]: f for f in ptx.dumped_kernels(tmp, prefix)}
    smem = shared_memory(tmp)
    rows = []
    for rep in compile_lib.parse_ptxas(r.stdout + r.stderr):
      name = rep["kernel"]
      if not name.startswith(prefix):
        continue
      f = facts.get(name, {})
      rows.append(dict(row, kernel=name[len(prefix) + 1:], tiles=tiles, arch=rep["arch"],
                       registers=rep["registers"], spill_store=rep["spill_store"],
                       spill_load=rep["spill_load"], smem=smem.get(name, (None,))[0],
                       threads=smem.get(name, (None, None))[1],
                       tensor_core=f.get("wgmma", 0) + f.get("mma", 0),
                       tensor_op="wgmma" if f.get("wgmma") else "mma.sync",
                       wgmma=f.get("wgmma", 0), mma=f.get("mma", 0),
                       cp_async=f.get("cp_async"), read_back=f.get("read_back"),
                       loop_prefetch=f.get("loop_prefetch"), unresolved=f.get("unresolved")))
    return rows


def _tensor_ops(r) -> str:
  """wgmma and mma.sync counts (a kernel may mix them: bwd_kv's 32-row products at 32-key
  tiles on Hopper run as mma.sync); rows written before both were kept: the sum."""
  if "wgmma" not in r:
    return f"{r['tensor_core']} {r['tensor_op']}"
  ops = [f"{r['wgmma']} wgmma"] if r["wgmma"] else []
  ops += [f"{r['mma']} mma.sync"] if r["mma"] or not r["wgmma"] else []
  return " + ".join(ops)


def markdown(rows) -> str:
  out = ["| target | case | dtype | Dh | kernel | tiles q/k, warps, stages | regs | spills B "
         "(st+ld) | smem B | tensor-core instr. | cp.async | read back |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['target']} | {r['case']} | {r['dtype']} | {r['head_dim']} | "
                 f"error: {r['error'].splitlines()[-1][:80]} |" + " |" * 7)
      continue
    t = r["tiles"]
    out.append(f"| {r['target']} | {r['case']} | {r['dtype']} | {r['head_dim']} | {r['kernel']} "
               f"| {t[0]}/{t[1]}, {t[2]}, {t[3]} | {r['registers']} | {r['spill_store']}+"
               f"{r['spill_load']} | {r['smem']} | {_tensor_ops(r)} | "
               f"{r['cp_async']} | {'none' if not r['read_back'] else r['read_back']} |")
  return "\n".join(out) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--targets", nargs="*", default=["h100", "a100_80"])
  p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
  p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
  p.add_argument("--head_dims", nargs="*", type=int, default=[64, 96])
  p.add_argument("--out", default="")
  p.add_argument("--md", default="", help="print the table of a JSON written by --out")
  a = p.parse_args()
  if a.md:
    print(markdown(json.load(open(a.md))["rows"]))
    return
  rows = []
  for target in a.targets:
    for case in a.cases:
      for dtype in a.dtypes:
        for dh in a.head_dims:
          got = run_one(target, case, dtype, dh)
          rows += got
          print("\n".join(markdown(got).splitlines()[2:]), flush=True)
          if a.out:
            with open(a.out, "w") as f:
              json.dump({"command": "python -m bench.kernel_facts " + " ".join(sys.argv[1:]),
                         "rows": rows}, f, indent=1)
  print(markdown(rows))


if __name__ == "__main__":
  main()
