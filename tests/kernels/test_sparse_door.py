"""The sparse model's attention table (kernels/sparse/door.py) and its splash rows: every pattern
and combination against the dense masked reference, values and gradients, interpreted."""
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from span_lm.kernels.sparse import block_sparse
from span_lm.kernels.sparse import door as sparse_door
from span_lm.kernels.sparse import splash_sparse
from span_lm.kernels import target
from span_lm.model import sparse


def _heads(pattern, combine, layer, n_heads, stride, c):
  return sparse.layer_heads(pattern, combine, n_heads, layer, stride, c)


def _spec(impl, heads=None, n=None, head_dim=None):
  return sparse_door.SparseSpec(impl=impl, heads=heads, n=n, head_dim=head_dim)


def test_rows_and_auto_by_platform():
  assert set(sparse_door.SPARSE_IMPLS) >= {"jnp", "dense", "splash", "splash_interpret",
                                           "pallas", "pallas_interpret"}
  heads = _heads("fixed", "merged", 0, 2, 32, 8)
  with target.compiling_for("cpu"):
    assert sparse_door.select(_spec("auto", heads, 256, 64)).name == "jnp"
  with target.compiling_for("tpu", kind="TPU v5p"):
    assert sparse_door.select(_spec("auto", heads, 256, 64)).name == "splash"
  with target.compiling_for("gpu", 9.0):  # Hopper, and Ampere: the Triton block-sparse kernel
    assert sparse_door.select(_spec("auto", heads, 256, 64)).name == "pallas"
  with target.compiling_for("gpu", 8.0):
    assert sparse_door.select(_spec("auto", heads, 256, 64)).name == "pallas"
  with target.compiling_for("gpu", 7.0):  # V100: no Triton kernel
    assert sparse_door.select(_spec("auto", heads, 256, 64)).name == "jnp"
  assert sparse_door.select(_spec("dense", heads, 256, 64)).fn == "dense_attention"


def test_fast_is_an_alias_with_a_warning():
  heads = _heads("strided", "merged", 0, 2, 8, 2)
  with pytest.warns(FutureWarning, match="'fast' is now 'jnp'"):
    assert sparse_door.select(_spec("fast", heads, 64, 16)).name == "jnp"


def test_explicit_choices_refused_in_one_line():
  with pytest.raises(ValueError, match=r"sparse.impl='nope': choose one of"):
    sparse_door.check(_spec("nope"))
  with pytest.raises(ValueError, match=r"sparse.impl='splash' runs jax's splash.*cpu devices"):
    sparse_door.check(_spec("splash"), backend="cpu")
  sparse_door.check(_spec("splash"), backend="tpu")
  sparse_door.check(_spec("splash_interpret"), backend="cpu")
  with pytest.raises(ValueError, match=r"sparse.impl='pallas' runs a Triton.*cpu devices"):
    sparse_door.check(_spec("pallas"), backend="cpu")
  sparse_door.check(_spec("pallas_interpret"), backend="cpu")
  with pytest.raises(ValueError, match="head size 12"):
    sparse_door.check(_spec("splash", _heads("fixed", "merged", 0, 2, 8, 2), 64, 12))


def test_config_takes_the_table_names():
  from model_helpers import build  # pylint: disable=g-import-not-at-top
  base = {"vocab_size": 30, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
          "sparse.context": 40, "span.mode": "fixed", "arch": "sparse", "sparse.stride": 8,
          "sparse.c": 2}
  for name in ("auto", "jnp", "dense", "splash", "splash_interpret", "pallas",
               "pallas_interpret", "fast"):
    assert build(base, **{"sparse.impl": name}).sparse.impl == name
  with pytest.raises(ValueError, match="sparse.impl"):
    build(base, **{"sparse.impl": "flash"})


@pytest.mark.parametrize("pattern", ["fixed", "strided"])
def test_first_query_is_the_connectivity_s(pattern):
  for combine in sparse.COMBINES:
    for layer in (0, 1):
      for h in _heads(pattern, combine, layer, 4, 16, 4):
        rows = block_sparse.connectivity(h, 64).any(1)
        assert rows.argmax() == block_sparse.first_query(h)
        assert rows[block_sparse.first_query(h):].all()


def _check(heads, n, d, dtype, atol):
  """The kernel in `dtype` against the float32 reference on the same (rounded) inputs."""
  rng = np.random.default_rng(n)
  q, k, v, w = (jnp.asarray(rng.normal(size=(1, len(heads), n, d)), jnp.float32)
                for _ in range(4))
  q, k, v = ((x * s).astype(dtype) for x, s in ((q, d ** -0.5), (k, 1), (v, 1)))

  def run(fn, cast):
    f = lambda *a: jnp.sum(w * fn(*(x.astype(cast) for x in a), heads).astype(jnp.float32))
    return jax.value_and_grad(f, (0, 1, 2))(q, k, v), fn(q.astype(cast), k.astype(cast),
                                                         v.astype(cast), heads)

  kernel = lambda *a: splash_sparse.block_sparse_attention(*a, interpret=True)
  ((lk, gk), ok) = run(kernel, dtype)
  ((lr, gr), orf) = run(sparse.reference_attention, jnp.float32)
  assert ok.dtype == dtype
  np.testing.assert_allclose(np.asarray(ok, np.float32), orf, atol=atol)
  np.testing.assert_allclose(lk, lr, rtol=atol, atol=atol * n)
  for a, b in zip(gk, gr):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=atol * max(1, np.abs(b).max()))


