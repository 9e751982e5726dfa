"""AdaptiveSpanAttention: adaptive attention span (Sukhbaatar et al., 2019) as a Flax Linen layer
that stands where nn.MultiHeadDotProductAttention stands; the maths is span_lm/layers/core.py's."""
import logging
import numbers
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from span_lm.layers import core
from span_lm.layers import decode as decode_lib

Initializer = Callable[..., Any]


def check_fields(layer, name: str):
  """The fields' rule (both modules), refused with the field's name before anything is traced."""

  def bad(field, why):
    raise ValueError(f"{name}.{field}={getattr(layer, field)!r}: {why}")

  def integer(field):
    v = getattr(layer, field)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      bad(field, "must be an integer")
    return int(v)

  if integer("num_heads") < 1:
    bad("num_heads", "must be >= 1")
  if layer.num_kv_heads is not None:
    if integer("num_kv_heads") < 1:
      bad("num_kv_heads", "must be >= 1 (1: multi-query attention; None: num_heads)")
    if layer.num_heads % layer.num_kv_heads:
      raise ValueError(
          f"{name}.num_heads={layer.num_heads!r} is not a multiple of "
          f"{name}.num_kv_heads={layer.num_kv_heads!r}: each key/value head serves a group of "
          f"num_heads / num_kv_heads query heads")
  if integer("max_span") < 1:
    bad("max_span", "must be >= 1 (the farthest distance attended is max_span - 1)")
  if layer.ramp is not None:
    if integer("ramp") < 1:
      bad("ramp", "must be >= 1 (or None: min(32, max_span))")
    if layer.ramp > layer.max_span:
      raise ValueError(
          f"{name}.max_span={layer.max_span!r} is below {name}.ramp={layer.ramp!r}: the soft "
          f"mask's ramp must fit inside the window (1 <= ramp <= max_span), or no span can "
          f"shorten it. Leave ramp=None (min(32, max_span) = {min(32, layer.max_span)}), "
          f"set ramp <= {layer.max_span}, or raise max_span to >= {layer.ramp}")
  if (isinstance(layer.span_init, bool) or not isinstance(layer.span_init, numbers.Real)
      or not 0.0 <= layer.span_init <= 1.0):
    bad("span_init", "must be in [0, 1]: z' at init, the span as a fraction of max_span "
        "(span_init=0.25 starts every span at max_span / 4 tokens)")
  if not isinstance(layer.span_loss_coef, numbers.Real) or not layer.span_loss_coef >= 0:
    bad("span_loss_coef", "must be >= 0 (0: no span penalty)")
  if not isinstance(layer.dropout_rate, numbers.Real) or not 0.0 <= layer.dropout_rate < 1.0:
    bad("dropout_rate", "must be in [0, 1)")
  if layer.asymmetric and layer.causal:
    bad("asymmetric", "spans ahead are learned apart only when bidirectional: set "
        "causal=False too (a causal layer has no keys ahead)")
  if layer.decode and not layer.causal:
    bad("decode", "only a causal layer decodes (a bidirectional one needs keys not yet seen)")
  if layer.attn_impl not in core.IMPLS:
    bad("attn_impl", f"choose one of {core.IMPLS}")
  if layer.qkv_features is not None and layer.qkv_features % layer.num_heads:
    bad("qkv_features", f"must be divisible by {name}.num_heads={layer.num_heads}")


def attend(q, k, v, ratio, pos_back, pos_ahead, ratio_ahead, *, max_span, causal, ramp, mask,
           segment_ids, rate, dropout_rng, attn_impl):
  """core.span_attention with keys and values of H_kv <= H heads (query head h reads KV head
  h // (H // H_kv))."""
  return core.span_attention(
      q, k, v, ratio, pos_back, pos_ahead, max_span=max_span, causal=causal, ramp=ramp,
      mask=mask, segment_ids=segment_ids, span_ratio_ahead=ratio_ahead, dropout_rate=rate,
      dropout_rng=dropout_rng if rate else None, attn_impl=attn_impl)



