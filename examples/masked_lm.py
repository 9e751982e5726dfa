"""A masked-language-model encoder built from span_lm.layers.AdaptiveSpanAttention: bidirectional
layers whose heads each learn how far they look back and, apart, how far ahead (asymmetric
spans), trained on variable-length lines of the text packaged with span_lm (docs/layer.md).

  python examples/masked_lm.py                    # packed rows, 300 steps: ~1-2 min on 2 CPU cores
  python examples/masked_lm.py --packing padded   # one line per row, then padding
  python examples/masked_lm.py --steps 1000 --length 1024 --batch 2

Tokens are bytes (256) plus [MASK]. Each row is a line of the head of enwik8 (span_lm/data/demo:
wiki markup and its XML, lines of 1 to 3,525 bytes, cut at --length): --packing packed (the
default) fills each row with several lines, segment_ids 1, 2, 3, ... (a token attends only to
its own line), the rest padding (id 0); --packing padded puts one line in each row, id 1, and
pads the rest (id 0). 15% of the real tokens
are picked as BERT picks them (80% replaced by [MASK], 10% by a random byte, 10% kept) and the
loss is the cross-entropy on the picked tokens only, plus the span penalty the layers sow
(layers.span_loss). At the end: the loss curve, every head's learned spans back and ahead, and
the speed of this model against the same model on the dense path (attn_impl='plain') at this
length, forward and backward, jit-compiled, median of a few, in this run.
"""
import argparse
import logging
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
from span_lm.data import demo  # pylint: disable=g-import-not-at-top

PAD, MASK, VOCAB = 0, 256, 257  # bytes 0..255 (the text has no 0 byte), then [MASK]


class Block(nn.Module):
  """Pre-LN encoder block: bidirectional adaptive-span self-attention, then a GELU MLP."""
  num_heads: int
  max_span: int
  ramp: int
  span_loss_coef: float
  attn_impl: str

  @nn.compact
  def __call__(self, x, segment_ids, train: bool):
    x = x + layers.AdaptiveSpanAttention(
        num_heads=self.num_heads, max_span=self.max_span, ramp=self.ramp, causal=False,
        asymmetric=True, span_loss_coef=self.span_loss_coef, attn_impl=self.attn_impl,
        name="attn")(nn.LayerNorm()(x), segment_ids=segment_ids, deterministic=not train)
    h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class MaskedLM(nn.Module):
  """Byte embeddings (no absolute positions: the layers' relative ones are all it has), encoder
  blocks, logits over the bytes and [MASK]."""
  d_model: int = 128
  num_layers: int = 3
  num_heads: int = 4
  max_span: int = 64
  ramp: int = 8
  span_loss_coef: float = 2e-6
  attn_impl: str = "auto"

  @nn.compact
  def __call__(self, tokens, segment_ids, train: bool = False):
    x = nn.Embed(VOCAB, self.d_model)(tokens)
    for i in range(self.num_layers):
      x = Block(self.num_heads, self.max_span, self.ramp, self.span_loss_coef, self.attn_impl,
                name=f"block{i}")(x, segment_ids, train)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def text_lines(part: slice, length: int) -> list:
  """The non-empty lines of the packaged text's `part`, each cut into pieces of <= length bytes."""
  raw = demo.read_bytes()[part]
  out = []
  for line in raw.split(b"\n"):
    out += [line[i:i + length] for i in range(0, len(line), length)]
  return [np.frombuffer(p, np.uint8).astype(np.int32) for p in out if p]


def make_batch(rng, lines: list, batch: int, length: int, packed: bool):
  """(tokens, segment_ids), each (batch, length): random lines, one per row then padding, or
  packed several to a row (ids 1, 2, ...: random lines, skipping those that do not fit in what
  is left, until 8 in a row did not). Padding: token PAD, id 0."""
  tokens = np.full((batch, length), PAD, np.int32)
  seg = np.zeros((batch, length), np.int32)
  for row in range(batch):
    at, sid, misses = 0, 1, 0
    while misses < 8:
      line = lines[rng.integers(len(lines))]  # a piece of <= length: the first always fits
      if at + len(line) > length:
        misses += 1
        continue
      tokens[row, at:at + len(line)], seg[row, at:at + len(line)] = line, sid
      at, sid = at + len(line), sid + 1
      if not packed:
        break
  return tokens, seg


def corrupt(rng, tokens, seg, rate: float = 0.15):
  """BERT's corruption of the real tokens: (inputs, weights: 1 where a token is scored)."""
  picked = (rng.random(tokens.shape) < rate) & (seg != 0)
  how = rng.random(tokens.shape)
  inputs = np.where(picked & (how < 0.8), MASK, tokens)
  inputs = np.where(picked & (how >= 0.8) & (how < 0.9),
                    rng.integers(1, 256, tokens.shape), inputs)
  return inputs.astype(np.int32), picked.astype(np.float32)


