"""The block-sparse GPU kernel (span_lm/kernels/sparse/pallas_gpu_sparse.py) against the dense masked
reference (span_lm/model/sparse.py `reference_attention`), in interpret mode on CPU.

Values and every gradient (q, k, v) for each pattern and combination (strided and fixed; merged,
split, interleaved layers; fixed heads with distinct and shared summary offsets; dense and local
heads), float32 and bf16, a length that is not a multiple of the tiles (padded), rows that see
no key (zeros, zero gradients, no NaN), that key tiles outside a query block's list are never
read (NaN there changes nothing), the lists themselves and `misfit`. Bigger shapes: `-m slow`.
`-m compile` (CUDA plugin, no GPU): the kernels compiled deviceless for an H100 and an A100
inside jit(value_and_grad) of a model-like step (embedding, per layer q/k/v projections, the
kernel, an output projection, a readout; every combination), and inside the Sparse Transformer's
own train step (configs/enwik8_sparse_fixed.py:small, the compile mode's builder) with the
model's attention routed to the kernel by replacing `model.sparse.attention` in the compiling
child, since the selection table that would route it is not on this branch: PTX facts
(tensor-core instructions, asynchronous copies, no read-back, no spills in bf16).
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from span_lm.kernels.sparse import block_sparse
from span_lm.kernels.sparse import pallas_gpu_sparse as ps
from span_lm.model import sparse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))

B, H, D, L, C, BQ, BK = 1, 4, 16, 16, 4, 16, 16


def _inputs(n, *, dtype=jnp.float32, seed=0, d=D, e=None, h=H, b=B):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  nrm = lambda k, s: jax.random.normal(k, s, jnp.float32)
  q = nrm(ks[0], (b, h, n, d)) / np.sqrt(d)
  k, v = nrm(ks[1], (b, h, n, d)), nrm(ks[2], (b, h, n, e or d))
  do = nrm(ks[3], (b, h, n, e or d))
  return tuple(x.astype(dtype) for x in (q, k, v)), do


def _both(heads, q, k, v, do, **kw):
  """(output, (dq, dk, dv)) of the kernel and of the reference, the loss sum(o * do)."""
  kern = lambda q, k, v: ps.block_sparse_attention(q, k, v, heads, interpret=True,
                                                   **{"block_q": BQ, "block_k": BK, **kw})
  ref = lambda q, k, v: sparse.reference_attention(q, k, v, heads)
  out = []
  for f in (kern, ref):
    def run(q, k, v, f=f):
      o, vjp = jax.vjp(f, q, k, v)
      return o, vjp(do.astype(o.dtype))
    out.append(jax.jit(run)(q, k, v))  # jitted: the interpreted kernels compile once
  return out


def _close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got))
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol)


CASES = [  # (pattern, combine, layer, distinct)
    ("fixed", "merged", 0, True), ("fixed", "merged", 0, False), ("fixed", "split", 0, True),
    ("fixed", "interleaved", 0, True), ("fixed", "interleaved", 1, True),
    ("strided", "merged", 0, True), ("strided", "split", 0, True),
    ("strided", "interleaved", 0, True), ("strided", "interleaved", 1, True),
    ("dense", "merged", 0, True), ("local", "merged", 0, True),
]


def _heads(pattern, combine, layer, distinct, h=H, stride=L, c=C):
  return sparse.layer_heads(pattern, combine, h, layer, stride, c, distinct)


@pytest.mark.parametrize("pattern,combine,layer,distinct", CASES)
def test_values_and_gradients_match_the_dense_reference_float32(pattern, combine, layer,
                                                                distinct):
  """n = 88: not a multiple of the tiles (16) nor of the stride (padded)."""
  heads = _heads(pattern, combine, layer, distinct)
  (q, k, v), do = _inputs(88)
  (o, g), (o_ref, g_ref) = _both(heads, q, k, v, do)
  _close(o, o_ref, 2e-5)
  for a, b in zip(g, g_ref):
    _close(a, b, 5e-5)


@pytest.mark.parametrize("pattern,combine", [("fixed", "merged"), ("fixed", "split"),
                                             ("strided", "merged"), ("strided", "split")])
def test_full_tiles_run_without_the_element_mask_and_still_match(pattern, combine):
  """Stride 64, c = 16, 16 x 16 tiles: many non-empty tiles are FULL (whole local blocks, whole
  summary columns, the strided window's inner tiles), run by the loop without a mask."""
  heads = _heads(pattern, combine, 0, True, stride=64, c=16)
  n = 150
  fwd, bwd = ps.tables(heads, n, BQ, BK)
  assert fwd[:, :, 0].sum() > 0 and bwd[:, :, 0].sum() > 0
  (q, k, v), do = _inputs(n, seed=6)
  (o, g), (o_ref, g_ref) = _both(heads, q, k, v, do)
  _close(o, o_ref, 2e-5)
  for a, b in zip(g, g_ref):
    _close(a, b, 5e-5)


@pytest.mark.parametrize("pattern,combine,layer", [("fixed", "merged", 0), ("fixed", "split", 0),
                                                   ("strided", "interleaved", 1)])
def test_values_and_gradients_match_the_dense_reference_bf16(pattern, combine, layer):
  heads = _heads(pattern, combine, layer, True)
  (q, k, v), do = _inputs(80, dtype=jnp.bfloat16, seed=1)
  (o, g), (o_ref, g_ref) = _both(heads, q, k, v, do)
  assert o.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in g)
  _close(o, o_ref, 2e-2)
  for a, b in zip(g, g_ref):
    _close(a, b, 3e-2)


