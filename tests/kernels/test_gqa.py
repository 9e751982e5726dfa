"""Grouped key/value heads (GQA; one key/value head: MQA) through the door: every implementation,
given keys and values of H_kv heads for H query heads, equals the same implementation given them
repeated to H heads (query head h reads key/value head h // (H / H_kv)), in values and in every
gradient (queries, keys, values, position embeddings behind and ahead, spans), causal and
bidirectional, with segment ids; and no implementation makes the H copies (the jaxpr holds no
array as large as the repeated keys). The interpreted kernels are slow: `slow`."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from span_lm import kernels

B, H, M, W, DH, R = 1, 4, 16, 16, 8, 4
SEG_Q = [1] * 10 + [2] * 6  # two documents in the block


def _case(kv_heads, a, seed=0):
  """Door inputs: queries (B, H, M, Dh), keys/values of the W + M + A rows with kv_heads heads,
  position embeddings, per-head spans, segment ids (two documents; padding before the block)."""
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  t = W + M + a
  args = dict(q=arr(B, H, M, DH), k=arr(B, kv_heads, t, DH), v=arr(B, kv_heads, t, DH),
              pe=arr(DH, W), z=jnp.asarray(rng.uniform(2, W - R, (1, H, 1)), jnp.float32))
  if a:
    args["pe_a"] = arr(DH, a)
  seg = kernels.Segments(jnp.asarray([SEG_Q] * B, jnp.int32),
                         jnp.asarray([[0] * 4 + [1] * (W - 4 + 10) + [2] * (6 + a)] * B,
                                     jnp.int32))
  return args, seg


def _spec(impl, a, kv_heads=None):
  return kernels.Spec(heads=H, head_dim=DH, window=W, ahead=a, ramp=R, segmented=True,
                      attention=kernels.Attention(impl=impl, block=16), kv_heads=kv_heads)


def _attend(impl, a, seg, repeat: bool, kv_heads: int):
  """The door's attend, with keys and values as given (grouped) or repeated to H heads."""
  def f(q, k, v, pe, z, pe_a=None):
    if repeat:
      k, v = (jnp.repeat(x, H // kv_heads, axis=1) for x in (k, v))
    spec = _spec(impl, a, None if repeat else kv_heads)
    extra = {"key_pe_ahead_DxA": pe_a} if a else {}
    return kernels.IMPLS[impl].attend(spec, q, kernels.KV(k, v), pe, span_z=z, segments=seg,
                                      **extra)
  return f


def _check_against_repeated(impl, kv_heads, a, rtol=2e-5):
  args, seg = _case(kv_heads, a)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=(B, H, M, DH)), jnp.float32)
  names = list(args)
  results = []
  for repeat in (False, True):
    f = _attend(impl, a, seg, repeat, kv_heads)

    @jax.jit
    def value_and_grads(*xs, f=f):
      out, vjp = jax.vjp(lambda *xs: f(**dict(zip(names, xs))), *xs)
      return out, vjp(ct)

    out, grads = value_and_grads(*args.values())
    results.append((out, dict(zip(names, grads))))
  (out, grads), (want, want_grads) = results
  scale = lambda x: float(jnp.max(jnp.abs(x))) + 1e-6
  np.testing.assert_allclose(out, want, rtol=0, atol=rtol * scale(want))
  for name in names:
    g, w = grads[name], want_grads[name]
    assert g.shape == w.shape == args[name].shape, name
    assert float(jnp.max(jnp.abs(w))) > 0, f"{name}: a zero gradient checks nothing"
    np.testing.assert_allclose(g, w, rtol=0, atol=rtol * scale(w), err_msg=f"d{name}")


_GROUPS = [(kv, a) for kv in (2, 1) for a in (0, 5)]  # GQA and MQA, causal and 5 rows ahead


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("kv_heads,a", _GROUPS)
def test_grouped_heads_equal_repeated_heads(impl, kv_heads, a):
  _check_against_repeated(impl, kv_heads, a)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_tpu_interpret"])
@pytest.mark.parametrize("kv_heads,a", _GROUPS)
def test_fused_kernels_grouped_heads_equal_repeated_heads(impl, kv_heads, a):
  """The kernels read key/value head h // group through their index maps; dk and dv sum the
  group's query heads inside the dk/dv kernel."""
  _check_against_repeated(impl, kv_heads, a)


def _arrays(jaxpr):
  """Every array an equation of the jaxpr (and of the jaxprs inside it) produces."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in eqn.outvars if hasattr(v.aval, "shape"))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
        if hasattr(sub, "eqns"):
          yield from _arrays(sub)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_interpret",
                                  "pallas_tpu_interpret"])
@pytest.mark.parametrize("a", [0, 5])
def test_no_implementation_repeats_the_keys(impl, a):
  """Forward and backward of the grouped call (one key/value head) hold no array of the keys'
  head size with H times the key rows' elements or more: the H copies a repeat would make
  (their gradient included). The repeated call's jaxpr does hold one: the check sees them."""
  args, seg = _case(1, a)
  t = W + M + a
  copies = B * H * t * DH

  def largest(repeat):
    f = _attend(impl, a, seg, repeat, 1)
    loss = lambda *xs: jnp.sum(f(*xs) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args.values())
    return max((np.prod(x.shape) for x in _arrays(jaxpr.jaxpr)
                if len(x.shape) >= 2 and x.shape[-1] == DH or x.shape[-2:-1] == (DH,)),
               default=0)

  assert largest(repeat=True) >= copies
  assert largest(repeat=False) < copies


def test_kv_heads_that_do_not_divide_are_refused():
  args, seg = _case(3, 0)
  for impl in kernels.IMPLS:  # before any kernel is traced
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 key/value heads"):
      kernels.IMPLS[impl].attend(_spec(impl, 0), args["q"], kernels.KV(args["k"], args["v"]),
                                 args["pe"], span_z=args["z"], segments=seg)
  with pytest.raises(ValueError, match="kv_heads=3: must be a positive integer dividing heads=4"):
    _spec("reference", 0, 3)
