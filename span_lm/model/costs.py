"""Multiply-adds, FLOPs and activation memory of a model, counted as span_lm computes them.

Why count by hand: the paper's claim is about compute, and our implementation does not compute the
paper's idealised H * span * 2 * Dh per token. What it does, per layer and block of M queries:

  projections  q and out: M * D^2 each; keys and values per head group, over the group's last W
               cached states plus the block: (W + M) * D * 2 G Dh. The cache holds hidden states,
               so the keys and values of the W cached rows are recomputed every block.
  attention    per head group of G heads with window W and chunk C = choose_chunk(M, W): each query
               computes W + C content scores (the skewed chunk of keys, of which W survive unskew),
               W position scores and W + C value products (the skewed weights), each Dh long;
               persistent memory adds 2 N Dh; the dynamic-span predictor D * H.
  feed-forward 2 * D * F; output D * V (the embedding lookup is a gather).

`forward_macs` itemises this (each architecture's count is its ARCHS record's, model/macs.py);
`generation_macs` counts what `sample` runs per token instead (the ring decoder over projected
key/value caches: no cached state is re-projected). The training step does 3x the forward's
matmul work (every matmul has two operand gradients) except for the cache rows of the key/value
projection: the cache is a constant of the step and is projected by its own matmul, so it gets a
weight gradient only. Under remat='layer' the count adds one more forward of the layers, an
upper bound: XLA removes part of that recomputation (tiny test model: 466M of 575M).

The memory counts are each architecture's too (its ARCHS record's `activation_bytes` and
`widest_scores`, below): the span model's from the attention implementation's residuals, the
Sparse Transformer's from JAX's own list of saved residuals.

They live here, beside the models, because training needs them (train/telemetry.py's MFU);
span_lm/tools/flops.py compiles the real train step and reads XLA's counts beside them, and
span_lm/tools/hlo.py sums the compiled matmuls, which equal 2 x our matmul count exactly (tested
on XLA:CPU, and on XLA:TPU HLO kept in tests/fixtures/tpu_hlo). arch='sparse' has its own count
(macs.sparse_forward_macs), equally exact. XLA's total `flops` also counts elementwise work
(softmax, masks, layer norms, the optimizer), a few percent above the matmul count on tiny models
(4-8% in tests/tools/test_tools.py), less as D grows.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels import target
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.archs import ARCHS
from span_lm.model.config import ModelConfig
from span_lm.model.macs import ATTENTION, COMPONENTS, OTHER, sparse_attention_macs
from span_lm.model.plan import SpanPlan


def forward_macs(cfg: ModelConfig, plan: SpanPlan | None, block: int, batch: int = 1) -> dict:
  """Multiply-adds of one forward pass over a (batch, block) input, by component (Python ints):
  the architecture's own count (model/macs.py), on `plan` (default: the full plan)."""
  return ARCHS[cfg.arch].forward_macs(cfg, plan or plan_lib.full_plan(cfg), block, batch)


def generation_macs(cfg: ModelConfig, plan: SpanPlan | None) -> dict:
  """Multiply-adds of one generated token as `sample` computes it (span_lm/tools/sample.py): the
  ring decoder (kernels/span/ring.py) over caches of projected keys and values, one token per step.
  Per layer: the token's query, key, value and output projections (D^2 each for q and out, 2 D^2
  for keys|values of all heads; the cached states are never re-projected); per head the content
  and value products over the layer's whole ring of L = cache_len slots (slots beyond a head's
  window are masked, not skipped), the position scores against all S relative embeddings, and
  persistent memory's 2 N; the span predictor, feed-forward and output layer as in a block."""
  if not ARCHS[cfg.arch].cache:
    raise ValueError(f"arch={cfg.arch!r} has no one-token generation step")
  plan = plan or plan_lib.full_plan(cfg)
  d, dh, h, s = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.span.size
  out = dict.fromkeys(COMPONENTS, 0)
  for lp in plan.layers:
    out["q_proj"] += d * d
    out["kv_proj"] += d * 2 * d
    out["out_proj"] += d * d
    out["attn_content"] += h * lp.cache_len * dh
    out["attn_position"] += h * s * dh
    out["attn_value"] += h * lp.cache_len * dh
    out["attn_persistent"] += 2 * h * cfg.pers_mem * dh
    if cfg.span.mode == "dynamic":
      out["span_predictor"] += d * h
    if cfg.pers_mem == 0:
      out["ff"] += 2 * d * cfg.d_ff
  out["output"] = d * cfg.vocab_size
  return out


