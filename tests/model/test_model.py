"""Model tests: the Flax SpanTransformer against the independent float64 numpy reference.

reference_numpy.py is written from the equations in docs/reference_semantics.md, not from the
Flax code; the equality tests below are what ties span_lm to the reference semantics. Everything
runs on CPU with tiny shapes.
"""
import json
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import reference_numpy as ref
from model_helpers import build, make_cfg, replaced, to_jax, to_np
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.train import planner as planner_lib
from span_lm.model.config import ModelConfig
from span_lm.model.transformer import SpanTransformer

B = 2




def shapes(tree):
  if isinstance(tree, dict) or hasattr(tree, "items"):
    return {k: shapes(v) for k, v in tree.items()}
  return tuple(tree.shape) if hasattr(tree, "shape") else tree


def random_caches(rng, cfg, lengths, b=B):
  return tuple(rng.normal(size=(b, n, cfg.d_model)) for n in lengths)


def apply_fn(cfg, plan=None):
  model = SpanTransformer(cfg, plan=plan)

  @jax.jit
  def f(params, tokens, caches):
    return model.apply({"params": params}, tokens, caches, train=False)

  return f


def flax_param_shapes(cfg, m=8, plan=None):
  model = SpanTransformer(cfg, plan=plan)
  tokens = jnp.zeros((B, m), jnp.int32)
  caches = caches_lib.init_caches(cfg, plan, B)
  init = lambda t, c: model.init(jax.random.key(0), t, c, train=False)["params"]
  return shapes(jax.eval_shape(init, tokens, caches))


def assert_close_tree(actual, expected, rtol, atol, what):
  actual, expected = list(actual), list(expected)
  assert len(actual) == len(expected), what
  for i, (a, e) in enumerate(zip(actual, expected)):
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol,
                               err_msg=f"{what}[{i}]")


# ----------------------------------------------------------------------------------------------
# The numpy reference itself (no Flax): cheap self-checks so that a failure below is attributable.


def test_reference_self_consistency_stream():
  """numpy: block-by-block with carried caches equals one pass over the whole stream."""
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 12})
  rng = np.random.default_rng(1)
  params = ref.random_params(cfg, rng)
  tokens = rng.integers(cfg.vocab_size, size=(B, 20))
  zeros = [np.zeros((B, cfg.span.size, cfg.d_model))] * cfg.n_layers
  full, full_caches, _ = ref.forward(cfg, params, tokens, zeros)
  caches, outs = zeros, []
  for k in range(0, 20, 5):
    logp, caches, _ = ref.forward(cfg, params, tokens[:, k:k + 5], caches)
    outs.append(logp)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-12, atol=1e-12)
  for a, e in zip(caches, full_caches):
    np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode,n_pers", [("fixed", 0), ("adaptive", 0), ("dynamic", 0),
                                         ("fixed", 3), ("adaptive", 3), ("dynamic", 3)])
def test_reference_weights_are_normalised_and_banded(mode, n_pers):
  cfg = make_cfg(**{"span.mode": mode, "span.size": 10}, pers_mem=n_pers)
  rng = np.random.default_rng(2)
  params = ref.random_params(cfg, rng)
  tokens = rng.integers(cfg.vocab_size, size=(B, 6))
  caches = random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers)
  _, _, aux = ref.forward(cfg, params, tokens, caches, return_weights=True)
  for w in aux["weights"]:
    tot = w["context"].sum(-1)
    if n_pers:
      tot = tot + w["persistent"].sum(-1)
    # Exactly 1 up to the renormalisation's 1e-8 (relative 1e-8 / masked mass, which can be
    # small with a short span and random scores).
    np.testing.assert_allclose(tot, 1.0, atol=1e-4)
    # Query i sits at S + i; only distances 1..S may carry weight.
    m, p = w["context"].shape[-2:]
    dist = (cfg.span.size + np.arange(m))[:, None] - np.arange(p)[None, :]
    outside = (dist < 1) | (dist > cfg.span.size)
    assert np.all(w["context"][..., outside] == 0)


# ----------------------------------------------------------------------------------------------
# 0. API basics: parameter tree and caches.

