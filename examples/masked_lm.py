"""A BERT-style masked character model built from span_lm.layers.AdaptiveSpanAttention, trained on
the head of enwik8 packaged with span_lm; prints each head's learned span (docs/layer.md).

  python examples/masked_lm.py                 # 300 steps: minutes on a CPU (docs/layer.md)
  python examples/masked_lm.py --steps 100     # a quick look

Bidirectional layers with relative positions only: each head learns how far it looks either
side. 15% of the characters are hidden (80% replaced by [MASK], 10% by a random character, 10%
kept, as BERT does) and the model predicts them.
"""
import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# the checkout's span_lm first, as bench/_repo.py does (an installed one otherwise)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from span_lm import layers  # pylint: disable=g-import-not-at-top
from span_lm.data import sources  # pylint: disable=g-import-not-at-top


class Block(nn.Module):
  """Pre-LN encoder block: adaptive-span self-attention, then a ReLU MLP."""
  num_heads: int
  max_span: int
  dropout: float

  @nn.compact
  def __call__(self, x, mask, train: bool):
    h = layers.AdaptiveSpanAttention(
        num_heads=self.num_heads, max_span=self.max_span, causal=False, ramp=32,
        span_loss_coef=2e-6, dropout_rate=self.dropout, name="attn")(
            nn.LayerNorm()(x), mask=mask, deterministic=not train)
    x = x + nn.Dropout(self.dropout)(h, deterministic=not train)
    h = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))
    return x + nn.Dropout(self.dropout)(h, deterministic=not train)


class MaskedLM(nn.Module):
  vocab_size: int  # including [MASK]
  d_model: int = 128
  num_layers: int = 3
  num_heads: int = 4
  max_span: int = 128
  dropout: float = 0.0

  @nn.compact
  def __call__(self, tokens, train: bool = False, pad_mask=None):
    """pad_mask (batch, length), 1 for real characters: padded keys get no attention."""
    mask = None if pad_mask is None else nn.make_attention_mask(pad_mask, pad_mask)
    x = nn.Embed(self.vocab_size, self.d_model)(tokens)
    for i in range(self.num_layers):
      x = Block(self.num_heads, self.max_span, self.dropout, name=f"block{i}")(x, mask, train)
    return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def corrupt(rng, tokens, vocab: int, mask_id: int, rate: float = 0.15):
  """BERT's corruption: (inputs, which positions are scored)."""
  picked = rng.random(tokens.shape) < rate
  how = rng.random(tokens.shape)
  inputs = np.where(picked & (how < 0.8), mask_id, tokens)
  inputs = np.where(picked & (how >= 0.8) & (how < 0.9), rng.integers(0, vocab, tokens.shape),
                    inputs)
  return inputs, picked.astype(np.float32)


def crops(rng, data, batch: int, length: int):
  starts = rng.integers(0, len(data) - length, batch)
  return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--max_span", type=int, default=128)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()

  splits = sources.demo_splits()  # span_lm/data/demo: the first 4.15 MB of enwik8
  vocab = splits.vocab_size
  mask_id = vocab  # one extra token
  model = MaskedLM(vocab + 1, max_span=args.max_span)
  rng = np.random.default_rng(args.seed)
  params = model.init(jax.random.key(args.seed), crops(rng, splits.train, 2, args.length))["params"]
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
  state = opt.init(params)

  def loss_fn(params, inputs, targets, weights):
    logits, inter = model.apply({"params": params}, inputs, train=True,
                                mutable=["intermediates"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    nll = jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return nll + layers.span_loss(inter), nll  # the span penalty is sown by every layer

  @jax.jit
  def step(params, state, inputs, targets, weights):
    (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, inputs, targets, weights)
    updates, state = opt.update(grads, state, params)
    # the reference clamps z' to [0, 1] after every step
    return layers.clamp_spans(optax.apply_updates(params, updates)), state, nll

  @jax.jit
  def eval_nll(params, inputs, targets, weights):
    logits = model.apply({"params": params}, inputs)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(nll * weights) / jnp.sum(weights)

  valid_rng = np.random.default_rng(1)
  valid = [(*corrupt(valid_rng, x, vocab, mask_id), x)
           for x in (crops(valid_rng, splits.valid, 32, args.length) for _ in range(4))]
  t0 = time.time()
  for i in range(1, args.steps + 1):
    x = crops(rng, splits.train, args.batch, args.length)
    inputs, weights = corrupt(rng, x, vocab, mask_id)
    params, state, nll = step(params, state, inputs, x, weights)
    if i % 100 == 0 or i == args.steps:
      v = np.mean([float(eval_nll(params, inp, tgt, w)) for inp, w, tgt in valid])
      print(f"step {i}: train {float(nll) / np.log(2):.3f} bits/masked char, valid "
            f"{v / np.log(2):.3f} ({time.time() - t0:.0f} s)", flush=True)

  print("\nlearned spans z (tokens either side; the mask reaches z + 32):")
  print("| layer | " + " | ".join(f"h{h}" for h in range(model.num_heads)) + " |")
  print("|---" * (model.num_heads + 1) + "|")
  for name, z in layers.learned_spans(params, args.max_span).items():
    print(f"| {name.split('/')[0]} | " + " | ".join(f"{float(s):.1f}" for s in z) + " |")


if __name__ == "__main__":
  main()