@dataclasses.dataclass(frozen=True)
class TokenCost:
  """Multiply-adds per predicted token, split as the paper discusses them."""
  attention: float  # score and value products (what grows with the span)
  kv_proj: float  # key/value projection, cache rows included
  other: float  # q/out projections, feed-forward, span predictor, output layer

  @property
  def total(self) -> float:
    return self.attention + self.kv_proj + self.other


def per_token(cfg: ModelConfig, plan: SpanPlan | None, block: int) -> TokenCost:
  """MACs per predicted token when the model runs blocks of `block` tokens over a hidden-state
  cache (training, evaluation)."""
  return _token_cost(forward_macs(cfg, plan, block), block)


def per_token_generation(cfg: ModelConfig, plan: SpanPlan | None) -> TokenCost:
  """MACs per generated token of `sample`'s ring decoder (generation_macs)."""
  return _token_cost(generation_macs(cfg, plan), 1)


def _token_cost(f: dict, block: int) -> TokenCost:
  return TokenCost(attention=sum(f[k] for k in ATTENTION) / block, kv_proj=f["kv_proj"] / block,
                   other=sum(f[k] for k in OTHER if k != "kv_proj") / block)


def train_step_flops(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int) -> int:
  """Matmul flops (2 per MAC) of one training step: forward + two operand gradients per matmul."""
  f = forward_macs(cfg, plan, block, batch)
  total = sum(f.values())
  layers = total - f["output"]
  plan = plan or plan_lib.full_plan(cfg)
  d, dh = cfg.d_model, cfg.head_dim
  cache_kv = 0 if not ARCHS[cfg.arch].cache else batch * sum(  # sparse: no cache
      w * d * 2 * len(heads) * dh for lp in plan.layers for heads, w in lp.groups)
  return 2 * (3 * total - cache_kv + (layers if cfg.remat == "layer" else 0))


# ------------------------------------------------------------------------------------------ memory


def activation_bytes(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
                     train: bool = True) -> dict:
  """Bytes the forward pass keeps for the backward pass (JAX's residuals), by kind: the
  architecture's own count (span_activation_bytes, sparse_activation_bytes), on `plan` (default:
  the full plan)."""
  return ARCHS[cfg.arch].activation_bytes(cfg, plan or plan_lib.full_plan(cfg), batch, block,
                                          train)


