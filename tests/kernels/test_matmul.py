"""Mixed-precision matmuls (span_lm/kernels/matmul.py; their CPU layouts: cpu_matmul.py):
bf16 x bf16 -> f32 in both passes."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_helpers import build
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.kernels import matmul
from span_lm.model.transformer import SpanTransformer

SPECS = [("bgncd,bgnkd->bgnck", (2, 3, 2, 4, 8), (2, 3, 2, 6, 8)),
         ("bgnck,bgnkd->bgncd", (2, 3, 2, 4, 6), (2, 3, 2, 6, 8)),
         ("bgncd,dw->bgncw", (2, 3, 2, 4, 8), (8, 5)),
         ("mk,kn->mn", (7, 8), (8, 9))]


def _dots(jaxpr):
  """(lhs dtype, rhs dtype) of every dot_general in a jaxpr, nested ones included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append((str(eqn.invars[0].aval.dtype), str(eqn.invars[1].aval.dtype)))
    for p in eqn.params.values():
      inner = getattr(p, "jaxpr", None)
      if inner is not None and hasattr(inner, "eqns"):
        out.extend(_dots(inner))
      elif hasattr(p, "eqns"):
        out.extend(_dots(p))
  return out


@pytest.mark.parametrize("spec, sa, sb", SPECS)
def test_float32_is_plain_einsum(spec, sa, sb):
  ka, kb = jax.random.split(jax.random.key(0))
  a, b = jax.random.normal(ka, sa), jax.random.normal(kb, sb)
  f = lambda a, b: jnp.sum(jnp.sin(matmul.einsum(spec, a, b)))
  g = lambda a, b: jnp.sum(jnp.sin(jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)))
  np.testing.assert_array_equal(matmul.einsum(spec, a, b), jnp.einsum(spec, a, b))
  for x, y in zip(jax.grad(f, (0, 1))(a, b), jax.grad(g, (0, 1))(a, b)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec, sa, sb", SPECS)
def test_bf16_forward_and_backward_are_bf16_dots_close_to_float32(spec, sa, sb):
  ka, kb = jax.random.split(jax.random.key(1))
  a32, b32 = jax.random.normal(ka, sa), jax.random.normal(kb, sb)
  a, b = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
  y = matmul.einsum(spec, a, b, jnp.float32)
  assert y.dtype == jnp.float32
  # Accumulated in float32: equal to the float32 product of the rounded operands.
  np.testing.assert_allclose(y, jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32)),
                             rtol=1e-5, atol=1e-5)
  loss = lambda a, b: jnp.sum(jnp.sin(matmul.einsum(spec, a, b, jnp.float32)))
  grads = jax.grad(loss, (0, 1))(a, b)
  ref = jax.grad(lambda a, b: jnp.sum(jnp.sin(jnp.einsum(spec, a, b))), (0, 1))(
      a.astype(jnp.float32), b.astype(jnp.float32))
  for g, r, x in zip(grads, ref, (a, b)):
    assert g.dtype == x.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=3e-2, atol=3e-2)
  dots = _dots(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b).jaxpr)
  assert len(dots) == 3 and all(d == ("bfloat16", "bfloat16") for d in dots), dots


def test_self_summed_index_is_refused():
  a = jnp.ones((2, 3), jnp.bfloat16)
  with pytest.raises(ValueError, match="summed on its own"):
    matmul.einsum("ij,jk->k", a, jnp.ones((3, 4), jnp.bfloat16))
  with pytest.raises(ValueError, match="dtypes differ"):  # (a float32 second operand is a weight)
    matmul.einsum("ij,jk->ik", a.astype(jnp.float32), jnp.ones((3, 4), jnp.bfloat16))
  with pytest.raises(ValueError, match="dtypes differ"):
    matmul.einsum("ij,jk->ik", a, jnp.ones((3, 4), jnp.float16))


