"""The demo: learned attention spans on the packaged head of enwik8, in minutes on a laptop CPU.

configs/tiny.py's adaptive-span model (4 layers, D=256, 4 heads, S=1024, ramp R=32, span loss
2e-6, z' initialised at 0) trained with Adam instead of the reference's Adagrad. Why: Adagrad's
accumulators are dominated by the large gradients of the first steps, so after ~100 steps the
span parameters stop moving (every span stays at 33-64 tokens through tiny's 1,250 steps, span
loss or not); Adam's moving average lets them follow the gradient, and within a few hundred
steps heads grow past the ramp, to different spans per layer and head. The long-span results
of the paper come from Adagrad over 600k steps; this is only the short version of that effect.
Valid and test are the last 50,000 bytes each, so the final evaluation takes seconds.
"""
from configs import tiny


def get_config(arg=None):
  c = tiny.get_config(arg)
  c.data.split_bytes = (4_054_000, 4_104_000)  # of data.dataset='enwik8_head' (4,154,000 bytes)
  c.optim.name = "adam"
  c.optim.lr = 3e-3
  c.optim.grad_clip = 1.0  # global-norm clip (adam)
  c.optim.warmup = 100
  c.train.steps = 600
  c.train.log_every = 50
  c.train.eval_every = 200
  c.train.checkpoint_every = 200
  return c
