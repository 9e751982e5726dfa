"""Sparse Transformer: validity, fast path == dense reference, model options, training, CIFAR."""
import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_helpers import build, replaced
from span_lm import config as config_lib
from span_lm.data import cifar
from span_lm.data import sources
from span_lm.model import build_model
from span_lm.model import sparse
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.sparse_transformer import SparseTransformer
from span_lm.train import loop
from span_lm.train import min_context
from span_lm.train import optimizer as optimizer_lib

REPO = pathlib.Path(__file__).resolve().parents[2]

L, C, H = 8, 2, 4  # stride, summary width, heads of the attention tests


def _all_heads(pattern, n_heads=H, stride=L, c=C):
  """Every distinct head of a pattern over the three combinations and both layer parities."""
  heads = []
  for combine in sparse.COMBINES:
    for layer in (0, 1):
      for h in sparse.layer_heads(pattern, combine, n_heads, layer, stride, c):
        if h not in heads:
          heads.append(h)
  return tuple(heads)


# --------------------------------------------------------------------------------- connectivity


def test_connectivity_definitions():
  n = 40
  i = np.arange(n)
  local = sparse.connectivity(sparse.HeadPattern("strided", local=True, stride=L), n)
  np.testing.assert_array_equal(local.sum(1), np.minimum(i + 1, L))  # the l most recent
  strided = sparse.connectivity(sparse.HeadPattern("strided", summary=True, stride=L), n)
  np.testing.assert_array_equal(strided.sum(1), i // L + 1)
  block = sparse.connectivity(sparse.HeadPattern("fixed", local=True, stride=L, c=C), n)
  np.testing.assert_array_equal(block.sum(1), i % L + 1)
  summ = sparse.connectivity(sparse.HeadPattern("fixed", summary=True, stride=L, c=C, offset=2), n)
  assert set(np.nonzero(summ[-1])[0] % L) == {L - C - 2, L - 2 - 1}  # columns 4 and 5
  assert not np.any(np.triu(summ | block | local | strided, 1))  # causal


def test_fixed_heads_take_distinct_sub_blocks():
  heads = sparse.layer_heads("fixed", "merged", 6, 0, L, C)
  assert [h.offset for h in heads] == [0, 2, 4, 6, 0, 2]  # cycles after l / c = 4 heads
  same = sparse.layer_heads("fixed", "merged", 6, 0, L, C, distinct=False)
  assert {h.offset for h in same} == {0}
  split = sparse.layer_heads("fixed", "split", 4, 0, L, C)
  assert [(h.local, h.summary, h.offset) for h in split] == [
      (True, False, 0), (False, True, 0), (True, False, 0), (False, True, 2)]


@pytest.mark.parametrize("n", [64, 61])
@pytest.mark.parametrize("combine", sparse.COMBINES)
@pytest.mark.parametrize("pattern", ["strided", "fixed", "dense"])
def test_validity_two_steps(pattern, combine, n):
  """Sec. 4.2: every j <= i reaches i through two consecutive layers (p = 2)."""
  layers = []
  for layer in (0, 1):
    heads = sparse.layer_heads(pattern, combine, H, layer, L, C)
    layers.append(np.any([sparse.connectivity(h, n) for h in heads], axis=0))
  causal = np.tril(np.ones((n, n), bool))
  np.testing.assert_array_equal(sparse.reachable(layers), causal)


def test_strided_valid_without_residual_path():
  """Strided: a path (j, a, i), j in A1_a and a in A2_i, exists for every j <= i (no identity)."""
  n = 50
  a1 = sparse.connectivity(sparse.HeadPattern("strided", local=True, stride=L), n).astype(int)
  a2 = sparse.connectivity(sparse.HeadPattern("strided", summary=True, stride=L), n).astype(int)
  np.testing.assert_array_equal((a2 @ a1) > 0, np.tril(np.ones((n, n), bool)))


def test_local_alone_is_not_valid():
  heads = sparse.layer_heads("local", "merged", H, 0, L, C)
  m = sparse.connectivity(heads[0], 40)
  assert not sparse.reachable([m, m])[39, 0]  # two local layers see 2l - 1 back only


# ------------------------------------------------------------------------ fast path == reference


@pytest.mark.slow
@pytest.mark.parametrize("n", [32, 37])  # a multiple of l and not
@pytest.mark.parametrize("pattern", sparse.PATTERNS)
def test_fast_path_equals_dense_reference(pattern, n):
  """Values and gradients of every head of every combination (one call: mixed head groups)."""
  heads = _all_heads(pattern)
  rng = np.random.default_rng(n)
  q, k, v = (jnp.asarray(rng.normal(size=(2, len(heads), n, 4)), jnp.float32) for _ in range(3))
  w = jnp.asarray(rng.normal(size=(2, len(heads), n, 4)), jnp.float32)

  @jax.jit
  def both(q, k, v):
    def run(fn):
      return jax.value_and_grad(lambda *a: jnp.sum(w * fn(*a, heads)), (0, 1, 2))(q, k, v)
    out = sparse.sparse_attention(q, k, v, heads), sparse.reference_attention(q, k, v, heads)
    return out, run(sparse.sparse_attention), run(sparse.reference_attention)

  (fast, ref), (lf, gf), (lr, gr) = both(q, k, v)
  np.testing.assert_allclose(fast, ref, atol=2e-6)
  np.testing.assert_allclose(lf, lr, rtol=1e-5)
  for a, b in zip(gf, gr):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_fast_path_bfloat16_close():
  heads = _all_heads("fixed")
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, len(heads), 40, 8)), jnp.float32) for _ in range(3))
  ref = jax.jit(lambda *a: sparse.reference_attention(*a, heads))(q, k, v)
  bf = jax.jit(lambda *a: sparse.sparse_attention(*a, heads))(
      *(x.astype(jnp.bfloat16) for x in (q, k, v)))
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(bf.astype(jnp.float32), ref, atol=5e-2)


