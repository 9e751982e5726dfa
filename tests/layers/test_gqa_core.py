"""Grouped key/value heads in the layers' attention function (span_lm.layers.core.span_attention):
keys and values of kv_heads heads (GQA; 1: MQA) give what the same call gives with them repeated
to the query heads (query head h reads key/value head h // (heads // kv_heads)), in values and in
the gradients of queries, keys, values, spans and position embeddings, through the door (cpu,
reference) and the dense plain path, causal and bidirectional, with segment ids; a head count
that does not divide is refused in one line before anything is traced."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from span_lm.layers import core

B, N, H, DH, S = 2, 24, 4, 8, 16
SEGMENTS = [1] * 14 + [2] * 8 + [0] * 2  # two documents, then padding


def _inputs(kv_heads, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return dict(query=arr(B, N, H, DH), key=arr(B, N, kv_heads, DH), value=arr(B, N, kv_heads, DH),
              span_ratio=jnp.asarray(rng.uniform(0.1, 0.5, H), jnp.float32),
              pos_back=arr(DH, S), pos_ahead=arr(DH, S))


@pytest.mark.parametrize("impl", ["cpu", "reference", "plain"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_heads_equal_repeated_heads(impl, causal, kv_heads):
  args = _inputs(kv_heads)
  seg = jnp.asarray([SEGMENTS] * B, jnp.int32)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=(B, N, H, DH)), jnp.float32)
  names = list(args)

  def run(repeat):
    @jax.jit
    def value_and_grads(*xs):
      def f(*xs):
        a = dict(zip(names, xs))
        if repeat:
          a["key"], a["value"] = (jnp.repeat(a[n], H // kv_heads, axis=-2)
                                  for n in ("key", "value"))
        if causal:
          a["pos_ahead"] = None
        return core.span_attention(**a, max_span=S, causal=causal, ramp=4, segment_ids=seg,
                                   attn_impl=impl)
      out, vjp = jax.vjp(f, *xs)
      return out, vjp(ct)
    return value_and_grads(*args.values())

  (out, grads), (want, want_grads) = run(False), run(True)
  scale = lambda x: float(jnp.max(jnp.abs(x)))
  np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * scale(want))
  for name, g, w in zip(names, grads, want_grads):
    if causal and name == "pos_ahead":
      continue  # unused
    assert g.shape == args[name].shape and scale(w) > 0, name
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * scale(w), err_msg=f"d{name}")


def test_heads_that_do_not_divide_are_refused_in_one_line():
  args = _inputs(3)
  with pytest.raises(ValueError, match=r"^span_attention: 4 query heads are not a multiple of 3 "
                                       r"key/value heads[^\n]*$"):
    core.span_attention(**args, max_span=S, attn_impl="cpu")
  args["value"] = args["value"][..., :2, :]
  with pytest.raises(ValueError, match="key .* and value .* differ"):
    core.span_attention(**args, max_span=S)


def test_ungrouped_spec_is_unchanged():
  """kv_heads equal to heads builds the very spec of before (the jit caches and compiled
  programs of ungrouped layers stay as they were)."""
  assert core.layer_spec(4, 8, 16, 4, kv_heads=4) == core.layer_spec(4, 8, 16, 4)
  assert core.layer_spec(4, 8, 16, 4, kv_heads=2).group == 2
