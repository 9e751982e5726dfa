"""Spans learn the distance a task needs: on tokens whose only dependency is 16 positions away
(both sides for an encoder, back for a decoder), the longest z + R (span z plus ramp R: the mask
is non-zero below it; the head's window is ceil(z) + R) converges near 16 from a start at 32,
and spans no task needs shrink.

  pytest tests/layers/test_layers_learn.py -s   # prints the spans as they learn
"""
import time

import numpy as np
import pytest

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from span_lm import layers

V, D, H, DIST, R = 4, 32, 2, 16, 4


class Net(nn.Module):
  """Two pre-LN Transformer layers of AdaptiveSpanAttention: no absolute positions at all."""
  causal: bool
  max_span: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D)(tokens)
    for i in range(2):
      x = x + layers.AdaptiveSpanAttention(
          num_heads=H, max_span=self.max_span, ramp=R, causal=self.causal,
          span_init=32 / self.max_span, span_loss_coef=1e-3, name=f"attn{i}")(nn.LayerNorm()(x))
      x = x + nn.Dense(D)(nn.relu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
    return nn.Dense(V if self.causal else V * V)(nn.LayerNorm()(x))


def batch(rng, causal, b, n):
  """Encoder: the target at i is the pair (x[i-16], x[i+16]); decoder: x[i-16]."""
  x = rng.integers(0, V, (b, n))
  y, w = np.zeros_like(x), np.zeros((b, n), np.float32)
  if causal:
    y[:, DIST:], w[:, DIST:] = x[:, :-DIST], 1
  else:
    y[:, DIST:-DIST], w[:, DIST:-DIST] = x[:, :-2 * DIST] * V + x[:, 2 * DIST:], 1
  return x, y, w


def train(causal, n, max_span, steps=400, batch_size=32, seed=0):
  net = Net(causal, max_span)
  rng = np.random.default_rng(seed)
  params = net.init(jax.random.key(seed), batch(rng, causal, batch_size, n)[0])["params"]
  # Adam moves every z' by ~lr per step whatever its gradient: the spans get a smaller step
  labels = jax.tree_util.tree_map_with_path(
      lambda path, _: "span" if "span_ratio" in jax.tree_util.keystr(path) else "rest", params)
  opt = optax.multi_transform({"span": optax.adam(2e-3), "rest": optax.adam(3e-3)}, labels)
  state = opt.init(params)

  def loss(p, x, y, w):
    logits, inter = net.apply({"params": p}, x, mutable=["intermediates"])
    ce = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * w) / jnp.sum(w)
    return ce + layers.span_loss(inter), ce

  @jax.jit
  def step(p, state, x, y, w):
    (_, ce), g = jax.value_and_grad(loss, has_aux=True)(p, x, y, w)
    updates, state = opt.update(g, state, p)
    return layers.clamp_spans(optax.apply_updates(p, updates)), state, ce

  t0 = time.time()
  for i in range(steps):
    params, state, ce = step(params, state, *batch(rng, causal, batch_size, n))
    if i % 100 == 0 or i == steps - 1:
      spans = {k: np.round(np.asarray(v), 1).tolist()
               for k, v in layers.learned_spans(params, max_span).items()}
      print(f"{'decoder' if causal else 'encoder'} step {i}: loss {float(ce):.4f} spans z "
            f"{spans} ({time.time() - t0:.0f} s)")
  return float(ce), np.stack(list(layers.learned_spans(params, max_span).values()))


@pytest.mark.slow
@pytest.mark.parametrize("causal,n,max_span", [(False, 64, 64), (True, 64, 32)])
def test_spans_converge_near_the_distance_the_task_needs(causal, n, max_span):
  """Encoder: bidirectional, max_span 64 at n = 64. Decoder: causal, max_span 32 at n = 64. Both
  run the door."""
  ce, z = train(causal, n, max_span)
  reach = z + R  # LxH
  assert ce < 0.05, ce  # solved: the spans reach distance 16
  assert 14 <= reach.max() <= 20, reach
  assert np.all(reach <= 22), reach
  assert reach.min() < 12, reach  # a head no task needs shrinks
