"""span_lm.layers.nnx.AdaptiveSpanAttention: from the Linen layer's weights it gives the Linen
layer's outputs, gradients and span penalty (causal, bidirectional, asymmetric, masked, segment
ids, grouped heads); grouped heads equal the repeated-heads definition; it works under nnx.jit,
nnx.grad, nnx.scan over layers and nnx.remat; the Linen layer's refusals hold for it; the sown
attention weights are the weights the call applied."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from span_lm import layers

F, H, S, R = 16, 4, 16, 4  # features, heads, max_span, ramp
L = layers.AdaptiveSpanAttention
NNX = layers.nnx.AdaptiveSpanAttention
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _x(n=24, b=2, seed=0):
  return jax.random.normal(jax.random.key(seed), (b, n, F))


def _linen(x, **kw):
  layer = L(**({"num_heads": H, "max_span": S, "ramp": R} | kw))
  params = layer.init(jax.random.key(1), x)["params"]
  # spans apart per head (and ahead), so that a mixed-up head would show
  params["span_ratio"] = jnp.asarray([0.1, 0.5, 0.3, 0.9])
  if "span_ratio_ahead" in params:
    params["span_ratio_ahead"] = jnp.asarray([0.7, 0.2, 0.0, 0.4])
  return layer, params


def _segments(n, b=2):
  seg = np.ones((b, n), np.int32)
  seg[0, n - 5:] = 0  # padding
  seg[1, : n // 3], seg[1, n // 3:] = 1, 2  # two packed sequences
  return jnp.asarray(seg)


CASES = {
    "causal": (dict(), dict()),
    "bidirectional": (dict(causal=False), dict()),
    "asymmetric": (dict(causal=False, asymmetric=True), dict()),
    "key_padding_mask": (dict(causal=False), dict(mask="pad")),
    "dense_mask": (dict(), dict(mask="dense")),
    "segment_ids": (dict(causal=False, asymmetric=True), dict(segment_ids=True)),
    "gqa_causal_segments": (dict(num_kv_heads=2), dict(segment_ids=True)),
    "mqa_bidirectional": (dict(num_kv_heads=1, causal=False), dict()),
}


def _call_kw(kind, n):
  seg = _segments(n)
  if kind.get("mask") == "pad":
    return {"mask": (seg != 0)[:, None, None, :]}
  if kind.get("mask") == "dense":
    rng = np.random.default_rng(0)
    return {"mask": jnp.asarray(rng.random((2, 1, n, n)) < 0.7)}
  if kind.get("segment_ids"):
    return {"segment_ids": seg}
  return {}


FAST = ("causal", "segment_ids", "gqa_causal_segments")


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_nnx_equals_linen_from_the_same_weights_values_gradients_and_penalty(case):
  fields, kind = CASES[case]
  x = _x()
  layer, params = _linen(x, **fields)
  kw = _call_kw(kind, x.shape[1])
  model = NNX.from_linen(layer, params)
  w = jax.random.normal(jax.random.key(3), (2, x.shape[1], F))

  def linen_loss(p, x):
    y, st = layer.apply({"params": p}, x, deterministic=False, mutable=["intermediates"], **kw)
    return jnp.sum(y * w) + 1e3 * layers.span_loss(st["intermediates"]), y

  def nnx_loss(m, x):
    y = m(x, deterministic=False, **kw)
    return jnp.sum(y * w) + 1e3 * layers.span_loss(m), y

  (l_lin, y_lin), (g_lin, gx_lin) = jax.value_and_grad(linen_loss, (0, 1), has_aux=True)(
      params, x)
  (l_nnx, y_nnx), (g_nnx, gx_nnx) = nnx.value_and_grad(
      nnx_loss, argnums=(0, 1), has_aux=True)(model, x)
  np.testing.assert_allclose(y_nnx, y_lin, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(l_nnx, l_lin, rtol=1e-6)
  np.testing.assert_allclose(gx_nnx, gx_lin, rtol=1e-5, atol=1e-6)
  g_nnx = nnx.state(g_nnx, nnx.Param).to_pure_dict()
  assert jax.tree.structure(g_nnx) == jax.tree.structure(g_lin)
  for a, b in zip(jax.tree.leaves(g_nnx), jax.tree.leaves(g_lin)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(g_lin["span_ratio"]).min()) > 0  # the penalty reached every span
  # the spans, read the same way from either
  for k, z in layers.learned_spans(params).items():
    np.testing.assert_array_equal(layers.learned_spans(model)[k], z)


def test_the_converter_goes_both_ways_and_refuses_other_weights():
  model = NNX(H, F, num_kv_heads=2, max_span=S, ramp=R, causal=False, asymmetric=True,
              rngs=nnx.Rngs(0))
  layer, params = model.to_linen()
  assert (layer.num_kv_heads, layer.causal, layer.asymmetric, layer.ramp) == (2, False, True, R)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(
      jnp.shape, layer.init(jax.random.key(0), _x())["params"])
  back = NNX.from_linen(layer, params)
  for a, b in zip(jax.tree.leaves(back.linen_params()), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  x = _x()
  np.testing.assert_array_equal(back(x, deterministic=True), model(x, deterministic=True))
  bad = dict(params) | {"span_ratio": jnp.zeros((H + 1,))}
  with pytest.raises(ValueError, match="load_linen_params: the parameters given do not match"):
    model.load_linen_params(bad)


@pytest.mark.slow  # the fast tier checks grouped heads through the door: tests/kernels/test_gqa.py
@pytest.mark.parametrize("impl", ["auto", "plain"])
def test_grouped_heads_equal_the_repeated_heads_definition(impl):
  """A layer of 4 query heads over 2 KV heads is the 4-head layer whose key and value weights
  are the 2 heads' repeated per group; its KV gradients are the group's gradients summed."""
  x = _x(40)
  gqa, params = _linen(x, num_kv_heads=2, attn_impl=impl)
  mha = L(num_heads=H, max_span=S, ramp=R, attn_impl=impl)
  rep = lambda p: jax.tree.map(lambda a: jnp.repeat(a, 2, axis=-2), p)
  seg = {"segment_ids": _segments(40)}

  def loss(layer, p):
    return jnp.sum(jnp.sin(layer.apply({"params": p}, x, deterministic=True, **seg)))

  full = params | {"key": rep(params["key"]), "value": rep(params["value"])}
  np.testing.assert_allclose(gqa.apply({"params": params}, x, deterministic=True, **seg),
                             mha.apply({"params": full}, x, deterministic=True, **seg),
                             rtol=1e-6, atol=1e-6)
  g = jax.grad(lambda p: loss(gqa, p))(params)
  g_full = jax.grad(lambda p: loss(mha, p))(full)
  group_sum = lambda a: a.reshape(a.shape[:-2] + (2, 2, a.shape[-1])).sum(-2)
  for name in ("key", "value"):
    scale = float(jnp.abs(g_full[name]["kernel"]).max())  # the key bias's gradient is ~0
    for leaf in ("kernel", "bias"):
      np.testing.assert_allclose(g[name][leaf], group_sum(g_full[name][leaf]), rtol=1e-5,
                                 atol=1e-5 * scale)
  for name in ("query", "out", "span_ratio", "pos_emb"):
    for a, b in zip(jax.tree.leaves(g[name]), jax.tree.leaves(g_full[name])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.slow
def test_scan_remat_and_jit_over_layers_give_the_unrolled_values_gradients_and_penalty():
  n_layers, x = 3, _x(20)

  @nnx.vmap(in_axes=0, out_axes=0)
  def create(key):
    return NNX(H, F, num_kv_heads=2, max_span=S, ramp=R, span_init=0.3, span_loss_coef=1e-2,
               rngs=nnx.Rngs(key))

  stack = create(jax.random.split(jax.random.key(0), n_layers))
  unrolled = []
  for i in range(n_layers):
    m = NNX(H, F, num_kv_heads=2, max_span=S, ramp=R, span_init=0.3, span_loss_coef=1e-2,
            rngs=nnx.Rngs(0))
    m.load_linen_params(jax.tree.map(lambda a: a[i], stack.linen_params()))  # pylint: disable=cell-var-from-loop
    unrolled.append(m)

  def scanned(stack, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return h + nnx.remat(lambda l, h: l(h, deterministic=False))(layer, h)
    return body(stack, x)

  def loss_scanned(stack, x):
    y = scanned(stack, x)
    return jnp.sum(y ** 2) + layers.span_loss(stack)

  def loss_unrolled(ms, x):
    h = x
    for m in ms:
      h = h + m(h, deterministic=False)
    return jnp.sum(h ** 2) + sum(layers.span_loss(m) for m in ms)

  l_s, g_s = nnx.jit(nnx.value_and_grad(loss_scanned))(stack, x)
  l_u, g_u = nnx.value_and_grad(loss_unrolled)(unrolled, x)
  np.testing.assert_allclose(l_s, l_u, rtol=1e-5)
  g_s = nnx.state(g_s, nnx.Param).to_pure_dict()
  g_u = [nnx.state(g, nnx.Param).to_pure_dict() for g in g_u]
  scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g_s))  # key bias: ~0, noise
  for path_leaf, a in jax.tree_util.tree_leaves_with_path(g_s):
    for i in range(n_layers):
      b = g_u[i]
      for p in path_leaf:
        b = b[p.key]
      np.testing.assert_allclose(a[i], b, rtol=1e-4, atol=2e-6 * scale)
  spans = layers.learned_spans(stack)
  assert spans[""].shape == (n_layers, H)
  np.testing.assert_allclose(spans[""], 0.3 * S, rtol=1e-6)


def test_the_linen_layers_refusals_hold_for_nnx():
  x = _x()
  model = NNX(H, F, max_span=S, ramp=R, span_init=0.5, rngs=nnx.Rngs(0))
  model(x, deterministic=False)  # sown, never collected ...
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention trains (deterministic=False) but still holds the span penalty an "
      "earlier training call sowed: it was never collected")):
    model(x, deterministic=False)  # ... so the next training call is refused
  layers.span_loss(model)  # collected: training goes on
  model(x, deterministic=False)
  assert float(layers.span_loss(model)) > 0
  model(x, deterministic=True)  # evaluation sows nothing
  with pytest.raises(ValueError, match="no span penalty on this NNX model"):
    layers.span_loss(model)
  NNX(H, F, max_span=S, ramp=R, span_loss_coef=0.0, rngs=nnx.Rngs(0))(x, deterministic=False)
  for module, call in ((model, lambda m: m(x, mask=jnp.ones((2, 3, 24, 24)),
                                            deterministic=True)),
                       (L(num_heads=H, max_span=S, ramp=R),
                        lambda m: m.init(jax.random.key(0), x, mask=jnp.ones((2, 1, 24, 23))))):
    with pytest.raises(ValueError, match=re.escape(
        "AdaptiveSpanAttention: mask of shape")):
      call(module)
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention.num_heads=6 is not a multiple of "
      "AdaptiveSpanAttention.num_kv_heads=4")):
    NNX(6, 24, num_kv_heads=4, max_span=S, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(
      "AdaptiveSpanAttention.num_heads=6 is not a multiple of")):
    L(num_heads=6, num_kv_heads=4, max_span=S)
  with pytest.raises(ValueError, match=re.escape("AdaptiveSpanAttention.ramp=32")):
    NNX(H, F, max_span=S, ramp=32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fields,call", [
    (dict(), dict(segment_ids=True)),
    (dict(causal=False, asymmetric=True, num_kv_heads=2), dict(mask="pad")),
])
def test_sown_weights_are_the_weights_the_call_applied(fields, call):
  """weights @ values, through the out projection, is the layer's output; padded queries have
  zero weights; no weight reaches past a head's window ceil(z) + R."""
  x = _x(24)
  layer, params = _linen(x, **fields)
  kw = _call_kw(call, 24)
  y, st = layer.apply({"params": params}, x, deterministic=True, sow_weights=True,
                      mutable=["intermediates"], **kw)
  (w_lin,) = st["intermediates"]["attention_weights"]
  model = NNX.from_linen(layer, params)
  y_nnx = model(x, deterministic=True, sow_weights=True, **kw)
  (w_nnx,) = nnx.pop(model, nnx.Intermediate)["attention_weights"].get_value()
  np.testing.assert_allclose(w_nnx, w_lin, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(y_nnx, y, rtol=1e-6, atol=1e-6)
  assert w_lin.shape == (2, H, 24, 24)
  vals = jnp.einsum("bnf,fgd->bngd", x, params["value"]["kernel"]) + params["value"]["bias"][None, None]
  vals = jnp.repeat(vals, H // vals.shape[-2], axis=-2)
  o = jnp.einsum("bhnk,bkhd->bnhd", w_lin, vals)
  want = jnp.einsum("bnhd,hdf->bnf", o, params["out"]["kernel"]) + params["out"]["bias"][None, None]
  np.testing.assert_allclose(want, y, rtol=1e-5, atol=1e-5)
  z = np.asarray(layers.learned_spans(params)[""])
  dist = np.arange(24)[:, None] - np.arange(24)[None, :]
  for h in range(H):
    beyond = dist >= np.ceil(z[h]) + R
    assert float(jnp.abs(w_lin[:, h][:, beyond]).max()) == 0.0


def test_under_nnx_capture_the_penalty_and_weights_are_sown_there():
  model = NNX(2, 8, max_span=8, span_init=0.5, span_loss_coef=1e-2, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 5, 8))
  y, inter = nnx.capture(model, nnx.Intermediate)(x, deterministic=False, sow_weights=True)
  np.testing.assert_allclose(layers.span_loss(inter), 1e-2 * 8 * 0.5, rtol=1e-6)
  assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))  # nothing left on the model
  (w,) = nnx.to_pure_dict(inter)["attention_weights"]
  assert w.shape == (1, 2, 5, 5)
  np.testing.assert_allclose(y, model(x, deterministic=True), rtol=1e-6)
