"""Sparse Transformer on CIFAR-10 as bytes (Child et al. 2019, Sec. 7.1; 2.80 bits per dim).

Strided pattern over 3072-byte images, 128 pre-activation layers, 2 heads, d=256, half-size
feed-forward (2d) and query/key projections, data position embeddings (row, column, channel),
dropout 0.25, Adam at 0.00035 (warmup, clip 1.0, weight decay, cosine as the enwik8 run), 120
epochs. Not in the paper, chosen here: stride 96 (one image row of 32 RGB pixels, so A2 is the
column and channel above), split heads (eq. 8: one local head, one strided head) and 16 images
per step (48000 / 16 = 3000 steps per epoch). The blocks run as one layer scan (scan_layers),
so the step compiles one block rather than 128. The residual stream is bfloat16
(sparse.stream_dtype='compute': the paper's Sec. 5.6 mixed precision, activations and their
gradients in half precision, weights float32): at d=256 the blocks' elementwise traffic bounds a
TPU step, and the float32 stream costs a quarter more HBM bytes (docs/kernels.md).

Data: the python pickle batches (cifar-10-batches-py) in config.data.data_dir, or
cifar-10-python.tar.gz there (md5-checked, then unpacked next to it); the last 2000
training images are the validation set (span_lm/data/cifar.py). The trainer's streams line up
with image boundaries for its first pass over the data only (its restarts draw a random offset).

Variants:
  dense / fixed: Table 2's other patterns.
  smoke: 2 layers, d=32, 2 steps (the data-source test).
"""
from configs import base
from configs import variants
from configs.enwik8_sparse_fixed import sparse_model


def _dense(c):
  c.model.sparse.pattern = "dense"


def _fixed(c):
  c.model.sparse.pattern = "fixed"
  c.model.sparse.c = 16


def _smoke(c):
  c.model.n_layers = 2
  c.model.d_model = 32
  c.model.d_ff = 32
  c.model.dtype = "float32"
  c.model.remat = "none"
  c.model.dropout = 0.0
  c.data.batch = 2
  c.data.eval_batch = 2
  c.optim.warmup = 1
  c.optim.decay_steps = 2
  c.train.steps = 2
  c.train.log_every = 1
  c.train.eval_every = 2
  c.train.eval_batches = 1
  c.train.checkpoint_every = 2


VARIANTS = {"dense": _dense, "fixed": _fixed, "smoke": _smoke}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "cifar10"
  c.data.align = 3072  # one image: every block is one whole image, restarts included
  c.data.data_dir = "data_cache/cifar10"
  sparse_model(c, 3072)
  c.model.n_layers = 128
  c.model.n_heads = 2
  c.model.d_model = 256
  c.model.d_ff = 512
  c.model.sparse.qk_ratio = 0.5
  c.model.sparse.pattern = "strided"
  c.model.sparse.combine = "split"
  c.model.sparse.stride = 96
  c.model.sparse.c = 8
  c.model.sparse.pos = "data"
  c.model.sparse.data_shape = (32, 32, 3)
  c.model.sparse.scan_layers = True  # 128 identical blocks: compile one (Sparse.scan_layers)
  c.model.sparse.stream_dtype = "compute"  # Sec. 5.6: half-precision activations
  c.model.dropout = 0.25
  c.data.batch = 16
  c.data.eval_batch = 16
  c.optim.name = "adam"
  c.optim.lr = 0.00035
  c.optim.warmup = 5000
  c.optim.grad_clip = 1.0
  c.optim.weight_decay = 0.01
  c.optim.schedule = "cosine"
  c.train.steps = 360_000
  c.optim.decay_steps = c.train.steps
  c.train.eval_every = 3000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 3000
  return variants.apply(c, arg, VARIANTS)
