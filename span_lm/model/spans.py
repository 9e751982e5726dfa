"""The span loss and span statistics as the reference computes and reports them; the span mask
itself is span_lm/kernels/span/span_mask.py, the compile-time plan span_lm/model/plan.py."""
import jax.numpy as jnp

from span_lm.model.config import ModelConfig


def span_stats(z_tokens, cfg: ModelConfig):
  """Average and maximum span in tokens as the reference reports them (ramp included, in [0, S])."""
  avg = jnp.clip(jnp.ceil(jnp.mean(z_tokens)) + cfg.span.ramp, 0, cfg.span.size)
  mx = jnp.clip(jnp.ceil(jnp.max(z_tokens)) + cfg.span.ramp, 0, cfg.span.size)
  return avg, mx


def span_loss(ratio, cfg: ModelConfig):
  """coeff * S * mean(z'), added to the training loss only (z' = span / S: the adaptive span
  parameters, or the dynamic span's sigmoid outputs)."""
  return span_penalty(ratio, cfg.span.loss, cfg.span.size)


def span_penalty(ratio, coef: float, max_span: int):
  """The reference's penalty coef * S * mean(z'): `span_loss` without a config (the layer's)."""
  return coef * max_span * jnp.mean(ratio)
