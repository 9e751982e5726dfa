"""model.doc_boundary: document boundaries in the stream (concatenated documents).

A query attends only to keys of its own document; the boundary token is the first token of the
document it starts (its own query sees no key: positions strictly before it only); the document
ids are derived from the tokens inside the model and carried in the caches (model/caches.py), so
blocks through the caches equal one long block. Off (-1, the default) changes nothing.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import reference_numpy as ref
from model_helpers import make_cfg, to_jax
from span_lm import kernels
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.transformer import SpanTransformer

B = 2
SEP = 0  # the boundary token of these tests; the other tokens are drawn from 1..V-1


def setup(seed=0, **kw):
  kw = dict({"span.mode": "adaptive", "span.size": 16, "span.ramp": 4, "doc_boundary": SEP}, **kw)
  cfg = make_cfg(**kw)
  rng = np.random.default_rng(seed)
  params = to_jax(ref.random_params(cfg, rng, span_ratio_range=(0.3, 0.9)))
  return cfg, params, rng


def apply_fn(cfg, plan=None):
  model = SpanTransformer(cfg, plan=plan)
  return jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, train=False)[:2])


def run_blocks(cfg, params, tokens, m, plan=None):
  f = apply_fn(cfg, plan)
  caches = caches_lib.init_caches(cfg, plan, tokens.shape[0])
  outs = []
  for k in range(0, tokens.shape[1], m):
    logp, caches = f(params, jnp.asarray(tokens[:, k:k + m], jnp.int32), caches)
    outs.append(np.asarray(logp))
  return np.concatenate(outs, 1), caches


def doc_tokens(rng, n, starts):
  """(B, n) tokens without boundaries, then a boundary token at each position of `starts`."""
  t = rng.integers(1, 11, size=(B, n))
  t[:, list(starts)] = SEP
  return t


def test_off_by_default_changes_nothing():
  cfg = make_cfg()
  assert cfg.doc_boundary == -1 and not cfg.attn_spec.segmented
  assert len(caches_lib.init_caches(cfg, None, B)) == cfg.n_layers
  on = make_cfg(doc_boundary=3)
  assert on.attn_spec.segmented
  ids = caches_lib.init_caches(on, None, B)[-1]
  assert ids.shape == (B, on.span.size) and ids.dtype == jnp.int32 and not ids.any()


@pytest.mark.parametrize("kw,msg", [(dict(doc_boundary=-2), "doc_boundary"),
                                    (dict(doc_boundary=11), "doc_boundary"),
                                    (dict(doc_boundary=True), "doc_boundary")])
def test_bad_doc_boundary_raises(kw, msg):
  with pytest.raises(ValueError, match=msg):
    make_cfg(**kw)


def test_block_stream_equals_one_block():
  """Boundaries mid-block, at a block start and at a block end; final caches (doc ids too)."""
  cfg, params, rng = setup(1)
  m, k = 8, 5
  tokens = doc_tokens(rng, m * k, [3, 8, 15, 26, 27])
  tokens[1, 12] = SEP  # the rows differ
  logp, caches = run_blocks(cfg, params, tokens, m)
  one, one_caches = run_blocks(cfg, params, tokens, m * k)
  np.testing.assert_allclose(logp, one, rtol=1e-5, atol=2e-5)
  for a, b in zip(caches[:-1], one_caches[:-1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(caches[-1]), np.asarray(one_caches[-1]))
  # the newest document (from 27 on) is 1, everything before it 0
  want = (np.arange(m * k)[None, -cfg.span.size:] >= 27).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(caches[-1])[0], want[0])


@pytest.mark.parametrize("m", [8, 24])
def test_document_two_ignores_document_one(m):
  """Perturbing document 1 leaves document 2's log-probabilities as they were, also where
  document 2 continues into the next block (through the caches: m=8); it does change
  document 1's (the test can fail)."""
  cfg, params, rng = setup(2)
  n, start = 24, 5
  tokens = doc_tokens(rng, n, [start])
  other = tokens.copy()
  other[:, :start] = rng.integers(1, 11, size=(B, start))
  a, _ = run_blocks(cfg, params, tokens, m)
  b, _ = run_blocks(cfg, params, other, m)
  np.testing.assert_allclose(a[:, start:], b[:, start:], rtol=1e-5, atol=1e-5)
  assert np.abs(a[:, 1:start] - b[:, 1:start]).max() > 1e-3


def test_document_alone_equals_document_in_stream():
  """Document 2 run alone from fresh caches (nothing before it attended) gives its numbers in
  the stream: relative positions and spans are the same, and its first token (the boundary)
  sees no key in either."""
  cfg, params, rng = setup(3)
  n, start, m = 32, 11, 8
  tokens = doc_tokens(rng, n, [start])
  stream, _ = run_blocks(cfg, params, tokens, m)
  alone, _ = run_blocks(cfg, params, tokens[:, start:], 7)
  np.testing.assert_allclose(stream[:, start:], alone, rtol=1e-5, atol=2e-5)