def test_unequal_tiles_a_value_size_and_a_head_size_that_are_padded():
  """Query tile 32, key tile 16; head size 12 and value size 20 (run as 16 and 32)."""
  heads = _heads("fixed", "split", 0, True)
  (q, k, v), do = _inputs(72, d=12, e=20, seed=2)
  (o, g), (o_ref, g_ref) = _both(heads, q, k, v, do, block_q=32, block_k=16)
  assert o.shape == (B, H, 72, 20)
  _close(o, o_ref, 2e-5)
  for a, b in zip(g, g_ref):
    _close(a, b, 5e-5)


def test_rows_that_see_no_key_give_exact_zeros_and_zero_gradients():
  """Fixed A2 alone (interleaved, odd layer): the positions before the first summary key of a
  head see no key; their outputs and their queries' gradients are exactly 0, never NaN."""
  heads = _heads("fixed", "interleaved", 1, True)
  n = 64
  none = ~np.stack([block_sparse.connectivity(h, n).any(-1) for h in heads])  # (H, n)
  assert none.any() and not none.all()
  (q, k, v), do = _inputs(n, seed=3)
  (o, (dq, dk, dv)), (o_ref, g_ref) = _both(heads, q, k, v, do)
  o, dq = np.asarray(o), np.asarray(dq)
  assert np.all(o[:, none] == 0) and np.all(dq[:, none] == 0)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in (o, dq, dk, dv))
  _close(o, o_ref, 2e-5)
  for a, b in zip((dq, dk, dv), g_ref):
    _close(a, b, 5e-5)


def test_key_tiles_outside_a_query_blocks_list_are_never_read():
  """NaN in the keys and values of tiles a query block's list leaves out: that block's outputs
  and query gradients are unchanged (the tiles are never loaded)."""
  heads = _heads("fixed", "split", 0, True)
  n = 96
  (q, k, v), do = _inputs(n, seed=4)
  clean_o, clean_g = _both(heads, q, k, v, do)[0]
  rb = 4  # query block 4 (rows 64..79)
  bmaps = [block_sparse.block_map(h, n, BQ, BK) for h in heads]
  kn, vn = np.array(k), np.array(v)
  poisoned = 0
  for hh, bm in enumerate(bmaps):
    for c in np.nonzero(bm[rb] == block_sparse.EMPTY)[0]:
      kn[:, hh, c * BK:(c + 1) * BK] = np.nan
      vn[:, hh, c * BK:(c + 1) * BK] = np.nan
      poisoned += 1
  assert poisoned >= H  # every head has tiles outside the list (the future ones at least)
  rows = slice(rb * BQ, (rb + 1) * BQ)
  do_rows = jnp.zeros_like(do).at[:, :, rows].set(do[:, :, rows])
  f = lambda q: ps.block_sparse_attention(q, jnp.asarray(kn), jnp.asarray(vn), heads,
                                          interpret=True, block_q=BQ, block_k=BK)
  o, vjp = jax.vjp(f, q)
  (dq,) = vjp(do_rows)
  g = lambda q: ps.block_sparse_attention(q, k, v, heads, interpret=True, block_q=BQ,
                                          block_k=BK)
  _, vjp_clean = jax.vjp(g, q)
  (dq_clean,) = vjp_clean(do_rows)
  np.testing.assert_array_equal(np.asarray(o)[:, :, rows], np.asarray(clean_o)[:, :, rows])
  np.testing.assert_array_equal(np.asarray(dq)[:, :, rows], np.asarray(dq_clean)[:, :, rows])


