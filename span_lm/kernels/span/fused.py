"""What the fused kernels (pallas_gpu, pallas_tpu) share: the span maths of one tile in
FlashAttention-2's names and the checks at their entry (running them per device under a mesh:
kernels/pallas_common.py).

One tile is a block of query rows against a block of keys. S is its scaled logits, m the running
row maximum, P = exp(S - m) and l the running row sum of P. The soft span mask adds a second
running sum, of P times the mask: the renormalised weights are P mask / (sum P mask + eps sum P)
(`span_mask.online_denominator`). The backward pass recomputes P from the saved m and
normaliser, with dP = dO V^T and delta = rowsum(dO * O).

The kernels' vocabulary (one meaning per name: z is a span, m a row maximum, den a normaliser,
bq, bk the tiles, ...) and the row statistics' layouts: docs/kernels.md, "What the fused kernels
share". These helpers are traced into each kernel's body, so sharing them costs nothing at run
time.
"""
import jax.numpy as jnp

from span_lm.kernels.span import span_mask

PRECISIONS = ("default", "highest")


def _col(x, keepdims: bool):
  return x if keepdims else x[:, None]


def online_softmax(m_prev, logits, visited=None, *, keepdims: bool = True):
  """One key tile of the online softmax: (m_new, alpha = exp(m_prev - m_new), which rescales
  what the rows accumulated so far, and P = exp(S - m_new), 0 off `visited`)."""
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=keepdims))
  p = jnp.exp(logits - _col(m_new, keepdims))
  if visited is not None:
    p = jnp.where(visited, p, 0.0)
  return m_new, jnp.exp(m_prev - m_new), p


def weights_grad(p, dp, delta, z=None, dist=None, *, renormalised: bool, eps: float, ramp: int,
                 keepdims: bool = True):
  """The backward pass of one tile's weights: (dS before the logits' scale, the weights A as
  they multiply the values, before dropout, and the rows' span gradient, or None).

  p: the softmax weights P / den (the saved normaliser); dp: dO V^T (times dropout's keep);
  z, dist: the rows' spans and the tile's distances, or None where the mask is 1 (a fixed span,
  persistent keys); renormalised: whether the weights were renormalised by the span mask (then
  the normaliser's eps sum P term has a gradient too). With u = span_mask.ramp(z, dist) and
  A = P clamp(u): dS = A (dP - delta) - eps P delta, dz = rowsum(P (dP - delta) clamp'(u)) / R.
  The operations run in this order on purpose: ptxas allocates registers along it, and computing
  dz first spilled in the A100 kernel's bwd_q (tests/kernels/test_pallas_gpu.py's PTX test)."""
  delta = _col(delta, keepdims)
  dp_c = dp - delta
  if z is None:
    return (p * dp_c - eps * p * delta if renormalised else p * dp_c), p, None
  u = span_mask.ramp(_col(z, keepdims), dist, ramp)
  wts = p * span_mask.clamp01(u)
  ds = wts * dp_c - eps * p * delta
  dz = jnp.sum(p * dp_c * span_mask.clamp01_slope(u), axis=1, keepdims=keepdims) / ramp
  return ds, wts, dz


def check_inputs(pers_k, pers_v, dropout_rate: float, dropout_seed, precision: str):
  """The fused kernels' common argument rules, as one ValueError each."""
  if (pers_k is None) != (pers_v is None):
    raise ValueError("fused attention: persistent keys and values come together")
  if dropout_rate and dropout_seed is None:
    raise ValueError("fused attention: dropout_rate > 0 needs a dropout_seed")
  if precision not in PRECISIONS:
    raise ValueError(f"fused attention: precision={precision!r}: choose one of {PRECISIONS}")
