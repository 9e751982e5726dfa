"""Reference Adagrad vs a plain float64 numpy port; warmup, span clamping, config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.base import get_base_config
from span_lm.train import optimizer as opt

SHAPES = {"emb": (7, 5), "layers_0": {"w": (5, 5, 3), "b": (3,)}, "span": (4,)}
LR, CLIP, WARMUP, STEPS = 0.07, 0.03, 50, 240


def _numpy_reference(params, grads_seq, lr, clip, warmup):
  """AdagradWithGradClip.step written out plainly, one tensor at a time, in float64."""
  params = {k: v.copy() for k, v in params.items()}
  acc = {k: np.zeros_like(v) for k, v in params.items()}
  clipped = {k: [] for k in params}
  for k_step, grads in enumerate(grads_seq):
    lr_t = lr * min(1.0, (k_step + 1) / warmup) if warmup > 0 else lr
    for name, g in grads.items():
      clr = lr_t
      norm = float(np.sqrt(np.sum(g * g)))
      if clip > 0 and norm > clip:
        clr = clr * clip / (norm + 1e-10)
      clipped[name].append(clr != lr_t)
      acc[name] = acc[name] + g * g
      params[name] = params[name] - clr * g / (np.sqrt(acc[name]) + 1e-10)
  return params, clipped


def _flat(tree):
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def _random_problem(seed=0):
  """Params and gradients whose per-tensor norms straddle CLIP (about c*e^-1 .. c*e^1)."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  params = [rng.normal(size=s) for s in leaves]
  grads = [[rng.normal(size=s) / np.sqrt(np.prod(s)) * CLIP * np.exp(rng.uniform(-1, 1))
            for s in leaves] for _ in range(STEPS)]
  return treedef, params, grads


def _run_optax(tx, treedef, params, grads):
  params = jax.tree.unflatten(treedef, [jnp.asarray(p) for p in params])
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, jax.tree.unflatten(treedef, [jnp.asarray(x) for x in g]))
  return params, state


def _reference_and(tx_fn):
  treedef, params, grads = _random_problem()
  names = list(_flat(jax.tree.unflatten(treedef, params)))
  want, clipped = _numpy_reference(dict(zip(names, params)),
                                   [dict(zip(names, g)) for g in grads], LR, CLIP, WARMUP)
  with jax.enable_x64(True):
    got, state = _run_optax(tx_fn(), treedef, params, grads)
    got = _flat(got)
  return want, got, clipped, state


def test_reference_adagrad_matches_numpy_port_float64():
  want, got, clipped, state = _reference_and(
      lambda: opt.reference_adagrad(opt.warmup_schedule(LR, WARMUP), CLIP))
  for name, flags in clipped.items():  # every tensor is clipped in some steps and not in others
    assert 0 < sum(flags) < len(flags), name
  assert max(np.max(np.abs(want[k] - got[k])) for k in want) < 1e-9
  assert got[next(iter(got))].dtype == np.float64
  assert int(state.count) == STEPS
  assert jax.tree.structure(state.sum) == jax.tree.structure(
      jax.tree.map(lambda s: 0, SHAPES, is_leaf=lambda x: isinstance(x, tuple)))


def test_clip_then_optax_adagrad_is_not_the_reference():
  def clip_then_adagrad():
    def per_tensor_clip(g):
      return g * jnp.minimum(1.0, CLIP / (jnp.sqrt(jnp.sum(g * g)) + 1e-10))
    clip = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(per_tensor_clip, u), s))
    return optax.chain(clip, optax.adagrad(opt.warmup_schedule(LR, WARMUP),
                                           initial_accumulator_value=0.0, eps=1e-10))

  want, got, _, _ = _reference_and(clip_then_adagrad)
  # Adagrad divides the clip scale back out, so steps are far larger than the reference's.
  assert max(np.max(np.abs(want[k] - got[k])) for k in want) > 1e-2


