"""A study, not a path of the model: the span kernel's forward pass in Pallas Mosaic GPU (Hopper).

Issue 55 item 5 (docs/kernels.md, "The way forward for the GPU kernels"): does the adaptive-span
kernel map onto Mosaic GPU's primitives (TMA copies, warpgroup matmuls, mbarriers)? This is the
smallest forward that answers it: one query tile of 64 rows (one warpgroup) against its banded key
tiles, with the relative-position term and the soft span mask, causal, no persistent memory,
segments or dropout, bf16, head size 64. Structure after jax's own
`jax/experimental/pallas/ops/gpu/attention_mgpu.py` (FA3 on Hopper), simplified to one compute
warpgroup that issues its own copies (no memory warpgroup).

What maps where:
- Keys and values: TMA copies of (64, Dh) tiles into swizzled shared memory, `stages` slots, one
  mbarrier per slot and operand; the copy for step j + stages is issued after step j's matmuls.
- q k^T and p v: `plgpu.wgmma` (bf16 operands, float32 accumulator); in the FA3 form (fold=True)
  q k^T's accumulator starts from the position tile, so the position term costs an accumulator
  load, not a matmul (fold=False, the form jax's interpreter runs: `span_forward`).
- The position term: G = q [pe | 0] is one XLA matmul outside (as kernels/span/pallas_gpu.py does),
  G's rows have pitch W + 1 and the buffer read with row pitch W is the score in key coordinates
  (the rel-shift view: flat[i W + t] = G[i, t - i]). Reshaped to (rows, W) that view is a plain
  2-D array, and the tile of query rows i0.. and key columns t0.. (t0 a multiple of the key tile,
  which divides W) is the rectangle starting at row i0 + t0 // W, column t0 % W: one TMA box at an
  element offset, no gather and no skew on chip.
- The banded key range per query tile: from the spans, outside the kernel (a (B, H, M / bq, 2)
  int32 array, the same rule as pallas_gpu._key_blocks); the kernel reads its two scalars and
  loops over [lo, hi) with a dynamic `fori_loop` (runtime spans change the work, not the program).
- Per-row runtime spans: the tile's z (64 floats) by TMA into shared memory, loaded in the
  accumulator's row layout (`Layout.WGMMA.reduce(1)`); the mask and the visited test are
  elementwise against `broadcasted_iota` distances in the accumulator's layout.

It has never run on a GPU: compiled deviceless for an H100 and interpreted on CPU only.

Normaliser as the Triton kernel's (kernels/span/span_mask.online_denominator): out = sum(p m v) /
(sum(p m) + eps sum(p)) over the visited distances.

  python -m bench.mosaic_gpu_span --check            # interpreted (fold=False) vs the reference
  python -m bench.mosaic_gpu_span --compile h100     # deviceless lowering + XLA compile: the
                                                     # ptxas report, launch and PTX counts (JSON)

The compile needs the CUDA plugin (pip install -e .[gpu-compile]), the check jax's Mosaic GPU
interpreter (jax 0.10.2 has it). tests/kernels/test_mosaic_gpu_span.py runs both (`-m slow`,
`-m compile`).
"""
import argparse
import functools
import inspect
import json
import math
import pathlib
import re
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

EPS = 1e-8
NEG = -1e30
# The position tiles' shared memory: jax 0.10.2 needs it tiled and swizzled to load it in the
# accumulator's layout ("Failed to synthesize a transfer pattern that avoids bank conflicts"
# without); jax 0.12's layout inference rejects those transforms for a TMA box at a row offset
# not a multiple of 8 ("Failed to infer a possible set of layouts") and picks its own. 0.11: not
# tried.
_G_SWIZZLED = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 12)


