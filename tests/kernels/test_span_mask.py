"""The soft span mask's derivative at the ramp's ends follows the reference's torch.clamp.

torch.clamp passes the gradient on the closed interval [min, max]; jnp.clip passes 1/2 at either
end. Whole-token spans (z = 0 included: the reference's initialisation, held there by the clamp
after each update) put keys exactly on those ends, so the convention decides how spans learn.
Every implementation's span gradient is compared with the float64 numpy reference's.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import reference_numpy as ref
from model_helpers import build
from span_lm import kernels
from span_lm.kernels.span import span_mask

B, DH, R = 2, 16, 3


def _inputs(seed, g, m, w, n_pers):
  rng = np.random.default_rng(seed)
  arrays = [rng.normal(size=(B, g, m, DH)), rng.normal(size=(B, g, w + m, DH)),
            rng.normal(size=(B, g, w + m, DH)), rng.normal(size=(DH, w)),
            rng.normal(size=(B, g, m, DH))]
  pers = None
  if n_pers:
    pers = (rng.normal(size=(g, DH, n_pers)), rng.normal(size=(g, n_pers, DH)))
  return rng, arrays, pers


def _whole_token_spans(rng, dynamic, g, m, w):
  """Integer spans whose both ramp ends (distance z + 1: m = 1; z + R + 1: m = 0) lie in the
  window, z = 0 included."""
  if dynamic:
    z = rng.integers(0, w - R, size=(B, g, m)).astype(np.float32)
    z[0, 0, :2] = 0.0
    return z
  return np.array([0.0, w - R - 1.0, 5.0, 2.0][:g], np.float32).reshape(1, g, 1)


def test_clamp01_derivative_is_one_on_the_closed_interval():
  x = jnp.array([-0.5, 0.0, 0.25, 1.0, 1.5])
  np.testing.assert_array_equal(jax.vmap(jax.grad(span_mask.clamp01))(x), [0, 1, 1, 1, 0])
  np.testing.assert_array_equal(span_mask.clamp01(x), jnp.clip(x, 0.0, 1.0))
  np.testing.assert_array_equal(span_mask.clamp01_slope(x), [0, 1, 1, 1, 0])


def door_cfg(impl, **kw):
  """A model config for calling the door's attend directly (head size DH)."""
  base = {"vocab_size": 11, "d_model": 2 * DH, "n_heads": 2, "d_ff": 8, "span.size": 16,
          "span.ramp": R, "span.mode": "adaptive", "attention.impl": impl, "attention.block": 16,
          "plan.granularity": 16}
  return build(base, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("impl,g,m,w,dynamic,n_pers", [
    ("cpu", 2, 8, 16, False, 0),     # long band, per-head mask per key (custom VJP)
    ("cpu", 1, 8, 16, False, 0),     # one head: the band mask skewed
    ("cpu", 2, 8, 16, True, 0),      # per-query spans
    ("cpu", 2, 8, 8, False, 0),      # short band (band coordinates, autodiff)
    ("cpu", 2, 8, 8, True, 0),
    ("cpu", 2, 8, 16, False, 4),     # persistent memory
    ("reference", 2, 8, 16, False, 0),
    ("reference", 2, 8, 8, True, 4),
    ("pallas_interpret", 2, 16, 16, False, 0),
    ("pallas_interpret", 2, 16, 16, True, 16),
])
def test_whole_token_span_gradients_equal_the_reference(impl, g, m, w, dynamic, n_pers):
  """Every implementation's span gradient with whole-token spans, against float64 numpy with
  torch.clamp's derivative (fails with jnp.clip's 1/2: checked when the convention changed)."""
  rng, (q, k, v, pe, ct), pers = _inputs(7 * w + m + n_pers + g, g, m, w, n_pers)
  z = _whole_token_spans(rng, dynamic, g, m, w)
  want_out, want_dz = ref.banded_attention(q, k, v, pe, z, R, *(pers or (None, None)), ct=ct)
  pk, pv = (None, None) if pers is None else (jnp.asarray(pers[0], jnp.float32),
                                              jnp.asarray(pers[1], jnp.float32))
  spec = door_cfg(impl).attn_spec

  def run(q, k, v, pe, z):
    return kernels.IMPLS[impl].attend(spec, q, kernels.KV(k, v), pe, span_z=z, pers_k_GxDxN=pk,
                                      pers_v_GxNxD=pv)

  args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, pe, z)]
  ct32 = jnp.asarray(ct, jnp.float32)
  out, vjp = jax.vjp(run, *args)
  dz = vjp(ct32)[-1]
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  want_dz = want_dz.sum(axis=tuple(a for a in range(3) if z.shape[a] == 1), keepdims=True)
  assert np.abs(want_dz).max() > 1e-2
  np.testing.assert_allclose(dz, want_dz, rtol=1e-4, atol=1e-5)


MASK_TABLE = [  # (z, R, distance, m): m = clip((R + z - (d - 1)) / R, 0, 1), computed by hand
    (0.0, 4, 1, 1.0), (0.0, 4, 2, 0.75), (0.0, 4, 4, 0.25), (0.0, 4, 5, 0.0), (0.0, 4, 9, 0.0),
    (10.0, 4, 1, 1.0), (10.0, 4, 11, 1.0), (10.0, 4, 12, 0.75), (10.0, 4, 14, 0.25),
    (10.0, 4, 15, 0.0), (2.5, 2, 4, 0.75), (2.5, 2, 5, 0.25), (2.5, 2, 6, 0.0),
    (7.0, 1, 8, 1.0), (7.0, 1, 9, 0.0), (7.25, 1, 9, 0.25), (16.0, 32, 40, 0.28125),
]


@pytest.mark.parametrize("z,r,d,expected", MASK_TABLE)
def test_soft_mask_table(z, r, d, expected):
  got = span_mask.soft_mask(jnp.float32(z), jnp.float32(d), r)
  np.testing.assert_allclose(float(got), expected, atol=1e-6)
  np.testing.assert_allclose(ref.soft_mask(z, d, r), expected, atol=1e-12)


@pytest.mark.parametrize("z,r,d,expected", [
    (2.5, 2, 4, 0.5), (10.0, 4, 12, 0.25), (7.25, 1, 9, 1.0), (16.0, 32, 40, 1 / 32),  # ramp
    (10.0, 4, 3, 0.0), (0.0, 4, 9, 0.0), (2.5, 2, 7, 0.0)])  # flat parts
def test_soft_mask_gradient(z, r, d, expected):
  g = jax.grad(lambda zz: span_mask.soft_mask(zz, jnp.float32(d), r))(jnp.float32(z))
  np.testing.assert_allclose(float(g), expected, atol=1e-6)