CASES = {
    "fixed": {"span.mode": "fixed", "span.size": 16},
    "adaptive": {"span.mode": "adaptive", "span.size": 24},
    "dynamic": {"span.mode": "dynamic", "span.size": 20},
    "pers_fixed": {"span.mode": "fixed", "span.size": 16, "pers_mem": 5},
    "pers_adaptive": {"span.mode": "adaptive", "span.size": 24, "pers_mem": 5},
    "pers_dynamic": {"span.mode": "dynamic", "span.size": 20, "pers_mem": 3},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_param_tree_matches_spec(case):
  cfg = make_cfg(**CASES[case])
  assert flax_param_shapes(cfg) == ref.param_shapes(cfg)


def test_init_caches_plan_none():
  cfg = make_cfg(**{"span.size": 16}, n_layers=3)
  caches = caches_lib.init_caches(cfg, None, B)
  assert isinstance(caches, tuple) and len(caches) == 3
  for c in caches:
    assert c.shape == (B, 16, cfg.d_model)
    assert np.all(np.asarray(c) == 0)


@pytest.mark.slow
@pytest.mark.parametrize("attn_impl", ["cpu", "reference"])
def test_bf16_models_carry_bf16_caches_with_the_same_outputs(attn_impl):
  """A bf16 model's caches are bf16: attention reads a cache only through its bf16 key/value
  projections, so float32 caches (as before) and their bf16 rounding give identical outputs,
  and the new caches equal the float32 ones rounded."""
  cfg = make_cfg(**{"span.size": 16, "attention.impl": attn_impl}, n_layers=2, dtype="bfloat16")
  assert all(c.dtype == jnp.bfloat16 for c in caches_lib.init_caches(cfg, None, B))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 8)), jnp.int32)
  f32 = tuple(jnp.asarray(rng.normal(size=c.shape), jnp.float32)
              for c in caches_lib.init_caches(cfg, None, B))
  model = SpanTransformer(cfg)
  params = model.init(jax.random.key(0), tokens, f32)["params"]
  logp_a, new_a, _ = model.apply({"params": params}, tokens, f32)
  logp_b, new_b, _ = model.apply({"params": params}, tokens,
                                 tuple(c.astype(jnp.bfloat16) for c in f32))
  np.testing.assert_array_equal(np.asarray(logp_a), np.asarray(logp_b))
  for a, b in zip(new_a, new_b):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


# ----------------------------------------------------------------------------------------------
# 1. Equality with the numpy reference.


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
  cfg = make_cfg(**CASES[case])
  check_against_reference(cfg, m=12 if "dynamic" in case else 8, seed=10)


@pytest.mark.parametrize("mode,n_pers,span,m,chunk", [
    ("fixed", 0, 16, 32, 0),      # 2 chunks of 16 queries, window <= chunk (strided key views)
    ("adaptive", 0, 16, 32, 8),   # 4 chunks of 8 < window 16 (gathered key windows)
    ("adaptive", 3, 12, 24, 6),   # gathered windows with persistent memory
    ("dynamic", 0, 8, 24, 0),     # 3 chunks of 8 = window
    ("dynamic", 2, 16, 32, 4),
])
def test_matches_numpy_reference_chunked(mode, n_pers, span, m, chunk):
  """Blocks longer than the span, split into query chunks (config attn_chunk)."""
  cfg = make_cfg(**{"span.mode": mode, "span.size": span,
                    "attention.chunk": chunk}, pers_mem=n_pers)
  check_against_reference(cfg, m=m, seed=12)


def check_against_reference(cfg, m, seed):
  rng = np.random.default_rng(seed)
  params64 = ref.random_params(cfg, rng)
  params = to_jax(params64)
  params64 = to_np(params)  # the float32-rounded values, so both sides see the same numbers
  tokens = rng.integers(cfg.vocab_size, size=(B, m))
  caches64 = random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers)
  caches = to_jax(caches64)
  caches64 = to_np(caches)

  logp, new_caches, aux = apply_fn(cfg)(params, jnp.asarray(tokens, jnp.int32), caches)
  e_logp, e_caches, e_aux = ref.forward(cfg, params64, tokens, caches64)

  assert logp.shape == (B, m, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(logp), e_logp, rtol=1e-5, atol=2e-5, err_msg="logp")
  assert_close_tree(new_caches, e_caches, rtol=1e-5, atol=1e-5, what="new_caches")
  np.testing.assert_allclose(float(aux["span_loss"]), e_aux["span_loss"], rtol=1e-5, atol=1e-8,
                             err_msg="span_loss")
  for key in ("span_avg", "span_max"):
    assert np.shape(aux[key]) == (cfg.n_layers,), key
    assert np.all(np.isfinite(np.asarray(aux[key]))), key
  if cfg.span.mode == "fixed":
    assert float(aux["span_loss"]) == 0.0
  if cfg.span.mode == "adaptive":
    np.testing.assert_allclose(np.asarray(aux["span_z"]), e_aux["span_z"], rtol=1e-6,
                               err_msg="span_z")
    np.testing.assert_array_equal(np.asarray(aux["span_avg"]), e_aux["span_avg"])
    np.testing.assert_array_equal(np.asarray(aux["span_max"]), e_aux["span_max"])
  if cfg.span.mode == "dynamic":
    assert_close_tree(aux["dyn_spans"], e_aux["dyn_spans"], rtol=1e-5, atol=1e-5,
                      what="dyn_spans")


