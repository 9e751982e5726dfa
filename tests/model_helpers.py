"""Shared by the model and kernel tests: a small ModelConfig and float32/float64 tree casts."""
import jax
import jax.numpy as jnp
import numpy as np

from span_lm.model import config as model_config
from span_lm.model.config import ModelConfig


def make_cfg(**kw):
  base = dict(vocab_size=11, d_model=16, n_layers=2, n_heads=4, d_ff=24, span=16,
              span_mode="fixed", ramp=4, span_loss=0.1, pers_mem=0, dropout=0.0)
  base.update(kw)
  return ModelConfig.from_config(base)


def to_jax(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def to_np(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# `cfg` with changes named as config.model's flat fields (span_mode='fixed', attn_impl=...), through
# the shim old run directories load through.
replace_flat = model_config.updated
