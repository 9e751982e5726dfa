"""Grouped key/value heads (GQA; one key/value head: MQA) through the door: every implementation,
given keys and values of H_kv heads for H query heads, equals the same implementation given them
repeated to H heads (query head h reads key/value head h // (H / H_kv)), in values and in every
gradient (queries, keys, values, position embeddings behind and ahead, spans), causal and
bidirectional, with segment ids; and no implementation makes the H copies (the jaxpr holds no
array as large as the repeated keys). The interpreted kernels are slow: `slow`."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from span_lm import kernels

B, H, M, W, DH, R = 1, 4, 16, 16, 8, 4
SEG_Q = [1] * 10 + [2] * 6  # two documents in the block


def _case(kv_heads, a, seed=0, dh=DH):
  """Door inputs: queries (B, H, M, Dh), keys/values of the W + M + A rows with kv_heads heads,
  position embeddings, per-head spans, segment ids (two documents; padding before the block)."""
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  t = W + M + a
  args = dict(q=arr(B, H, M, dh), k=arr(B, kv_heads, t, dh), v=arr(B, kv_heads, t, dh),
              pe=arr(dh, W), z=jnp.asarray(rng.uniform(2, W - R, (1, H, 1)), jnp.float32))
  if a:
    args["pe_a"] = arr(dh, a)
  seg = kernels.Segments(jnp.asarray([SEG_Q] * B, jnp.int32),
                         jnp.asarray([[0] * 4 + [1] * (W - 4 + 10) + [2] * (6 + a)] * B,
                                     jnp.int32))
  return args, seg


def _spec(impl, a, kv_heads=None, dh=DH, dropout=0.0):
  return kernels.Spec(heads=H, head_dim=dh, window=W, ahead=a, ramp=R, segmented=True,
                      dropout=dropout,
                      attention=kernels.Attention(impl=impl, block=16), kv_heads=kv_heads)


def _attend(impl, a, seg, repeat: bool, kv_heads: int, dh=DH, dropout=0.0):
  """The door's attend, with keys and values as given (grouped) or repeated to H heads; with
  dropout, the fused kernels' hashed keep mask from a fixed seed (per query head, row, key)."""
  def f(q, k, v, pe, z, pe_a=None):
    if repeat:
      k, v = (jnp.repeat(x, H // kv_heads, axis=1) for x in (k, v))
    spec = _spec(impl, a, None if repeat else kv_heads, dh, dropout)
    extra = {"key_pe_ahead_DxA": pe_a} if a else {}
    if dropout:
      extra.update(dropout=lambda p: p, dropout_seed=lambda: jnp.uint32(7))
    return kernels.IMPLS[impl].attend(spec, q, kernels.KV(k, v), pe, span_z=z, segments=seg,
                                      **extra)
  return f


def _check_against_repeated(impl, kv_heads, a, rtol=2e-5, dropout=0.0):
  args, seg = _case(kv_heads, a)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=(B, H, M, DH)), jnp.float32)
  names = list(args)
  results = []
  for repeat in (False, True):
    f = _attend(impl, a, seg, repeat, kv_heads, dropout=dropout)

    @jax.jit
    def value_and_grads(*xs, f=f):
      out, vjp = jax.vjp(lambda *xs: f(**dict(zip(names, xs))), *xs)
      return out, vjp(ct)

    out, grads = value_and_grads(*args.values())
    results.append((out, dict(zip(names, grads))))
  (out, grads), (want, want_grads) = results
  scale = lambda x: float(jnp.max(jnp.abs(x))) + 1e-6
  np.testing.assert_allclose(out, want, rtol=0, atol=rtol * scale(want))
  for name in names:
    g, w = grads[name], want_grads[name]
    assert g.shape == w.shape == args[name].shape, name
    assert float(jnp.max(jnp.abs(w))) > 0, f"{name}: a zero gradient checks nothing"
    np.testing.assert_allclose(g, w, rtol=0, atol=rtol * scale(w), err_msg=f"d{name}")


_GROUPS = [(kv, a) for kv in (2, 1) for a in (0, 5)]  # GQA and MQA, causal and 5 rows ahead


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("kv_heads,a", _GROUPS)
def test_grouped_heads_equal_repeated_heads(impl, kv_heads, a):
  _check_against_repeated(impl, kv_heads, a)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_tpu_interpret"])
@pytest.mark.parametrize("kv_heads,a", _GROUPS)
def test_fused_kernels_grouped_heads_equal_repeated_heads(impl, kv_heads, a):
  """The kernels read key/value head h // group through their index maps; dk and dv sum the
  group's query heads inside the dk/dv kernel."""
  _check_against_repeated(impl, kv_heads, a)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_tpu_interpret"])
