"""One-token decoding over ring caches: each stream's query attends to its head's window of
projected keys/values where they lie in the ring, with the same span mask and renormalisation
as training (span_mask), so sampling equals banded attention over the shifted caches.
"""
import math

import jax
import jax.numpy as jnp

from span_lm.kernels.span import span_mask
from span_lm.kernels import matmul


def ring_attention(q_BxHxD, k_BxHxLxD, v_BxHxLxD, key_pe_DxS, pos, windows_H, *, span_z=None,
                   ramp: int = 0, pers_k_HxDxN=None, pers_v_HxNxD=None):
  """One query per stream over a ring cache (keys, values head-major, (B, H, L, Dh)).

  Slot j holds the token at distance d_j = ((pos - j - 1) mod L) + 1, so keys are used where they
  lie and the position term is gathered by distance; keys beyond a head's plan window (windows_H)
  get zero weight. span_z: spans in tokens, (H,) or (B, H), or None (fixed).
  Returns (B, H, Dh) in float32.
  """
  b, nh, l, dh = k_BxHxLxD.shape
  s = key_pe_DxS.shape[-1]
  dist_L = (pos - 1 - jnp.arange(l)) % l + 1  # slot -> distance in [1, L]
  valid_HxL = dist_L[None, :] <= jnp.asarray(windows_H)[:, None]
  cont = matmul.einsum("bhd,bhld->bhl", q_BxHxD, k_BxHxLxD, jnp.float32)
  qpe = matmul.einsum("bhd,ds->bhs", q_BxHxD, key_pe_DxS.astype(q_BxHxD.dtype), jnp.float32)
  pos_BxHxL = jnp.take(qpe, jnp.clip(s - dist_L, 0, s - 1), axis=2)
  logits = jnp.where(valid_HxL[None], (cont + pos_BxHxL) / math.sqrt(dh), -jnp.inf)
  if pers_k_HxDxN is not None:
    pers = matmul.einsum("bhd,hdp->bhp", q_BxHxD, pers_k_HxDxN.astype(q_BxHxD.dtype),
                            jnp.float32)
    logits = jnp.concatenate([logits, pers / math.sqrt(dh)], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  if span_z is not None:
    z = jnp.asarray(span_z, jnp.float32)
    z_BxHx1 = z[None, :, None] if z.ndim == 1 else z[:, :, None]
    mask = span_mask.soft_mask(z_BxHx1, dist_L.astype(jnp.float32)[None, None, :], ramp)
    if pers_k_HxDxN is not None:  # the persistent vectors' mask is 1
      ones = jnp.ones(mask.shape[:2] + (pers_k_HxDxN.shape[-1],), mask.dtype)
      mask = jnp.concatenate([mask, ones], axis=-1)
    probs = span_mask.renormalise(probs * mask)
  dt = v_BxHxLxD.dtype
  out = matmul.einsum("bhl,bhld->bhd", probs[..., :l].astype(dt), v_BxHxLxD, jnp.float32)
  if pers_v_HxNxD is not None:
    out = out + matmul.einsum("bhp,hpd->bhd", probs[..., l:].astype(dt),
                                 pers_v_HxNxD.astype(dt), jnp.float32)
  return out
