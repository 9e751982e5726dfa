"""Adaptive attention span as a drop-in Flax layer (docs/layer.md).

  AdaptiveSpanAttention  the Linen module, where nn.MultiHeadDotProductAttention stands
  nnx.AdaptiveSpanAttention  the NNX module, where nnx.MultiHeadAttention stands (same weights)
  span_attention         its functional core (nn.dot_product_attention's layout)
  span_loss              the sown span penalties of a forward pass, summed: add to the loss
  learned_spans          every layer's spans z in tokens (back, and ahead where learned apart)
  clamp_spans            the reference's post-step clamp of every z' to [0, 1]
  decode_window          the cached keys a decoding call must read for learned spans
  save_safetensors       a parameter tree to a safetensors file (names: layers.3.attn.query.kernel)
  load_safetensors       and back, checked before it is read (span_lm/layers/safetensors_io.py)

Words: a head's *span* is z = max_span * z' (tokens, what it learned); its *window* is
ceil(z) + ramp, the distances its soft mask reaches (what the trainer's `spans` mode tabulates).
"""
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from flax import nnx as flax_nnx

from span_lm.layers import decode as decode_lib
from span_lm.layers import nnx
from span_lm.layers.attention import AdaptiveSpanAttention
from span_lm.layers.core import span_attention
from span_lm.layers.core import span_tokens
from span_lm.layers.safetensors_io import load_safetensors
from span_lm.layers.safetensors_io import save_safetensors

