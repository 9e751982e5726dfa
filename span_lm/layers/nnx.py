"""AdaptiveSpanAttention as a Flax NNX module: `span_lm.layers.nnx.AdaptiveSpanAttention`, beside
the Linen layer as `flax.nnx.MultiHeadAttention` stands beside `flax.linen`'s.

The same fields, maths and parameter names as span_lm/layers/attention.py (the Linen layer), so
`from_linen` / `to_linen` move weights either way and the two give the same outputs and
gradients. Constructed as nnx.MultiHeadAttention is (`num_heads, in_features, qkv_features,
out_features, num_kv_heads, in_kv_features, *, ..., rngs`), with `max_span` required.

The span penalty: a call that may train (deterministic False or None) adds it to the layer's
`SpanLoss` variable (an `nnx.Intermediate`, named 'span_loss'; under `nnx.capture(...,
nnx.Intermediate)` it is sown there instead). `span_lm.layers.span_loss(model)` sums and removes
every layer's, so it goes in the loss function:

    def loss_fn(model):
      return task_loss(model(x)) + layers.span_loss(model)

A training call (deterministic=False) on a layer still holding the penalty of an earlier
training call is refused: that penalty was dropped from the loss, and the spans would only grow.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import linear as nnx_linear

from span_lm.layers import attention as linen_attention
from span_lm.layers import core
from span_lm.layers import decode as decode_lib

Initializer = Callable[..., Any]

# The fields the two modules share (and `from_linen` / `to_linen` carry over).
FIELDS = ("num_heads", "max_span", "causal", "asymmetric", "ramp", "span_init", "span_loss_coef",
          "dropout_rate", "deterministic", "dtype", "param_dtype", "qkv_features",
          "out_features", "use_bias", "kernel_init", "out_kernel_init", "bias_init",
          "pos_emb_init", "attn_impl", "num_kv_heads", "decode_window")


def pure_dict(state) -> dict:
  """An nnx.State as a plain nested dict of arrays (nnx.to_pure_dict where flax has it)."""
  to_pure = getattr(nnx, "to_pure_dict", None)
  return to_pure(state) if to_pure is not None else state.to_pure_dict()


class SpanLoss(nnx.Intermediate):
  """The span penalty of the calls since it was last collected (`layers.span_loss(model)`)."""


class _TrainingSpanLoss(SpanLoss):
  """A SpanLoss that a training call (deterministic=False) added to: collected, or refused."""


class AdaptiveSpanAttention(nnx.Module):
  """Multi-head attention whose heads each learn how far they look (docs/layer.md), NNX.

  Fields as the Linen layer's (span_lm.layers.AdaptiveSpanAttention), plus `in_features` (and
  `in_kv_features`) as nnx.MultiHeadAttention takes them, and `rngs`. Parameters: query, key,
  value, out (nnx.LinearGeneral: kernel, bias, shaped as the Linen layer's), span_ratio,
  pos_emb [pos_emb_ahead, span_ratio_ahead].

  Decoding as nnx.MultiHeadAttention: `decode=True` (field or call) after `init_cache(shape)`;
  a call takes one token or a chunk and attends to the cached keys within each head's window.
  The cache is a ring of max_span slots per KV head; `init_cache` fixes, from the spans at that
  time, how many cached keys each KV head reads (its widest window, rounded up to 16).
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, max_span: int, causal: bool = True,
               asymmetric: bool = False, ramp: int | None = None, span_init: float = 0.0,
               span_loss_coef: float = 2e-6, dropout_rate: float = 0.0,
               deterministic: bool | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, use_bias: bool = True,
               kernel_init: Initializer = nnx_linear.default_kernel_init,
               out_kernel_init: Initializer | None = None,
               bias_init: Initializer = nnx.initializers.zeros_init(),
               pos_emb_init: Initializer = nnx.initializers.normal(1.0),
               attn_impl: str = "auto", decode: bool | None = None,
               decode_window: int | tuple | None = None, rngs: nnx.Rngs,
               keep_rngs: bool = True):
    self.num_heads, self.in_features, self.max_span = num_heads, in_features, max_span
    self.qkv_features, self.out_features = qkv_features, out_features
    self.num_kv_heads, self.causal, self.asymmetric, self.ramp = num_kv_heads, causal, asymmetric, ramp
    self.span_init, self.span_loss_coef = span_init, span_loss_coef
    self.dropout_rate, self.deterministic = dropout_rate, deterministic
    self.dtype, self.param_dtype, self.use_bias = dtype, param_dtype, use_bias
    self.kernel_init, self.out_kernel_init, self.bias_init = kernel_init, out_kernel_init, bias_init
    self.pos_emb_init, self.attn_impl = pos_emb_init, attn_impl
    self.decode, self.decode_window = decode, decode_window
    name = type(self).__name__
    linen_attention.check_fields(self, name)
    qkv = qkv_features or in_features
    if qkv % num_heads:
      raise ValueError(f"{name}.num_heads={num_heads}: must divide the features ({qkv}: "
                       f"qkv_features, else in_features)")
    self.in_kv_features = in_kv_features or in_features
    self.head_dim = qkv // num_heads
    self.kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
    self.ramp_tokens = min(32, max_span) if ramp is None else int(ramp)
    lin = lambda fin, heads: nnx.LinearGeneral(
        fin, (heads, self.head_dim), dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.query = lin(in_features, num_heads)
    self.key = lin(self.in_kv_features, self.kv_heads)
    self.value = lin(self.in_kv_features, self.kv_heads)
    self.out = nnx.LinearGeneral(
        (num_heads, self.head_dim), out_features or in_features, axis=(-2, -1), dtype=dtype,
        param_dtype=param_dtype, kernel_init=out_kernel_init or kernel_init,
        bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.span_ratio = nnx.Param(jnp.full((num_heads,), span_init, jnp.float32))
    pe = lambda: nnx.Param(pos_emb_init(rngs.params(), (self.head_dim, max_span), param_dtype))
    self.pos_emb = pe()
    if not causal:
      self.pos_emb_ahead = pe()
    if asymmetric and not causal:
      self.span_ratio_ahead = nnx.Param(jnp.full((num_heads,), span_init, jnp.float32))
    self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else nnx.data(None)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cached_segment: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)
    self.read_windows: tuple | None = None

  # -- the Linen layer's weights, both ways --------------------------------------------------

  @classmethod
  def from_linen(cls, layer: linen_attention.AdaptiveSpanAttention, params=None, *,
                 in_features: int | None = None, in_kv_features: int | None = None,
                 rngs: nnx.Rngs | None = None, **overrides):
    """The NNX module with a Linen layer's fields and, given, its parameters
    (`variables['params']` of that layer): in_features is read from them (query's kernel)."""
    if params is not None and "params" in params and "query" not in params:
      params = params["params"]
    if in_features is None:
      if params is None:
        raise ValueError("AdaptiveSpanAttention.from_linen: give the Linen parameters or "
                         "in_features")
      in_features = int(params["query"]["kernel"].shape[0])
      in_kv_features = in_kv_features or int(params["key"]["kernel"].shape[0])
    kw = {f: getattr(layer, f) for f in FIELDS} | {"decode": layer.decode or None} | overrides
    kw = {k: v for k, v in kw.items() if v is not None or k in ("deterministic", "decode")}
    module = cls(in_features=in_features, in_kv_features=in_kv_features,
                 rngs=rngs or nnx.Rngs(0), **kw)
    if params is not None:
      module.load_linen_params(params)
    return module

  def to_linen(self):
    """(the Linen layer with these fields, its parameters): `layer.apply({'params': p}, x)`."""
    layer = linen_attention.AdaptiveSpanAttention(
        **{f: getattr(self, f) for f in FIELDS}, decode=bool(self.decode))
    return layer, self.linen_params()

  def linen_params(self) -> dict:
    """The parameters as the Linen layer names them (a plain nested dict of arrays)."""
    return pure_dict(nnx.state(self, nnx.Param))

  def load_linen_params(self, params):
    """Sets the parameters from the Linen layer's (`variables['params']`); one line for a tree
    of other names or shapes."""
    state = nnx.state(self, nnx.Param)
    have = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype).name), pure_dict(state))
    got = jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.dtype(a.dtype).name), dict(params))
    if jax.tree.structure(have) != jax.tree.structure(got) or have != got:
      raise ValueError(f"{type(self).__name__}.load_linen_params: the parameters given do not "
                       f"match this module's (names, shapes, dtypes): {got} against {have}")
    nnx.replace_by_pure_dict(state, params)
    nnx.update(self, state)

  # -- calls ----------------------------------------------------------------------------------

  def spans(self):
    """The learned spans z in tokens, (heads,)."""
    return core.span_tokens(self.span_ratio[...], self.max_span)

  def init_cache(self, input_shape, dtype: Any = jnp.float32):
    """Sets up decoding for inputs of `input_shape` (batch..., length, features): a ring of
    max_span keys and values per KV head (whatever `length`), and the cached keys each KV head
    reads, from the spans as they are now (or `decode_window`)."""
    batch = tuple(input_shape[:-2])
    shape = batch + (self.max_span, self.kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_segment = nnx.Cache(jnp.zeros(batch + (self.max_span,), jnp.int32))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    self.read_windows = decode_lib.reads_for(self.decode_window, self.span_ratio[...],
                                             self.max_span, self.ramp_tokens, self.kv_heads)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, segment_ids=None,
               deterministic: bool | None = None, rngs: nnx.Rngs | None = None,
               sow_weights: bool = False, decode: bool | None = None):
    """inputs_q (batch..., q_len, in_features) -> (batch..., q_len, out_features), as
    nnx.MultiHeadAttention; segment_ids (batch..., q_len): attend within a segment only, 0 is
    padding. sow_weights: sow the attention weights (after the soft mask) as
    nnx.Intermediate 'attention_weights', (batch..., heads, q_len, kv_len): dense, small inputs.
    """
    name = type(self).__name__
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"{name}: inputs of {inputs_q.shape[-1]} features, but in_features="
                       f"{self.in_features}")
    *batch, n = inputs_q.shape[:-1]
    batch = tuple(batch)
    decode = bool(self.decode if decode is None else decode)
    q, k, v = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    ratio = self.span_ratio[...]
    if decode:
      return self.out(self._decode(q, k, v, ratio, mask, segment_ids, sow_weights, batch))
    decode_lib.check_mask(mask, batch, self.num_heads, n, inputs_k.shape[-2], name)
    det = self.deterministic if deterministic is None else deterministic
    pos_ahead = None if self.causal else self.pos_emb_ahead[...]
    ratio_ahead = self.span_ratio_ahead[...] if self.asymmetric and not self.causal else None
    if det is not True and self.span_loss_coef:
      both = ratio if ratio_ahead is None else jnp.concatenate([ratio, ratio_ahead])
      self._sow_penalty(core.span_loss(both, self.max_span, self.span_loss_coef), det is False)
    rate, dropout_rng = 0.0, None
    if self.dropout_rate > 0 and det is False:
      rate, dropout_rng = self.dropout_rate, self._dropout_key(rngs)
    elif self.dropout_rate > 0 and det is None:
      raise ValueError(f"{name}: dropout_rate={self.dropout_rate} needs deterministic (a call "
                       f"argument, the field, or model.train() / model.eval())")
    out = linen_attention.attend(
        q, k, v, ratio, self.pos_emb[...], pos_ahead, ratio_ahead, max_span=self.max_span,
        causal=self.causal, ramp=self.ramp_tokens, mask=mask, segment_ids=segment_ids,
        rate=rate, dropout_rng=dropout_rng, attn_impl=self.attn_impl)
    if sow_weights:
      self._sow_weights(decode_lib.attention_weights(
          q, k, ratio, self.pos_emb[...], pos_ahead, max_span=self.max_span, causal=self.causal,
          ramp=self.ramp_tokens, mask=mask, segment_ids=segment_ids,
          span_ratio_ahead=ratio_ahead))
    return self.out(out)

  def _decode(self, q, k, v, ratio, mask, segment_ids, sow_weights, batch):
    name = type(self).__name__
    if not self.causal:
      raise ValueError(f"{name}: only a causal layer decodes (this one is causal=False: its "
                       f"queries need keys not yet seen)")
    if self.cached_key is None:
      raise ValueError(f"{name}: decoding needs a cache: call init_cache((batch, 1, features)) "
                       f"first")
    if mask is not None:
      raise ValueError(f"{name}: a decoding call takes segment_ids=(batch, tokens), not mask "
                       f"(causality and the window are built in)")
    if sow_weights:
      raise ValueError(f"{name}: sow_weights is for a full (not decoding) call")
    decode_lib.check_cache(self.cached_key.shape, batch, name)
    cache = (self.cached_key[...], self.cached_value[...], self.cached_segment[...],
             self.cache_index[...])
    out, (ck, cv, cs, ci) = decode_lib.decode_attention(
        q, k, v, cache, segment_ids, ratio, self.pos_emb[...], max_span=self.max_span,
        ramp=self.ramp_tokens, reads=self.read_windows)
    self.cached_key[...], self.cached_value[...] = ck, cv
    self.cached_segment[...], self.cache_index[...] = cs, ci
    return out

  def _dropout_key(self, rngs):
    if rngs is None:
      rngs = self.rngs
    if rngs is None:
      raise ValueError(f"{type(self).__name__}: dropout needs rngs (pass rngs= to the call, or "
                       f"build the layer with keep_rngs=True)")
    return rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs()

  def _sow_penalty(self, value, training: bool):
    if hasattr(self, "__captures__"):  # under nnx.capture: sown there
      self.sow(nnx.Intermediate, "span_loss", value, reduce_fn=lambda a, b: a + b,
               init_fn=lambda: jnp.zeros((), jnp.float32))
      return
    prev = getattr(self, "span_loss", None)
    if training and isinstance(prev, _TrainingSpanLoss):
      raise ValueError(
          f"{type(self).__name__} trains (deterministic=False) but still holds the span penalty "
          f"an earlier training call sowed: it was never collected, so it was dropped from the "
          f"loss and the spans would only grow. Add span_lm.layers.span_loss(model) to the loss "
          f"(it sums and removes every layer's), once after each forward; to train without the "
          f"penalty, set span_loss_coef=0")
    kind = _TrainingSpanLoss if training or isinstance(prev, _TrainingSpanLoss) else SpanLoss
    self.span_loss = kind(value if prev is None else prev.get_value() + value)

  def _sow_weights(self, weights):
    if hasattr(self, "__captures__"):
      self.sow(nnx.Intermediate, "attention_weights", weights)
      return
    prev = getattr(self, "attention_weights", None)
    self.attention_weights = nnx.Intermediate((() if prev is None else prev.get_value()) + (weights,))


def span_loss_of(module) -> jax.Array | None:
  """Sums and removes every SpanLoss under `module` (None when there is none)."""
  state = nnx.pop(module, SpanLoss)
  leaves = jax.tree.leaves(state)
  if not leaves:
    return None
  return sum((jnp.sum(x) for x in leaves), jnp.zeros((), jnp.float32))


__all__ = ["AdaptiveSpanAttention", "SpanLoss"]
