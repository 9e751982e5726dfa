"""WikiText-103, all-attention model (reference experiments/wiki103_pers.sh; 36 layers, N=2048).

Word level with Adam (lr 2.5e-4, global-norm clip 1, warmup 8k). Steps follow the reference script
(paper: not stated): 800k, then the `finetune` variant: 50k more steps at lr/10 (niter 800 -> 850)
from --config.train.init_from=<the 800k run>. Tied adaptive input and adaptive softmax over the
frequency-sorted vocabulary (--adapt-io --adapt-io-tied: cutoffs 20k/40k/200k, dims d/4**i).
"""
from configs import base
from configs import variants

VARIANTS = {
    "finetune": variants.finetune(steps=50_000),
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "wikitext103"
  c.model.n_layers = 36
  c.model.d_model = 512
  c.model.d_ff = 0  # unused: persistent memory replaces the feed-forward
  c.model.n_heads = 8
  c.model.pers_mem = 2048
  c.model.span.size = 2048
  c.model.dropout = 0.3
  c.model.emb_dropout = 0.1  # input embeddings and final representation
  c.model.span.loss = 5e-7
  c.model.adapt_io.enabled = True
  c.model.adapt_io.cutoffs = (20000, 40000, 200000)
  c.model.adapt_io.div = 4
  c.model.adapt_io.tied = True
  c.data.block = 256
  c.data.batch = 64
  c.optim.name = "adam"
  c.optim.lr = 2.5e-4
  c.optim.grad_clip = 1.0  # adam: global-norm clip
  c.optim.warmup = 8000
  c.optim.batch_split = 2  # the reference's memory knob (same maths); change freely
  c.train.steps = 800_000
  return variants.apply(c, arg, VARIANTS)
