"""Shared by the model and kernel tests: a small ModelConfig and float32/float64 tree casts.

Tests name config.model's fields as its sections do: plain fields (`d_model=32`), dotted section
fields (`**{"span.mode": "adaptive"}`) or whole sections (`span=Span(...)`, `span={"mode": ...}`,
merged over the base). The old flat names (`span_mode`, `attn_impl`, `sparse_stride`, ...) are the
upgrade shim's business, for old run directories, checkpoints and command lines: make_cfg and
`replaced` refuse them, and the shim's own tests use make_flat_cfg / replace_flat.
"""
import jax
import jax.numpy as jnp
import numpy as np

from span_lm.model import archs
from span_lm.model import config as model_config
from span_lm.model.config import ModelConfig

# make_cfg's model; "context" is the architecture's context length (span.size, sparse.context).
BASE = {"vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 24, "context": 16,
        "span.mode": "fixed", "span.ramp": 4, "span.loss": 0.1, "pers_mem": 0, "dropout": 0.0}


_moved = model_config._moved  # pylint: disable=protected-access
_as_dict = model_config._as_dict  # pylint: disable=protected-access


def _refuse_flat(changes):
  old = sorted(k for k, v in changes.items() if _moved(k, v))
  if old:
    raise TypeError(f"old flat config.model names {old}: name the sections "
                    f"({', '.join(f'{k!r} -> {model_config.moved_to(k)!r}' for k in old)}); "
                    "only the upgrade shim's tests use them, through make_flat_cfg / replace_flat")


def build(base, **kw):
  """A ModelConfig from `base` with `kw` over it, both named as fields, dotted section fields or
  whole sections (merged field by field); base's "context" is the architecture's context length.
  Neither may use the old flat names."""
  _refuse_flat(base)
  _refuse_flat(kw)
  arch = kw.get("arch", base.get("arch", archs.DEFAULT))
  dotted = {}
  for k, v in [*base.items(), *kw.items()]:
    if k == "context":
      k = model_config.moved_to("span", arch)  # where the old flat context went
    if k in model_config.SECTIONS and not _moved(k, v):
      dotted.update({f"{k}.{f}": x for f, x in _as_dict(v).items()})
    else:
      dotted[k] = v
  nested = {}
  for k, v in dotted.items():
    if "." in k:
      section, field = k.split(".", 1)
      nested.setdefault(section, {})[field] = v
    else:
      nested[k] = v
  return ModelConfig.from_config(nested)


def make_cfg(**kw):
  """A small span (or, with arch='sparse', sparse) model: BASE with `kw` (no old flat names)."""
  return build(BASE, **kw)


def make_flat_cfg(**flat):
  """make_cfg's model built from the old flat fields, through the upgrade shim: for the shim's
  own tests (and old run directories' shapes) only."""
  base = dict(vocab_size=11, d_model=16, n_layers=2, n_heads=4, d_ff=24, span=16,
              span_mode="fixed", ramp=4, span_loss=0.1, pers_mem=0, dropout=0.0)
  base.update(flat)
  return ModelConfig.from_config(base)


def replaced(cfg, **changes):
  """`cfg` with `changes` named as fields, dotted section fields (**{"attention.impl": "reference"})
  or whole sections: model_config.updated, refusing the old flat names."""
  _refuse_flat(changes)
  return model_config.updated(cfg, **changes)


def to_jax(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def to_np(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# `cfg` with changes named as config.model's old flat fields (span_mode='fixed', attn_impl=...),
# through the upgrade shim old run directories load through: for the shim's own tests only.
replace_flat = model_config.updated