# ------------------------------------------------------------------------------------ the model


def _cfg(**kw):
  base = {"vocab_size": 30, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
          "sparse.context": 40, "span.mode": "fixed", "arch": "sparse", "sparse.stride": 8,
          "sparse.c": 2}
  return build(base, **kw)


def _init(cfg, m):
  init = jax.jit(build_model(cfg).init)
  return init(jax.random.key(0), jnp.zeros((1, m), jnp.int32),
              caches_lib.init_caches(cfg, None, 1))["params"]


def _loss_and_grads(cfg, params, m=37):
  """(loss, logp, grads, (caches, new caches, aux)) of a jitted forward/backward on 2 x m tokens."""
  model = build_model(cfg, plan_lib.full_plan(cfg))
  caches = caches_lib.init_caches(cfg, None, 2)
  tok = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, m)), jnp.int32)

  @jax.jit
  def f(p):
    def loss(p):
      logp, new_caches, aux = model.apply({"params": p}, tok, caches)
      return -jnp.mean(logp[:, :, 0]), (logp, new_caches, aux)
    return jax.value_and_grad(loss, has_aux=True)(p)

  (loss, (logp, new_caches, aux)), grads = f(params)
  return loss, logp, grads, (caches, new_caches, aux)


@pytest.fixture(scope="module")
def base():
  """The default sparse model: fresh params, perturbed params (non-zero W_out, so the gradient
  reaches every layer) and their loss, log-probabilities and gradients."""
  cfg = _cfg()
  fresh = _init(cfg, 40)
  params = dict(fresh, out_emb={"kernel": 0.1 * jax.random.normal(
      jax.random.key(1), fresh["out_emb"]["kernel"].shape)})
  return cfg, fresh, params, _loss_and_grads(cfg, params)