def test_tables_hold_each_heads_block_lists_and_offsets():
  """Per row: the FULL blocks (no element mask), then the PARTIAL ones, each in order; the
  head's summary offset; no EMPTY block."""
  heads = _heads("fixed", "split", 0, True, stride=64, c=16)  # strides of 2 tiles: FULL ones
  n = 100
  fwd, bwd = ps.tables(heads, n, 32, 16)
  assert fwd.dtype == np.int32 and fwd.shape[:2] == (H, 4) and bwd.shape[:2] == (H, 7)
  for table in (fwd, bwd):
    assert table.shape[-1] & (table.shape[-1] - 1) == 0  # a power of two (Triton's blocks)
  saw_full = False
  for i, h in enumerate(heads):
    bm = block_sparse.block_map(h, n, 32, 16)
    for tab, m in ((fwd[i], bm), (bwd[i], bm.T)):
      assert np.all(tab[:, 2] == h.offset)
      for r in range(m.shape[0]):
        full = np.nonzero(m[r] == block_sparse.FULL)[0]
        part = np.nonzero(m[r] == block_sparse.PARTIAL)[0]
        assert (tab[r, 0], tab[r, 1]) == (len(full), len(part))
        np.testing.assert_array_equal(tab[r, 3:3 + len(full) + len(part)],
                                      np.concatenate([full, part]))
        saw_full |= len(full) > 0
  assert saw_full


def test_enwik8_sparse_fixed_tiles_compute_about_a_quarter_of_the_causal_tiles():
  """configs/enwik8_sparse_fixed.py's shape at the Hopper/Ampere bf16 tiles (64 x 32)."""
  heads = sparse.layer_heads("fixed", "merged", 8, 0, 128, 32)
  for cc in (9, 8):
    bq, bk, _, _ = ps.tiles(cc, jnp.bfloat16)
    frac = block_sparse.computed_fraction(heads, 12_288, bq, bk)
    assert 0.25 < frac < 0.27, frac
  assert block_sparse.computed_fraction(heads, 12_288, 64, 64) > 0.5


def test_batch_sharded_over_a_mesh_runs_each_devices_rows():
  """Under a mesh (the trainer's), each device runs the kernels on its batch rows
  (fused.per_device): the same values and gradients as the unsharded call."""
  heads = _heads("fixed", "split", 0, True)
  (q, k, v), do = _inputs(48, b=2, seed=7)
  f = lambda q, k, v: jnp.sum(ps.block_sparse_attention(q, k, v, heads, interpret=True,
                                                        block_q=BQ, block_k=BK) * do)
  want = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
  with jax.set_mesh(mesh):
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(*args).as_text()
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args)
  assert "shard_map" in hlo or "manual" in hlo.lower()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _close(a, b, 1e-5)


