"""Adaptive input and adaptive softmax (span_lm/model/adaptive_io.py) against numpy.

The numpy side is written from the reference's equations in the reference's own layout
(adaptive-span adaptive_io.py: torch Linear weights are (out, in); the embedding projection
P_i (D, d_i) maps a cluster embedding e to e P_i^T and a hidden state h to h P_i; tail cluster
i reads head column -i), so the parameter map of the importer is checked on the way.
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_numpy as ref
from model_helpers import build, replaced
from span_lm.model import adaptive_io
from span_lm.model import caches as caches_lib
from span_lm.model.transformer import SpanTransformer
from span_lm.tools import reference_checkpoint as rc

V, D = 23, 16


def make_cfg(**kw):
  base = {"vocab_size": V, "d_model": D, "n_layers": 1, "n_heads": 2, "d_ff": 8, "span.size": 8,
          "span.ramp": 2, "span.mode": "fixed", "adapt_io.enabled": True, "adapt_io.cutoffs": (5,
          12), "adapt_io.div": 2, "adapt_io.tied": True}
  return build(base, **kw)


def init(module, *args, seed=0):
  """Random parameters of the module's shapes (eval_shape: compiling init is slow on CPU)."""
  shapes = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a)["params"], *args)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(0.5 * rng.normal(size=x.shape), jnp.float32), shapes)


def run(module, params, *args):
  return jax.jit(lambda p, *a: module.apply({"params": p}, *a))(params, *args)


def numpy_adaptive_logp(sd, cfg, h):
  """Reference adaptive log-softmax (ProjectedAdaptiveLogSoftmax.forward, for every token)."""
  edges = [0, *cfg.adapt_io.cutoffs, cfg.vocab_size]
  n_tail = len(edges) - 2
  w0 = np.concatenate([sd["out_emb.out_layers.0.weight"], sd["out_emb.cluster_proj.weight"]])
  b0 = np.concatenate([sd["out_emb.out_layers.0.bias"], sd["out_emb.cluster_proj.bias"]])
  head = ref.log_softmax(h @ sd["out_emb.out_projs.0"] @ w0.T + b0)
  out = [head[..., :edges[1]]]
  for i in range(1, n_tail + 1):
    tail = h @ sd[f"out_emb.out_projs.{i}"] @ sd[f"out_emb.out_layers.{i}.weight"].T
    out.append(head[..., -i, None] + ref.log_softmax(tail + sd[f"out_emb.out_layers.{i}.bias"]))
  return np.concatenate(out, axis=-1)


def numpy_embedding_table(sd, cfg):
  """AdaptiveEmbedding as a dense (V, D) table: row t = sqrt(D) * emb_i[t - c_i] P_i^T."""
  n = len(cfg.adapt_io.cutoffs) + 1
  return np.concatenate([sd[f"in_emb.emb_layers.{i}.weight"] @ sd[f"in_emb.emb_projs.{i}"].T
                         for i in range(n)]) * np.sqrt(cfg.d_model)


