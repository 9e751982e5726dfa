"""Sparse Transformer on enwik8 (Child et al. 2019, Sec. 7.2; Table 1: 0.99 bits per byte).

30 pre-activation layers, 8 heads, d=512, context 12,288 trained on contiguous blocks of 12,288
bytes (no state carried between blocks), fixed pattern with stride 128 and c=32, merged heads,
dropout 0.4; Adam with a 5000-step warmup, global-norm clip 1.0, weight decay 0.01, cosine decay.
80 epochs of 90M bytes at 8 x 12,288 tokens per step is ~73k steps. The paper gives no enwik8
learning rate or batch size: 0.00035 (its CIFAR-10 rate) and 8 sequences (one per V100) here.
Table 3 (bits per byte at a minimum context): python -m span_lm.train.min_context.

Variants:
  strided / dense: Table 2's other patterns (dense: the masked n x n reference attention).
  head:   the head of enwik8 packaged with span_lm (data.dataset='enwik8_head') instead of enwik8.
  small:  2 layers, d=128, 2 heads (a 12,288-context model that trains on a CPU).
  smoke:  tiny model, context 64, stride 8, c=2, 4 steps on enwik8_head (the end-to-end test).
"""
from configs import base
from configs import variants


def _strided(c):
  c.model.sparse.pattern = "strided"


def _dense(c):
  c.model.sparse.pattern = "dense"


def _head(c):
  c.data.dataset = "enwik8_head"
  c.data.file_vocab = "bytes"


def _small(c):
  c.model.n_layers = 2
  c.model.d_model = 128
  c.model.d_ff = 512
  c.model.n_heads = 2
  c.data.batch = 1
  c.data.eval_batch = 1


def _smoke(c):
  _head(c)
  c.model.n_layers = 2
  c.model.d_model = 32
  c.model.d_ff = 64
  c.model.n_heads = 2
  c.model.sparse.context = 64
  c.model.sparse.stride = 8
  c.model.sparse.c = 2
  c.model.dropout = 0.0
  c.model.dtype = "float32"
  c.model.remat = "none"
  c.data.block = 64
  c.data.batch = 8
  c.data.eval_batch = 64
  c.optim.lr = 1e-3
  c.optim.warmup = 2
  c.optim.decay_steps = 4
  c.train.steps = 4
  c.train.log_every = 2
  c.train.eval_every = 2
  c.train.eval_batches = 2
  c.train.checkpoint_every = 2


VARIANTS = {"strided": _strided, "dense": _dense, "head": _head, "small": _small,
            "smoke": _smoke}


def sparse_model(c, context: int) -> None:
  """The architecture switch shared by the Sparse Transformer configs."""
  c.model.arch = "sparse"
  c.model.sparse.context = context  # n; the span model's settings (model.span.*) are unused
  c.model.sparse.prenorm = True
  c.model.sparse.act = "gelu"
  c.model.sparse.init_scale = True
  c.model.remat = "layer"  # Sec. 5.4: recompute attention and feed-forward in the backward pass
  c.model.remat_policy = "nothing_saveable"
  c.model.dtype = "bfloat16"  # Sec. 5.6 (float32 on V100)
  c.data.block = context


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "enwik8"
  sparse_model(c, 12_288)
  c.model.n_layers = 30
  c.model.n_heads = 8
  c.model.d_model = 512
  c.model.d_ff = 2048
  c.model.sparse.pattern = "fixed"
  c.model.sparse.combine = "merged"
  c.model.sparse.stride = 128
  c.model.sparse.c = 32
  c.model.sparse.pos = "attn"
  c.model.dropout = 0.4
  c.data.batch = 8
  c.data.eval_batch = 8
  c.optim.name = "adam"
  c.optim.lr = 0.00035
  c.optim.warmup = 5000
  c.optim.grad_clip = 1.0
  c.optim.weight_decay = 0.01
  c.optim.schedule = "cosine"
  c.train.steps = 73_000
  c.optim.decay_steps = c.train.steps
  c.train.log_every = 100
  c.train.eval_every = 1000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 1000
  return variants.apply(c, arg, VARIANTS)