def test_misfit():
  heads = _heads("fixed", "merged", 0, True)
  assert ps.misfit(heads, 12_288, 64) == ""
  assert ps.misfit(heads, 100, 96) == ""  # padded to 128
  assert "head size" in ps.misfit(heads, 100, 512)
  assert ps.misfit((), 100, 64)
  assert ps.misfit((block_sparse.HeadPattern("fixed", stride=8),), 100, 64)  # no part
  with pytest.raises(ValueError, match="head patterns"):
    ps.block_sparse_attention(*_inputs(32)[0], heads[:2], interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("pattern,combine,layer", [("fixed", "merged", 0), ("fixed", "split", 0),
                                                   ("fixed", "interleaved", 1),
                                                   ("strided", "merged", 0),
                                                   ("strided", "split", 0)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bigger_shapes_match_the_dense_reference(pattern, combine, layer, dtype):
  """n = 500 (ragged), stride 32, c = 8, 8 heads (distinct offsets cycle after 4), head size 32,
  batch 2, the GPU tiles 64 x 32."""
  heads = _heads(pattern, combine, layer, True, h=8, stride=32, c=8)
  dt = jnp.dtype(dtype)
  (q, k, v), do = _inputs(500, dtype=dt, seed=5, d=32, h=8, b=2)
  (o, g), (o_ref, g_ref) = _both(heads, q, k, v, do, block_q=64, block_k=32)
  tol = 2e-5 if dt == jnp.float32 else 2e-2
  _close(o, o_ref, tol)
  for a, b in zip(g, g_ref):
    _close(a, b, 3 * tol)


@pytest.mark.slow
def test_enwik8_sparse_fixed_shape_matches_the_jnp_path():
  """n = 12,288, fixed, stride 128, c = 32, two merged heads with distinct offsets (64, 96), head
  size 64, the GPU's bf16 tiles 64 x 32, float32: values and every gradient against the jnp
  path (model/sparse.py sparse_attention, itself checked against the dense reference in
  tests/model; the (n, n) reference is too big here)."""
  heads = sparse.layer_heads("fixed", "merged", 8, 0, 128, 32)[2:4]
  (q, k, v), do = _inputs(12_288, d=64, h=2, seed=8)
  got, want = [], []
  for f, out in ((lambda q, k, v: ps.block_sparse_attention(q, k, v, heads, interpret=True,
                                                            block_q=64, block_k=32), got),
                 (lambda q, k, v: sparse.sparse_attention(q, k, v, heads), want)):
    def run(q, k, v, f=f):
      o, vjp = jax.vjp(f, q, k, v)
      return (o, *vjp(do))
    out.extend(jax.jit(run)(q, k, v))
  for a, b in zip(got, want):
    _close(a, b, 1e-5)


# ------------------------------------------------------------------------------------------------
# Deviceless compiles for an H100 and an A100 (CUDA plugin): the kernels' PTX facts inside a
# model-like training step.

STEP_CHILD = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from span_lm import kernels
from span_lm.kernels import chips
from span_lm.kernels.sparse import pallas_gpu_sparse as ps
from span_lm.kernels import target
from span_lm.model import sparse
chip = chips.get(sys.argv[1])
topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                    target_config=chips.gpu_target_config(chip))
sh = NamedSharding(Mesh(np.asarray(topo.devices), ("x",)), P())
# jax >= 0.11: Pallas-Triton lowers for the default device's GPU (target.compiling_for)
jax.config.update("jax_default_device", topo.devices[0])
# A small Sparse Transformer-like step: 3 layers whose heads cover the combinations: fixed
# merged (distinct offsets), fixed interleaved at an odd layer (A2 alone, distinct offsets),
# strided split (two groups: two calls).
b, n, h, dh, vocab = 2, 1024, 4, 64, 256
layers = [sparse.layer_heads("fixed", "merged", h, 0, 128, 32),
          sparse.layer_heads("fixed", "interleaved", h, 1, 128, 32),
          sparse.layer_heads("strided", "split", h, 0, 128, 1)]
with target.compiling_for("gpu", chip.cc, chip.device_kind):
  for dt in (jnp.bfloat16, jnp.float32):
    print("STEP " + json.dumps([jnp.dtype(dt).name, ps._target_tiles(dt)]), flush=True)
    def loss(params, tokens):
      x = params["emb"][tokens]
      for w, heads in zip(params["layers"], layers):
        y = x.astype(dt)
        qkv = jnp.einsum("bnd,dk->bnk", y, w["qkv"].astype(dt)).reshape(b, n, 3, h, dh)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        o = ps.block_sparse_attention(q * dh ** -0.5, k, v, heads)
        o = o.transpose(0, 2, 1, 3).reshape(b, n, h * dh)
        x = x + jnp.einsum("bnk,kd->bnd", o, w["out"].astype(dt)).astype(jnp.float32)
      logits = x @ params["emb"].T
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))
    sds = lambda *s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=sh)
    params = {"emb": sds(vocab, h * dh),
              "layers": [{"qkv": sds(h * dh, 3 * h * dh), "out": sds(h * dh, h * dh)}
                         for _ in layers]}
    jax.jit(jax.value_and_grad(loss)).lower(params, sds(b, n, d=jnp.int32)).compile(
        compiler_options=dict(kernels.GPU_COMPILER_OPTIONS))
