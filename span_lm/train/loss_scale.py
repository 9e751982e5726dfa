"""Dynamic loss scaling for float16 training (V100, T4: tensor cores without bfloat16).

float16 has 5 exponent bits: the backward pass's cotangents, cast to float16 for the matmuls
(kernels/matmul.py), underflow to 0 below 6e-8 (the logits' cotangent is already (p - y) / (B M),
1e-5 at the paper's batch). The loss is multiplied by a scale S before the gradient, so every
cotangent is S times larger; the float32 parameter gradients are multiplied by 1/S right after
each piece's backward pass (before the gradient-accumulation sum, before the cross-device mean of
steps._local_grads, before the optimizer's per-tensor step clip, which must see true gradients).

S is always a power of two in [MIN_SCALE, MAX_SCALE] (the config insists on it and the updates
keep it so), which makes the scaling exact: x * 2^k rounds like x in float32, so a float32 sum of
scaled gradients is the scaled float32 sum, bit for bit, barring overflow and subnormals. Hence
also the float32 all-reduce of GSPMD's implicit gradient reduction, which runs on the scaled
float32 partial sums, gives the same unscaled gradient as unscaling first.

The schedule (as flax.training.dynamic_scale and apex's dynamic scaler): an attempt whose loss is
finite but whose gradients are not (an overflow) is thrown away and the scale halves; after
`period` finite steps in a row it doubles. What happens to the overflowing step is in
steps.train_step: the same batch is retried on the device at once with the halved scale (same
dropout key), so no batch is lost and the host never replays anything.

The scale lives in the training state, `state['loss_scale']`, a dict of three scalars:
  scale (float32), good_steps (int32: finite steps since the last change), skips (int32: overflowed
  attempts so far). Orbax saves and restores it with the rest of the state, bit for bit.

Why not a library: jmp (DeepMind's mixed-precision helpers, DynamicLossScale) has had no release
since 0.0.4 (January 2023); flax.training.dynamic_scale.DynamicScale wraps jax.value_and_grad, so
it cannot unscale each gradient-accumulation piece before the sum, or sit outside the per-device
accumulation's shard_map, and it stores a flax struct rather than this state's plain arrays. The
arithmetic is ten lines; they are here.
"""
import jax
import jax.numpy as jnp

# the config's names and check, below span_lm/config.py (re-exported here)
from span_lm.run_config import LOSS_SCALE_MODES as MODES  # pylint: disable=unused-import
from span_lm.run_config import MAX_SCALE, MIN_SCALE
from span_lm.run_config import check_loss_scale as check  # pylint: disable=unused-import
from span_lm.run_config import loss_scale_enabled as enabled


def init(initial: float) -> dict[str, jax.Array]:
  return {"scale": jnp.asarray(initial, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
          "skips": jnp.zeros((), jnp.int32)}


def overflowed(loss, grads) -> jax.Array:
  """An attempt to retry at half the scale: finite loss (the forward pass does not see the
  scale), a non-finite gradient."""
  grads_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  return jnp.isfinite(loss) & ~grads_finite


def after_step(ls: dict, scale: jax.Array, retries: jax.Array, finite: jax.Array,
               period: int) -> dict:
  """The loss-scale state after a step that ran its last attempt at `scale` (after `retries`
  overflowed attempts); finite: that attempt's loss and gradients are finite."""
  good = jnp.where(finite, jnp.where(retries > 0, 1, ls["good_steps"] + 1), 0).astype(jnp.int32)
  grow = good >= period
  new_scale = jnp.where(grow, jnp.minimum(scale * 2.0, MAX_SCALE), scale).astype(jnp.float32)
  return {"scale": new_scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
          "skips": (ls["skips"] + retries).astype(jnp.int32)}