def key_tile_ranges(z_BxHxM, *, w: int, ramp: int, bq: int, bk: int):
  """[lo, hi) key tiles per query tile, (B, H, M / bq, 2) int32: every key that some row of the
  tile visits (distances 1..min(W, floor(z) + R + 1): kernels/span/span_mask.visited_distances)."""
  b, h, m = z_BxHxM.shape
  win = jnp.clip(jnp.floor(z_BxHxM).astype(jnp.int32) + ramp + 1, 1, w)
  top = jnp.max(win.reshape(b, h, m // bq, bq), axis=-1)
  i0 = jnp.broadcast_to(jnp.arange(m // bq, dtype=jnp.int32) * bq, top.shape)
  lo = (w + i0 - top) // bk
  hi = (w + i0 + bq - 2) // bk + 1
  return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def relshift_view(q_BxHxMxD, pe_DxW):
  """G = q [pe | 0] (row pitch W + 1) read with row pitch W, as a 2-D array per head:
  (B, H, rows, W) in q's dtype, view[i + t // W, t % W] = G[i, t - i] for 0 <= t - i <= W."""
  b, h, m, _ = q_BxHxMxD.shape
  w = pe_DxW.shape[-1]
  g = jnp.einsum("bhmd,dw->bhmw", q_BxHxMxD, jnp.pad(pe_DxW.astype(q_BxHxMxD.dtype),
                                                      ((0, 0), (0, 1))),
                 preferred_element_type=jnp.float32).astype(q_BxHxMxD.dtype)
  rows = -(-(m + (w + m - 1) // w + 1) // 8) * 8  # the last tile's rows, in TMA's 8-row tiles
  flat = jnp.pad(g.reshape(b, h, m * (w + 1)), ((0, 0), (0, 0), (0, rows * w - m * (w + 1))))
  return flat.reshape(b, h, rows, w)


def span_forward(q, k, v, pe, z, *, ramp: int = 32, stages: int = 2, fold: bool = True,
                 interpret=False):
  """Span attention's forward, causal: q (B, H, M, 64) bf16, k, v (B, H, W + M, 64), pe (64, W),
  z (B, H, M) float32 spans in tokens.

  fold=True (FA3's form): keys read through `transpose_ref`, the weights p a register operand of
  the second wgmma, the position tile q k^T's initial accumulator and the running output p v's
  (`pl.run_state`). fold=False, what jax's GPU interpreter can run (it has no rule for run_state,
  transposed refs or register operands of wgmma): keys given transposed, (B, H, 64, W + M), the
  weights staged through shared memory, both matmuls into fresh accumulators, added after. The
  two compute the same; both compile. interpret: False (compiled, Mosaic GPU) or an
  `InterpretGPUParams` (jax's GPU interpreter, on CPU)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  b, h, m, dh = q.shape
  w = pe.shape[-1]
  bq = bk = 64
  if dh != 64 or m % bq or w % bk or q.dtype != jnp.bfloat16:
    raise ValueError(f"study kernel: head size 64, bf16, M and W multiples of 64 (got {q.shape}, "
                     f"W={w}, {q.dtype})")
  scale = 1.0 / math.sqrt(dh)
  dtype = q.dtype
  view = relshift_view(q, pe)
  ranges = key_tile_ranges(z, w=w, ramp=ramp, bq=bq, bk=bk)
  z = z.astype(jnp.float32)
  if not fold:
    k = jnp.swapaxes(k, 2, 3)  # (B, H, Dh, T): q k^T's right operand as stored, no transpose_ref

  # jax's GPU interpreter has no rules for plgpu.load, layout_cast and the layout of
  # broadcasted_iota: there, plain reads and arrays (layouts are the compiler's business)
  interp = interpret is not False

  def load(ref, layout):
    if interp:
      return ref[...]
    if "idx" in inspect.signature(plgpu.load).parameters:  # jax 0.10: load(ref, idx, layout=)
      return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)  # jax 0.12: load(ref, layout=)

  def cast(x, layout):
    return x if interp else plgpu.layout_cast(x, layout)

  def iota(dim):
    if interp:
      return lax.broadcasted_iota(jnp.int32, (bq, bk), dim)
    return plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=plgpu.Layout.WGMMA)

  def kernel(q_ref, k_ref, v_ref, g_ref, z_ref, r_ref, o_ref, scoped):
    hi_, qi, bi = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    (q_smem, k_smem, v_smem, g_smem, z_smem, p_smem), (k_bar, v_bar, g_bar, q_bar, z_bar) = scoped
    i0 = qi * bq
    lo = r_ref[bi, hi_, qi, 0]
    hi = r_ref[bi, hi_, qi, 1]

    def issue(step, slot):
      t0 = step * bk
      k_tile = k_ref.at[bi, hi_, pl.ds(t0, bk)] if fold else k_ref.at[bi, hi_, :, pl.ds(t0, bk)]
      plgpu.copy_gmem_to_smem(k_tile, k_smem.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[bi, hi_, pl.ds(t0, bk)], v_smem.at[slot], v_bar.at[slot])
      row = i0 + lax.div(t0, w)
      col = lax.rem(t0, w)
      plgpu.copy_gmem_to_smem(g_ref.at[bi, hi_, pl.ds(row, bq), pl.ds(col, bk)],
                              g_smem.at[slot], g_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[bi, hi_, pl.ds(i0, bq)], q_smem, q_bar.at[0])
    plgpu.copy_gmem_to_smem(z_ref.at[bi, hi_, pl.ds(i0, bq)], z_smem, z_bar.at[0])
    for s in range(stages):  # the prologue: the first `stages` tiles in flight
      @pl.when(lo + s < hi)
      def _():
        issue(lo + s, s)
    plgpu.barrier_wait(q_bar.at[0])
    plgpu.barrier_wait(z_bar.at[0])
    zz = load(z_smem, plgpu.Layout.WGMMA.reduce(1))
    z2 = lax.broadcast_in_dim(zz, (bq, bk), [0])
    rows, cols = iota(0), iota(1)

    def body(step, carry):
      acc, m_i, l_all, l_mask = carry
      slot = lax.rem(step - lo, stages)
      t0 = step * bk
      plgpu.barrier_wait(g_bar.at[slot])
      g = load(g_smem.at[slot], plgpu.Layout.WGMMA).astype(jnp.float32)
      plgpu.barrier_wait(k_bar.at[slot])

      def qk(acc_ref):
        kt = plgpu.transpose_ref(k_smem.at[slot], (1, 0)) if fold else k_smem.at[slot]
        plgpu.wgmma(acc_ref, q_smem, kt)
      if fold:  # the accumulator starts from the position tile
        s = pl.run_state(qk)(plgpu.ACC.init(g))
      else:
        s = pl.run_scoped(lambda r: (qk(r), r[...])[1], plgpu.ACC((bq, bk), jnp.float32)) + g
      dist = (w + i0 - t0) + rows - cols  # signed distance, key behind the query
      distf = dist.astype(jnp.float32)
      visited = (dist >= 1) & (dist <= w) & (distf - 1.0 <= z2 + float(ramp))
      logits = jnp.where(visited, s * scale, NEG)
      m_new = jnp.maximum(m_i, logits.max(axis=1))
      alpha = jnp.exp(m_i - m_new)
      p = jnp.where(visited, jnp.exp(logits - lax.broadcast_in_dim(m_new, (bq, bk), [0])), 0.0)
      mask = jnp.minimum(jnp.maximum((float(ramp) + z2 - (distf - 1.0)) / float(ramp), 0.0), 1.0)
      pm = p * mask
      l_all = l_all * alpha + p.sum(axis=1)
      l_mask = l_mask * alpha + pm.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, (bq, dh), [0])
      plgpu.barrier_wait(v_bar.at[slot])

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, pm.astype(dtype) if fold else p_smem, v_smem.at[slot])
      if fold:  # accumulated onto the running output
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      else:
        p_smem[...] = pm.astype(dtype)
        plgpu.commit_smem()  # the stores before the tensor cores' (async proxy) reads
        acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1], plgpu.ACC((bq, dh), jnp.float32))

      @pl.when(step + stages < hi)  # the slot is free: its matmuls have completed
      def _():
        issue(step + stages, slot)
      return acc, m_new, l_all, l_mask

    wgmma = plgpu.Layout.WGMMA
    init = (cast(jnp.zeros((bq, dh), jnp.float32), wgmma),
            cast(jnp.full((bq,), NEG, jnp.float32), wgmma.reduce(1)),
            cast(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1)),
            cast(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1)))
    acc, _, l_all, l_mask = lax.fori_loop(lo, hi, body, init)
    den = l_mask + EPS * l_all
    acc = acc / lax.broadcast_in_dim(den, (bq, dh), [0])
    q_smem[...] = acc.astype(dtype)  # q is spent: its buffer carries the output out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, hi_, pl.ds(i0, bq)])
    plgpu.wait_smem_to_gmem(0)

  def entry(q_ref, k_ref, v_ref, g_ref, z_ref, r_ref, o_ref):
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (plgpu.SMEM((bq, dh), dtype, transforms=swz),
            plgpu.SMEM((stages, bk, dh) if fold else (stages, dh, bk), dtype, transforms=swz),
            plgpu.SMEM((stages, bk, dh), dtype, transforms=swz),
            plgpu.SMEM((stages, bq, bk), dtype, transforms=swz if _G_SWIZZLED else ()),
            plgpu.SMEM((bq,), jnp.float32),
            None if fold else plgpu.SMEM((bq, bk), dtype, transforms=swz))
    bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=1))
    pl.run_scoped(lambda *a: kernel(q_ref, k_ref, v_ref, g_ref, z_ref, r_ref, o_ref, a),
                  smem, bars)

  extra = {} if interpret is False else {"interpret": interpret}
  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
                      grid=(h, m // bq, b), grid_names=("heads", "q", "batch"),
                      compiler_params=plgpu.CompilerParams(), **extra)(q, k, v, view, z, ranges)


def inputs(b=1, h=2, m=128, w=256, dh=64, seed=0):
  """bf16 q, k, v, pe and float32 spans, one span per row drawn over [0, W)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, h, m, dh), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, h, w + m, dh), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, h, w + m, dh), jnp.float32).astype(jnp.bfloat16)
  pe = jax.random.normal(ks[3], (dh, w), jnp.float32).astype(jnp.bfloat16)
  z = jax.random.uniform(ks[4], (b, h, m), minval=0.0, maxval=float(w))
  return q, k, v, pe, z


def reference(q, k, v, pe, z, ramp=32):
  """span_lm's readable definition (kernels/span/banded_reference.py), float32."""
  from span_lm.kernels.span import banded_reference  # pylint: disable=g-import-not-at-top
  f = lambda x: x.astype(jnp.float32)
  return banded_reference.banded_attention(f(q), f(k), f(v), f(pe), span_z=z, ramp=ramp)


def interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
  return params.InterpretGPUParams()


def _check(args):
  q, k, v, pe, z = inputs(m=args.m, w=args.w)
  out = span_forward(q, k, v, pe, z, fold=False, interpret=interpret_params())
  ref = reference(q, k, v, pe, z)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
  print(f"CHECK jax {jax.__version__} max |mgpu - reference| = {err:.3g} "
        f"(max |reference| {float(jnp.max(jnp.abs(ref))):.3g})", flush=True)
  return 0


# Mosaic prints the kernel's PTX, and ptxas' report (jax 0.12 assembles in process: only
# MOSAIC_GPU_DUMP_PTXAS shows it; jax 0.10.2 runs ptxas, whose report XLA's log also carries)
_CHILD_ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
              "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}


def _lower_and_compile(args):
  """In the child: deviceless, lower for CUDA on a one-chip topology of the named GPU and compile
  through XLA (which compiles the Mosaic kernel: PTX, then ptxas). Prints the kernel's launch."""
  from jax._src.pallas.mosaic_gpu import lowering  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from span_lm.kernels import chips  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  launches = []
  # the entry the pallas_call lowering calls (renamed between jax 0.10 and 0.12)
  name = next(n for n in ("lower_pipelined_jaxpr_to_module", "lower_unpipelined_jaxpr_to_module")
              if hasattr(lowering, n))
  lower = getattr(lowering, name)

  def spy(*a, **kw):  # the Mosaic module's launch: threads and dynamic shared memory
    res = lower(*a, **kw)
    text = str(res.module.operation)
    m = re.search(r"threads\(.*?\) in \(%\w+ = %c(\d+),.*?dynamic_shared_memory_size %c(\d+)_i32",
                  text)
    launches.append({"threads": int(m.group(1)), "dynamic_smem": int(m.group(2))} if m else {})
    return res
  setattr(lowering, name, spy)
  chip = chips.get(args.compile)
  topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=chips.gpu_target_config(chip))
  sh = NamedSharding(Mesh(np.asarray(topo.devices), ("x",)), P())
  b, hh, m, w, dh = 1, 2, args.m, args.w, 64
  sds = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=sh)
  lowered = jax.jit(functools.partial(span_forward, stages=args.stages, fold=args.fold)).lower(
      sds(b, hh, m, dh), sds(b, hh, w + m, dh), sds(b, hh, w + m, dh), sds(dh, w),
      sds(b, hh, m, d=jnp.float32))
  assert "mosaic_gpu" in lowered.as_text()
  lowered.compile()
  print("LAUNCH " + json.dumps(launches[-1] if launches else {}), flush=True)


