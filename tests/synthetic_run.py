"""The tiny synthetic run that the training, distributed and fault tests build on (data only:
worker processes import it before JAX).

Synthetic splits of 640/480/480 tokens: 8 training streams of 80 tokens, so with blocks of 16 the
walk restarts at a random offset (and zeroes the caches) after every 4th step.
"""
SMALL = {
    "model.d_model": 32,
    "model.n_layers": 2,
    "model.n_heads": 2,
    "model.d_ff": 64,
    "model.span": 64,
    "model.ramp": 8,
    "model.plan_granularity": 16,
    "model.plan_margin": 0,  # cache length = the largest window: a shrink resizes the caches
    "model.dropout": 0.1,
    "data.dataset": "synthetic",
    "data.path": None,
    "data.split_bytes": (),
    "data.split_fractions": (0.4, 0.3, 0.3),
    "data.synthetic_length": 1600,
    "data.synthetic_distance": 8,
    "data.synthetic_vocab": 16,
    "data.block": 16,
    "data.batch": 8,
    "data.eval_batch": 8,
    "optim.warmup": 0,
    "train.log_every": 1,
    "train.tensorboard": False,
}