SPAN_PARAM = "span_ratio"
SPAN_AHEAD_PARAM = "span_ratio_ahead"  # asymmetric layers: the spans ahead, learned apart
POS_PARAM = "pos_emb"  # (head_dim, max_span): where learned_spans reads max_span
AHEAD = "ahead"  # learned_spans' key suffix for the spans ahead
_HOW = ("`y, state = model.apply(variables, x, mutable=['intermediates'])`, then "
        "`layers.span_loss(state['intermediates'])`, i.e. "
        "model.apply(v, x, mutable=['intermediates'])[1]['intermediates']")


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _keys(tree):
  return [tuple(_key(p) for p in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def span_loss(intermediates):
  """The sum of every 'span_loss' an AdaptiveSpanAttention sowed (nested, scanned or not):
  `model.apply(v, x, mutable=['intermediates'])[1]['intermediates']`, or that dict's parent;
  NNX: the model (its layers' penalties are summed and removed, so a call in the loss function
  collects each forward's), or the intermediates `nnx.capture(model, nnx.Intermediate)` gives.

  Raises TypeError for anything but a mapping (an array, a loss), ValueError for a mapping with
  no 'span_loss' in it (parameters, or the state of a call without mutable=['intermediates']).
  """
  if isinstance(intermediates, flax_nnx.Module):
    total = nnx.span_loss_of(intermediates)
    if total is None:
      raise ValueError(
          "layers.span_loss: no span penalty on this NNX model: call it first (with "
          "deterministic=False, or None: a deterministic=True call sows none), in the same loss "
          "function, then layers.span_loss(model)")
    return total
  if isinstance(intermediates, flax_nnx.State):
    intermediates = nnx.pure_dict(intermediates)
  if not isinstance(intermediates, Mapping):
    raise TypeError(
        f"layers.span_loss takes the 'intermediates' collection a forward pass sowed (a "
        f"mapping), not {type(intermediates).__name__}: {_HOW}")
  total, found = jnp.zeros((), jnp.float32), False
  for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
    if any(_key(p) == "span_loss" for p in path):
      total, found = total + jnp.sum(leaf), True
  if not found:
    keys = _keys(intermediates)
    looks = ("; it holds parameters (span_ratio), not the sown penalties"
             if any(k and k[-1] == SPAN_PARAM for k in keys) else "")
    raise ValueError(
        f"layers.span_loss: no 'span_loss' entry in the mapping given (top-level keys "
        f"{sorted({k[0] for k in keys if k})}{looks}). Pass the intermediates of a forward pass "
        f"run with the collection mutable: {_HOW}")
  return total


def learned_spans(params, max_span: int | None = None) -> dict:
  """Every AdaptiveSpanAttention's learned spans z in tokens, clipped as applied (Linen
  parameters, or an NNX model or its state):
  {'path/to/layer': (heads,)} or (layers, heads) when scanned, and for an asymmetric layer
  (causal=False, asymmetric=True) also {'path/to/layer/ahead': the spans ahead}. A symmetric
  bidirectional layer's span serves both sides. Its window is ceil(z) + ramp.

  max_span is read from each layer's `pos_emb` (head_dim, max_span); give it only for span
  parameters without one beside them (a `max_span` that disagrees with a layer's is refused).
  """
  if isinstance(params, flax_nnx.Module):
    params = flax_nnx.state(params, flax_nnx.Param)
  if isinstance(params, flax_nnx.State):
    params = nnx.pure_dict(params)
  if not isinstance(params, Mapping):
    raise TypeError(f"layers.learned_spans takes the parameters (a mapping, "
                    f"variables['params']), not {type(params).__name__}")
  groups: dict = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = tuple(_key(p) for p in path)
    groups.setdefault(keys[:-1], {})[keys[-1]] = leaf
  out = {}
  for parent, leaves in groups.items():
    if SPAN_PARAM not in leaves:
      continue
    where = "/".join(parent)
    at = repr(where) if where else "the top level"
    pos = leaves.get(POS_PARAM)
    s = max_span
    if pos is not None and getattr(pos, "ndim", 0) >= 2:
      s = int(pos.shape[-1])
      if max_span is not None and int(max_span) != s:
        raise ValueError(
            f"layers.learned_spans: max_span={max_span}, but the layer at {at} "
            f"was built with max_span={s} (its pos_emb is {tuple(pos.shape)}: (head_dim, "
            f"max_span)); leave max_span out: it is read from the parameters")
    elif s is None:
      raise ValueError(
          f"layers.learned_spans: the span_ratio at {at} has no pos_emb "
          f"(head_dim, max_span) beside it to read max_span from; pass max_span=")
    out[where] = span_tokens(leaves[SPAN_PARAM], s)
    if SPAN_AHEAD_PARAM in leaves:
      out[f"{where}/{AHEAD}" if where else AHEAD] = span_tokens(leaves[SPAN_AHEAD_PARAM], s)
  if not out:
    raise ValueError(f"layers.learned_spans: no {SPAN_PARAM!r} in what was given (top-level "
                     f"keys {sorted({k[0] for k in _keys(params) if k})}): pass the parameters "
                     f"of a model with AdaptiveSpanAttention layers, variables['params']")
  return out


def decode_window(params, ramp: int) -> int:
  """The cached keys a decoding call must read to see every head's window ceil(z) + ramp, for
  every layer in `params` (Linen parameters or an NNX model), rounded up to 16: the Linen
  layer's `decode_window` field (the NNX module works it out in init_cache)."""
  widest = 1
  for where, z in learned_spans(params).items():
    if where.endswith(AHEAD):
      continue
    widest = max(widest, int(jnp.max(jnp.ceil(z))) + int(ramp))
  return -(-widest // decode_lib.BUCKET) * decode_lib.BUCKET


def clamp_spans(params):
  """Every span_ratio (and span_ratio_ahead) clipped to [0, 1], as the reference does after
  each optimizer step (the layer clips in its forward pass too; this keeps z' from drifting
  past an end)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (jnp.clip(x, 0.0, 1.0)
                       if _key(path[-1]) in (SPAN_PARAM, SPAN_AHEAD_PARAM) else x), params)


__all__ = ["AdaptiveSpanAttention", "span_attention", "span_loss", "learned_spans",
           "clamp_spans", "span_tokens", "save_safetensors", "load_safetensors"]
