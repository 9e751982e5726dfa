"""enwik8, small all-attention model (experiments/enwik8_pers_small.sh): 18 layers, N=1024.

Persistent memory replaces the feed-forward sublayers. 450k steps, then the `finetune` variant:
30k more steps at lr/10 from --config.train.init_from=<the 450k run>.
"""
from configs import base
from configs import variants

VARIANTS = {
    "finetune": variants.finetune(steps=30_000),
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "enwik8"
  c.model.n_layers = 18
  c.model.d_model = 512
  c.model.d_ff = 0  # unused: persistent memory replaces the feed-forward
  c.model.n_heads = 8
  c.model.pers_mem = 1024
  c.model.span.size = 8192
  c.model.dropout = 0.3
  c.model.span.loss = 1e-7
  c.data.block = 512
  c.data.batch = 64
  c.optim.warmup = 32_000
  c.optim.batch_split = 2  # the reference's memory knob (same maths); change freely
  c.train.steps = 450_000
  return variants.apply(c, arg, VARIANTS)