def random_reference_io(cfg, rng):
  """The reference's in_emb/out_emb tensors (tied: out_layers/out_projs repeat in_emb's)."""
  edges = [0, *cfg.adapt_io.cutoffs, cfg.vocab_size]
  sd = collections.OrderedDict()
  dims = [cfg.d_model // cfg.adapt_io.div ** i for i in range(len(edges) - 1)]
  for i, d in enumerate(dims):
    sd[f"in_emb.emb_layers.{i}.weight"] = rng.normal(size=(edges[i + 1] - edges[i], d))
  for i, d in enumerate(dims):
    sd[f"in_emb.emb_projs.{i}"] = rng.normal(size=(cfg.d_model, d)) / np.sqrt(d)
  sd["out_emb.cluster_proj.weight"] = rng.normal(size=(len(dims) - 1, cfg.d_model))
  sd["out_emb.cluster_proj.bias"] = rng.normal(size=(len(dims) - 1,))
  for i, d in enumerate(dims):
    sd[f"out_emb.out_layers.{i}.weight"] = (sd[f"in_emb.emb_layers.{i}.weight"] if cfg.adapt_io.tied
                                            else rng.normal(size=(edges[i + 1] - edges[i], d)))
    sd[f"out_emb.out_layers.{i}.bias"] = rng.normal(size=(edges[i + 1] - edges[i],))
  for i, d in enumerate(dims):
    sd[f"out_emb.out_projs.{i}"] = (sd[f"in_emb.emb_projs.{i}"] if cfg.adapt_io.tied
                                    else rng.normal(size=(cfg.d_model, d)) / np.sqrt(d))
  return sd


@pytest.mark.parametrize("tied", [True, False])
def test_log_probs_normalised_over_the_vocabulary(tied):
  cfg = make_cfg(**{"adapt_io.tied": tied, "adapt_io.cutoffs": (4, 9, 15), "adapt_io.div": 2})
  h = jax.random.normal(jax.random.key(1), (2, 3, D))
  tables = None
  if tied:
    inp, tokens = adaptive_io.AdaptiveInput(cfg), jnp.zeros((1, 1), jnp.int32)
    _, tables = run(inp, init(inp, tokens), tokens)
  module = adaptive_io.AdaptiveLogSoftmax(cfg)
  logp = run(module, init(module, h, tables), h, tables)
  assert logp.shape == (2, 3, V)
  np.testing.assert_allclose(np.exp(np.asarray(logp, np.float64)).sum(-1), 1.0, atol=1e-5)


def test_one_cluster_is_a_full_softmax_and_a_plain_embedding():
  cfg = make_cfg(**{"adapt_io.cutoffs": (), "adapt_io.tied": False})
  tokens = jnp.asarray([[0, 7, 22, 3]])
  inp = adaptive_io.AdaptiveInput(cfg)
  p_in = init(inp, tokens)
  emb, _ = run(inp, p_in, tokens)
  table = p_in["emb_0"] @ p_in["proj_0"] * np.sqrt(D)
  np.testing.assert_allclose(emb, table[tokens], rtol=1e-5, atol=1e-5)

  h = jax.random.normal(jax.random.key(2), (1, 4, D))
  out = adaptive_io.AdaptiveLogSoftmax(cfg)
  p = init(out, h)
  assert set(p) == {"emb_0", "proj_0", "bias_0"}  # no cluster logits with one cluster
  logits = h @ (p["emb_0"] @ p["proj_0"]).T + p["bias_0"][None, None]
  np.testing.assert_allclose(run(out, p, h), jax.nn.log_softmax(logits),
                             rtol=1e-5, atol=1e-5)


def test_tied_weights_are_shared():
  cfg = make_cfg()
  model = SpanTransformer(cfg)
  tokens = jnp.asarray([[0, 1, 2, 3]])  # head tokens only: clusters 1, 2 are read by the output
  caches = caches_lib.init_caches(cfg, None, 1)
  params = init(model, tokens, caches)
  assert set(params["out_emb"]) == {"bias_0", "bias_1", "bias_2", "cluster_kernel", "cluster_bias"}
  untied = SpanTransformer(make_cfg(**{"adapt_io.tied": False}))
  untied = jax.eval_shape(lambda: untied.init(jax.random.key(0), tokens, caches))
  assert {"emb_2", "proj_2"} <= set(untied["params"]["out_emb"])

  def loss(p):
    logp, _, _ = model.apply({"params": p}, tokens, caches)
    return -logp[..., 20].sum()  # a token of the last cluster, never an input here

  g = jax.jit(jax.grad(loss))(params)
  assert np.abs(np.asarray(g["in_emb"]["emb_2"])).max() > 0  # the output trains the input table
  assert np.abs(np.asarray(g["in_emb"]["proj_2"])).max() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_model_matches_reference_equations_after_import(tied):
  """A reference wiki103-style state_dict imports; the model's log-probs equal numpy's."""
  cfg = make_cfg(**{"adapt_io.tied": tied})
  rng = np.random.default_rng(0)
  body = ref.random_params(replaced(cfg, **{"adapt_io.enabled": False}), rng)
  sd = random_reference_io(cfg, rng)
  sd.update((k, v) for k, v in rc.to_reference(body, replaced(cfg, **{"adapt_io.enabled": False}),
                                                prefix="").items()
            if not k.startswith(("in_emb", "out_emb")))
  sd = collections.OrderedDict(
      (e.key, np.asarray(sd[e.key], np.float32)) for e in rc.reference_entries(cfg)
      if e.key in sd)
  assert rc.infer_model(sd)["adapt_io.tied"] == tied
  rc.check_fits(sd, cfg)
  params = rc.to_span_lm(sd, cfg)

  tokens = rng.integers(V, size=(2, 6))
  caches = tuple(rng.normal(size=(2, cfg.span.size, D)) for _ in range(cfg.n_layers))
  logp, _, _ = run(SpanTransformer(cfg), params, jnp.asarray(tokens),
                   tuple(jnp.asarray(c, jnp.float32) for c in caches))

  # The numpy body with a dense input table and an output that exposes the last hidden state:
  # logits [h, 0] give log_softmax = [h - lse, -lse], so h = first D columns - last column.
  sd64 = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  dense = dict(body, in_emb={"embedding": numpy_embedding_table(sd64, cfg)},
               out_emb={"kernel": np.eye(D, D + 1), "bias": np.zeros(D + 1)})
  out, _, _ = ref.forward(replaced(cfg, **{"adapt_io.enabled": False}, vocab_size=D + 1), dense,
                                           tokens,
                          caches)
  h = out[..., :D] - out[..., D:]
  want = numpy_adaptive_logp(sd64, cfg, h)
  np.testing.assert_allclose(np.exp(want).sum(-1), 1.0, atol=1e-9)
  np.testing.assert_allclose(np.asarray(logp, np.float64), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_reference_order_is_torchs(tied):
  """torch modules registered as the reference's AdaptiveEmbedding / ProjectedAdaptiveLogSoftmax
  (and tied as build_adaptive_io ties them): state_dict and parameters() orders are span_lm's."""
  torch = pytest.importorskip("torch")
  nn = torch.nn
  cfg = make_cfg(**{"adapt_io.tied": tied})
  edges = [0, *cfg.adapt_io.cutoffs, V]
  dims = [D // cfg.adapt_io.div ** i for i in range(len(edges) - 1)]

  class In(nn.Module):
    def __init__(self):
      super().__init__()
      self.emb_layers, self.emb_projs = nn.ModuleList(), nn.ParameterList()
      for i, d in enumerate(dims):
        self.emb_layers.append(nn.Embedding(edges[i + 1] - edges[i], d))
        self.emb_projs.append(nn.Linear(d, D).weight)

  class Out(nn.Module):
    def __init__(self):
      super().__init__()
      self.cluster_proj = nn.Linear(D, len(dims) - 1)
      self.out_layers, self.out_projs = nn.ModuleList(), nn.ParameterList()
      for i, d in enumerate(dims):
        self.out_projs.append(nn.Linear(d, D).weight)
        self.out_layers.append(nn.Linear(d, edges[i + 1] - edges[i]))

  class Seq(nn.Module):
    def __init__(self):
      super().__init__()
      self.in_emb, self.out_emb = In(), Out()
      if tied:
        for i in range(len(dims)):
          self.out_emb.out_layers[i].weight = self.in_emb.emb_layers[i].weight
          self.out_emb.out_projs[i] = self.in_emb.emb_projs[i]
      self.key_pe = nn.Parameter(torch.zeros(1, cfg.head_dim, cfg.span.size))

  m = Seq()
  entries = [e for e in rc.reference_entries(cfg) if not e.key.startswith("layers.")]
  assert list(m.state_dict()) == [e.key for e in entries]
  assert [n for n, _ in m.named_parameters()] == [e.key for e in entries if e.is_param]
