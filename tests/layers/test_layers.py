"""span_lm.layers.AdaptiveSpanAttention: equals Flax's attention at full span, respects masks,
causality and the span window, its penalty reaches the spans, the door (kernel) path equals the
plain path in values and gradients, it works under jit/grad/vmap/remat/scan/sharding, and spans
learn the distance a task needs."""
import logging

import numpy as np
import pytest

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from span_lm import layers
from span_lm.layers import core

F, H, S, R = 16, 2, 32, 8  # features, heads, max_span, ramp


def _layer(**kw):
  return layers.AdaptiveSpanAttention(**({"num_heads": H, "max_span": S, "ramp": R} | kw))


def _x(n, b=2, seed=0):
  return jax.random.normal(jax.random.key(seed), (b, n, F))


def _params(layer, x, *, ratio=None, zero_pe=False, seed=1):
  params = layer.init(jax.random.key(seed), x)["params"]
  if ratio is not None:
    params["span_ratio"] = jnp.full((H,), ratio, jnp.float32)
  if zero_pe:
    params = {k: jnp.zeros_like(v) if k.startswith("pos_emb") else v for k, v in params.items()}
  return params


def _from_mha(mha_params, layer, x):
  """Our parameters with MHA's projections, every span at S, position embeddings zero."""
  params = _params(layer, x, ratio=1.0, zero_pe=True)
  return params | {k: mha_params[k] for k in ("query", "key", "value", "out")}


def _band(n, causal):
  ij = np.arange(n)[:, None] - np.arange(n)[None, :]
  return ((ij >= 0) if causal else True) & (np.abs(ij) < S)


@pytest.mark.slow
@pytest.mark.parametrize("causal,n", [(True, 24), (False, 24), (True, 96)])
def test_equals_flax_attention_at_full_span_without_positions(causal, n):
  """Within the span (n <= S), at z = S with zero position embeddings, the layer is
  nn.MultiHeadDotProductAttention; at n = 96 (the door path) it is MHA with the band mask."""
  x = _x(n)
  mha = nn.MultiHeadDotProductAttention(num_heads=H)
  mha_params = mha.init(jax.random.key(2), x)["params"]
  layer = _layer(causal=causal)
  params = _from_mha(mha_params, layer, x)
  band = jnp.asarray(_band(n, causal))[None, None]
  want = mha.apply({"params": mha_params}, x, mask=band)
  if n <= S:
    mask = nn.make_causal_mask(x[..., 0]) if causal else None  # float32, as Flax builds it
    np.testing.assert_allclose(mha.apply({"params": mha_params}, x, mask=mask), want, atol=1e-6)
  got = layer.apply({"params": params}, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert got.shape == x.shape


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_dtype", [jnp.float32, jnp.bool_])
def test_padding_changes_no_unpadded_output_and_gets_no_gradient(causal, mask_dtype):
  n, keep = 40, np.array([[True] * 33 + [False] * 7, [True] * 20 + [False] * 20])
  x = _x(n)
  mask = nn.make_attention_mask(keep, keep, dtype=mask_dtype)
  if causal:
    mask = nn.combine_masks(mask, nn.make_causal_mask(keep, dtype=mask_dtype)).astype(mask_dtype)
  layer = _layer(causal=causal)
  params = _params(layer, x, ratio=0.6)
  f = jax.jit(lambda x: layer.apply({"params": params}, x, mask=mask))
  noise = jax.random.normal(jax.random.key(5), x.shape) * (~keep)[..., None]
  kept = keep[..., None]
  np.testing.assert_allclose(f(x) * kept, f(x + 3 * noise) * kept, atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * kept))(x)
  assert np.all(np.asarray(g)[~keep] == 0) and np.abs(np.asarray(g)[keep]).min() > 0


