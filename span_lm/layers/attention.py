"""AdaptiveSpanAttention: adaptive attention span (Sukhbaatar et al., 2019) as a Flax Linen layer
that stands where nn.MultiHeadDotProductAttention stands; the maths is span_lm/layers/core.py's."""
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from span_lm.layers import core

Initializer = Callable[..., Any]


class AdaptiveSpanAttention(nn.Module):
  """Multi-head attention whose heads each learn how far they look.

  Each head h attends to keys at distance x = |i - j| < max_span (only back when causal) with
  the soft mask m(x) = clamp((ramp + z_h - x) / ramp, 0, 1) on its weights, z_h = max_span * z'_h
  learned; relative position embeddings (both directions when bidirectional) replace absolute
  ones. The span penalty is sown as ('intermediates', 'span_loss'): add
  `span_lm.layers.span_loss(intermediates)` to the training loss, or the spans only grow.

  Parameters: query/key/value/out as nn.MultiHeadDotProductAttention names and shapes them (so
  its weights load as they are), span_ratio (heads,) z', pos_emb (head_dim, max_span) [and
  pos_emb_ahead when not causal], column max_span - 1 - x for distance x.

  Causal or bidirectional (keys up to max_span - 1 ahead, with their own position embeddings and,
  with asymmetric=True, their own learned spans per head), padded or packed (`segment_ids`, or a
  key-padding `mask`): the door runs (span_lm.kernels, the model's own attention; O(length *
  max_span)). Any other dense mask runs the plain dense path (O(length^2)) and says so.
  """
  num_heads: int
  max_span: int
  causal: bool = True
  asymmetric: bool = False  # bidirectional: learn the span ahead apart (span_ratio_ahead)
  ramp: int = 32
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

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               segment_ids=None, deterministic: bool | None = None, dropout_rng=None):
    """inputs_q (batch..., q_len, features) -> (batch..., q_len, out_features); keys and values
    as nn.MultiHeadDotProductAttention takes them, positions aligned with the queries'.
    segment_ids (batch..., q_len): attend within a segment only; 0 is padding (zeros out)."""
    if inputs_kv is not None:
      inputs_k = inputs_v = inputs_kv
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    qkv = self.qkv_features or inputs_q.shape[-1]
    if qkv % self.num_heads:
      raise ValueError(f"qkv_features={qkv} must be divisible by num_heads={self.num_heads}")
    head_dim = qkv // self.num_heads
    dense = lambda name: nn.DenseGeneral(
        (self.num_heads, head_dim), dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias, name=name)
    q, k, v = dense("query")(inputs_q), dense("key")(inputs_k), dense("value")(inputs_v)

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
    both = ratio if ratio_ahead is None else jnp.concatenate([ratio, ratio_ahead])
    self.sow("intermediates", "span_loss",
             core.span_loss(both, self.max_span, self.span_loss_coef))

    rate = 0.0
    if self.dropout_rate > 0:
      if not nn.merge_param("deterministic", self.deterministic, deterministic):
        rate = self.dropout_rate
        dropout_rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
    out = core.span_attention(
        q, k, v, ratio, pos_back, pos_ahead, max_span=self.max_span, causal=self.causal,
        ramp=self.ramp, mask=mask, segment_ids=segment_ids, span_ratio_ahead=ratio_ahead,
        dropout_rate=rate, dropout_rng=dropout_rng if rate else None,
        attn_impl=self.attn_impl)
    return nn.DenseGeneral(
        self.out_features or inputs_q.shape[-1], axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias, name="out")(out)

  def spans(self):
    """The learned spans in tokens, (heads,): `layer.apply(variables, method='spans')`."""
    return core.span_tokens(self.get_variable("params", "span_ratio"), self.max_span)
