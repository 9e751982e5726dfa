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
from span_lm.model import attention
from span_lm.model import fused_attention
from span_lm.model import spans

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
  np.testing.assert_array_equal(jax.vmap(jax.grad(spans.clamp01))(x), [0, 1, 1, 1, 0])
  np.testing.assert_array_equal(spans.clamp01(x), jnp.clip(x, 0.0, 1.0))
  np.testing.assert_array_equal(spans.clamp01_slope(x), [0, 1, 1, 1, 0])


@pytest.mark.parametrize("impl,g,m,w,dynamic,n_pers", [
    ("jnp", 2, 8, 16, False, 0),     # long band, per-head mask per key (custom VJP)
    ("jnp", 1, 8, 16, False, 0),     # one head: the band mask skewed
    ("jnp", 2, 8, 16, True, 0),      # per-query spans
    ("jnp", 2, 8, 8, False, 0),      # short band (band coordinates, autodiff)
    ("jnp", 2, 8, 8, True, 0),
    ("jnp", 2, 8, 16, False, 4),     # persistent memory
    ("pallas_interpret", 2, 8, 16, False, 0),
    ("pallas_interpret", 2, 8, 16, True, 8),
])
def test_whole_token_span_gradients_equal_the_reference(impl, g, m, w, dynamic, n_pers):
  rng, (q, k, v, pe, ct), pers = _inputs(7 * w + m + n_pers + g, g, m, w, n_pers)
  z = _whole_token_spans(rng, dynamic, g, m, w)
  want_out, want_dz = ref.banded_attention(q, k, v, pe, z, R, *(pers or (None, None)), ct=ct)
  pk, pv = (None, None) if pers is None else (jnp.asarray(pers[0], jnp.float32),
                                              jnp.asarray(pers[1], jnp.float32))

  def run(q, k, v, pe, z):
    if impl == "jnp":
      return attention.banded_attention(q, k, v, pe, span_z=z, ramp=R, pers_k_GxDxN=pk,
                                        pers_v_GxNxD=pv)[0]
    return fused_attention.span_attention(q, k, v, pe, jnp.broadcast_to(z, (B, g, m)), ramp=R,
                                          block=8, pers_k_HxDxN=pk, pers_v_HxNxD=pv,
                                          interpret=True)

  args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, pe, z)]
  ct32 = jnp.asarray(ct, jnp.float32)
  out, vjp = jax.vjp(run, *args)
  dz = vjp(ct32)[-1]
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  want_dz = want_dz.sum(axis=tuple(a for a in range(3) if z.shape[a] == 1), keepdims=True)
  assert np.abs(want_dz).max() > 1e-2
  np.testing.assert_allclose(dz, want_dz, rtol=1e-4, atol=1e-5)
