"""What a new user of span_lm.layers meets (issue 43, goal 8): every field rule refused with the
layer's own field names before anything is traced, the ramp's default fitting a short max_span,
span_loss / learned_spans refusing what is not theirs, and a training call that would drop the
span penalty refused (or, when it cannot tell, warned about once)."""
import logging
import re

import numpy as np
import pytest

import flax.linen as nn
import jax
import jax.numpy as jnp

from span_lm import layers
from span_lm.layers import core

A = layers.AdaptiveSpanAttention
F = 16


def _x(n=24, b=1):
  return jax.random.normal(jax.random.key(0), (b, n, F))


@pytest.mark.parametrize("kw,message", [
    (dict(max_span=16, ramp=32),
     "AdaptiveSpanAttention.max_span=16 is below AdaptiveSpanAttention.ramp=32: the soft mask's "
     "ramp must fit inside the window (1 <= ramp <= max_span)"),
    (dict(max_span=16, ramp=0), "AdaptiveSpanAttention.ramp=0: must be >= 1"),
    (dict(max_span=0), "AdaptiveSpanAttention.max_span=0: must be >= 1"),
    (dict(max_span=16.0), "AdaptiveSpanAttention.max_span=16.0: must be an integer"),
    (dict(max_span=16, num_heads=0), "AdaptiveSpanAttention.num_heads=0: must be >= 1"),
    (dict(max_span=16, span_init=1.5), "AdaptiveSpanAttention.span_init=1.5: must be in [0, 1]"),
    (dict(max_span=16, span_init=-0.1), "AdaptiveSpanAttention.span_init=-0.1: must be in [0, 1]"),
    (dict(max_span=16, span_loss_coef=-1e-3), "AdaptiveSpanAttention.span_loss_coef=-0.001"),
    (dict(max_span=16, asymmetric=True), "AdaptiveSpanAttention.asymmetric=True: spans ahead"),
    (dict(max_span=16, qkv_features=15), "AdaptiveSpanAttention.qkv_features=15: must be "
     "divisible by AdaptiveSpanAttention.num_heads=2"),
    (dict(max_span=16, attn_impl="fast"), "AdaptiveSpanAttention.attn_impl='fast': choose one"),
])
def test_fields_are_refused_by_name_when_the_layer_is_built(kw, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    A(**({"num_heads": 2} | kw))  # construction alone: nothing is traced


def test_heads_that_do_not_divide_the_features_are_refused_by_name():
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention.num_heads=3: must divide the features (16")):
    A(num_heads=3, max_span=16).init(jax.random.key(0), _x())


def test_the_ramp_defaults_to_fit_a_short_max_span():
  assert A(num_heads=2, max_span=8).ramp_tokens == 8
  assert A(num_heads=2, max_span=1000).ramp_tokens == 32
  assert A(num_heads=2, max_span=16, ramp=4).ramp_tokens == 4
  x = _x()
  short, explicit = A(num_heads=2, max_span=8), A(num_heads=2, max_span=8, ramp=8)
  v = short.init(jax.random.key(1), x)
  v = {"params": v["params"] | {"span_ratio": jnp.asarray([0.0, 0.5])}}
  y = short.apply(v, x, deterministic=True)
  np.testing.assert_array_equal(y, explicit.apply(v, x, deterministic=True))
  # ... and it is the ramp the mask uses: R = 4 gives other weights
  assert np.abs(np.asarray(y - A(num_heads=2, max_span=8, ramp=4).apply(
      v, x, deterministic=True))).max() > 1e-4


def test_span_loss_refuses_what_is_not_the_sown_intermediates():
  layer = A(num_heads=2, max_span=16, span_init=0.5, span_loss_coef=1e-2)
  x = _x()
  v = layer.init(jax.random.key(0), x)
  _, state = layer.apply(v, x, mutable=["intermediates"])
  want = 1e-2 * 16 * 0.5
  np.testing.assert_allclose(layers.span_loss(state["intermediates"]), want, rtol=1e-6)
  np.testing.assert_allclose(layers.span_loss(state), want, rtol=1e-6)  # the parent dict too
  with pytest.raises(TypeError, match=re.escape(
      "layers.span_loss takes the 'intermediates' collection a forward pass sowed (a mapping), "
      "not ArrayImpl")):
    layers.span_loss(jnp.ones(3))
  with pytest.raises(ValueError, match=r"no 'span_loss' entry .* it holds parameters .*"
                     r"model.apply\(v, x, mutable=\['intermediates'\]\)\[1\]\['intermediates'\]"):
    layers.span_loss(v["params"])
  with pytest.raises(ValueError, match="no 'span_loss' entry"):
    layers.span_loss(v)  # {'params': ...}: init does not sow


def test_a_training_call_that_would_drop_the_penalty_is_refused_an_unknown_one_warned_once(
    caplog):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=None):
      return A(num_heads=2, max_span=16, name="attn")(x, deterministic=(
          None if train is None else not train))

  net, x = Net(), _x()
  v = net.init(jax.random.key(0), x, train=True)  # init: nothing to refuse
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention (attn) trains (deterministic=False) but the 'intermediates' "
      "collection is not mutable, so its span penalty (span_loss_coef=2e-06) would be dropped "
      "and the spans would only grow: pass mutable=['intermediates']")):
    net.apply(v, x, train=True)
  _, state = net.apply(v, x, train=True, mutable=["intermediates"])  # as it should be
  assert "span_loss" in state["intermediates"]["attn"]
  core._logged.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING, logger="span_lm"):
    net.apply(v, x, train=False)  # evaluation: silent
    assert not caplog.records
    for _ in range(2):
      net.apply(v, x)  # cannot tell: one warning per process
  msgs = [r for r in caplog.records if "span penalty" in r.getMessage()]
  assert len(msgs) == 1 and msgs[0].levelname == "WARNING", caplog.records
  assert "is not mutable, so the span penalty (span_loss_coef=2e-06) is dropped" in \
      msgs[0].getMessage()
  assert "pass deterministic=True" in msgs[0].getMessage()
  # no penalty to drop: nothing to say, in training too
  quiet = A(num_heads=2, max_span=16, span_loss_coef=0.0)
  quiet.apply(quiet.init(jax.random.key(0), x), x, deterministic=False)