@pytest.mark.slow
def test_dropout_is_identity_at_eval_and_active_in_training():
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 16}, dropout=0.3, n_layers=1)
  rng = np.random.default_rng(11)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = rng.integers(cfg.vocab_size, size=(B, 8))
  caches = to_jax(random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers))
  logp, _, _ = apply_fn(cfg)(params, jnp.asarray(tokens, jnp.int32), caches)
  e_logp, _, _ = ref.forward(cfg, to_np(params), tokens, to_np(caches))
  np.testing.assert_allclose(np.asarray(logp), e_logp, rtol=1e-5, atol=2e-5)
  model = SpanTransformer(cfg, plan=None)
  train_apply = jax.jit(lambda p, t, c, key: model.apply({"params": p}, t, c, train=True,
                                                         rngs={"dropout": key}))
  t_logp, _, _ = train_apply(params, jnp.asarray(tokens, jnp.int32), caches, jax.random.key(3))
  assert np.all(np.isfinite(np.asarray(t_logp)))
  assert not np.allclose(np.asarray(t_logp), e_logp, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# 2. Stream invariance (fixed span).


def run_blocks(cfg, params, tokens, m):
  f = apply_fn(cfg)
  caches = caches_lib.init_caches(cfg, None, tokens.shape[0])
  outs = []
  for k in range(0, tokens.shape[1], m):
    logp, caches, _ = f(params, jnp.asarray(tokens[:, k:k + m], jnp.int32), caches)
    outs.append(np.asarray(logp))
  return np.concatenate(outs, 1), caches


def test_stream_blocks_equal_numpy_single_pass():
  cfg = make_cfg(**{"span.mode": "fixed", "span.size": 16})
  m, k = 8, 5
  rng = np.random.default_rng(20)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = rng.integers(cfg.vocab_size, size=(B, m * k))
  logp, caches = run_blocks(cfg, params, tokens, m)
  zeros = [np.zeros((B, cfg.span.size, cfg.d_model))] * cfg.n_layers
  e_logp, e_caches, _ = ref.forward(cfg, to_np(params), tokens, zeros)
  np.testing.assert_allclose(logp, e_logp, rtol=1e-5, atol=2e-5)
  assert_close_tree(caches, e_caches, rtol=1e-5, atol=1e-5, what="final caches")


def test_stream_blocks_equal_flax_single_block():
  """Also a block longer than the span (T = 40 > S = 16): several query chunks in one call."""
  cfg = make_cfg(**{"span.mode": "fixed", "span.size": 16})
  m, k = 8, 5
  rng = np.random.default_rng(21)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = rng.integers(cfg.vocab_size, size=(B, m * k))
  logp, caches = run_blocks(cfg, params, tokens, m)
  one, one_caches = run_blocks(cfg, params, tokens, m * k)
  np.testing.assert_allclose(logp, one, rtol=1e-5, atol=2e-5)
  assert_close_tree(caches, to_np(one_caches), rtol=1e-5, atol=1e-5, what="final caches")


# ----------------------------------------------------------------------------------------------
# 3. Trimming invariance and check_plan.


def short_span_setup(seed=30):
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 64, "span.ramp": 4,
                    "plan.granularity": 8, "plan.margin": 0})
  rng = np.random.default_rng(seed)
  # z' <= 0.15: z + R <= 13.6 < 16 for every head.
  params = to_jax(ref.random_params(cfg, rng, span_ratio_range=(0.0, 0.15)))
  tokens = rng.integers(cfg.vocab_size, size=(B, 8))
  full = to_jax(random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers))
  return cfg, params, jnp.asarray(tokens, jnp.int32), full


@pytest.mark.slow
def test_trimming_plan_matches_untrimmed():
  cfg, params, tokens, full = short_span_setup()
  plan = plan_lib.plan_from_params(cfg, params)
  hash(plan)
  assert len(plan.layers) == cfg.n_layers
  lens = [lp.cache_len for lp in plan.layers]
  assert all(n < cfg.span.size for n in lens), f"plan does not trim at all: {plan}"
  plan_lib.check_plan(cfg, params, plan)  # must not raise

  trimmed = caches_lib.resize_caches(full, cfg, plan)
  for t, f_, n in zip(trimmed, full, lens):
    assert t.shape == (B, n, cfg.d_model)
    np.testing.assert_array_equal(np.asarray(t), np.asarray(f_)[:, cfg.span.size - n:])
  fresh = caches_lib.init_caches(cfg, plan, B)
  assert [c.shape for c in fresh] == [(B, n, cfg.d_model) for n in lens]

  logp0, caches0, aux0 = apply_fn(cfg)(params, tokens, full)
  logp1, caches1, aux1 = apply_fn(cfg, plan)(params, tokens, trimmed)
  np.testing.assert_allclose(np.asarray(logp1), np.asarray(logp0), rtol=1e-5, atol=1e-5)
  for c1, c0, n in zip(caches1, caches0, lens):
    assert c1.shape == (B, n, cfg.d_model)
    np.testing.assert_allclose(np.asarray(c1), np.asarray(c0)[:, cfg.span.size - n:], rtol=1e-5,
                               atol=1e-5)
  np.testing.assert_allclose(float(aux1["span_loss"]), float(aux0["span_loss"]), rtol=1e-6)
  e_logp, _, _ = ref.forward(cfg, to_np(params), np.asarray(tokens), to_np(full))
  np.testing.assert_allclose(np.asarray(logp1), e_logp, rtol=1e-5, atol=2e-5)


