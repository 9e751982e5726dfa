"""The soft span mask, its renormalisation and its derivative: written once, used by every
attention implementation, the decoder and the Pallas kernels.

Distances count back from the query: distance 1 is the previous token. The reference's mask
template gives distance d the value clamp((R + z - (d - 1)) / R, 0, 1): the previous token is the
paper's "x = 0". The clamp is differentiated as torch.clamp (slope 1 on the closed interval), the
reference's convention; see docs/reference_semantics.md ("The clamp's subgradient").
"""
import jax
import jax.numpy as jnp

EPS = 1e-8  # the reference's renormalisation guard: p m / (sum p m + EPS)


def ramp(z, distance, ramp_len):
  """The mask before the clamp, (R + z - (d - 1)) / R; z and distance broadcast."""
  return (ramp_len + z - (distance - 1)) / ramp_len


def soft_mask(z, distance, ramp_len):
  """m_z(d) = clamp((R + z - (d - 1)) / R, 0, 1); z and distance broadcast."""
  return clamp01(ramp(z, distance, ramp_len))


@jax.custom_jvp
def clamp01(x):
  """clip(x, 0, 1) differentiated as the reference's torch.clamp: slope 1 on the closed interval
  [0, 1] (jnp.clip's is 1/2 at either end). Whole-token spans, z' = 0 included, sit on the ends."""
  return jnp.clip(x, 0.0, 1.0)


def clamp01_slope(x):
  """d clamp01(x) / dx: 1 where 0 <= x <= 1, else 0 (for backward passes written by hand)."""
  return jnp.where((x >= 0) & (x <= 1), 1.0, 0.0).astype(x.dtype)


@clamp01.defjvp
def _clamp01_jvp(primals, tangents):
  x, = primals
  t, = tangents
  return clamp01(x), t * clamp01_slope(x)


def visited_distances(z, ramp_len: int):
  """Distances 1..floor(z) + R + 1 that a span z reaches: every non-zero mask value and the
  clamp's lower end (mask 0, slope 1), as int32."""
  return jnp.floor(z).astype(jnp.int32) + (ramp_len + 1)


def denominator(masked):
  """sum(p m) + EPS over the last axis, for weights already masked (persistent weights, mask 1,
  on the same axis)."""
  return jnp.sum(masked, axis=-1, keepdims=True) + EPS


def renormalise(masked):
  """p m / (sum p m + EPS): softmax weights times the mask, renormalised as the reference does."""
  return masked / denominator(masked)


def online_denominator(masked_sum, total_sum, eps: float = EPS):
  """The same normaliser for unnormalised weights e (as flash-style kernels carry them):
  sum(e m) + EPS sum(e), which is denominator() times sum(e)."""
  return masked_sum + eps * total_sum