class AdaptiveSpanAttention(nn.Module):
  """Multi-head attention whose heads each learn how far they look (docs/layer.md).

  Each head h attends to keys at distance x = |i - j| < max_span (only back when causal) with
  the soft mask m(x) = clamp((ramp + z_h - x) / ramp, 0, 1) on its weights, z_h = max_span * z'_h
  learned: the head's *span* z_h (tokens), its *window* ceil(z_h) + ramp the keys it reaches.
  Relative position embeddings (both directions when bidirectional) replace absolute ones.

  The span penalty is sown as ('intermediates', 'span_loss'): train with
  `y, state = model.apply(v, x, mutable=['intermediates'])` and add
  `span_lm.layers.span_loss(state['intermediates'])` to the loss, or the spans only grow. A
  training call (deterministic=False) without 'intermediates' mutable is refused; a call that
  does not say (deterministic None, no dropout) warns once; deterministic=True (evaluation) and
  span_loss_coef=0 need nothing.

  Sizes (checked when the layer is built, errors naming these fields): num_heads >= 1 dividing
  qkv_features; max_span >= 1; ramp None (the default) is min(32, max_span), an explicit ramp
  must be 1 <= ramp <= max_span (the mask must be able to reach 0 inside the window); span_init
  (z' at init) in [0, 1]; span_loss_coef >= 0; 0 <= dropout_rate < 1.

  Parameters: query/key/value/out as nn.MultiHeadDotProductAttention names and shapes them (so
  its weights load as they are), span_ratio (heads,) z', pos_emb (head_dim, max_span) [and
  pos_emb_ahead when not causal], column max_span - 1 - x for distance x; span_ratio_ahead
  (heads,) with causal=False, asymmetric=True (the spans ahead, learned apart; else span_ratio
  serves both sides).

  Grouped key/value heads: num_kv_heads (None: num_heads; 1: multi-query) key and value heads,
  query head h reading KV head h // (num_heads // num_kv_heads); spans stay per query head.

  Decoding (decode=True, causal only): `init` creates the 'cache' collection, a ring of max_span
  keys and values per KV head whatever length init saw; `apply(..., mutable=['cache'])` then
  takes one token or a chunk and attends to the cached keys within each head's window. A call
  reads decode_window cached keys per KV head (an int, or one per KV head; None: from the spans
  when they are concrete, else max_span);
  `layers.decode_window(params, ramp)` gives the tightest from learned spans (docs/layer.md).

  Causal or bidirectional (keys up to max_span - 1 ahead, with their own position embeddings and,
  with asymmetric=True, their own learned spans per head), padded or packed (`segment_ids`, id 0
  padding, or a key-padding `mask`): the door runs (span_lm.kernels, the model's own attention;
  O(length * max_span)). Any other dense mask runs the plain dense path (O(length^2)) and says
  so once at WARNING.
  """
  num_heads: int
  max_span: int
  causal: bool = True
  asymmetric: bool = False  # bidirectional: learn the span ahead apart (span_ratio_ahead)
  ramp: int | None = None  # R; None: min(32, max_span)
  span_init: float = 0.0  # z' at init; the reference starts every span at 0
  span_loss_coef: float = 2e-6
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  use_bias: bool = True
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  pos_emb_init: Initializer = nn.initializers.normal(1.0)  # the reference's key_pe: N(0, 1)
  attn_impl: str = "auto"
  num_kv_heads: int | None = None  # key/value heads, each serving num_heads / num_kv_heads
  decode: bool = False  # one token or a chunk at a time from the 'cache' collection
  decode_window: int | tuple | None = None  # cached keys a decoding call reads per KV head

  def __post_init__(self):
    check_fields(self, type(self).__name__)
    super().__post_init__()

  @property
  def ramp_tokens(self) -> int:
    """R as applied: `ramp`, or min(32, max_span) when it is None."""
    return min(32, self.max_span) if self.ramp is None else int(self.ramp)

  def _check_penalty_kept(self, deterministic):
    """Refuse (training) or warn once (unknown) when the sown span penalty would be dropped."""
    if (self.span_loss_coef == 0 or self.is_initializing()
        or self.is_mutable_collection("intermediates")):
      return
    det = self.deterministic if deterministic is None else deterministic
    how = ("pass mutable=['intermediates'] to apply and add "
           "span_lm.layers.span_loss(state['intermediates']) to the loss: "
           "`y, state = model.apply(variables, x, mutable=['intermediates'])` (under nn.scan, "
           "list 'intermediates' in variable_axes too)")
    if det is None:
      core._log_once(  # pylint: disable=protected-access
          logging.WARNING, ("penalty dropped",),
          "AdaptiveSpanAttention: the 'intermediates' collection is not mutable, so the span "
          "penalty (span_loss_coef=%g) is dropped from this call. Training? %s. Evaluating? "
          "pass deterministic=True (or span_loss_coef=0) and this warning goes.",
          self.span_loss_coef, how)
    elif not det:
      raise ValueError(
          f"{type(self).__name__} ({self._where()}) trains (deterministic=False) but the "
          f"'intermediates' collection is not mutable, so its span penalty "
          f"(span_loss_coef={self.span_loss_coef:g}) would be dropped and the spans would only "
          f"grow: {how}. To train without the penalty, set span_loss_coef=0.")

  def _where(self) -> str:
    return "/".join(self.scope.path) if self.scope is not None and self.scope.path else "top"

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else int(self.num_kv_heads)

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               segment_ids=None, deterministic: bool | None = None, dropout_rng=None,
               sow_weights: bool = False):
    """inputs_q (batch..., q_len, features) -> (batch..., q_len, out_features); keys and values
    as nn.MultiHeadDotProductAttention takes them, positions aligned with the queries'.
    segment_ids (batch..., q_len): attend within a segment only; 0 is padding (zeros out).
    sow_weights: sow the attention weights (after the soft mask), (batch..., heads, q_len,
    kv_len), as ('intermediates', 'attention_weights'): dense, for small inputs."""
    if inputs_kv is not None:
      inputs_k = inputs_v = inputs_kv
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    head_dim = self._head_dim(inputs_q)
    *batch, n = inputs_q.shape[:-1]
    decoding = self.decode and self.has_variable("cache", "cached_key")
    if not decoding:
      decode_lib.check_mask(mask, tuple(batch), self.num_heads, n, inputs_k.shape[-2],
                            type(self).__name__)
      self._check_penalty_kept(deterministic)
    q, k, v = self._project(inputs_q, inputs_k, inputs_v, head_dim)
    ratio, pos_back, pos_ahead, ratio_ahead = self._span_params(head_dim)
    if self.decode:
      out = self._decode(q, k, v, ratio, pos_back, mask, segment_ids, tuple(batch), decoding)
      if out is not None:
        return self._out(out, inputs_q)
    both = ratio if ratio_ahead is None else jnp.concatenate([ratio, ratio_ahead])
    self.sow("intermediates", "span_loss",
             core.span_loss(both, self.max_span, self.span_loss_coef))

    rate, dropout_rng = self._dropout(deterministic, dropout_rng)
    out = attend(q, k, v, ratio, pos_back, pos_ahead, ratio_ahead, max_span=self.max_span,
                 causal=self.causal, ramp=self.ramp_tokens, mask=mask, segment_ids=segment_ids,
                 rate=rate, dropout_rng=dropout_rng, attn_impl=self.attn_impl)
    if sow_weights:
      self.sow("intermediates", "attention_weights", decode_lib.attention_weights(
          q, k, ratio, pos_back, pos_ahead, max_span=self.max_span, causal=self.causal,
          ramp=self.ramp_tokens, mask=mask, segment_ids=segment_ids,
          span_ratio_ahead=ratio_ahead))
    return self._out(out, inputs_q)

  def _head_dim(self, inputs_q) -> int:
    """qkv_features (else the inputs' features) over the heads; one line where they do not split."""
    qkv = self.qkv_features or inputs_q.shape[-1]
    if qkv % self.num_heads:
      raise ValueError(f"{type(self).__name__}.num_heads={self.num_heads}: must divide the "
                       f"features ({qkv}: qkv_features, else the inputs' last axis)")
    return qkv // self.num_heads

  def _project(self, inputs_q, inputs_k, inputs_v, head_dim):
    """Queries (num_heads), keys and values (kv_heads), each (batch..., length, heads, head_dim)."""
    dense = lambda name, heads: nn.DenseGeneral(
        (heads, head_dim), dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias, name=name)
    q = dense("query", self.num_heads)(inputs_q)
    k = dense("key", self.kv_heads)(inputs_k)
    v = dense("value", self.kv_heads)(inputs_v)
    return q, k, v

  def _span_params(self, head_dim):
    """span_ratio, pos_emb, and (bidirectional) pos_emb_ahead and (asymmetric) span_ratio_ahead,
    else None."""
    ratio = self.param("span_ratio", nn.initializers.constant(self.span_init), (self.num_heads,),
                       jnp.float32)
    pe = lambda name: self.param(name, self.pos_emb_init, (head_dim, self.max_span),
                                 self.param_dtype)
    pos_back = pe("pos_emb")
    pos_ahead = None if self.causal else pe("pos_emb_ahead")
    ratio_ahead = None
    if self.asymmetric and not self.causal:
      ratio_ahead = self.param("span_ratio_ahead", nn.initializers.constant(self.span_init),
                               (self.num_heads,), jnp.float32)
    return ratio, pos_back, pos_ahead, ratio_ahead

  def _dropout(self, deterministic, dropout_rng):
    """The attention dropout's rate for this call (0: none) and its rng."""
    rate = 0.0
    if self.dropout_rate > 0:
      if not nn.merge_param("deterministic", self.deterministic, deterministic):
        rate = self.dropout_rate
        dropout_rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
    return rate, dropout_rng

  def _out(self, out, inputs_q):
    return nn.DenseGeneral(
        self.out_features or inputs_q.shape[-1], axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias, name="out")(out)

  def _decode(self, q, k, v, ratio, pos_back, mask, segment_ids, batch, decoding):
    """The 'cache' collection (created by init, max_span slots whatever init's length) and,
    once it exists, one decoding call; None at init (the full forward runs instead)."""
    where = f"{type(self).__name__} ({self._where()})"
    if not decoding and not self.is_initializing():
      raise ValueError(
          f"{where} decodes (decode=True) but has no 'cache' collection: pass the variables "
          f"init made with decode=True (its 'cache' entry) and mutable=['cache'] to apply")
    if decoding and not self.is_mutable_collection("cache"):
      raise ValueError(f"{where} decodes (decode=True): pass mutable=['cache'] to apply, "
                       f"and the cache it returns to the next call")
    shape = batch + (self.max_span, self.kv_heads, k.shape[-1])
    ck = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
    cv = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
    cseg = self.variable("cache", "cached_segment", jnp.zeros, batch + (self.max_span,),
                         jnp.int32)
    ci = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not decoding:
      return None
    if mask is not None:
      raise ValueError(f"{where}: a decoding call takes segment_ids=(batch, tokens), not mask "
                       f"(causality and the window are built in)")
    decode_lib.check_cache(ck.value.shape, batch, where)
    reads = decode_lib.reads_for(self.decode_window, ratio, self.max_span, self.ramp_tokens,
                                 self.kv_heads)
    out, (ck.value, cv.value, cseg.value, ci.value) = decode_lib.decode_attention(
        q, k, v, (ck.value, cv.value, cseg.value, ci.value), segment_ids, ratio, pos_back,
        max_span=self.max_span, ramp=self.ramp_tokens, reads=reads)
    return out

  def spans(self):
    """The learned spans z in tokens, (heads,): `layer.apply(variables, method='spans')`; the
    spans ahead of an asymmetric layer: `layers.learned_spans(params)`."""
    return core.span_tokens(self.get_variable("params", "span_ratio"), self.max_span)
