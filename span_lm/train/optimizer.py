"""Optimizers: the reference Adagrad (per-tensor step clipping), SGD/momentum/Adam, span clamping.

The reference (facebookresearch/adaptive-span, AdagradWithGradClip) is easy to port wrongly:
its "gradient clip" shrinks each tensor's *step size*, the accumulator sees the *unclipped*
gradient, and eps sits outside the square root. "Clip, then optax.adagrad" is a different algorithm
(Adagrad's normalisation cancels the clip scale), so that one piece is written by hand here; the
rest is stock optax. See docs/reference_semantics.md ("The optimizer").
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from span_lm.train import sharding

# the accepted names and the field check, below span_lm/config.py (re-exported here)
from span_lm.run_config import OPTIMIZERS, SCHEDULES  # pylint: disable=unused-import
from span_lm.run_config import check_optim


# The reference's fixed guard in the clip scale c / (||g|| + 1e-10); not the Adagrad eps.
_CLIP_GUARD = 1e-10


def warmup_schedule(lr: float, warmup: int) -> optax.Schedule:
  """Linear warmup as the reference: update k (from 0) uses lr * min(1, (k + 1) / warmup).

  The (k + 1) means the first update already moves (the reference steps its LambdaLR scheduler
  before the optimizer). warmup 0 is a constant learning rate.
  """
  if warmup <= 0:
    return optax.constant_schedule(lr)

  def schedule(count):
    # In the default float (float64 under x64): int32 / int would be float32 regardless.
    k = jnp.asarray(count, jax.dtypes.canonicalize_dtype(jnp.float64)) + 1
    return lr * jnp.minimum(1.0, k / warmup)

  return schedule


class ReferenceAdagradState(NamedTuple):
  """State of `reference_adagrad`.

  Attributes:
    count: updates taken so far (the schedule's step; torch's per-parameter state['step']).
    sum: per-tensor accumulator of squared raw gradients, same tree as the params (torch's
      Adagrad state['sum'], so a checkpoint importer can copy those buffers in directly).
  """
  count: jax.Array
  sum: optax.Updates


def reference_adagrad(learning_rate: float | optax.Schedule, grad_clip: float,
                      eps: float = 1e-10) -> optax.GradientTransformation:
  """Adagrad with per-tensor step-size clipping, exactly as the reference AdagradWithGradClip.

  For each tensor: acc += g * g (unclipped); step = lr_t, or lr_t * c / (||g||_2 + 1e-10) when
  ||g||_2 > c; update = -step * g / (sqrt(acc) + eps). Accumulator starts at 0.

  Args:
    learning_rate: a float or an optax schedule evaluated at the update count.
    grad_clip: c, the per-tensor norm threshold; <= 0 disables clipping.
    eps: added outside the square root (the reference's 1e-10).
  """

  def init_fn(params):
    return ReferenceAdagradState(count=jnp.zeros([], jnp.int32),
                                 sum=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    lr_t = learning_rate(state.count) if callable(learning_rate) else learning_rate
    new_sum = jax.tree.map(lambda s, g: s + g * g, state.sum, updates)

    def step(path, g, s):
      clr = lr_t
      if grad_clip > 0:  # a layer scan's stacked tensor: each layer's own norm, as unrolled
        axes = tuple(range(1, g.ndim)) if sharding.is_stacked(path) else None
        norm = jnp.sqrt(jnp.sum(g * g, axis=axes, keepdims=axes is not None))
        clr = jnp.where(norm > grad_clip, lr_t * (grad_clip / (norm + _CLIP_GUARD)), lr_t)
      return (-clr * (g / (jnp.sqrt(s) + eps))).astype(g.dtype)

    new_updates = jax.tree_util.tree_map_with_path(step, updates, new_sum)
    return new_updates, ReferenceAdagradState(count=optax.safe_increment(state.count),
                                              sum=new_sum)

  return optax.GradientTransformation(init_fn, update_fn)


def cosine_schedule(lr: float, warmup: int, decay_steps: int) -> optax.Schedule:
  """The reference warmup, then a cosine from lr down to 0 at update decay_steps (Sparse
  Transformer Sec. 6, after Radford et al. 2018); 0 after that."""
  warm = warmup_schedule(lr, warmup)

  def schedule(count):
    k = jnp.asarray(count, jax.dtypes.canonicalize_dtype(jnp.float64))
    frac = jnp.clip((k - warmup) / max(1, decay_steps - warmup), 0.0, 1.0)
    return jnp.where(k < warmup, warm(count), 0.5 * lr * (1.0 + jnp.cos(jnp.pi * frac)))

  return schedule


def _decay_mask(params):
  """Weight decay on matrices only, not on biases, gains or other vectors (as Radford et al.);
  a layer scan's stacked parameters (under 'layers') count without their leading layer axis."""
  def matrix(path, x):
    return jnp.ndim(x) - int(sharding.is_stacked(path)) >= 2
  return jax.tree_util.tree_map_with_path(matrix, params)


def make_optimizer(optim_cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds the optimizer named by `config.optim` and returns (tx, schedule).

  schedule(k) is the learning rate of update k (k = updates already taken, i.e. the train step
  before it is incremented), for logging. batch_split is only validated: gradient accumulation
  happens inside the train step, so the optimizer sees one (mean) gradient per step.
  """
  f = check_optim(optim_cfg)
  if f["schedule"] == "cosine":
    schedule = cosine_schedule(float(f["lr"]), f["warmup"], f["decay_steps"])
  else:
    schedule = warmup_schedule(float(f["lr"]), f["warmup"])
  name, clip = f["name"], float(f["grad_clip"])
  if name == "adagrad":
    return reference_adagrad(schedule, clip), schedule
  if name in ("sgd", "momentum"):
    tx = optax.sgd(schedule, momentum=float(f["momentum"]) or None)
  else:  # adam; torch's defaults (b1 .9, b2 .999, eps 1e-8) equal optax's
    tx = optax.adam(schedule)
    if f["weight_decay"]:
      tx = optax.adamw(schedule, weight_decay=float(f["weight_decay"]), mask=_decay_mask)
  if clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  return tx, schedule


def _is_span_ratio(path) -> bool:
  if not path:
    return False
  last = path[-1]
  return getattr(last, "key", getattr(last, "name", None)) == "span_ratio"


def clamp_spans(params: Any) -> Any:
  """Clips every `span_ratio` leaf (the adaptive span z') to [0, 1], as the reference does after
  each optimizer step; other leaves pass through unchanged. Pure and jittable."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.clip(x, 0.0, 1.0) if _is_span_ratio(path) else x, params)