def test_cached_positions_of_id_zero_are_not_attended():
  """Cached states whose document id is 0 (the zero states a stream starts with, a zeroed cache,
  older documents) are not attended whatever they hold; the same states with id 1 are."""
  cfg, params, rng = setup(4)
  tokens = jnp.asarray(doc_tokens(rng, 8, []), jnp.int32)
  f = apply_fn(cfg)
  zeros = caches_lib.init_caches(cfg, None, B)
  noise = tuple(jnp.asarray(rng.normal(size=c.shape), jnp.float32) for c in zeros[:-1])
  a, _ = f(params, tokens, zeros)
  b, _ = f(params, tokens, noise + (zeros[-1],))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  c, _ = f(params, tokens, noise + (jnp.ones_like(zeros[-1]),))
  assert np.abs(np.asarray(c) - np.asarray(a)).max() > 1e-3


def test_gradients_finite_with_dropout_and_boundary_rows():
  cfg, params, rng = setup(5, dropout=0.2)
  model = SpanTransformer(cfg)
  tokens = jnp.asarray(doc_tokens(rng, 16, [0, 1, 7, 15]), jnp.int32)  # back-to-back boundaries
  caches = caches_lib.init_caches(cfg, None, B)

  def loss(p):
    logp, _, aux = model.apply({"params": p}, tokens, caches, train=True,
                               rngs={"dropout": jax.random.key(0)})
    return -logp.mean() + aux["span_loss"]

  grads = jax.grad(loss)(params)
  leaves = jax.tree.leaves(grads)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_resize_caches_pads_doc_ids_with_zero_and_plan_stream():
  cfg, params, rng = setup(6, **{"plan.granularity": 8, "plan.margin": 0})
  plan = plan_lib.plan_from_params(cfg, params)
  tokens = doc_tokens(rng, 24, [4, 13])
  full, _ = run_blocks(cfg, params, tokens, 8)
  planned, caches = run_blocks(cfg, params, tokens, 8, plan)
  np.testing.assert_allclose(planned, full, rtol=1e-5, atol=2e-5)
  grown = caches_lib.resize_caches(caches, cfg, None)
  assert grown[-1].shape == (B, cfg.span.size)
  n = caches[-1].shape[1]
  np.testing.assert_array_equal(np.asarray(grown[-1])[:, -n:], np.asarray(caches[-1]))
  assert not np.asarray(grown[-1])[:, :cfg.span.size - n].any()


def test_kv_cache_and_ring_refusal():
  """Evaluation's key/value caches carry the doc ids as well; the ring decode refuses."""
  cfg, params, rng = setup(7)
  tokens = doc_tokens(rng, 16, [5, 12])
  hidden, _ = run_blocks(cfg, params, tokens, 8)
  model = SpanTransformer(cfg, kv_cache=True)
  caches = caches_lib.init_caches(cfg, None, B, kv=True)
  outs = []
  for k in range(0, 16, 8):
    logp, caches, _ = model.apply({"params": params}, jnp.asarray(tokens[:, k:k + 8]), caches)
    outs.append(np.asarray(logp))
  np.testing.assert_allclose(np.concatenate(outs, 1), hidden, rtol=1e-5, atol=2e-5)
  rings = caches_lib.to_ring(caches[:-1], 16, cfg.n_heads) + (caches[-1],)
  with pytest.raises(ValueError, match="doc_boundary"):
    model.apply({"params": params}, jnp.asarray(tokens[:, :1]), rings, ring_pos=16)


def test_sampling_with_doc_boundary_runs():
  from span_lm.tools import sample
  cfg, params, rng = setup(8)
  prompt = jnp.asarray(doc_tokens(rng, 6, [2]), jnp.int32)
  toks = sample._generate(params, prompt, jax.random.key(0), 1.0, 0, cfg=cfg, plan=None,
                          length=5, greedy=True)
  assert toks.shape == (B, 5)
  # greedy decoding equals re-scoring the whole sequence in one block
  seq = np.concatenate([np.asarray(prompt), np.asarray(toks)], 1)
  logp, _ = run_blocks(cfg, params, seq, seq.shape[1])
  np.testing.assert_array_equal(logp[:, 5:-1].argmax(-1), np.asarray(toks))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "pallas_interpret", "pallas_tpu_interpret"])
def test_implementations_agree_with_segments(impl):
  """The fused kernels (interpreted) against the CPU path, outputs and gradients, with
  documents crossing a block boundary."""
  kw = {"span.size": 32, "d_model": 32, "n_heads": 2, "attention.block": 16}
  cfg, params, rng = setup(9, **kw)
  other = make_cfg(**kw, **{"span.mode": "adaptive", "span.ramp": 4, "attention.impl": impl},
                   doc_boundary=SEP)
  assert kernels.choose(other.attn_spec, 16, 32) == impl
  tokens = doc_tokens(rng, 32, [3, 20, 21])
  a, ca = run_blocks(cfg, params, tokens, 16)
  b, cb = run_blocks(other, params, tokens, 16)
  np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4)
  caches = caches_lib.init_caches(cfg, None, B)
  t = jnp.asarray(tokens[:, :16], jnp.int32)
  grad = lambda c: jax.grad(lambda p: SpanTransformer(c).apply({"params": p}, t, caches)[0].sum())(
      params)
  for x, y in zip(jax.tree.leaves(grad(other)), jax.tree.leaves(grad(cfg))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-3, atol=2e-3)
