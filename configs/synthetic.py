"""Synthetic demo: tokens that depend on the token D=64 positions back; learned spans find D.

A small adaptive model on the synthetic source (data.synthetic_*). The spans start at z = S/2 = 128,
beyond D, and the span loss shrinks them: heads that do not need the dependency collapse towards the
ramp, while at least one head settles near D (reported span ceil(z) + R ~ 64). Starting from z = 0
would not work: with R < D the mask gives no gradient at distance D. A few hundred steps on a CPU.
"""
from configs import base
from configs import variants

VARIANTS = {
    "fixed": variants.fixed(),  # the same model with the full span S, for comparison
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "synthetic"
  c.data.synthetic_distance = 64
  c.data.synthetic_vocab = 16
  c.data.synthetic_noise = 0.1
  c.data.synthetic_length = 1_000_000
  c.model.n_layers = 1  # one layer: the dependency must be inside one head's span
  c.model.d_model = 64
  c.model.d_ff = 256
  c.model.n_heads = 4
  c.model.span.size = 256
  c.model.span.ramp = 16
  c.model.span.init = 0.5  # z = 128 > D, so the dependency is inside every head's span at start
  c.model.span.loss = 1e-4  # strong enough to shrink unneeded spans within the run
  c.model.dropout = 0.0
  c.data.block = 128
  c.data.batch = 32
  c.optim.warmup = 50
  c.train.steps = 500
  c.train.log_every = 20
  c.train.eval_every = 100
  c.train.checkpoint_every = 100
  c.model.plan.shrink_patience = 50  # let the plan follow the shrinking spans within the demo
  return variants.apply(c, arg, VARIANTS)