def masked_nll(logits, targets, weights):
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def median_time(f, *args, reps: int) -> float:
  jax.block_until_ready(f(*args))  # compile
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=256, help="tokens per row")
  p.add_argument("--packing", choices=("packed", "padded"), default="packed",
                 help="packed: several lines per row (segment ids 1, 2, ...); padded: one")
  p.add_argument("--max_span", type=int, default=32)
  p.add_argument("--ramp", type=int, default=8)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--span_loss_coef", type=float, default=2e-6)
  p.add_argument("--log_every", type=int, default=50)
  p.add_argument("--speed_reps", type=int, default=5, help="timed runs per path (0: no timing)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  # the layer says once which attention runs (logger span_lm, INFO)
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
  logging.getLogger("span_lm").addHandler(handler)
  logging.getLogger("span_lm").setLevel(logging.INFO)

  train_end, valid_end = demo.SPLIT_BYTES
  train_lines = text_lines(slice(0, train_end), args.length)
  valid_lines = text_lines(slice(train_end, valid_end), args.length)
  n = np.array([len(l) for l in train_lines])
  print(f"{len(train_lines):,} training lines (longer ones cut into pieces of <= {args.length} "
        f"bytes; median {np.median(n):.0f}) in rows of {args.length}, "
        f"{args.packing}: batch {args.batch}, {args.steps} steps")
  packed = args.packing == "packed"

  model = MaskedLM(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                   max_span=args.max_span, ramp=args.ramp, span_loss_coef=args.span_loss_coef)
  rng = np.random.default_rng(args.seed)
  tokens, seg = make_batch(rng, train_lines, args.batch, args.length, packed)
  params = model.init(jax.random.key(args.seed), tokens, seg)["params"]
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
  state = opt.init(params)

  def loss_fn(params, inputs, seg, targets, weights, model=model):
    logits, inter = model.apply({"params": params}, inputs, seg, train=True,
                                mutable=["intermediates"])
    nll = masked_nll(logits, targets, weights)
    return nll + layers.span_loss(inter["intermediates"]), nll  # every layer's span penalty

  @jax.jit
  def step(params, state, inputs, seg, targets, weights):
    (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, inputs, seg, targets, weights)
    updates, state = opt.update(grads, state, params)
    # the reference clamps every z' to [0, 1] after each step
    return layers.clamp_spans(optax.apply_updates(params, updates)), state, nll

  @jax.jit
  def eval_nll(params, inputs, seg, targets, weights):
    return masked_nll(model.apply({"params": params}, inputs, seg), targets, weights)

  vrng = np.random.default_rng(1234)
  valid = []
  for _ in range(4):
    t, s = make_batch(vrng, valid_lines, args.batch, args.length, packed)
    valid.append((*corrupt(vrng, t, s), s, t))

  def valid_bits():
    return np.mean([float(eval_nll(params, inp, s, t, w)) for inp, w, s, t in valid]) / np.log(2)

  print("\nloss curve (cross-entropy on the masked tokens, bits per token):")
  t0, acc, real, scored = time.time(), [], 0, 0
  for i in range(1, args.steps + 1):
    tokens, seg = make_batch(rng, train_lines, args.batch, args.length, packed)
    inputs, weights = corrupt(rng, tokens, seg)
    params, state, nll = step(params, state, inputs, seg, tokens, weights)
    acc.append(nll)
    real += int((seg != 0).sum())
    scored += int(weights.sum())
    if i % args.log_every == 0 or i == args.steps:
      train = float(np.mean(jax.device_get(acc))) / np.log(2)
      print(f"step {i:5d}: train {train:.3f}  valid {valid_bits():.3f}  "
            f"({real / (i * args.batch * args.length):.0%} of the rows real tokens, "
            f"{scored / i:.0f} scored per step; {time.time() - t0:.0f} s)", flush=True)
      acc = []
  if not np.isfinite(train):
    raise SystemExit(f"the loss is not finite: {train}")

  spans = layers.learned_spans(params)  # {'blockI/attn': back, 'blockI/attn/ahead': ahead}
  print(f"\nlearned spans z in tokens (max_span {args.max_span}; in brackets the window "
        f"ceil(z) + {args.ramp}, the distances the head reaches):")
  print("| layer | side | " + " | ".join(f"h{h}" for h in range(args.heads)) + " |")
  print("|---" * (args.heads + 2) + "|")
  for i in range(args.layers):
    for side, key in (("back", f"block{i}/attn"), ("ahead", f"block{i}/attn/ahead")):
      print(f"| block{i} | {side} | " + " | ".join(
          f"{float(z):.1f} ({min(args.max_span, int(np.ceil(z)) + args.ramp)})"
          for z in spans[key]) + " |")

  if args.speed_reps:
    tokens, seg = make_batch(rng, train_lines, args.batch, args.length, packed)
    inputs, weights = corrupt(rng, tokens, seg)
    print(f"\nforward + backward of the whole model at batch {args.batch} x {args.length} "
          f"tokens, jit, median of {args.speed_reps} ({jax.devices()[0].platform}):")
    times = {}
    for impl, name in (("auto", "span path (attn_impl='auto')"),
                       ("plain", "dense path (attn_impl='plain')")):
      m = model.clone(attn_impl=impl)  # the same parameters: only the path differs
      grad = jax.jit(jax.value_and_grad(lambda p, *a, m=m: loss_fn(p, *a, model=m), has_aux=True))
      times[impl] = median_time(grad, params, inputs, seg, tokens, weights, reps=args.speed_reps)
      print(f"  {name:32s} {times[impl] * 1e3:8.1f} ms", flush=True)
    print(f"  the span path takes {times['auto'] / times['plain']:.2f}x the dense path's time")


if __name__ == "__main__":
  main()