def test_dense_dot_general_matches_dense():
  x = jax.random.normal(jax.random.key(2), (2, 5, 8))
  plain, ours = nn.Dense(6), nn.Dense(6, dot_general=matmul.dense_dot_general)
  params = plain.init(jax.random.key(3), x)
  np.testing.assert_allclose(ours.apply(params, x), plain.apply(params, x), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="unsupported"):
    matmul.dense_dot_general(x.astype(jnp.bfloat16), jnp.ones((2, 6), jnp.bfloat16),
                                (((0,), (0,)), ((), ())))
  low = nn.Dense(6, dtype=jnp.bfloat16, dot_general=matmul.dense_dot_general)
  np.testing.assert_allclose(low.apply(params, x).astype(np.float32), plain.apply(params, x),
                             rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_bf16_model_step_has_no_float32_matmul():
  """Every matmul of a bf16 model's forward and backward is bf16 x bf16 (the CPU fast path)."""
  cfg = build({"vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
               "span.size": 16, "span.ramp": 4, "span.init": 0.5, "dtype": "bfloat16"})
  model = SpanTransformer(cfg, plan_lib.full_plan(cfg))
  x = jnp.zeros((2, 8), jnp.int32)
  caches = caches_lib.init_caches(cfg, None, 2)
  params = model.init(jax.random.key(0), x, caches)["params"]

  def loss(p):
    logp, _, aux = model.apply({"params": p}, x, caches)
    return -jnp.mean(logp[..., 0]) + aux["span_loss"]

  dots = _dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  assert len(dots) >= 3 * (2 * 7 + 1)  # per layer q, kv (cache + block), QK, pos, AV, out, fc1, fc2
  assert all(d == ("bfloat16", "bfloat16") for d in dots), [d for d in dots if d[0] != "bfloat16"]


@pytest.mark.slow
def test_precision_dense_is_nn_dense_and_sums_its_bias_gradient_in_float32():
  """matmul.Dense has nn.Dense's parameters and float32 results; in bf16 its bias gradient is
  a float32 sum (nn.Dense(dtype=bf16) accumulates it in bf16: visibly off over many tokens)."""
  x = jax.random.normal(jax.random.key(2), (4, 512, 8))
  plain = nn.Dense(6, bias_init=nn.initializers.normal(1.0))
  ours = matmul.Dense(6, nn.initializers.lecun_normal(), nn.initializers.normal(1.0))
  params = plain.init(jax.random.key(3), x)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(3), x)) == jax.tree.map(jnp.shape, params)
  np.testing.assert_array_equal(ours.apply(params, x), plain.apply(params, x))
  g = jax.random.normal(jax.random.key(4), (4, 512, 6)) + 3.0  # a large mean: bf16 sums drift
  exact = np.asarray(g, np.float64).sum((0, 1))

  def bias_grad(module, dtype):
    m = module.clone(dtype=dtype)
    f = lambda p: jnp.sum(m.apply(p, x).astype(jnp.float32) * g)
    return np.asarray(jax.grad(f)(params)["params"]["bias"], np.float64)

  ours_err = np.max(np.abs(bias_grad(ours, jnp.bfloat16) - exact) / np.abs(exact))
  plain_err = np.max(np.abs(bias_grad(plain, jnp.bfloat16) - exact) / np.abs(exact))
  assert ours_err < 5e-3 < plain_err, (ours_err, plain_err)


