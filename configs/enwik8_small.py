"""enwik8, small model on 1 GPU (reference experiments/enwik8_small.sh): 8 layers, D=256, S=1024.

Variants:
  fixed: the fixed-span baseline at the same limit S=1024.
"""
from configs import base
from configs import variants

VARIANTS = {
    "fixed": variants.fixed(span=1024),
}


def get_config(arg=None):
  c = base.get_base_config()  # the base config is this run's shape
  c.data.dataset = "enwik8"
  c.model.n_layers = 8
  c.model.d_model = 256
  c.model.d_ff = 1024
  c.model.n_heads = 4
  c.model.span.size = 1024
  c.model.dropout = 0.0
  c.model.span.loss = 2e-6
  c.data.block = 256
  c.data.batch = 64
  c.optim.warmup = 8000
  c.train.steps = 150_000
  return variants.apply(c, arg, VARIANTS)