@pytest.mark.slow
def test_model_interface_and_init(base):
  cfg, fresh, _, (_, logp, _, (caches, new_caches, aux)) = base
  assert isinstance(build_model(cfg), SparseTransformer)
  assert logp.shape == (2, 37, 30)
  assert all(c.shape == (2, 1, 16) for c in caches)  # placeholders (Orbax: no empty arrays)
  assert all(np.array_equal(a, b) for a, b in zip(caches, new_caches))
  assert float(aux["span_loss"]) == 0.0
  np.testing.assert_array_equal(aux["span_avg"], [37, 37])
  # Sec. 6 init: W_out zero; fc2 (and W_p) N(0, 0.125 / sqrt(d_in)) scaled by 1/sqrt(2N).
  assert not np.any(fresh["out_emb"]["kernel"])
  std = float(np.std(np.asarray(fresh["layers_0"]["ff"]["fc2"]["kernel"])))
  assert std == pytest.approx(0.125 / math.sqrt(32) / math.sqrt(4), rel=0.15)
  assert fresh["pos_emb_0"].shape == (5, 16) and fresh["pos_emb_1"].shape == (8, 16)


@pytest.mark.slow
def test_fast_and_dense_impl_agree_in_the_model(base):
  cfg, _, params, (loss, logp, grads, _) = base
  loss_d, logp_d, grads_d, _ = _loss_and_grads(replaced(cfg, **{"sparse.impl": "dense"}),
                                               params)
  np.testing.assert_allclose(logp, logp_d, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, grads_d)


def test_parameters_keep_each_heads_pattern_though_heads_run_grouped():
  """Fixed heads with offsets 0, c, 0, c run grouped (0, 0, c, c: one kernel call per group), yet
  head h of the parameters (columns h*dh:(h+1)*dh of query/key/value, rows of proj) attends
  with layer_heads' pattern h: the layer equals the attention written out from its parameters."""
  from span_lm.model.sparse_transformer import SparseAttention  # pylint: disable=g-import-not-at-top
  cfg = _cfg(**{"n_heads": 4, "d_model": 16, "sparse.pattern": "fixed", "sparse.c": 4,
                "sparse.combine": "merged", "dtype": "float32"})
  heads = sparse.layer_heads("fixed", "merged", 4, 0, 8, 4)
  assert [h.offset for h in heads] == [0, 4, 0, 4]
  assert sparse.grouped_order(heads) == (0, 2, 1, 3)
  layer = SparseAttention(cfg, 0)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 24, 16)), jnp.float32)
  params = layer.init(jax.random.key(0), x)["params"]
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(1), p.shape), params)

  def written_out(params, x):
    proj = lambda name: (x @ params[name]["kernel"] + params[name]["bias"][None, None]).reshape(
        2, 24, 4, 4).transpose(0, 2, 1, 3)
    o = sparse.reference_attention(proj("query") / 2.0, proj("key"), proj("value"), heads)
    return o.transpose(0, 2, 1, 3).reshape(2, 24, 16) @ params["proj"]["kernel"] + (
        params["proj"]["bias"][None, None])

  w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 24, 16)), jnp.float32)
  grad = lambda f: jax.jit(jax.value_and_grad(lambda p: jnp.sum(w * f(p, x))))(params)
  (got, g_got), (want, g_want) = grad(lambda p, x: layer.apply({"params": p}, x)), grad(written_out)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g_got, g_want)


@pytest.mark.slow
def test_remat_changes_nothing(base):
  cfg, _, params, (loss, _, grads, _) = base
  remat = dataclasses.replace(cfg, remat="layer", remat_policy="nothing_saveable")
  loss_r, _, grads_r, _ = _loss_and_grads(remat, params)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads_r, grads)


@pytest.mark.slow
def test_bfloat16_close_to_float32(base):
  cfg, _, params, (loss, logp, _, _) = base
  loss_b, logp_b, grads_b, _ = _loss_and_grads(dataclasses.replace(cfg, dtype="bfloat16"), params)
  assert logp_b.dtype == jnp.float32  # float32 softmax
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads_b))  # float32 params
  np.testing.assert_allclose(loss_b, loss, rtol=2e-2)
  np.testing.assert_allclose(logp_b, logp, atol=5e-2)