def test_resize_caches_pads_left_with_zeros():
  cfg, params, _, full = short_span_setup()
  plan = plan_lib.plan_from_params(cfg, params)
  trimmed = caches_lib.resize_caches(full, cfg, plan)
  back = caches_lib.resize_caches(trimmed, cfg, None)
  for bk, t in zip(back, trimmed):
    n = t.shape[1]
    assert bk.shape == (B, cfg.span.size, cfg.d_model)
    np.testing.assert_array_equal(np.asarray(bk)[:, :cfg.span.size - n], 0.0)
    np.testing.assert_array_equal(np.asarray(bk)[:, cfg.span.size - n:], np.asarray(t))


def test_check_plan_rejects_too_short_window():
  cfg, params, _, _ = short_span_setup()
  params = jax.tree.map(lambda a: a, params)
  # Head 1 of layer 0 gets z = 0.5 * 64 = 32: span + ramp = 36 does not fit in a 16 window.
  params["layers_0"]["attn"]["span_ratio"] = params["layers_0"]["attn"]["span_ratio"].at[1].set(
      0.5)
  heads = tuple(range(cfg.n_heads))
  bad = plan_lib.SpanPlan(layers=tuple(
      plan_lib.LayerPlan(cache_len=16, groups=((heads, 16),)) for _ in range(cfg.n_layers)))
  with pytest.raises(ValueError):
    plan_lib.check_plan(cfg, params, bad)
  good = plan_lib.SpanPlan(layers=(
      plan_lib.LayerPlan(cache_len=40, groups=((heads, 40),)),
      plan_lib.LayerPlan(cache_len=16, groups=((heads, 16),))))
  plan_lib.check_plan(cfg, params, good)