def peak_activation_bytes(cfg: ModelConfig, plan: SpanPlan | None, batch: int,
                          block: int) -> int:
  """Residuals plus the backward pass's working set at the widest head group.

  The working set is an estimate, not XLA's schedule: the float32 score block of the widest
  group (the architecture's widest_scores) and its gradient, live together while that group's
  backward runs.
  """
  widest = ARCHS[cfg.arch].widest_scores(cfg, plan or plan_lib.full_plan(cfg), block)
  return sum(activation_bytes(cfg, plan, batch, block).values()) + 2 * batch * widest * 4


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes of the float32 parameters (the same again for their gradients)."""
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  plan = plan_lib.full_plan(cfg)
  shapes = jax.eval_shape(lambda: build_model(cfg, plan).init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


# ---- span Transformer ----------------------------------------------------------------------------


def span_activation_bytes(cfg: ModelConfig, plan: SpanPlan, batch: int, block: int,
                          train: bool = True) -> dict:
  """activation_bytes of the span Transformer, on the windows of span plan `plan`.

  The attention's own residuals (keys/values, score bands, weights) come from the implementation
  the door picks (its residual_bytes; the CPU one is checked in float32 against jax's saved
  residuals in tests); per layer this adds the key/value input rows, layer-norm and feed-forward
  intermediates. Dropout masks (train and dropout > 0) are approximate: a byte per element plus
  the dropped copy. With remat='layer' only the layer inputs and one layer's residuals are kept.
  These are JAX's residuals, which XLA:CPU keeps (tests/tools/test_tools.py). XLA:TPU does not:
  of the reference attention it keeps two float32 bands per head row whatever the span mode and
  dropout, and recomputes the rest in the backward pass (xla_tpu_score_bands), so where the target
  is a TPU (kernels.target) that is the score_bands entry.
  """
  b, m, d = batch, block, cfg.d_model
  act, f32 = jnp.dtype(cfg.dtype).itemsize, 4
  drop = train and cfg.dropout > 0
  impl = kernels.select(cfg.attn_spec, m, max(w for lp in plan.layers for _, w in lp.groups))
  layers = []
  for lp in plan.layers:
    it = dict.fromkeys(("kv_input", "keys_values", "score_bands", "weights", "layer", "ff"), 0)
    it["layer"] = b * m * d * act * 2  # queries, attention output
    for heads, w in lp.groups:
      g = len(heads)
      # The block rows, and the cache rows read unless they are the whole cache (then the
      # residual is the step's input itself, not a new buffer).
      rows = impl.cached_rows(w)
      it["kv_input"] += b * (m + (rows if rows != lp.cache_len else 0)) * d * act
      res = impl.residual_bytes(cfg.attn_spec, b, m, g, w, train)
      if impl.name == "reference" and target.name() == "tpu":
        res["score_bands"] = xla_tpu_score_bands(cfg, b, m, g, w)
      for k, v in res.items():
        it[k] += v
    n_norms = 1 if cfg.pers_mem else 2
    it["layer"] += n_norms * (4 * b * m * d + 4 * b * m) * f32
    if cfg.pers_mem == 0:
      it["ff"] = b * m * cfg.d_ff * (2 * act + 1 + (1 + act if drop else 0))
    layers.append(it)
  out = {k: sum(it[k] for it in layers) for k in layers[0]}
  if cfg.remat == "layer":
    heaviest = max(layers, key=lambda it: sum(it.values()))
    out = dict(heaviest, layer=heaviest["layer"] + cfg.n_layers * b * m * d * f32)
  out["embedding_output"] = b * m * (d * f32 + 4) + b * m * (cfg.vocab_size + 2) * f32
  return out


def span_widest_scores(cfg: ModelConfig, plan: SpanPlan, block: int) -> int:
  """widest_scores of the span Transformer: the (M, W + C) score block of its widest head group
  (persistent memory's N columns included), all of the group's heads."""
  return block * max(len(h) * (w + kernels.chunk(cfg.attn_spec, block, w) + cfg.pers_mem)
                     for lp in plan.layers for h, w in lp.groups)


def xla_tpu_score_bands(cfg: ModelConfig, batch: int, m: int, g: int, w: int) -> int:
  """Bytes of score bands XLA:TPU keeps of one head group's reference attention: the float32
  content scores over each chunk's W + C keys and one float32 band over the W (+ N persistent)
  columns, per query row, whatever the span mode and dropout. It recomputes the rest of what
  JAX saves (softmax, span mask, renormalisation, dropout and its keep mask) in the backward
  pass. Measured on deviceless v5p compiles (libtpu, jax 0.10.2): the compiled temporaries of
  1- and 3-layer models (fixed/adaptive, with and without dropout) and of configs/enwik8_large.py
  and enwik8_pers.py (tests/fixtures/tpu_hlo/memory.json, docs/benchmarks.md)."""
  c = kernels.chunk(cfg.attn_spec, m, w)
  return batch * g * m * ((w + c) + (w + cfg.pers_mem)) * 4


# ---- Sparse Transformer --------------------------------------------------------------------------


def sparse_activation_bytes(cfg: ModelConfig, plan: SpanPlan, batch: int, block: int,
                            train: bool = True) -> dict:
  """activation_bytes of arch='sparse': JAX's own list of saved residuals for the model (one
  kind, 'residuals'). `plan` is unused: the patterns are fixed by config.model.sparse."""
  del plan
  return {"residuals": _saved_residual_bytes(cfg, batch, block, train)}


def sparse_widest_scores(cfg: ModelConfig, plan: SpanPlan, block: int) -> int:
  """widest_scores of arch='sparse': the (query, key) pairs its widest layer computes, summed
  over its heads (sparse_attention_macs' products over their lengths, d_qk / H + head_dim)."""
  del plan
  return max(sum(sparse_attention_macs(cfg, i, block)) // (cfg.d_qk // cfg.n_heads
                                                            + cfg.head_dim)
             for i in range(cfg.n_layers))


def _saved_residual_bytes(cfg: ModelConfig, batch: int, block: int, train: bool) -> int:
  """Bytes of jax's saved residuals of a (batch, block) training forward (abstract: nothing is
  computed), parameters and caches excluded (the step holds them anyway)."""
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  plan = plan_lib.full_plan(cfg)
  model = build_model(cfg, plan)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                             caches_lib.init_caches(cfg, plan, 1))["params"])
  caches = jax.eval_shape(lambda: caches_lib.init_caches(cfg, plan, batch))
  tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32)

  def loss(p, c, x):
    logp, _, aux = model.apply({"params": p}, x, c, train=train,
                               rngs={"dropout": jax.random.key(0)})
    return jnp.mean(logp) + aux["span_loss"]

  return int(sum(a.size * a.dtype.itemsize for a, why in
                 ad_checkpoint.saved_residuals(loss, params, caches, tokens)
                 if "from the argument" not in why))
