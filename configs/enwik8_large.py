"""enwik8, 24-layer model (reference experiments/enwik8_large.sh; paper Table 2, test 0.98 bpc).

150k steps, then the `finetune` variant: 20k more steps at lr/10 from
--config.train.init_from=<the 150k run>.
"""
from configs import base
from configs import variants

VARIANTS = {
    "finetune": variants.finetune(steps=20_000),
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "enwik8"
  c.model.n_layers = 24
  c.model.d_model = 768
  c.model.d_ff = 4096
  c.model.n_heads = 8
  c.model.span.size = 8192
  c.model.dropout = 0.4
  c.model.span.loss = 5e-7
  c.data.block = 512
  c.data.batch = 64
  c.optim.warmup = 32_000
  c.optim.batch_split = 2  # the reference's memory knob (same maths); change freely
  c.train.steps = 150_000
  return variants.apply(c, arg, VARIANTS)