def test_check_plan_exact_boundary():
  """z = 5 exactly, R = 4: m(9) = 0.25 > 0 and m(10) = 0, so the head needs a window of 9."""
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 32, "span.ramp": 4}, n_layers=1)
  rng = np.random.default_rng(31)
  p64 = ref.random_params(cfg, rng)
  p64["layers_0"]["attn"]["span_ratio"] = np.array([0.15625, 0.0625, 0.0625, 0.0625])  # z 5, 2
  params = to_jax(p64)
  assert float(params["layers_0"]["attn"]["span_ratio"][0]) * 32 == 5.0
  plan = lambda w0: plan_lib.SpanPlan(layers=(
      plan_lib.LayerPlan(cache_len=9, groups=(((0,), w0), ((1, 2, 3), 6))),))
  with pytest.raises(ValueError):
    plan_lib.check_plan(cfg, params, plan(8))
  plan_lib.check_plan(cfg, params, plan(9))
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 8)), jnp.int32)
  full = to_jax(random_caches(rng, cfg, [cfg.span.size]))
  logp0, _, _ = apply_fn(cfg)(params, tokens, full)
  logp9, _, _ = apply_fn(cfg, plan(9))(params, tokens, caches_lib.resize_caches(full, cfg, plan(9)))
  np.testing.assert_allclose(np.asarray(logp9), np.asarray(logp0), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# 4. Head grouping changes nothing.


@pytest.mark.slow
@pytest.mark.parametrize("m,chunk", [(8, 0), (32, 4)])  # one chunk; 8 chunks of 4 < windows
def test_head_groups_match_single_group_and_no_plan(m, chunk):
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 32, "span.ramp": 4,
                    "plan.granularity": 8, "plan.margin": 0, "attention.chunk": chunk})
  rng = np.random.default_rng(40)
  params64 = ref.random_params(cfg, rng)
  # z + R per head, layer 0: 5.6, 13.6, 7.2, 23.2; layer 1: 10.4, 4.64, 18.4, 7.2.
  params64["layers_0"]["attn"]["span_ratio"] = np.array([0.05, 0.3, 0.1, 0.6])
  params64["layers_1"]["attn"]["span_ratio"] = np.array([0.2, 0.02, 0.45, 0.1])
  params = to_jax(params64)
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, m)), jnp.int32)
  full = to_jax(random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers))

  grouped = plan_lib.SpanPlan(layers=(
      plan_lib.LayerPlan(cache_len=24, groups=(((0, 2), 8), ((1,), 16), ((3,), 24))),
      plan_lib.LayerPlan(cache_len=24, groups=(((1, 3), 8), ((0,), 16), ((2,), 24)))))
  single = plan_lib.SpanPlan(layers=(
      plan_lib.LayerPlan(cache_len=24, groups=(((0, 1, 2, 3), 24),)),
      plan_lib.LayerPlan(cache_len=24, groups=(((0, 1, 2, 3), 24),))))
  plan_lib.check_plan(cfg, params, grouped)
  plan_lib.check_plan(cfg, params, single)

  logp0, caches0, _ = apply_fn(cfg)(params, tokens, full)
  results = {}
  for name, plan in (("grouped", grouped), ("single", single)):
    trimmed = caches_lib.resize_caches(full, cfg, plan)
    results[name] = apply_fn(cfg, plan)(params, tokens, trimmed)
  for name, (logp, caches, _) in results.items():
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp0), rtol=1e-5, atol=1e-5,
                               err_msg=f"{name} vs plan=None")
    for c, c0 in zip(caches, caches0):
      np.testing.assert_allclose(np.asarray(c), np.asarray(c0)[:, -24:], rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name} caches")
  np.testing.assert_allclose(np.asarray(results["grouped"][0]), np.asarray(results["single"][0]),
                             rtol=1e-5, atol=1e-5, err_msg="grouped vs single")
  e_logp, _, _ = ref.forward(cfg, to_np(params), np.asarray(tokens), to_np(full))
  np.testing.assert_allclose(np.asarray(results["grouped"][0]), e_logp, rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------------
# 5. Causality by gradient.


@pytest.mark.parametrize("mode,n_pers", [("fixed", 0), ("adaptive", 0), ("dynamic", 3)])
def test_causality_by_gradient(mode, n_pers):
  m = 12
  cfg = make_cfg(vocab_size=16, **{"span.mode": mode, "span.size": 16}, pers_mem=n_pers)
  rng = np.random.default_rng(50)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = rng.permutation(cfg.vocab_size)[:m]  # one distinct token (embedding row) per position
  targets = rng.integers(cfg.vocab_size, size=m)
  caches = to_jax(random_caches(rng, cfg, [cfg.span.size] * cfg.n_layers, b=1))
  model = SpanTransformer(cfg, plan=None)

  def losses(emb):
    p = dict(params)
    p["in_emb"] = {"embedding": emb}
    logp, _, _ = model.apply({"params": p}, jnp.asarray(tokens[None], jnp.int32), caches,
                             train=False)
    return logp[0, jnp.arange(m), jnp.asarray(targets)]

  jac = np.asarray(jax.jit(jax.jacrev(losses))(params["in_emb"]["embedding"]))  # (M, V, D)
  g = np.abs(jac).sum(-1)[:, tokens]  # (t, position)
  for t in range(m):
    future = g[t, t + 1:]
    assert np.all(future == 0), f"loss at {t} depends on future positions: {future}"
    assert g[t, t] > 0
    if t > 0:
      assert np.any(g[t, :t] > 0)


# ----------------------------------------------------------------------------------------------
# 6. The span loss gradient (the soft mask: tests/kernels/test_span_mask.py; the clamp after
# each update: tests/train/test_optimizer.py).

def test_span_loss_gradient():
  cfg = make_cfg(**{"span.mode": "adaptive", "span.size": 16})
  rng = np.random.default_rng(60)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 8)), jnp.int32)
  caches = caches_lib.init_caches(cfg, None, B)
  model = SpanTransformer(cfg, plan=None)
  grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, tokens, caches,
                                                 train=False)[2]["span_loss"]))(params)
  for i in range(cfg.n_layers):
    g = np.asarray(grads[f"layers_{i}"]["attn"]["span_ratio"])
    # d/dz' of coeff * S * mean(z') = coeff * S / H per head.
    np.testing.assert_allclose(g, cfg.span.loss * cfg.span.size / cfg.n_heads, rtol=1e-6)


