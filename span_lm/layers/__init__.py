"""Adaptive attention span as a drop-in Flax layer (docs/layer.md).

  AdaptiveSpanAttention  the Linen module, where nn.MultiHeadDotProductAttention stands
  span_attention         its functional core (nn.dot_product_attention's layout)
  span_loss              the sown span penalties of a forward pass, summed: add to the loss
  learned_spans          every layer's spans in tokens, from the parameters
  clamp_spans            the reference's post-step clamp of every z' to [0, 1]
"""
import jax
import jax.numpy as jnp

from span_lm.layers.attention import AdaptiveSpanAttention
from span_lm.layers.core import span_attention
from span_lm.layers.core import span_tokens

SPAN_PARAM = "span_ratio"


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


def span_loss(intermediates):
  """The sum of every 'span_loss' an AdaptiveSpanAttention sowed (nested, scanned or not):
  `model.apply(v, x, mutable=['intermediates'])[1]['intermediates']`, or that dict's parent."""
  total = jnp.zeros((), jnp.float32)
  for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
    if any(_key(p) == "span_loss" for p in path):
      total = total + jnp.sum(leaf)
  return total


def learned_spans(params, max_span: int) -> dict:
  """{'path/to/layer': spans in tokens (heads,) or (layers, heads) when scanned}: every
  span_ratio in `params`, times max_span (the layers' common max_span), clipped as applied."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if path and _key(path[-1]) == SPAN_PARAM:
      out["/".join(_key(p) for p in path[:-1])] = span_tokens(leaf, max_span)
  return out


def clamp_spans(params):
  """Every span_ratio clipped to [0, 1], as the reference does after each optimizer step (the
  layer clips in its forward pass too; this keeps z' from drifting past an end)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.clip(x, 0.0, 1.0) if _key(path[-1]) == SPAN_PARAM else x, params)


__all__ = ["AdaptiveSpanAttention", "span_attention", "span_loss", "learned_spans",
           "clamp_spans", "span_tokens"]
