"""Config variants: the `:arg` after a config file's path (`configs/enwik8.py:fixed`).

A config file declares `VARIANTS = {name: fn(config)}` and ends `get_config` with
`variants.apply(config, arg, VARIANTS)`. The arg may name several variants separated by commas
(`configs/enwik8_large.py:finetune`, `configs/tiny.py:smoke,fixed`); they apply left to right.
This module has no `get_config`: it is a helper, not a run.
"""
from typing import Callable, Mapping

import ml_collections

Variant = Callable[[ml_collections.ConfigDict], None]


def apply(config: ml_collections.ConfigDict, arg: str | None,
          table: Mapping[str, Variant]) -> ml_collections.ConfigDict:
  """Applies the comma-separated variants named by `arg` (None or '': none) and returns config."""
  for name in (arg or "").split(","):
    name = name.strip()
    if not name:
      continue
    if name not in table:
      raise ValueError(f"unknown config variant {name!r}; known: {sorted(table) or 'none'}")
    table[name](config)
  return config


def finetune(steps: int) -> Variant:
  """The reference's fine-tuning phase: `steps` more steps at lr/10 from `train.init_from`.

  The reference resumes its checkpoint (warmup long finished), so warmup is off here; pass the
  pre-trained run with --config.train.init_from=DIR.
  """
  def fn(c):
    c.optim.lr = c.optim.lr / 10
    c.optim.warmup = 0
    c.train.steps = steps
  return fn


def fixed(span: int | None = None) -> Variant:
  """A fixed-span baseline: every head attends to the full span S (no span parameters or loss).

  span: the limit S; None keeps the config's (so it composes with e.g. `smoke`).
  """
  def fn(c):
    c.model.span.mode = "fixed"
    if span is not None:
      c.model.span.size = span
    c.model.span.loss = 0.0
  return fn


def adaptive(span: int | None = None, span_loss: float = 2e-6) -> Variant:
  """An adaptive-span model with limit `span` (the paper uses lambda 2e-6 below S=8192)."""
  def fn(c):
    c.model.span.mode = "adaptive"
    if span is not None:
      c.model.span.size = span
    c.model.span.loss = span_loss
  return fn


def dynamic(span: int | None = None, span_loss: float = 2e-6) -> Variant:
  """A dynamic-span model, z_t = S sigmoid(v.x_t + b) with b initialised to -4 (paper Sec. 3)."""
  def fn(c):
    c.model.span.mode = "dynamic"
    if span is not None:
      c.model.span.size = span
    c.model.span.loss = span_loss
    c.model.span.dynamic_bias_init = -4.0
  return fn