@pytest.mark.slow
def test_dynamic_span_loss_gradient_reaches_predictor():
  cfg = make_cfg(**{"span.mode": "dynamic", "span.size": 16})
  rng = np.random.default_rng(61)
  params = to_jax(ref.random_params(cfg, rng))
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 8)), jnp.int32)
  caches = caches_lib.init_caches(cfg, None, B)
  model = SpanTransformer(cfg, plan=None)
  loss = jax.jit(lambda p: model.apply({"params": p}, tokens, caches, train=False)[2]["span_loss"])
  grads = jax.jit(jax.grad(loss))(params)
  for i in range(cfg.n_layers):
    g = np.asarray(grads[f"layers_{i}"]["attn"]["span_predictor"]["bias"])
    assert np.all(g > 0)  # the loss increases with every head's span
  e = ref.forward(cfg, to_np(params), np.asarray(tokens), to_np(caches))[2]["span_loss"]
  np.testing.assert_allclose(float(loss(params)), e, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# 7. Persistent memory: weights over context + persistent vectors sum to one.


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "dynamic"])
def test_persistent_memory_weights_sum_to_one(mode):
  """Weights over context + persistent vectors sum to one.

  The model does not return its attention weights, so the Flax check is a probe: every context
  position holds the same hidden state e (cache and tokens), and every persistent value of head h
  (pers_val * sqrt(N)) is set to that head's context value (e Wv)_h. Then whatever the attention
  pattern (random queries, keys, key_pe, spans), each head outputs (sum of its weights) * (e Wv)_h,
  so a one-layer model must give LN1(e + e Wv Wo) exactly when the weights sum to one.
  """
  cfg = make_cfg(**{"span.mode": mode, "span.size": 16}, pers_mem=4, n_layers=1)
  rng = np.random.default_rng(70)
  p64 = ref.random_params(cfg, rng)
  tokens = rng.integers(cfg.vocab_size, size=(B, 8))
  caches = random_caches(rng, cfg, [cfg.span.size])
  _, _, aux = ref.forward(cfg, p64, tokens, caches, return_weights=True)
  for w in aux["weights"]:  # the reference itself
    np.testing.assert_allclose(w["context"].sum(-1) + w["persistent"].sum(-1), 1.0, atol=1e-4)

  attn = p64["layers_0"]["attn"]
  e = p64["in_emb"]["embedding"][0]
  v_h = (e @ attn["proj_val"]["kernel"]).reshape(cfg.n_heads, cfg.head_dim)
  attn["pers_val"] = np.repeat(v_h[:, None, :], cfg.pers_mem, axis=1) / np.sqrt(cfg.pers_mem)
  params = to_jax(p64)
  p64 = to_np(params)
  tokens = np.zeros((B, 8), np.int64)
  caches = (np.tile(p64["in_emb"]["embedding"][0], (B, cfg.span.size, 1)),)
  logp, _, _ = apply_fn(cfg)(params, jnp.asarray(tokens, jnp.int32), to_jax(caches))

  e = p64["in_emb"]["embedding"][0]
  attn, norm1 = p64["layers_0"]["attn"], p64["layers_0"]["norm1"]
  h1 = ref.layer_norm(e + e @ attn["proj_val"]["kernel"] @ attn["proj_out"]["kernel"],
                      norm1["scale"], norm1["bias"])
  expected = ref.log_softmax(h1 @ p64["out_emb"]["kernel"] + p64["out_emb"]["bias"])
  np.testing.assert_allclose(np.asarray(logp), np.broadcast_to(expected, logp.shape),
                             rtol=1e-5, atol=2e-5)
  e_logp, _, _ = ref.forward(cfg, p64, tokens, caches)
  np.testing.assert_allclose(e_logp, np.broadcast_to(expected, logp.shape), atol=1e-7)


@pytest.mark.slow
def test_dynamic_span_extremes():
  cfg_dyn = make_cfg(**{"span.mode": "dynamic", "span.size": 16})
  cfg_ad = make_cfg(**{"span.mode": "adaptive", "span.size": 16})
  cfg_fix = make_cfg(**{"span.mode": "fixed", "span.size": 16})
  rng = np.random.default_rng(80)
  p64 = ref.random_params(cfg_dyn, rng)
  tokens = jnp.asarray(rng.integers(cfg_dyn.vocab_size, size=(B, 8)), jnp.int32)
  caches = to_jax(random_caches(rng, cfg_dyn, [16] * cfg_dyn.n_layers))

  def variant(bias, with_ratio=None):
    p = jax.tree.map(lambda a: a, p64)
    for i in range(cfg_dyn.n_layers):
      attn = p[f"layers_{i}"]["attn"]
      attn["span_predictor"]["kernel"] = 0.05 * attn["span_predictor"]["kernel"]
      attn["span_predictor"]["bias"] = np.full((cfg_dyn.n_heads,), bias)
      if with_ratio is not None:
        del attn["span_predictor"]
        if with_ratio == "fixed":
          continue
        attn["span_ratio"] = np.full((cfg_dyn.n_heads,), with_ratio)
    return to_jax(p)

  lo, _, _ = apply_fn(cfg_dyn)(variant(-30.0), tokens, caches)
  ad, _, _ = apply_fn(cfg_ad)(variant(-30.0, with_ratio=0.0), tokens, caches)
  np.testing.assert_allclose(np.asarray(lo), np.asarray(ad), rtol=1e-5, atol=1e-5,
                             err_msg="bias -30 vs adaptive z'=0")
  hi, _, _ = apply_fn(cfg_dyn)(variant(30.0), tokens, caches)
  fx, _, _ = apply_fn(cfg_fix)(variant(30.0, with_ratio="fixed"), tokens, caches)
  np.testing.assert_allclose(np.asarray(hi), np.asarray(fx), rtol=1e-5, atol=1e-5,
                             err_msg="bias +30 vs fixed")
  assert not np.allclose(np.asarray(lo), np.asarray(hi), atol=1e-3)  # the extremes differ


# ----------------------------------------------------------------------------------------------
# 9. Bad configurations.


@pytest.mark.parametrize("kw,field", [
    (dict(d_model=16, n_heads=5), "n_heads"),
    ({"span.ramp": 0}, "span.ramp"),
    ({"span.size": 0}, "span.size"),
    (dict(dropout=-0.1), "dropout"),
    ({"span.mode": "sliding"}, "span.mode"),
])
def test_bad_config_raises(kw, field):
  with pytest.raises(ValueError, match=rf"config\.model\.{field}="):
    make_cfg(**kw)