def compile_facts(chip: str, *, fold: bool = True, m: int = 128, w: int = 256,
                  stages: int = 2) -> dict:
  """Compiles the kernel deviceless for `chip` in a child process and returns what the
  compiler says: jax's version, the Mosaic kernel's ptxas report (registers, spills, static
  shared memory), its launch (threads, dynamic shared memory), and its PTX read by
  span_lm/tools/ptx.py plus Hopper counts (wgmma, TMA copies, mbarrier waits); or {"error": the
  child's last lines}."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx as ptx_lib  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env.update(_CHILD_ENV)
  cmd = [sys.executable, "-m", "bench.mosaic_gpu_span", "--_child", "--compile", chip,
         "--m", str(m), "--w", str(w), "--stages", str(stages)] + ([] if fold else ["--no_fold"])
  repo = pathlib.Path(__file__).resolve().parent.parent
  r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1200,
                     check=False)
  log = r.stdout + "\n" + r.stderr
  if r.returncode:  # the compiler's own error lines first, then the end of the log
    lines = log.strip().splitlines()
    said = [l for l in lines if re.search(r"error:|LLVM ERROR|Error: ", l)][:4]
    return {"error": "\n".join(said + lines[-12:])}
  import jax as jax_  # pylint: disable=g-import-not-at-top
  facts = {"jax": jax_.__version__, "chip": chip, "fold": fold, "m": m, "w": w, "stages": stages}
  reports = [k for k in compile_lib.parse_ptxas(log) if k["kernel"].startswith("entry_mosaic")]
  facts["ptxas"] = reports[0] if reports else None
  facts["ptxas_versions"] = sorted(set(re.findall(r"Using \S*ptxas with version (\S+)", log)))
  launch = [l for l in log.splitlines() if l.startswith("LAUNCH ")]
  facts["launch"] = json.loads(launch[-1][7:]) if launch else {}
  lines = log.splitlines()
  entry = [i for i, l in enumerate(lines) if ".entry entry_mosaic_gpu_kernel" in l]
  if entry:
    first = max(i for i in range(entry[0]) if lines[i].startswith(".version"))
    last = next((i for i in range(entry[0], len(lines)) if re.match(r"^[IWE]\d{4} |^ptxas ", lines[i])),
                len(lines))
    text = "\n".join(lines[first:last])
    facts["ptx"] = ptx_lib.kernel_facts(text)
    count = lambda pattern: len(re.findall(pattern, text))
    facts["ptx"].update(
        ptx_version=re.search(r"^\.version\s+(\S+)", text, re.M).group(1),
        tma_loads=count(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global"),
        tma_stores=count(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared"),
        mbarrier_waits=count(r"mbarrier\.try_wait"), plain_global_loads=count(r"\bld\.global"),
        plain_global_stores=count(r"\bst\.global"))
  return facts


def _compile(args):
  if args._child:  # pylint: disable=protected-access
    _lower_and_compile(args)
    return 0
  facts = compile_facts(args.compile, fold=args.fold, m=args.m, w=args.w, stages=args.stages)
  print("FACTS " + json.dumps(facts), flush=True)
  return 1 if "error" in facts else 0


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="interpret mode vs the reference")
  p.add_argument("--compile", default="", help="a GPU chip name (h100): deviceless compile")
  p.add_argument("--m", type=int, default=128)
  p.add_argument("--w", type=int, default=256)
  p.add_argument("--stages", type=int, default=2)
  p.add_argument("--no_fold", dest="fold", action="store_false",
                 help="the interpreter's form (span_forward's fold=False)")
  p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  rc = 0
  if args.check:
    rc |= _check(args)
  if args.compile:
    rc |= _compile(args)
  return rc


if __name__ == "__main__":
  sys.exit(main())