def test_fused_kernels_grouped_heads_with_dropout(impl):
  """Attention dropout: the keep mask hashes the query head, so the dk/dv kernel's loop over the
  group regenerates each query head's mask as the forward drew it."""
  _check_against_repeated(impl, 2, 0, dropout=0.3)


@pytest.mark.parametrize("m,w,chunk,last,n_pers,per_row,dtype", [
    (16, 64, 16, False, 0, False, "float32"),  # a long band: key coordinates, per-key span mask
    (16, 64, 16, False, 16, True, "float32"),  # the same with persistent memory, spans per row
    (32, 16, 0, True, 0, False, "float32"),  # one chunk, keys positions last
    (32, 16, 8, False, 16, False, "float32"),  # short bands, four chunks, persistent memory
    (16, 64, 16, False, 0, False, "bfloat16"),  # bf16: cpu_matmul's layouts of the group axis
    (32, 16, 8, False, 0, True, "bfloat16")])
def test_cpu_layouts_grouped_equal_repeated(m, w, chunk, last, n_pers, per_row, dtype):
  """banded_cpu's own paths (key coordinates, bands, positions last, persistent memory) with
  2 key/value heads for 4 query heads equal them with the keys and values repeated (bf16: to
  its rounding, the sums being ordered differently)."""
  from span_lm.kernels.span import banded_cpu  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  arr = lambda *s, dt=dtype: jnp.asarray(rng.normal(size=s), dt)
  hk, t = 2, w + m
  xs = dict(q=arr(B, H, m, DH), k=arr(B, hk, DH, t) if last else arr(B, hk, t, DH),
            v=arr(B, hk, DH, t) if last else arr(B, hk, t, DH), pe=arr(DH, w, dt="float32"),
            z=jnp.asarray(rng.uniform(2, w - R, (B, H, m) if per_row else (1, H, 1)),
                          jnp.float32))
  if n_pers:
    xs.update(pk=arr(H, DH, n_pers, dt="float32"), pv=arr(H, n_pers, DH, dt="float32"))
  ct = arr(B, H, m, DH)
  tol = 2e-5 if dtype == "float32" else 2e-2

  def run(repeat):
    def f(q, k, v, pe, z, pk=None, pv=None):
      if repeat:
        k, v = (jnp.repeat(x, H // hk, axis=1) for x in (k, v))
      return banded_cpu.banded_attention(q, k, v, pe, span_z=z, ramp=R, chunk=chunk,
                                         positions_last=last, pers_k_GxDxN=pk,
                                         pers_v_GxNxD=pv)[0]
    out, vjp = jax.vjp(f, *xs.values())
    return out, vjp(ct.astype(out.dtype))  # out: float32 (impl_cpu casts it)

  (out, grads), (want, want_grads) = jax.jit(lambda: run(False))(), jax.jit(lambda: run(True))()
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(out), f32(want), rtol=0,
                             atol=tol * float(jnp.max(jnp.abs(f32(want)))))
  for name, g, wg in zip(xs, grads, want_grads):
    assert g.dtype == wg.dtype == xs[name].dtype, name
    scale = float(jnp.max(jnp.abs(f32(wg))))
    assert scale > 0, name
    np.testing.assert_allclose(f32(g), f32(wg), rtol=0, atol=tol * scale, err_msg=f"d{name}")


def _arrays(jaxpr):
  """Every array an equation of the jaxpr (and of the jaxprs inside it) produces."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in eqn.outvars if hasattr(v.aval, "shape"))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
        if hasattr(sub, "eqns"):
          yield from _arrays(sub)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_interpret",
                                  "pallas_tpu_interpret"])
@pytest.mark.parametrize("a", [0, 5])
def test_no_implementation_repeats_the_keys(impl, a):
  """Forward and backward of the grouped call (one key/value head) hold no array of the keys'
  head size with H times the key rows' elements or more: the H copies a repeat would make
  (their gradient included). The repeated call's jaxpr does hold one: the check sees them.
  Head size 64, unlike any other size here (chunks, windows), so a size-64 axis is a head's."""
  dh = 64
  args, seg = _case(1, a, dh=dh)
  t = W + M + a
  copies = B * H * t * dh

  def largest(repeat):
    f = _attend(impl, a, seg, repeat, 1, dh)
    loss = lambda *xs: jnp.sum(f(*xs) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args.values())
    return max((np.prod(x.shape) for x in _arrays(jaxpr.jaxpr) if dh in x.shape[-2:]),
               default=0)

  assert largest(repeat=True) >= copies
  assert largest(repeat=False) < copies


def test_kv_heads_that_do_not_divide_are_refused():
  args, seg = _case(3, 0)
  for impl in kernels.IMPLS:  # before any kernel is traced
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 key/value heads"):
      kernels.IMPLS[impl].attend(_spec(impl, 0), args["q"], kernels.KV(args["k"], args["v"]),
                                 args["pe"], span_z=args["z"], segments=seg)
  with pytest.raises(ValueError, match="kv_heads=3: must be a positive integer dividing heads=4"):
    _spec("reference", 0, 3)


HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin: pip install -e .[gpu-compile]")
def test_gqa_kernels_compile_for_h100_without_spills(tmp_path):
  """The GPU kernels at 8 query heads, 2 key/value heads (bench/kernel_facts' causal_gqa and
  two_sided_gqa: segment ids, persistent memory, dropout; bf16, head size 64, the door's tiles),
  compiled by ptxas for an H100, no GPU: every kernel compiles, none spills, none reads back
  what it wrote, and the dk/dv kernel's loop over the group still pipelines its loads."""
  out = tmp_path / "facts.json"
  r = subprocess.run([sys.executable, "-m", "bench.kernel_facts", "--targets", "h100", "--cases",
                      "causal_gqa", "two_sided_gqa", "--dtypes", "bfloat16", "--head_dims", "64",
                      "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                     timeout=1800, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert not [x for x in rows if "error" in x], [x.get("error") for x in rows]
  print("\n" + r.stdout)
  for case in ("causal_gqa", "two_sided_gqa"):
    got = {x["kernel"]: x for x in rows if x["case"] == case}
    assert set(got) == {"fwd", "bwd_q", "bwd_kv"}, case
    for k, x in got.items():
      assert x["spill_store"] == 0 and x["spill_load"] == 0, (case, k, x)
      assert not x["read_back"] and x["cp_async"] > 0, (case, k, x)


@pytest.mark.compile
@pytest.mark.skipif(not HAS_TPU, reason="needs libtpu: pip install -e .[tpu-compile]")
@pytest.mark.parametrize("a", [0, 255])
def test_gqa_kernels_compile_for_v5p(a):
  """Forward and backward of one layer with 8 query heads and 2 key/value heads (B=2, M=512,
  W=8192, Dh=64, bf16, segment ids; causal, and 255 rows ahead), at the door's tiles, compiled
  by Mosaic for one v5p chip, no TPU: the three kernels compile, and the grouped step holds
  less memory than the same step on repeated key/value heads."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.span import pallas_tpu as ft  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.span import tpu_tiles  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b, h, hk, m, w, d = 2, 8, 2, 512, 8192, 64
  sd = lambda shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rep)
  bq, bk = tpu_tiles.tiles(64, m, tpu_tiles.layout_window(w), 0)
  t = w + m + a
  facts = {}
  for kv in (hk, h):
    args = [sd((b, h, m, d)), sd((b, kv, t, d)), sd((b, kv, t, d)), sd((d, w), "float32"),
            sd((b, h, m), "float32"), sd((b, m), "int32"), sd((b, t), "int32")]
    if a:
      args.append(sd((d, a), "float32"))

    def loss(q, k, v, pe, z, qs, ks, pe_a=None):
      out = ft.span_attention(q, k, v, pe, z, ramp=32, block=bq, block_k=bk,
                              key_pe_ahead_DxA=pe_a, q_seg_BxM=qs, kv_seg_BxT=ks)
      return jnp.sum(out.astype(jnp.float32))

    argnums = (0, 1, 2, 3, 4) + ((7,) if a else ())
    start = time.time()
    compiled = jax.jit(jax.grad(loss, argnums=argnums)).lower(*args).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3, "forward, dq and dk/dv kernels"
    mem = compiled.memory_analysis()
    facts[kv] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                 + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    print(f"v5p GQA compile: H={h} H_kv={kv} B={b} M={m} W={w} A={a} Dh={d} bf16 tiles "
          f"{bq}x{bk}: arguments {mem.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
          f"{mem.output_size_in_bytes / 2**20:.1f} MiB, temporaries "
          f"{mem.temp_size_in_bytes / 2**20:.1f} MiB; {time.time() - start:.0f} s")
  assert facts[hk] < facts[h]


@pytest.mark.parametrize("impl", list(kernels.IMPLS))
def test_residual_bytes_count_the_key_value_heads(impl):
  """model/costs.py's count of what the backward pass keeps: the keys and values of H_kv heads."""
  spec = _spec(impl, 0)
  mha = kernels.IMPLS[impl].residual_bytes(spec, B, 64, H, 64, True)
  gqa = kernels.IMPLS[impl].residual_bytes(spec.replace(kv_heads=1), B, 64, H, 64, True)
  assert gqa["keys_values"] * H == mha["keys_values"] > 0
  assert {k: v for k, v in gqa.items() if k != "keys_values"} == {
      k: v for k, v in mha.items() if k != "keys_values"}
