"""enwik8, 12-layer model (reference experiments/enwik8.sh; paper Table 2, test 1.02 bpc).

Variants (paper Sec. 4, Fig. 3 and Table 3):
  fixed:        fixed-span baseline at S=2048, the largest fixed span that trained without splitting
                batches (the paper did not train a fixed S=8192 model; T12's 512 is another model).
  dynamic:      dynamic span with S=1024 and lambda 2e-6 (Table 3).
  adaptive1024: Table 3's adaptive counterpart, S=1024 and lambda 2e-6.
"""
from configs import base
from configs import variants

VARIANTS = {
    "fixed": variants.fixed(span=2048),
    "dynamic": variants.dynamic(span=1024),
    "adaptive1024": variants.adaptive(span=1024),
}


def get_config(arg=None):
  c = base.get_base_config()
  c.data.dataset = "enwik8"
  c.model.n_layers = 12
  c.model.d_model = 512
  c.model.d_ff = 2048
  c.model.n_heads = 8
  c.model.span.size = 8192
  c.model.dropout = 0.3
  c.model.span.loss = 5e-7  # lambda is 2e-6 except at S=8192 (spans stopped growing past 4000)
  c.data.block = 512
  c.data.batch = 64
  c.optim.warmup = 32_000
  c.train.steps = 600_000
  return variants.apply(c, arg, VARIANTS)