@pytest.mark.slow
def test_half_precision_residual_stream(base):
  """sparse.stream_dtype='compute' (the paper's Sec. 5.6): the blocks' residual stream is in
  model.dtype, unrolled and under the layer scan (whose carry must keep one dtype); float32
  layer-norm statistics, softmax and parameter gradients; close to the float32 stream. With
  dtype float32 it is the default model exactly."""
  from span_lm.model.sparse_transformer import ResBlock  # pylint: disable=g-import-not-at-top
  cfg, _, params, (loss, logp, grads, _) = base
  same = _loss_and_grads(replaced(cfg, **{"sparse.stream_dtype": "compute"}), params)
  np.testing.assert_array_equal(same[0], loss)
  jax.tree.map(np.testing.assert_array_equal, same[2], grads)

  def block_dtypes(c):
    tok = jnp.zeros((1, 40), jnp.int32)
    _, state = build_model(c).apply({"params": params}, tok, caches_lib.init_caches(c, None, 1),
                                    capture_intermediates=lambda m, _: isinstance(m, ResBlock))
    return {x.dtype for x in jax.tree.leaves(state)}

  bf16 = dataclasses.replace(cfg, dtype="bfloat16")
  half = replaced(bf16, **{"sparse.stream_dtype": "compute"})
  assert block_dtypes(bf16) == {jnp.dtype(jnp.float32)}
  assert block_dtypes(half) == {jnp.dtype(jnp.bfloat16)}
  loss_h, logp_h, grads_h, _ = _loss_and_grads(half, params)
  assert logp_h.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 and np.all(np.isfinite(g)) for g in jax.tree.leaves(grads_h))
  np.testing.assert_allclose(loss_h, loss, rtol=2e-2)
  np.testing.assert_allclose(logp_h, logp, atol=5e-2)
  cos = lambda a, b: float(np.vdot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
  assert cos(grads_h["layers_0"]["attn"]["query"]["kernel"],
             grads["layers_0"]["attn"]["query"]["kernel"]) > 0.95
  scan = replaced(half, **{"sparse.scan_layers": True})
  loss_s, logp_s, _, _ = _loss_and_grads(scan, _stack(params, scan))
  np.testing.assert_allclose(loss_s, loss_h, rtol=1e-3)
  np.testing.assert_allclose(logp_s, logp_h, atol=2e-2)


@pytest.mark.slow
def test_pre_and_post_activation_blocks(base):
  cfg, _, params, (loss, _, _, _) = base
  post = replaced(cfg, **{"sparse.prenorm": False, "sparse.act": "relu"})
  assert "norm_out" in params
  post_params = {k: v for k, v in params.items() if k != "norm_out"}  # the same weights
  loss_p, _, grads_p, _ = _loss_and_grads(post, post_params)
  assert "norm_out" not in grads_p
  assert np.isfinite(float(loss_p)) and float(loss_p) != pytest.approx(float(loss))


def test_data_position_embeddings():
  cfg = _cfg(**{"sparse.context": 24, "sparse.pos": "data", "sparse.data_shape": (2, 4, 3)})
  params = jax.eval_shape(lambda: _init(cfg, 24))
  assert [params[f"pos_emb_{j}"].shape[0] for j in range(3)] == [2, 4, 3]


@pytest.mark.parametrize("kw,field", [
    (dict(arch="sparse2"), "arch"),
    (dict(pers_mem=4), "pers_mem"),
    ({"sparse.c": 9}, "sparse.c"),
    ({"sparse.pattern": "axial"}, "sparse.pattern"),
    ({"sparse.qk_ratio": 0.3}, "sparse.qk_ratio"),
    ({"sparse.stream_dtype": "float16"}, "sparse.stream_dtype"),
    ({"sparse.pos": "data"}, "sparse.data_shape"),
    ({"sparse.scan_layers": True, "sparse.combine": "interleaved", "sparse.pattern": "fixed",
      "n_layers": 3}, "sparse.scan_layers"),
    ({"sparse.scan_layers": True, "arch": "span", "span.mode": "adaptive"}, "sparse.scan_layers"),
])
def test_bad_sparse_config_names_the_field(kw, field):
  with pytest.raises(ValueError, match=rf"config\.model\.{field}="):
    _cfg(**kw)


def test_adamw_cosine_optimizer():
  import ml_collections  # pylint: disable=g-import-not-at-top
  o = ml_collections.ConfigDict(dict(name="adam", lr=1.0, momentum=0.0, grad_clip=1.0, warmup=10,
                                     batch_split=1, weight_decay=0.01, schedule="cosine",
                                     decay_steps=110))
  tx, sched = optimizer_lib.make_optimizer(o)
  assert [round(float(sched(k)), 4) for k in (0, 9, 10, 60, 110)] == [0.1, 1.0, 1.0, 0.5, 0.0]
  p = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
  upd, _ = tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
  assert float(upd["w"][0, 0]) == pytest.approx(-0.1 * 0.01) and float(upd["b"][0]) == 0.0
  for field, value in (("weight_decay", -1.0), ("schedule", "linear"), ("decay_steps", 5)):
    bad = o.copy_and_resolve_references()
    bad[field] = value
    with pytest.raises(ValueError, match=rf"config\.optim\.{field}="):
      optimizer_lib.make_optimizer(bad)
  bad = o.copy_and_resolve_references()
  bad.name = "adagrad"
  with pytest.raises(ValueError, match=r"config\.optim\.weight_decay="):
    optimizer_lib.make_optimizer(bad)


def _stack(params, cfg):
  """Unrolled 'layers_{i}' parameters in the layer scan's layout: 'layers/block_j', stacked over
  the groups of cfg.scan_period blocks."""
  p = cfg.sparse.scan_period
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  out["layers"] = {f"block_{j}": jax.tree.map(
      lambda *xs: jnp.stack(xs), *[params[f"layers_{g * p + j}"]
                                   for g in range(cfg.n_layers // p)]) for j in range(p)}
  return out


@pytest.mark.slow
@pytest.mark.parametrize("combine,n_layers,remat", [("split", 3, "none"), ("interleaved", 4, "none"),
                                                    ("interleaved", 4, "layer")])
def test_layer_scan_is_the_same_function(combine, n_layers, remat):
  """sparse.scan_layers with the unrolled model's weights, stacked: the same loss, log-probabilities
  and gradients (interleaved patterns alternate by layer, so the scan steps over pairs)."""
  cfg = _cfg(n_layers=n_layers, remat=remat,
             **{"sparse.combine": combine, "sparse.pattern": "strided"})
  fresh = _init(cfg, 40)
  params = dict(fresh, out_emb={"kernel": 0.1 * jax.random.normal(
      jax.random.key(1), fresh["out_emb"]["kernel"].shape)})
  loss, logp, grads, _ = _loss_and_grads(cfg, params)
  scan = replaced(cfg, **{"sparse.scan_layers": True})
  assert scan.sparse.scan_period == (2 if combine == "interleaved" else 1)
  assert jax.tree.structure(_init(scan, 40)) == jax.tree.structure(_stack(params, scan))
  loss_s, logp_s, grads_s, _ = _loss_and_grads(scan, _stack(params, scan))
  np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
  np.testing.assert_allclose(logp_s, logp, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads_s,
               _stack(grads, scan))
  # Mixing the patterns up changes the function, so the comparison above can fail.
  if combine == "interleaved":
    swapped = _stack(params, scan)
    blocks = swapped["layers"]
    swapped["layers"] = {"block_0": blocks["block_1"], "block_1": blocks["block_0"]}
    assert float(_loss_and_grads(scan, swapped)[0]) != pytest.approx(float(loss), rel=1e-6)


def test_reference_adagrad_clips_each_layer_of_a_stacked_tensor():
  """The reference Adagrad clips per tensor; a layer scan's stacked tensor is one tensor per
  layer, so its updates equal the unrolled layers' (one layer clipped, one not)."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.normal(size=(3, 4)), jnp.float32) * s for s in (1.0, 0.01))
  tx = optimizer_lib.reference_adagrad(0.07, 0.5)
  unrolled = {"layers_0": {"w": a}, "layers_1": {"w": b}}
  stacked = {"layers": {"block_0": {"w": jnp.stack([a, b])}}}
  for _ in range(2):  # the accumulator's second step too
    u_un, _ = tx.update(unrolled, tx.init(unrolled))
    u_st, _ = tx.update(stacked, tx.init(stacked))
  got = u_st["layers"]["block_0"]["w"]
  np.testing.assert_allclose(got[0], u_un["layers_0"]["w"], rtol=1e-6)
  np.testing.assert_allclose(got[1], u_un["layers_1"]["w"], rtol=1e-6)
  whole = tx.update({"w": jnp.stack([a, b])}, tx.init({"w": jnp.stack([a, b])}))[0]["w"]
  assert not np.allclose(whole, got)  # one norm over both layers would differ: the test can fail


@pytest.mark.slow
def test_layer_scan_init_and_training_step():
  """Stacked init: every layer its own draw from the same distribution (split rngs), biases and
  gains left out of weight decay and the layer axis out of the sharding names; a train-mode
  step with dropout runs."""
  cfg = _cfg(n_layers=4, **{"sparse.scan_layers": True}, dropout=0.1)
  params = _init(cfg, 40)
  fc2 = np.asarray(params["layers"]["block_0"]["ff"]["fc2"]["kernel"])
  assert fc2.shape == (4, 32, 16) and not np.allclose(fc2[0], fc2[1])
  assert float(np.std(fc2)) == pytest.approx(0.125 / math.sqrt(32) / math.sqrt(8), rel=0.15)
  import ml_collections  # pylint: disable=g-import-not-at-top
  o = ml_collections.ConfigDict(dict(name="adam", lr=1.0, momentum=0.0, grad_clip=1.0, warmup=1,
                                     batch_split=1, weight_decay=0.01, schedule="cosine",
                                     decay_steps=10))
  tx, _ = optimizer_lib.make_optimizer(o)
  upd, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  block = upd["layers"]["block_0"]
  assert block["norm1"]["scale"].shape == (4, 16)  # stacked vectors, all ones: no decay
  assert float(jnp.max(jnp.abs(block["norm1"]["scale"]))) == 0.0
  assert float(jnp.max(jnp.abs(block["ff"]["fc2"]["kernel"]))) > 0.0
  from span_lm.train import sharding  # pylint: disable=g-import-not-at-top
  path = tuple(jax.tree_util.DictKey(k) for k in ("layers", "block_0", "ff", "fc1", "kernel"))
  assert sharding.logical_axes(path, 3) == (None, "embed", "mlp")
  model = build_model(cfg, plan_lib.full_plan(cfg))
  tok = jnp.zeros((2, 40), jnp.int32)
  logp, _, _ = jax.jit(lambda p: model.apply({"params": p}, tok, caches_lib.init_caches(
      cfg, None, 2), train=True, rngs={"dropout": jax.random.key(3)}))(params)
  assert bool(jnp.all(jnp.isfinite(logp)))


# ------------------------------------------------------------------------- training, evaluation


def test_min_context_windows_score_each_target_once():
  for n_tokens, ctx, m in ((100, 16, 1), (100, 16, 9), (101, 16, 16), (10, 16, 4)):
    seen = np.zeros(n_tokens, int)
    for s, k0 in min_context.windows(n_tokens, ctx, m):
      for k in range(k0, min(ctx, n_tokens - 1 - s)):
        seen[s + k + 1] += 1
        assert s == 0 or k + 1 >= m
    np.testing.assert_array_equal(seen[1:], 1)


@pytest.mark.slow
def test_tiny_sparse_config_trains_and_evaluates(tmp_path, enwik8_head, monkeypatch):
  monkeypatch.chdir(REPO)
  c = config_lib.load_config("configs/enwik8_sparse_fixed.py:smoke")
  c.workdir = str(tmp_path / "run")
  c.train.tensorboard = False
  c.train.compilation_cache = ""
  head = tmp_path / "head.bin"  # 300 kB of enwik8_head: short valid and test splits
  head.write_bytes(enwik8_head.read_bytes()[:300_000])
  c.data.path = str(head)
  c.data.split_bytes = (260_000, 280_000)
  out = loop.train(c)
  assert out["step"] == 4 and np.isfinite(out["loss"]) and out["loss"] < math.log(256)
  assert out["full_test_bpc"] < 8.0
  # Table 3 evaluation from the checkpoint: every target once, at two minimum contexts.
  r1, r2 = min_context.evaluate_min_context(c, [1, 48], split="valid")
  assert r1["tokens"] == r2["tokens"] == 20_000 - 1
  assert r2["windows"] > r1["windows"]
  assert abs(r1["bpc"] - out["full_valid_bpc"]) < 0.05  # same model, other cuts of the split


# ------------------------------------------------------------------------------------- CIFAR-10


def _write_cifar(d, per_batch=50, seed=0):
  rng = np.random.default_rng(seed)
  d.mkdir(parents=True, exist_ok=True)
  for f in cifar.TRAIN_FILES + (cifar.TEST_FILE,):
    cifar.write_batch(d / f, rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                      rng.integers(0, 10, per_batch))


def test_cifar_source(tmp_path):
  d = tmp_path / "cifar-10-batches-py"
  _write_cifar(d)
  img, _ = cifar.read_batch(d / "data_batch_1")
  splits = sources.load_splits({"dataset": "cifar10", "data_dir": str(tmp_path), "block": 3072,
                                "batch": 2, "eval_batch": 2})
  assert splits.vocab_size == 256
  assert (len(splits.train), len(splits.valid), len(splits.test)) == (240 * 3072, 10 * 3072,
                                                                       50 * 3072)
  first = splits.train[:3072].reshape(32, 32, 3)  # raster order: row, column, channel
  np.testing.assert_array_equal(first[3, 5], img[0].reshape(3, 32, 32)[:, 3, 5])
  with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
    cifar.find_dir(tmp_path / "nowhere")


def test_cifar_config_builds_a_run(tmp_path, monkeypatch):
  """configs/cifar10_sparse.py:smoke reads the generated batches and traces its training state."""
  monkeypatch.chdir(REPO)
  _write_cifar(tmp_path / "cifar")
  c = config_lib.load_config("configs/cifar10_sparse.py:smoke")
  c.workdir = str(tmp_path / "run")
  c.data.data_dir = str(tmp_path / "cifar")
  c.data.batch = c.data.eval_batch = 8  # the tests' 8 devices
  run = loop.Run(c)
  try:
    assert run.splits.name == "cifar10" and run.model_cfg.sparse.data_shape == (32, 32, 3)
    plan = plan_lib.full_plan(run.model_cfg)
    _, abstract, _ = run.abstract_state(plan)
    assert abstract["params"]["pos_emb_2"].shape == (3, 32)  # the channel table
    logp, _, aux = jax.eval_shape(
        lambda p: build_model(run.model_cfg, plan).apply(
            {"params": p}, jnp.zeros((1, 3072), jnp.int32),
            caches_lib.init_caches(run.model_cfg, plan, 1)), abstract["params"])
    assert logp.shape == (1, 3072, 256)
  finally:
    run.ckpt.close()
