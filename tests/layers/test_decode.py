"""Decoding (decode=True) from the ring cache: N tokens one at a time, or in chunks, equal the full
causal forward at every position (float32, 1e-5 relative), Linen and NNX, grouped heads, rows
with padding and packed sequences, past the ring's length; the cache is max_span slots whatever
was decoded, each KV head reads only its window; the user's mistakes get one line."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from span_lm import layers

F, H, S, R = 16, 4, 32, 4  # features, heads, max_span, ramp
N = 48  # tokens: past the ring's 32 slots
RATIO = jnp.asarray([0.05, 0.3, 0.1, 0.2])  # windows ceil(32 z') + 4: 6, 14, 8, 11
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _x(b=2, n=N, seed=0):
  return jax.random.normal(jax.random.key(seed), (b, n, F))


def _full_and_params(x, kv, **kw):
  layer = layers.AdaptiveSpanAttention(num_heads=H, max_span=S, ramp=R, num_kv_heads=kv, **kw)
  params = layer.init(jax.random.key(1), x)["params"]
  params["span_ratio"] = RATIO
  return layer, params


def _segments():
  seg = np.ones((2, N), np.int32)
  seg[0, :7] = 0  # left padding (a shorter prompt)
  seg[1, :20], seg[1, 20:] = 1, 2  # two sequences packed in one row
  return jnp.asarray(seg)


def _close(got, want):
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("kv,segments", [(4, False), (2, True), (1, False)])
def test_linen_decoding_one_token_at_a_time_equals_the_full_forward(kv, segments):
  x = _x()
  seg = _segments() if segments else None
  full, params = _full_and_params(x, kv)
  want = full.apply({"params": params}, x, segment_ids=seg, deterministic=True)
  dec = layers.AdaptiveSpanAttention(num_heads=H, max_span=S, ramp=R, num_kv_heads=kv,
                                     decode=True,
                                     decode_window=layers.decode_window(params, R))
  cache = dec.init(jax.random.key(1), x[:, :5])["cache"]  # any length: the ring is max_span
  assert cache["cached_key"].shape == (2, S, kv, F // H)

  @jax.jit
  def step(cache, tok, seg):
    y, st = dec.apply({"params": params, "cache": cache}, tok, segment_ids=seg,
                      mutable=["cache"])
    return y, st["cache"]

  outs = []
  for i in range(N):
    y, cache = step(cache, x[:, i:i + 1], None if seg is None else seg[:, i:i + 1])
    outs.append(y)
  _close(jnp.concatenate(outs, axis=1), want)
  assert cache["cached_key"].shape == (2, S, kv, F // H)  # memory independent of N
  assert int(cache["cache_index"]) == N


@pytest.mark.parametrize("kv", [4, 2])
def test_nnx_decoding_in_chunks_with_padding_and_packing_equals_the_full_forward(kv):
  x, seg = _x(), _segments()
  full, params = _full_and_params(x, kv)
  want = full.apply({"params": params}, x, segment_ids=seg, deterministic=True)
  model = layers.nnx.AdaptiveSpanAttention.from_linen(full, params)
  model.init_cache(x.shape)
  # each KV head reads the widest window of its group rounded up to 16, not max_span's 32
  assert model.read_windows == ((16, 16, 16, 16) if kv == 4 else (16, 16))
  step = nnx.jit(lambda m, t, s: m(t, segment_ids=s, decode=True))
  outs, at = [], 0
  for c in (1, 9, 1, 17, 3, 1, 16):  # chunks: prompt pieces, then single tokens
    outs.append(step(model, x[:, at:at + c], seg[:, at:at + c]))
    at += c
  assert at == N
  _close(jnp.concatenate(outs, axis=1), want)
  np.testing.assert_array_equal(jnp.concatenate(outs, axis=1)[0, :7], 0.0)  # padding: zeros
  assert model.cached_key.shape == (2, S, kv, F // H)


def test_learned_windows_set_what_a_head_reads():
  """Wider spans read more of the ring; a head's window past its read size is not reached."""
  x = _x(n=8)
  m = layers.nnx.AdaptiveSpanAttention(H, F, num_kv_heads=2, max_span=64, ramp=R,
                                       rngs=nnx.Rngs(0))
  m.span_ratio[...] = jnp.asarray([0.0, 0.1, 0.5, 0.2])  # windows 4, 11, 36, 17
  m.init_cache(x.shape)
  assert m.read_windows == (16, 48)  # group {0, 1}: 11 -> 16; group {2, 3}: 36 -> 48
  m.span_ratio[...] = jnp.ones((H,))
  m.init_cache(x.shape)
  assert m.read_windows == (64, 64)  # capped at max_span


def test_decoding_mistakes_get_one_line():
  x = _x(n=4)
  m = layers.nnx.AdaptiveSpanAttention(H, F, max_span=S, ramp=R, decode=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention: decoding needs a cache: call init_cache((batch, 1, features)) "
      "first")):
    m(x[:, :1])
  m.init_cache((3, 1, F))
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention: the decoding cache was set up for batch (3,), this call has "
      "batch (2,)")):
    m(x[:, :1])
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention.decode=True: only a causal layer decodes")):
    layers.nnx.AdaptiveSpanAttention(H, F, max_span=S, causal=False, decode=True,
                                     rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention.decode=True: only a causal layer decodes")):
    layers.AdaptiveSpanAttention(num_heads=H, max_span=S, causal=False, decode=True)
  bi = layers.nnx.AdaptiveSpanAttention(H, F, max_span=S, causal=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="only a causal layer decodes"):
    bi(x, decode=True)
  dec = layers.AdaptiveSpanAttention(num_heads=H, max_span=S, ramp=R, decode=True)
  v = dec.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention (top) decodes (decode=True) but has no 'cache' collection")):
    dec.apply({"params": v["params"]}, x[:, :1], mutable=["cache"])
  with pytest.raises(ValueError, match=re.escape("pass mutable=['cache'] to apply")):
    dec.apply(v, x[:, :1])
  with pytest.raises(ValueError, match="the decoding cache was set up for batch"):
    dec.apply(v, _x(b=3, n=1), mutable=["cache"])