# Fast tier: one merged fixed layer with distinct offsets, one fixed summary-only layer (queries
# with no key) and split strided heads, at n = 200 (padded to 256: two blocks of 128), float32.
@pytest.mark.parametrize("pattern,combine,layer", [("fixed", "merged", 0),
                                                   ("fixed", "interleaved", 1),
                                                   ("strided", "split", 0)])
def test_splash_equals_dense_reference(pattern, combine, layer):
  _check(_heads(pattern, combine, layer, 2, 32, 8), 200, 16, jnp.float32, 2e-5)


def test_splash_runs_of_heads_in_any_order():
  """Heads grouped in runs of one pattern (two, one, one): each run one splash call."""
  local = block_sparse.HeadPattern("strided", local=True, stride=32)
  strided = block_sparse.HeadPattern("strided", summary=True, stride=32)
  heads = (local, local, strided, local)
  assert splash_sparse.runs(heads) == [(0, 2), (2, 3), (3, 4)]
  _check(heads, 200, 16, jnp.float32, 2e-5)


@pytest.mark.parametrize("pattern,combine", [("strided", "split"), ("fixed", "merged")])
def test_splash_evaluates_the_mask_in_the_kernel(pattern, combine):
  """No call is handed a mask array (an int32 block x block per partial block, read from HBM
  each time the kernel visits one): every call's heads share one mask, computed in the kernel."""
  heads = _heads(pattern, combine, 0, 4, 32, 8)
  assert len(set(heads)) > 1  # heads of different masks in one layer
  n, block = 256, splash_sparse.block_size(256)
  x = jax.ShapeDtypeStruct((1, 4, n, 16), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q, k, v: splash_sparse.block_sparse_attention(
      q, k, v, heads, interpret=True))(x, x, x)
  calls = []

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        calls.append([v.aval for v in eqn.invars])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  assert calls
  for avals in calls:
    assert not [a for a in avals if a.shape[-2:] == (block, block)], avals


@pytest.mark.slow
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 6e-2)])
@pytest.mark.parametrize("combine", sparse.COMBINES)
@pytest.mark.parametrize("pattern", sparse.PATTERNS)
def test_splash_every_pattern_and_combination(pattern, combine, dtype, atol):
  for layer in (0, 1):
    _check(_heads(pattern, combine, layer, 4, 64, 16), 640, 64, dtype, atol)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("kernel", ["pallas_interpret", "splash_interpret"])
def test_kernels_in_the_model_equal_the_dense_reference(kernel, scan):
  """Also under the layer scan, which traces the kernel inside Flax's scan (a kernel holding
  arrays made in one trace and reused in another leaks tracers there)."""
  from model_helpers import build, replaced  # pylint: disable=g-import-not-at-top
  from span_lm.model import build_model
  from span_lm.model import caches as caches_lib
  from span_lm.model import plan as plan_lib
  cfg = build({"vocab_size": 30, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 32,
               "sparse.context": 130, "span.mode": "fixed", "arch": "sparse", "sparse.stride": 16,
               "sparse.c": 4, "sparse.combine": "interleaved"})
  tok = jnp.asarray(np.random.default_rng(1).integers(0, 30, (1, 130)), jnp.int32)
  out = {}
  for name in ("dense", kernel):
    c = replaced(cfg, **{"sparse.impl": name, "sparse.scan_layers": scan})
    model = build_model(c, plan_lib.full_plan(c))
    caches = caches_lib.init_caches(c, None, 1)
    params = jax.jit(model.init)(jax.random.key(0), tok, caches)["params"]
    loss = lambda p: -jnp.mean(model.apply({"params": p}, tok, caches)[0][:, :, 0])
    out[name] = jax.jit(jax.value_and_grad(loss))(params)  # a second trace, as in training
  np.testing.assert_allclose(out["dense"][0], out[kernel][0], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
               out["dense"][1], out[kernel][1])


def test_flops_count_the_blocks_the_chosen_kernel_computes():
  """The FLOPs accounting counts what runs: the jnp path's parts, or a kernel's non-empty tiles
  times their area (here the Triton kernel's 64 x 32 bf16 tiles on an H100), which
  block_sparse.computed_fraction relates to the dense causal tiles."""
  from span_lm.kernels.sparse import block_sparse  # pylint: disable=g-import-not-at-top
  from model_helpers import build  # pylint: disable=g-import-not-at-top
  from span_lm.model import macs  # pylint: disable=g-import-not-at-top
  n = 1024
  cfg = build({"vocab_size": 30, "d_model": 128, "n_layers": 1, "n_heads": 2, "d_ff": 32,
               "sparse.context": n, "span.mode": "fixed", "arch": "sparse", "sparse.stride": 64,
               "sparse.c": 16, "dtype": "bfloat16"})
  heads = _heads("fixed", "merged", 0, 2, 64, 16)
  with target.compiling_for("gpu", 9.0):
    macs_q, _ = macs.sparse_attention_macs(cfg, 0, n)
  tiles = sum(int((block_sparse.block_map(h, n, 64, 32) != block_sparse.EMPTY).sum())
              for h in heads)
  assert macs_q == tiles * 64 * 32 * 64  # pairs x head size
  dense_pairs = 2 * int((block_sparse.block_map(block_sparse.HeadPattern("dense"), n, 64, 32)
                         != block_sparse.EMPTY).sum()) * 64 * 32
  assert macs_q / 64 == pytest.approx(
      block_sparse.computed_fraction(heads, n, 64, 32) * dense_pairs)
  with target.compiling_for("cpu"):  # the jnp path: its parts, not tiles
    assert macs.sparse_attention_macs(cfg, 0, n)[0] != macs_q
