"""The yardstick: a small enwik8 model that trains on a 2-core CPU in minutes.

Reads the head of enwik8 packaged with span_lm (data.dataset='enwik8_head', 4,154,000 bytes, no
download): train = [0, 3654000), valid = [3654000, 3904000), test = [3904000, 4154000).
`--config.data.path=FILE` trains on any raw file instead, split by data.split_fractions (the
smallest file that holds one batch in each split is reported when a file is too small).
4 layers, D=256, FF=1024, 4 heads, adaptive S=1024, 1250 steps.

Variants:
  smoke: 2 layers, D=64, S=128, block 64, batch 8, 50 steps: the end-to-end tests' run.
  fixed: fixed span at the config's S (composes: `smoke,fixed`).
"""
from configs import base
from configs import variants


def _smoke(c):
  c.model.n_layers = 2
  c.model.d_model = 64
  c.model.d_ff = 256
  c.model.span.size = 128
  c.data.block = 64
  c.data.batch = 8
  c.data.eval_batch = 32  # keeps the final full evaluation of the 250k-byte splits quick
  c.train.steps = 50
  c.train.log_every = 10
  c.train.eval_every = 25
  c.train.checkpoint_every = 25


VARIANTS = {
    "smoke": _smoke,
    "fixed": variants.fixed(),
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "enwik8_head"  # span_lm/data/demo; data.path, when set, wins
  c.model.n_layers = 4
  c.model.d_model = 256
  c.model.d_ff = 1024
  c.model.n_heads = 4
  c.model.span.size = 1024
  c.model.span.mode = "adaptive"
  c.model.span.ramp = 32
  c.model.span.loss = 2e-6
  c.model.span.cache = True
  c.model.dropout = 0.0
  c.model.emb_dropout = 0.0
  c.data.block = 128
  c.data.batch = 16
  c.optim.name = "adagrad"
  c.optim.lr = 0.07
  c.optim.grad_clip = 0.03
  c.optim.warmup = 200
  c.train.steps = 1250
  c.train.log_every = 50
  c.train.eval_every = 250
  c.train.checkpoint_every = 250
  return variants.apply(c, arg, VARIANTS)
