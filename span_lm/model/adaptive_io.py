"""Adaptive input (Baevski & Auli, 2019) and adaptive softmax (Grave et al., 2017), tied or not.

The vocabulary, sorted by frequency, is cut at `cutoffs` into clusters 0..K; cluster i has
n_i tokens embedded in d_i = D // div**i dimensions and projected to and from D, so rare words
cost little. Parameterised as the reference (adaptive-span adaptive_io.py, itself from
transformer-XL) so its checkpoints map one to one (reference names in brackets; torch stores
Linear weights as (out, in)):

  in_emb.emb_i (n_i, d_i)         [in_emb.emb_layers.i.weight]
  in_emb.proj_i (d_i, D)          [in_emb.emb_projs.i, transposed]
  out_emb.cluster_kernel (D, K)   [out_emb.cluster_proj.weight, transposed]
  out_emb.cluster_bias (K,)       [out_emb.cluster_proj.bias]
  out_emb.bias_i (n_i,)           [out_emb.out_layers.i.bias]
  out_emb.emb_i, out_emb.proj_i   [out_emb.out_layers.i.weight, out_emb.out_projs.i^T]; untied only

Input: e(t) = sqrt(D) * emb_i[t - c_i] @ proj_i. Output: the head softmax is over the n_0 frequent
tokens plus one logit per tail cluster, both read from h @ proj_0^T; token t of tail cluster i
has log p = head[c_0 + K - i] + log_softmax(h @ proj_i^T @ emb_i^T + bias_i)[t - c_i] (the
reference gives tail cluster i the head column -i). Tied: the output reuses emb_i and proj_i.
The output here is the log-probability of every token, (B, M, V), which the loss indexes.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from span_lm.model.config import ModelConfig


def torch_linear_init(in_axis: int = -2, out_axis: int = -1):
  """torch.nn.Linear's weight init U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in along in_axis."""
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", in_axis=in_axis,
                                          out_axis=out_axis)


def uniform_bias_init(fan_in: int):
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def cluster_bounds(cfg: ModelConfig) -> list[tuple[int, int, int]]:
  """(start, end, dim) of each cluster; refuses cutoffs that do not fit the vocabulary."""
  edges = [0, *cfg.adapt_io.cutoffs, cfg.vocab_size]
  if any(b <= a for a, b in zip(edges, edges[1:])):
    raise ValueError(f"config.model.adapt_io.cutoffs={tuple(cfg.adapt_io.cutoffs)}: must be "
                     f"increasing, > 0 and < the vocabulary size {cfg.vocab_size}")
  return [(a, b, cfg.d_model // cfg.adapt_io.div ** i)
          for i, (a, b) in enumerate(zip(edges, edges[1:]))]


def _add_bias(x, b):
  return x + b.reshape((1,) * (x.ndim - 1) + b.shape)


def _tables(module: nn.Module, cfg: ModelConfig, emb_init):
  """The per-cluster (emb_i, proj_i) parameters of `module`."""
  return [(module.param(f"emb_{i}", emb_init, (b - a, d)),
           module.param(f"proj_{i}", torch_linear_init(), (d, cfg.d_model)))
          for i, (a, b, d) in enumerate(cluster_bounds(cfg))]


class AdaptiveInput(nn.Module):
  """tokens (B, M) -> (embeddings (B, M, D), the cluster tables for a tied output)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    tables = _tables(self, cfg, nn.initializers.normal(1.0))
    out = jnp.zeros(tokens.shape + (cfg.d_model,), jnp.float32)  # as nn.Embed: float32 out
    for (a, b, _), (emb, proj) in zip(cluster_bounds(cfg), tables):
      inside = (tokens >= a) & (tokens < b)
      e = jnp.take(emb, jnp.clip(tokens - a, 0, b - a - 1), axis=0).astype(dt) @ proj.astype(dt)
      out = jnp.where(inside[..., None], e.astype(jnp.float32), out)
    return out * math.sqrt(cfg.d_model), tables


class AdaptiveLogSoftmax(nn.Module):
  """h (B, M, D) -> log-probabilities (B, M, V) in float32; `tables` given when tied."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, h, tables=None):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    bounds = cluster_bounds(cfg)
    n_tail = len(bounds) - 1
    if tables is None:  # untied: weights laid out as the reference's out_layers (rows = tokens)
      tables = _tables(self, cfg, torch_linear_init(in_axis=-1, out_axis=-2))
    biases = [self.param(f"bias_{i}", uniform_bias_init(d), (b - a,))
              for i, (a, b, d) in enumerate(bounds)]
    h = h.astype(dt)

    def logits(i):  # (cluster i's logits, h projected to its dimension)
      emb, proj = tables[i]
      ph = h @ proj.T.astype(dt)
      return _add_bias((ph @ emb.T.astype(dt)).astype(jnp.float32), biases[i]), ph

    head, ph0 = logits(0)
    if n_tail:
      w = self.param("cluster_kernel", torch_linear_init(), (bounds[0][2], n_tail))
      c = self.param("cluster_bias", uniform_bias_init(bounds[0][2]), (n_tail,))
      head = jnp.concatenate([head, _add_bias((ph0 @ w.astype(dt)).astype(jnp.float32), c)],
                             axis=-1)
    head = jax.nn.log_softmax(head, axis=-1)
    n0 = bounds[0][1]
    parts = [head[..., :n0]]
    for i in range(1, n_tail + 1):
      parts.append(head[..., n0 + n_tail - i, None] + jax.nn.log_softmax(logits(i)[0], axis=-1))
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