def _dependence(layer, params, n):
  """(n, n): |d out_i / d in_j| summed over features, one sequence."""
  x = _x(n, b=1)
  jac = jax.jacrev(lambda x: layer.apply({"params": params}, x))(x)  # 1 n F 1 n F
  return np.abs(np.asarray(jac[0, :, :, 0])).sum(axis=(1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("causal,impl", [(True, "auto"), (True, "plain"), (False, "auto")])
def test_dependence_follows_direction_span_and_window(causal, impl):
  n = 96  # causal auto: the door runs queries 32..95
  ij = np.arange(n)[:, None] - np.arange(n)[None, :]
  layer = _layer(causal=causal, attn_impl=impl)
  # At full span every input within max_span matters, nothing farther (or later, when causal).
  dep = _dependence(layer, _params(layer, _x(n), ratio=1.0), n)
  within = _band(n, causal)
  assert np.all(dep[within] > 0) and np.all(dep[~within] == 0)
  if not causal:
    assert np.all(dep[ij < 0][np.abs(ij[ij < 0]) < S] > 0)  # later inputs within the span
  # A span of z = 8 with ramp 8: distances from z + R = 16 on have mask 0; they reach the output
  # only through the renormaliser's EPS (p m / (sum p m + 1e-8), the reference's), outside the
  # window not at all.
  dep = _dependence(layer, _params(layer, _x(n), ratio=8 / S), n)
  near = within & (np.abs(ij) < 8 + R)
  assert np.all(dep[near] > 0) and np.all(dep[~within] == 0)
  assert dep[~near].max() < 1e-6 * dep.max()


@pytest.mark.slow
def test_span_penalty_gradient_reaches_the_spans():
  x = _x(48)
  layer = _layer(span_loss_coef=1e-3)
  params = _params(layer, x, ratio=0.5)

  def loss(params):
    y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    return layers.span_loss(state["intermediates"]), jnp.mean(y ** 2)

  g_pen = jax.grad(lambda p: loss(p)[0])(params)["span_ratio"]
  np.testing.assert_allclose(g_pen, np.full(H, 1e-3 * S / H), rtol=1e-6)
  g_data = jax.grad(lambda p: loss(p)[1])(params)["span_ratio"]
  assert np.all(np.abs(np.asarray(g_data)) > 0)  # the data loss reaches them through the mask


@pytest.mark.slow
@pytest.mark.parametrize("impl,n,dtype", [
    ("cpu", 96, "float32"), ("cpu", 160, "float32"), ("reference", 96, "float32"),
    ("cpu", 96, "bfloat16"), ("pallas_interpret", 64, "float32")])
def test_door_path_equals_plain_path(impl, n, dtype):
  """Values and gradients (inputs and every parameter) at spans inside the ramp and beyond."""
  x = _x(n).astype(dtype)
  fast, plain = _layer(attn_impl=impl, dtype=dtype), _layer(attn_impl="plain", dtype=dtype)
  params = _params(fast, x)
  params["span_ratio"] = jnp.asarray([0.3, 0.9])
  ct = jax.random.normal(jax.random.key(7), x.shape)

  def run(layer):
    loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

  low = dtype == "bfloat16"
  (v_got, g_got), (v_want, g_want) = run(fast), run(plain)
  tol = dict(rtol=3e-2, atol=3e-2) if low else dict(rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(v_got / abs(v_want), v_want / abs(v_want), **tol)
  for path, a in jax.tree_util.tree_leaves_with_path(g_got):
    if "key" in str(path) and "bias" in str(path):
      continue  # 0 in exact arithmetic (it shifts a row's every score): both are rounding
    b = np.asarray(_get(g_want, path), np.float32)
    a = np.asarray(a, np.float32)
    scale = np.abs(b).max()
    assert scale > 0, path
    np.testing.assert_allclose(a / scale, b / scale, err_msg=str(path), **tol)


def _get(tree, path):
  for p in path:
    tree = tree[getattr(p, "key", getattr(p, "idx", None))]
  return tree


def test_auto_logs_its_choice_once(caplog):
  x = _x(96)
  layer = _layer()
  params = _params(layer, x)
  core._logged.clear()
  with caplog.at_level(logging.INFO, logger="span_lm"):
    for _ in range(2):
      layer.apply({"params": params}, x)
    layer.apply({"params": params}, x, mask=nn.make_causal_mask(x[..., 0]))
  msgs = [r.message for r in caplog.records if "adaptive span attention" in r.message]
  assert len(msgs) == 2, msgs
  assert msgs[0].startswith("adaptive span attention: cpu") and "causal" in msgs[0]
  assert msgs[1].startswith("adaptive span attention: the dense plain path") and "mask" in msgs[1]
  assert "segment_ids" in msgs[1]  # names the fast alternative
  assert [r.levelname for r in caplog.records if "plain path" in r.message] == ["WARNING"]


class _Stack(nn.Module):
  """Two layers, scanned or rematerialised."""
  scan: bool = False
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    cls = nn.remat(layers.AdaptiveSpanAttention) if self.remat else layers.AdaptiveSpanAttention
    if self.scan:
      body = lambda mdl, c, _: (c + mdl(c), None)
      scanned = nn.scan(body, variable_axes={"params": 0, "intermediates": 0},
                        split_rngs={"params": True}, length=2)
      return scanned(cls(num_heads=H, max_span=S, ramp=R, span_init=0.5, span_loss_coef=1e-3,
                         name="layers"), x, None)[0]
    for i in range(2):
      x = x + cls(num_heads=H, max_span=S, ramp=R, span_init=0.5, span_loss_coef=1e-3,
                  name=f"layer{i}")(x)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("scan,remat", [(False, True), (True, False), (True, True)])
def test_remat_and_scan_give_the_unrolled_values_gradients_and_span_loss(scan, remat):
  x = _x(96)
  plain = _Stack()
  params = plain.init(jax.random.key(3), x)["params"]
  other = _Stack(scan=scan, remat=remat)
  o_params = other.init(jax.random.key(3), x)["params"]
  if scan:  # the unrolled layers' parameters, stacked
    o_params = {"layers": jax.tree.map(lambda a, b: jnp.stack([a, b]), params["layer0"],
                                       params["layer1"])}
    assert jax.tree.map(jnp.shape, o_params) == jax.tree.map(jnp.shape, other.init(
        jax.random.key(3), x)["params"])
  else:
    o_params = params

  def loss(model, p):
    y, st = model.apply({"params": p}, x, mutable=["intermediates"])
    return jnp.mean(y ** 2) + layers.span_loss(st)

  want, g_want = jax.jit(jax.value_and_grad(lambda p: loss(plain, p)))(params)
  got, g_got = jax.jit(jax.value_and_grad(lambda p: loss(other, p)))(o_params)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  if scan:
    g_got = {f"layer{i}": jax.tree.map(lambda a, i=i: a[i], g_got["layers"]) for i in range(2)}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_got, g_want)
  spans = layers.learned_spans(o_params, S)
  assert {k: v.shape for k, v in spans.items()} == (
      {"layers": (2, H)} if scan else {"layer0": (H,), "layer1": (H,)})


@pytest.mark.slow
def test_vmap_and_data_parallel_sharding_give_the_batched_values():
  x = _x(96, b=8)
  layer = _layer()
  params = _params(layer, x, ratio=0.4)
  f = jax.jit(lambda x: layer.apply({"params": params}, x))
  want = f(x)
  np.testing.assert_allclose(jax.vmap(lambda xi: f(xi[None])[0])(x), want, atol=1e-5)
  assert len(jax.devices()) == 8  # tests/conftest.py's fake CPU devices
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = jax.jit(jax.value_and_grad(
      lambda p, x: jnp.mean(layer.apply({"params": p}, x) ** 2)),
      in_shardings=(rep, spec), out_shardings=(rep, rep))
  (v_got, g_got), (v_want, g_want) = step(params, jax.device_put(x, spec)), jax.jit(
      jax.value_and_grad(lambda p, x: jnp.mean(layer.apply({"params": p}, x) ** 2)))(params, x)
  np.testing.assert_allclose(v_got, v_want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g_got, g_want)


@pytest.mark.slow
def test_clamp_and_read_spans():
  params = {"a": {"span_ratio": jnp.asarray([-0.5, 0.25, 1.5]), "pos_emb": jnp.full((2,), 5.0)}}
  clamped = layers.clamp_spans(params)
  np.testing.assert_array_equal(clamped["a"]["span_ratio"], [0.0, 0.25, 1.0])
  np.testing.assert_array_equal(clamped["a"]["pos_emb"], [5.0, 5.0])
  np.testing.assert_array_equal(layers.learned_spans(params, 64)["a"], [0.0, 16.0, 64.0])
  layer = _layer()
  v = layer.init(jax.random.key(0), _x(8))
  np.testing.assert_array_equal(layer.apply(v, method="spans"), np.zeros(H))