"""


def compile_step(dump_dir, target: str, child: str = STEP_CHILD):
  """(stdout, per-kernel PTX facts, ptxas reports) of the child compiled for target."""
  from span_lm.tools import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from span_lm.tools import ptx  # pylint: disable=g-import-not-at-top
  env = compile_lib.child_env("gpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
  r = subprocess.run([sys.executable, "-c", child, target], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=1500, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  facts = ptx.dumped_kernels(dump_dir, "block_sparse")
  reports = [k for k in compile_lib.parse_ptxas(r.stdout + r.stderr)
             if k["kernel"].startswith("block_sparse")]
  return r.stdout, facts, reports


# The kernels' parameters as tools/ptx.py numbers them (inputs, then outputs): the table is 0;
# fwd and bwd_q read keys 2 and values 3 through the lists; bwd_kv reads queries 1 and output
# gradients 4 through its lists.
_LISTED = {"fwd": {2, 3}, "bwd_q": {2, 3}, "bwd_kv": {1, 4}}


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_training_step_compiles_the_block_sparse_kernels(tmp_path, target):
  """jit(value_and_grad) of a 3-layer model-like step (fixed merged, fixed A2 alone, strided
  split: 4 head groups) compiled for the chip at its tiles, bf16 and float32: 12 kernels per
  dtype, each with tensor-core instructions (wgmma on the H100), asynchronous copies, no buffer
  read back, every address resolved; no spills in bf16; the bf16 fwd and bwd_q load the listed
  key and value tiles with cp.async."""
  out, facts, reports = compile_step(tmp_path, target)
  steps = [json.loads(l[5:]) for l in out.splitlines() if l.startswith("STEP ")]
  assert len(steps) == 2 and all(s[1][3] >= 2 for s in steps), steps  # pipelined
  assert len(facts) == 24 == len(reports), ([f["kernel"] for f in facts], reports)
  sm90 = target == "h100"
  for f in facts:
    assert f["unresolved"] == 0 and f["writes"], f
    assert not f["read_back"], f
    assert f["cp_async"] > 0, f
    assert (f["wgmma"] if sm90 else f["mma"]) > 0, f
  bf16 = reports[:12]  # compiled in the child's order: bf16 first
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in bf16), bf16


# The Sparse Transformer's own train step (span_lm/tools/compile.py's compile_target: the
# trainer's step builder, remat, the layer scan, dropout, the optimizer) for one GPU, with the
# model's attention routed to the kernel in this child only (the selection table is not on this
# branch): configs/enwik8_sparse_fixed.py:small (n = 12,288, 2 heads of 64, fixed, stride 128,
# c = 32, bf16), merged and interleaved.
REAL_STEP_CHILD = """
import json, sys
from span_lm import config as config_lib
from span_lm.kernels.sparse import pallas_gpu_sparse as ps
from span_lm.model import sparse
from span_lm.tools import compile as compile_lib
routed = []
def attention(q, k, v, heads, impl="fast"):
  routed.append(heads)
  return ps.block_sparse_attention(q, k, v, heads)
sparse.attention = attention
for combine in ("merged", "interleaved"):
  config = config_lib.load_config("configs/enwik8_sparse_fixed.py:small", {
      "mode": "compile", "compile.steps": "train", "data.batch": 1,
      "model.sparse.combine": combine})  # the compile mode's run config, as its child gets it
  row = compile_lib.compile_target(config, compile_lib.parse_target(sys.argv[1] + ":1"))
  train = row.get("train") or {}
  print("STEP " + json.dumps([combine, len(routed), row.get("error"), train.get("compiled"),
                              train.get("error")]), flush=True)
"""


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
@pytest.mark.parametrize("target", ["h100", "a100_80"])
def test_sparse_transformer_train_step_routed_to_the_kernel(tmp_path, target):
  """configs/enwik8_sparse_fixed.py:small's train step compiled for one GPU with its attention
  routed to the kernel: merged (one head group) and interleaved (layer 0 A1, layer 1 A2 with
  distinct offsets: two kernels of each kind), the same PTX facts, no spills (bf16)."""
  out, facts, reports = compile_step(tmp_path, target, REAL_STEP_CHILD)
  steps = [json.loads(l[5:]) for l in out.splitlines() if l.startswith("STEP ")]
  assert [s[0] for s in steps] == ["merged", "interleaved"], out[-2000:]
  assert all(s[1] > 0 and s[2] is None and s[3] and s[4] is None for s in steps), steps
  assert steps[1][1] > steps[0][1]  # the interleaved step traced the kernel too
  assert len(facts) == len(reports) >= 9, ([f["kernel"] for f in facts], reports)
  sm90 = target == "h100"
  for f in facts:
    assert f["unresolved"] == 0 and f["writes"] and not f["read_back"], f
    assert f["cp_async"] > 0 and (f["wgmma"] if sm90 else f["mma"]) > 0, f
  assert all(k["spill_store"] == 0 == k["spill_load"] for k in reports), reports