# ----------------------------------------------------------------------------------- span planner


def _planner_walk(cfg, z, start=0, planner=None):
  """Feeds z' (steps, layers, heads) to a planner; checks every plan covers its step's spans."""
  planner = planner or planner_lib.SpanPlanner(cfg)
  changes = []
  for i in range(start, z.shape[0]):
    if planner.update(list(z[i]), i + 1):
      changes.append(i + 1)
    for lp, zl in zip(planner.plan.layers, z[i]):
      assert np.all(np.asarray(lp.head_windows(cfg.n_heads)) >= plan_lib.needed_tokens(cfg, zl)), i
  return planner, changes


def _noisy_growth(cfg, steps, seed=0):
  rng = np.random.default_rng(seed)
  z_end = rng.uniform(0, 0.5, (cfg.n_layers, cfg.n_heads)) * cfg.span.size
  t = np.arange(1, steps + 1)[:, None, None]
  walk = np.cumsum(rng.standard_normal((steps, cfg.n_layers, cfg.n_heads)) * 2, axis=0)
  walk -= np.linspace(0, 1, steps)[:, None, None] * walk[-1]  # a bridge: bounded noise
  z = z_end * (1 - np.exp(-t / rng.uniform(500, 3000, z_end.shape))) + walk
  return (np.clip(z, 0, cfg.span.size) / cfg.span.size).astype(np.float32)


def test_planner_always_covers_and_headroom_cuts_changes():
  base = build({"vocab_size": 8, "d_model": 16, "n_layers": 3, "n_heads": 4, "d_ff": 16,
                "span.size": 1024, "span.ramp": 16, "plan.shrink_patience": 300})
  z = _noisy_growth(base, 4000)
  _, tight = _planner_walk(replaced(base, **{"plan.growth": 1.0}), z)
  _, roomy = _planner_walk(replaced(base, **{"plan.growth": 1.5}), z)
  assert len(roomy) < len(tight) / 2, (len(roomy), len(tight))
  assert tight and roomy


def test_planner_shrinks_once_per_window_to_recent_need():
  cfg = build({"vocab_size": 8, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16,
               "span.size": 1024, "span.ramp": 16, "plan.shrink_patience": 10, "plan.growth": 1.5})
  planner = planner_lib.SpanPlanner(cfg)
  big = np.array([[0.5, 0.0]], np.float32)
  assert planner.update(list(big), 1)  # growth is immediate
  assert planner.plan.layers[0].head_windows(2)[0] >= 512
  small = np.array([[100 / 1024, 0.0]], np.float32)
  changed = [s for s in range(2, 40) if planner.update(list(small), s)]
  assert len(changed) == 1 and changed[0] == 12  # the window 2..12, then one shrink
  w0 = planner.plan.layers[0].head_windows(2)[0]
  assert 116 <= w0 <= 192  # need 116 (ceil(z) + R) with 1.5x headroom, on the 64-grid


def test_planner_state_round_trip_mid_window():
  cfg = build({"vocab_size": 8, "d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 16,
               "span.size": 512, "span.ramp": 16, "plan.shrink_patience": 50})
  z = _noisy_growth(cfg, 1200, seed=3)
  a, changes_a = _planner_walk(cfg, z)
  b, changes_b = _planner_walk(cfg, z[:600])
  restored = planner_lib.SpanPlanner(cfg)
  restored.load_state_dict(json.loads(json.dumps(b.state_dict())))
  c, changes_c = _planner_walk(cfg, z, start=600, planner=restored)
  assert changes_b + changes_c == changes_a
  assert c.plan == a.plan and c.state_dict() == a.state_dict()


# ----------------------------------------------------------------------------------- kv caches


def _grouped_case(cfg, rng, mode):
  """Random parameters and, for adaptive spans, a plan whose head groups are not contiguous."""
  params64 = ref.random_params(cfg, rng)
  plan = None
  if mode == "adaptive":
    params64["layers_0"]["attn"]["span_ratio"] = np.array([0.05, 0.3, 0.1, 0.6])
    params64["layers_1"]["attn"]["span_ratio"] = np.array([0.2, 0.02, 0.45, 0.1])
    plan = plan_lib.SpanPlan(layers=(
        plan_lib.LayerPlan(cache_len=24, groups=(((0, 2), 8), ((1,), 16), ((3,), 24))),
        plan_lib.LayerPlan(cache_len=24, groups=(((1, 3), 8), ((0,), 16), ((2,), 24)))))
  return to_jax(params64), plan


@pytest.mark.slow
@pytest.mark.parametrize("mode,n_pers", [("fixed", 0), ("adaptive", 0), ("dynamic", 0),
                                         ("adaptive", 3)])