def test_reference_adagrad_float32_no_clip_and_state_layout():
  tx = opt.reference_adagrad(0.5, grad_clip=0.0)
  params = {"a": jnp.ones((3,)), "b": {"c": jnp.ones((2, 2))}}
  state = tx.init(params)
  assert isinstance(state, opt.ReferenceAdagradState)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(state.sum))
  g = {"a": jnp.array([3.0, -4.0, 0.0]), "b": {"c": jnp.full((2, 2), 10.0)}}
  updates, state = jax.jit(tx.update)(g, state)
  # Huge norms, but clipping is off: each first Adagrad step is lr * sign(g) (0 stays 0).
  np.testing.assert_allclose(updates["a"], [-0.5, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_allclose(updates["b"]["c"], np.full((2, 2), -0.5), rtol=1e-6)
  np.testing.assert_allclose(state.sum["a"], [9.0, 16.0, 0.0])
  assert updates["a"].dtype == jnp.float32 and int(state.count) == 1


def test_warmup_schedule_values():
  w, lr = 8, 0.5
  s = opt.warmup_schedule(lr, w)
  for k, want in [(0, lr / w), (1, 2 * lr / w), (w - 2, (w - 1) * lr / w), (w - 1, lr), (w, lr),
                  (10 * w, lr)]:
    assert float(s(jnp.int32(k))) == pytest.approx(want, rel=1e-6), k
  const = opt.warmup_schedule(lr, 0)
  assert float(const(0)) == lr and float(const(1000)) == lr


def test_clamp_spans_only_span_ratio_under_jit():
  params = {
      "layers_0": {"attn": {"span_ratio": jnp.array([-0.5, 0.3, 1.7, 1.0]),
                            "kernel": jnp.array([[-2.0, 3.0]])}},
      "layers_1": {"attn": {"span_ratio": jnp.array([2.0, -1.0, 0.0, 0.5])}},
      "span_ratio_bias": jnp.array([-3.0, 5.0]),
  }
  out = jax.jit(opt.clamp_spans)(params)
  np.testing.assert_array_equal(out["layers_0"]["attn"]["span_ratio"],
                                np.float32([0.0, 0.3, 1.0, 1.0]))
  np.testing.assert_array_equal(out["layers_1"]["attn"]["span_ratio"], [1.0, 0.0, 0.0, 0.5])
  np.testing.assert_array_equal(out["layers_0"]["attn"]["kernel"], [[-2.0, 3.0]])
  np.testing.assert_array_equal(out["span_ratio_bias"], [-3.0, 5.0])
  assert jax.tree.structure(out) == jax.tree.structure(params)


def _cfg(**kw):
  c = get_base_config().optim
  c.update(kw)
  return c


def _one_step(tx, params, grads):
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  return optax.apply_updates(params, updates), updates


@pytest.mark.parametrize("name", ["sgd", "momentum"])
def test_sgd_global_clip_and_momentum(name):
  tx, sched = opt.make_optimizer(_cfg(name=name, lr=0.1, momentum=0.9, grad_clip=1.0, warmup=0))
  params = {"w": jnp.zeros((3,)), "v": jnp.zeros((4,))}
  grads = {"w": jnp.full((3,), 100.0), "v": jnp.full((4,), -100.0)}
  new, updates = _one_step(tx, params, grads)
  norm = float(optax.tree.norm(updates))
  assert norm == pytest.approx(0.1 * 1.0, rel=1e-5)  # clipped to global norm 1, times lr
  assert float(sched(0)) == pytest.approx(0.1)
  assert float(new["w"][0]) < 0 < float(new["v"][0])


def test_adam_reference_run_settings():
  tx, sched = opt.make_optimizer(_cfg(name="adam", lr=2.5e-4, grad_clip=1.0, warmup=8000))
  assert float(sched(0)) == pytest.approx(2.5e-4 / 8000)
  assert float(sched(8000)) == pytest.approx(2.5e-4)
  params = {"w": jnp.zeros((3,))}
  _, updates = _one_step(tx, params, {"w": jnp.array([5.0, -5.0, 1.0])})
  np.testing.assert_allclose(updates["w"], np.array([-1, 1, -1]) * 2.5e-4 / 8000, rtol=1e-3)


def test_adagrad_config_is_reference():
  tx, sched = opt.make_optimizer(get_base_config().optim)
  assert float(sched(0)) == pytest.approx(0.07 / 8000)
  assert isinstance(tx.init({"w": jnp.zeros(2)}), opt.ReferenceAdagradState)


@pytest.mark.parametrize("field,value", [
    ("name", "adamw"), ("lr", 0.0), ("lr", -1.0), ("grad_clip", -0.1), ("warmup", -1),
    ("momentum", -0.5), ("momentum", 1.0), ("batch_split", 0), ("warmup", 1.5)])
def test_bad_fields_raise_naming_the_field(field, value):
  c = get_base_config().optim
  with c.ignore_type():
    setattr(c, field, value)
  with pytest.raises(ValueError, match=rf"config\.optim\.{field}"):
    opt.make_optimizer(c)


def test_momentum_name_needs_momentum():
  with pytest.raises(ValueError, match=r"config\.optim\.momentum"):
    opt.make_optimizer(_cfg(name="momentum", momentum=0.0))