def _bf16_rounded(x):
  x = np.asarray(x, np.float32)
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def test_bf16_weight_gradient_is_the_float32_product():
  """A bf16 layer's float32 kernel gets the float32-accumulated x^T g as its gradient, not that
  product rounded to bf16: parameters are float32 and the reference sums float32 gradients (over
  pieces and devices), so the weight gradient stays float32 from the backward dot on."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 32, 24)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)
  dense = matmul.Dense(16, nn.initializers.lecun_normal(), nn.initializers.zeros, jnp.bfloat16)
  params = dense.init(jax.random.key(0), x)
  got = jax.grad(lambda p: jnp.sum(dense.apply(p, x).astype(jnp.float32) * g))(params)
  got = np.asarray(got["params"]["kernel"])
  assert got.dtype == np.float32
  # The operands as the matmuls see them: x and the output cotangent in bf16.
  xb = np.asarray(x.astype(jnp.bfloat16), np.float64).reshape(-1, 24)
  gb = np.asarray(g.astype(jnp.bfloat16), np.float64).reshape(-1, 16)
  exact = xb.T @ gb
  err, bf16_err = np.abs(got - exact).max(), np.abs(_bf16_rounded(exact) - exact).max()
  assert err < 1e-4 < bf16_err / 10, (err, bf16_err)
  # The same through einsum/dot directly: a float32 weight next to bf16 is cast inside, and its
  # cotangent is float32; the activation's stays bf16.
  w = jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)
  xl = x.astype(jnp.bfloat16)
  dx, dw = jax.grad(lambda x, w: jnp.sum(matmul.dot(x, w, jnp.float32) * g), (0, 1))(xl, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(dw, exact, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(matmul.dot(xl, w), matmul.dot(xl, w.astype(jnp.bfloat16)))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("kind", ["fixed", "adaptive_short", "persistent"])
def test_bf16_model_parameter_gradients_are_not_rounded_to_bf16(impl, kind):
  """Every float32 parameter of a bf16 model that a matmul reads (projections, feed-forward and
  output kernels, key_pe, persistent vectors) gets an unrounded float32 gradient: it passes the
  float32 parameter into the matmul, which casts it (nn.Dense(dtype=bf16) and `.astype` before
  the matmul rounded every such gradient to bf16). Both attention implementations; cpu 'fixed'
  takes the positions-last projection and the keyed custom VJP, 'adaptive_short' the banded one."""
  fields = {"vocab_size": 23, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
            "span.size": 32, "span.ramp": 4, "attention.impl": impl, "dtype": "bfloat16"}
  fields.update({"fixed": {"span.mode": "fixed"},
                 "adaptive_short": {"span.mode": "adaptive", "span.init": 0.1,
                                    "plan.granularity": 8},
                 "persistent": {"span.mode": "fixed", "pers_mem": 16}}[kind])
  cfg = build(fields)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 23, (4, 16)), jnp.int32)
  full = plan_lib.full_plan(cfg)
  params = SpanTransformer(cfg, full).init(jax.random.key(0), x,
                                           caches_lib.init_caches(cfg, full, 4))["params"]
  model = SpanTransformer(cfg, plan_lib.plan_from_params(cfg, params))
  caches = tuple(jnp.asarray(rng.standard_normal(c.shape), jnp.float32)
                 for c in caches_lib.init_caches(cfg, model.plan, 4))

  def loss(p):
    logp, _, aux = model.apply({"params": p}, x, caches)
    return -jnp.mean(jnp.take_along_axis(logp, x[..., None], -1)) + aux["span_loss"]

  grads = jax.jit(jax.grad(loss))(params)
  checked = []
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if not (name.endswith("kernel") or name.split("/")[-1] in ("key_pe", "pers_key", "pers_val")):
      continue
    g = np.asarray(g)
    assert g.dtype == np.float32, name
    nz = g[g != 0]
    assert nz.size and np.mean(_bf16_rounded(nz) == nz) < 0.1, name  # random f32: ~2^-16
    checked.append(name.split("/")[-2] if name.endswith("kernel") else name.split("/")[-1])
  want = {"proj_query", "proj_key", "proj_val", "proj_out", "key_pe", "out_emb"}
  want |= {"pers_key", "pers_val"} if kind == "persistent" else {"fc1", "fc2"}
  assert set(checked) == want, checked


# Contractions whose natural layout XLA:CPU's fast matmul kernel refuses: weight gradients
# (token axis contracted), banded attention's key/value gradients, the position-embedding
# gradient, batch axes not leading (persistent memory), and an output order that needs a
# transpose.
CONTRACT_SPECS = [("mk,mn->kn", (64, 16), (64, 24)),
                  ("mk,mn->kn", (64, 24), (64, 16)),
                  ("mn,kn->mk", (64, 16), (24, 16)),
                  ("bgnck,bgncd->bgnkd", (2, 3, 2, 8, 12), (2, 3, 2, 8, 16)),
                  ("bgncd,bgnck->bgnkd", (2, 3, 2, 8, 16), (2, 3, 2, 8, 12)),
                  ("bgncd,bgncw->dw", (2, 3, 2, 8, 16), (2, 3, 2, 8, 10)),
                  ("bgncp,gpd->bgncd", (2, 3, 2, 8, 8), (3, 8, 16)),
                  ("bgncd,bgncp->gpd", (2, 3, 2, 8, 16), (2, 3, 2, 8, 8)),
                  ("bhl,bhld->bhd", (2, 4, 16), (2, 4, 16, 8)),
                  ("mk,kn->nm", (16, 32), (32, 24)),
                  # positions-last key/value projection (rows flattened inside contract) and its
                  # weight and input gradients
                  ("btd,dz->zbt", (2, 12, 8), (8, 10)),
                  ("btd,zbt->dz", (2, 12, 8), (10, 2, 12)),
                  ("zbt,dz->btd", (10, 2, 12), (8, 10))]


@pytest.mark.parametrize("spec, sa, sb", CONTRACT_SPECS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_equals_einsum(spec, sa, sb, dtype):
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal(sa), dtype)
  b = jnp.asarray(rng.standard_normal(sb), dtype)
  want = np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
  got = jax.jit(lambda a, b: matmul.contract(spec, a, b))(a, b)
  assert got.dtype == jnp.float32 and got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _fast_dots(spec, sa, sb):
  """Whether every dot XLA compiles for `contract(spec)` on bf16 runs in XLA:CPU's YNNPACK
  kernels (no dot left at the top level, where Eigen runs it in float32)."""
  a, b = jnp.ones(sa, jnp.bfloat16), jnp.ones(sb, jnp.bfloat16)
  text = jax.jit(lambda a, b: matmul.contract(spec, a, b)).lower(a, b).compile().as_text()
  entry = text[text.index("ENTRY"):]
  return "ynn_fusion" in entry and " dot(" not in entry


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's matmul kernels")
def test_contract_sends_every_backward_dot_to_the_fast_kernel():
  if not _fast_dots("mk,kn->mn", (256, 128), (128, 256)):
    pytest.skip("this XLA:CPU build has no YNNPACK dots")
  for spec, sa, sb in [("mk,mn->kn", (256, 128), (256, 192)),
                       ("mk,mn->kn", (256, 192), (256, 128)),
                       ("bgnck,bgncd->bgnkd", (2, 4, 2, 64, 128), (2, 4, 2, 64, 64)),
                       ("bgncd,bgnck->bgnkd", (2, 4, 2, 64, 64), (2, 4, 2, 64, 128))]:
    # (Plain jnp.einsum fails this on jax 0.10-0.12: the dot stays outside YNNPACK.)
    assert _fast_dots(spec, sa, sb), spec


@pytest.mark.parametrize("w, c, m", [(4, 4, 8), (2, 4, 8), (6, 4, 8), (8, 8, 8)])
def test_bf16_key_window_gradient_adds_overlaps_in_float32(w, c, m):
  from span_lm.kernels.span.banded_cpu import key_windows  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  y = jnp.asarray(rng.standard_normal((2, 3, w + m, 4)), jnp.bfloat16)
  win, vjp = jax.vjp(lambda y: key_windows(y, w, c), y)
  g = jnp.asarray(rng.standard_normal(win.shape), jnp.bfloat16)
  # Window j of chunk i holds key i * c + j: its gradient is the sum over the windows holding it.
  g64 = np.asarray(g, np.float64)
  want = np.zeros(y.shape)
  for i in range(m // c):
    np.testing.assert_array_equal(np.asarray(win[:, :, i]), np.asarray(y[:, :, i * c:i * c + w + c]))
    want[:, :, i * c:i * c + w + c] += g64[:, :, i]
  got, = vjp(g)
  assert got.dtype == jnp.bfloat16
  # One rounding of the exact sum (autodiff would round after each add).
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16)))


def test_contract_under_a_mesh_never_gathers_the_batch():
  """The trainer traces under a mesh with the batch sharded on dim 0: contract's layout copies
  must not merge that dim with others (XLA would all-gather the batch to every device)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from span_lm.train import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(2)
  rng = np.random.default_rng(0)
  cases = [("bgnck,bgncd->bgnkd", (4, 2, 2, 16, 32), (4, 2, 2, 16, 16)),
           ("mk,mn->kn", (64, 16), (64, 24)),
           ("bgncp,gpd->bgncd", (4, 2, 2, 16, 8), (2, 8, 16))]
  for spec, sa, sb in cases:
    a = jnp.asarray(rng.standard_normal(sa), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(sb), jnp.bfloat16)
    a = jax.device_put(a, NamedSharding(mesh, P(sharding.DATA_AXIS)))
    b_spec = P(sharding.DATA_AXIS) if spec.split(",")[1][0] == spec[0] else P()
    b = jax.device_put(b, NamedSharding(mesh, b_spec))
    f = jax.jit(lambda a, b, spec=spec: matmul.contract(spec, a, b))
    with jax.set_mesh(mesh):
      text = f.lower(a, b).compile().as_text()
      got = f(a, b)
    assert "all-gather" not in text and "all-to-all" not in text, spec
    want = np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fixed", "adaptive_short", "persistent"])