def test_kv_cache_inference_equals_hidden_state_cache(mode, n_pers):
  """Streaming blocks with projected key/value caches gives the hidden-state caches' output
  (head groups with non-contiguous heads included); training refuses kv caches."""
  cfg = make_cfg(**{"span.mode": mode, "span.size": 32, "span.ramp": 4, "plan.granularity": 8,
                    "plan.margin": 0}, pers_mem=n_pers)
  rng = np.random.default_rng(50)
  params, plan = _grouped_case(cfg, rng, mode)
  plan_lib.check_plan(cfg, params, plan or plan_lib.full_plan(cfg))
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 40)), jnp.int32)
  hidden_model = SpanTransformer(cfg, plan)
  kv_model = SpanTransformer(cfg, plan, kv_cache=True)
  hc = caches_lib.init_caches(cfg, plan, B)
  kc = caches_lib.init_caches(cfg, plan, B, kv=True)
  assert kc[0].shape[-1] == 2 * cfg.d_model
  bounds = [0, 8, 16, 17, 25, 40]  # blocks of 8, 8, 1, 8, 15 tokens
  for a, b in zip(bounds[:-1], bounds[1:]):
    lh, hc, _ = hidden_model.apply({"params": params}, tokens[:, a:b], hc)
    lk, kc, _ = kv_model.apply({"params": params}, tokens[:, a:b], kc)
    np.testing.assert_allclose(np.asarray(lk), np.asarray(lh), rtol=1e-5, atol=1e-5,
                               err_msg=f"block {a}:{b}")
  with pytest.raises(ValueError, match="inference"):
    kv_model.apply({"params": params}, tokens[:, :8], kc, train=True)
  with pytest.raises(ValueError, match="kv_cache=True"):
    kv_model.apply({"params": params}, tokens[:, :8], hc)


@pytest.mark.slow
@pytest.mark.parametrize("mode,n_pers", [("fixed", 0), ("adaptive", 0), ("dynamic", 0),
                                         ("adaptive", 3), ("fixed", 3)])
def test_ring_decoding_equals_shifted_kv_caches(mode, n_pers):
  """One token at a time over ring caches (one slot written per token) gives the shifted
  key/value caches' log-probabilities, past a full turn of the ring; and the final rings are
  the shifted caches rolled (head groups with non-contiguous heads included)."""
  cfg = make_cfg(**{"span.mode": mode, "span.size": 32, "span.ramp": 4, "plan.granularity": 8,
                    "plan.margin": 0}, pers_mem=n_pers)
  rng = np.random.default_rng(51)
  params, plan = _grouped_case(cfg, rng, mode)
  model = SpanTransformer(cfg, plan, kv_cache=True)
  tokens = jnp.asarray(rng.integers(cfg.vocab_size, size=(B, 75)), jnp.int32)
  prompt = 5
  _, shifted, _ = model.apply({"params": params}, tokens[:, :prompt],
                              caches_lib.init_caches(cfg, plan, B, kv=True))
  ring = caches_lib.to_ring(shifted, prompt, cfg.n_heads)
  step = jax.jit(lambda p, t, c, pos: model.apply({"params": p}, t, c, ring_pos=pos))
  plain = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c))
  for pos in range(prompt, tokens.shape[1]):  # 70 tokens: past two turns of a 32-slot ring
    tok = tokens[:, pos:pos + 1]
    want, shifted, _ = plain(params, tok, shifted)
    got, ring, _ = step(params, tok, ring, jnp.int32(pos))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=f"token {pos}")
  for r, s_ in zip(caches_lib.from_ring(ring, tokens.shape[1]), shifted):  # (deeper layers' keys
    np.testing.assert_allclose(np.asarray(r), np.asarray(s_), rtol=1e-5, atol=1e-5)  # round)
  with pytest.raises(ValueError, match="one token"):
    model.apply({"params": params}, tokens[:, :2], ring, ring_pos=jnp.int32(3))


def test_span_ratios_are_read_and_set_through_one_path():
  """plan.span_ratio_leaves / span_ratios / with_span_ratios: the one place that knows where
  the z' parameters live; setting them copies down to the layers and leaves the rest shared."""
  params = {f"layers_{i}": {"attn": {"span_ratio": np.full(2, 0.1 * i), "key_pe": np.zeros(1)},
                            "ff": {"w": np.ones(1)}} for i in range(3)}
  params["in_emb"] = {"embedding": np.ones(2)}
  new = plan_lib.with_span_ratios(params, [np.full(2, 0.5 + i) for i in range(3)])
  assert [z.tolist() for z in plan_lib.span_ratios(new)] == [[0.5, 0.5], [1.5, 1.5], [2.5, 2.5]]
  assert [z.tolist() for z in plan_lib.span_ratios(params)] == [[0.0, 0.0], [0.1, 0.1],
                                                                [0.2, 0.2]]  # untouched
  assert new["layers_1"]["ff"] is params["layers_1"]["ff"] and new["in_emb"] is params["in_emb"]
  assert plan_lib.span_ratio_leaves(new)[2] is new["layers_2"]["attn"]["span_ratio"]