def test_learned_spans_read_max_span_from_the_parameters_and_report_the_spans_ahead():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = A(num_heads=2, max_span=16, causal=False, asymmetric=True, name="enc")(x)
      return A(num_heads=2, max_span=32, name="dec")(x)

  shapes = jax.eval_shape(Net().init, jax.random.key(0), _x())["params"]  # no forward pass
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  params["enc"] |= {"span_ratio": jnp.asarray([0.25, 0.5]),
                    "span_ratio_ahead": jnp.asarray([1.5, -0.5])}  # clipped as applied
  params["dec"] |= {"span_ratio": jnp.asarray([0.5, 0.125])}
  got = layers.learned_spans(params)
  assert list(got) == ["dec", "enc", "enc/ahead"]
  np.testing.assert_array_equal(got["enc"], [4.0, 8.0])  # 16 * z'
  np.testing.assert_array_equal(got["enc/ahead"], [16.0, 0.0])
  np.testing.assert_array_equal(got["dec"], [16.0, 4.0])  # 32 * z'
  with pytest.raises(ValueError, match=re.escape(
      "layers.learned_spans: max_span=32, but the layer at 'enc' was built with max_span=16 "
      "(its pos_emb is (8, 16): (head_dim, max_span)); leave max_span out")):
    layers.learned_spans(params, 32)
  with pytest.raises(TypeError, match="takes the parameters"):
    layers.learned_spans(jnp.ones(2))
  with pytest.raises(ValueError, match=r"no 'span_ratio' in what was given"):
    layers.learned_spans({"intermediates": {"attn": {"span_loss": (jnp.zeros(()),)}}})
  # span parameters without a pos_emb beside them (not a layer's): max_span must be given
  bare = {"a": {"span_ratio": jnp.asarray([0.5])}}
  with pytest.raises(ValueError, match="no pos_emb .* pass max_span="):
    layers.learned_spans(bare)
  np.testing.assert_array_equal(layers.learned_spans(bare, 64)["a"], [32.0])
  clamped = layers.clamp_spans(params)
  np.testing.assert_array_equal(clamped["enc"]["span_ratio_ahead"], [1.0, 0.0])