def test_bf16_model_gradients_follow_float32(kind):
  """The whole bf16 model (every matmul through contract's layouts; key windows gathered (W > C)
  or as two strided views (W <= C)) against the same float32 model: each parameter's gradient
  points the same way and has the same size, to bf16 accuracy."""
  fields = {"vocab_size": 23, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
            "span.size": 32, "span.ramp": 4}
  if kind == "fixed":
    fields.update({"span.mode": "fixed"})
  elif kind == "adaptive_short":  # 8-token windows, chunks of 16 queries
    fields.update({"span.mode": "adaptive", "span.init": 0.1, "plan.granularity": 8})
  else:
    fields.update({"span.mode": "fixed", "pers_mem": 16})
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 23, (4, 16)), jnp.int32)
  y = jnp.asarray(rng.integers(0, 23, (4, 16)), jnp.int32)
  grads = {}
  for dtype in ("float32", "bfloat16"):
    cfg = build(fields, dtype=dtype)
    full = plan_lib.full_plan(cfg)
    params = SpanTransformer(cfg, full).init(jax.random.key(0), x,
                                             caches_lib.init_caches(cfg, full, 4))["params"]
    plan = plan_lib.plan_from_params(cfg, params)
    if kind == "adaptive_short":
      assert all(w == 8 for layer in plan.layers for _, w in layer.groups), plan.describe()
    model = SpanTransformer(cfg, plan)
    caches = tuple(jnp.asarray(np.random.default_rng(1).standard_normal(c.shape), jnp.float32)
                   for c in caches_lib.init_caches(cfg, plan, 4))

    def loss(p, model=model, caches=caches):
      logp, _, aux = model.apply({"params": p}, x, caches)
      return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1)) + aux["span_loss"]

    grads[dtype] = jax.jit(jax.grad(loss))(params)
  flat32 = jax.tree_util.tree_leaves_with_path(grads["float32"])
  flat16 = jax.tree.leaves(grads["bfloat16"])
  assert len(flat32) == len(flat16)
  for (path, g32), g16 in zip(flat32, flat16):
    a, b = np.ravel(np.asarray(g32, np.float64)), np.ravel(np.asarray(g16, np.float64))
    if np.linalg.norm(a) < 1e-6:
      continue
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    assert cos > 0.98, (jax.tree_util.keystr(path), cos)
    assert abs(np.linalg.norm(b) / np.linalg.norm(a) - 1) < 0.05, jax.tree_util.keystr(path)
