"""Multiply-adds and activation memory of the span Transformer, counted as span_lm computes them.

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

`forward_macs` itemises this. The training step does 3x the forward's matmul work (every matmul
has two operand gradients) except for the cache rows of the key/value projection: the cache is a
constant of the step and is projected by its own matmul, so it gets a weight gradient only. Under remat='layer' the count adds one more forward of the
layers, an upper bound: XLA removes part of that recomputation (tiny test model: 466M of 575M).

`xla_costs` compiles the real train step and reads XLA's cost and memory analyses;
`hlo_dot_flops` sums its dot instructions, which equal 2 x our matmul count exactly (tested).
XLA's total `flops` also counts elementwise work (softmax, masks, layer norms, the optimizer), a
few percent above the matmul count on tiny models (4-8% in tests/tools/test_tools.py), less as D grows.
"""
import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels.banded_reference import choose_chunk
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan

ATTENTION = ("attn_content", "attn_position", "attn_value", "attn_persistent")
OTHER = ("q_proj", "kv_proj", "out_proj", "span_predictor", "ff", "output")
COMPONENTS = ATTENTION + OTHER


def forward_macs(cfg: ModelConfig, plan: SpanPlan | None, block: int, batch: int = 1) -> dict:
  """Multiply-adds of one forward pass over a (batch, block) input, by component (Python ints)."""
  plan = plan or plan_lib.full_plan(cfg)
  d, dh, m = cfg.d_model, cfg.head_dim, block
  out = dict.fromkeys(COMPONENTS, 0)
  for lp in plan.layers:
    out["q_proj"] += m * d * d
    out["out_proj"] += m * d * d
    for heads, w in lp.groups:
      g, c = len(heads), choose_chunk(m, w, cfg.attn_chunk)
      out["kv_proj"] += (w + m) * d * 2 * g * dh
      out["attn_content"] += g * m * (w + c) * dh
      out["attn_position"] += g * m * w * dh
      out["attn_value"] += g * m * (w + c) * dh
      out["attn_persistent"] += 2 * g * m * cfg.pers_mem * dh
    if cfg.span_mode == "dynamic":
      out["span_predictor"] += m * d * cfg.n_heads
    if cfg.pers_mem == 0:
      out["ff"] += 2 * m * d * cfg.d_ff
  out["output"] = m * d * cfg.vocab_size
  return {k: v * batch for k, v in out.items()}


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
  """MACs per predicted token when the model runs blocks of `block` tokens (1: generation)."""
  f = forward_macs(cfg, plan, block)
  return TokenCost(attention=sum(f[k] for k in ATTENTION) / block, kv_proj=f["kv_proj"] / block,
                   other=sum(f[k] for k in OTHER if k != "kv_proj") / block)


def train_step_flops(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int) -> int:
  """Matmul flops (2 per MAC) of one training step: forward + two operand gradients per matmul."""
  f = forward_macs(cfg, plan, block, batch)
  total = sum(f.values())
  layers = total - f["output"]
  plan = plan or plan_lib.full_plan(cfg)
  d, dh = cfg.d_model, cfg.head_dim
  cache_kv = batch * sum(w * d * 2 * len(heads) * dh for lp in plan.layers for heads, w in lp.groups)
  return 2 * (3 * total - cache_kv + (layers if cfg.remat == "layer" else 0))


# ------------------------------------------------------------------------------------------ memory


def activation_bytes(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
                     train: bool = True) -> dict:
  """Bytes the forward pass keeps for the backward pass (JAX's residuals), by kind.

  The attention's own residuals (keys/values, score bands, weights) come from the implementation
  the door picks (kernels.residual_bytes; the CPU one is checked in float32 against jax's saved
  residuals in tests); per layer this adds the key/value input rows, layer-norm and feed-forward
  intermediates. Dropout masks (train and dropout > 0) are approximate: a byte per element plus
  the dropped copy. With remat='layer' only the layer inputs and one layer's residuals are kept.
  """
  plan = plan or plan_lib.full_plan(cfg)
  b, m, d = batch, block, cfg.d_model
  act, f32 = jnp.dtype(cfg.dtype).itemsize, 4
  drop = train and cfg.dropout > 0
  impl = kernels.choose(cfg, m, max(w for lp in plan.layers for _, w in lp.groups))
  layers = []
  for lp in plan.layers:
    it = dict.fromkeys(("kv_input", "keys_values", "score_bands", "weights", "layer", "ff"), 0)
    it["layer"] = b * m * d * act * 2  # queries, attention output
    for heads, w in lp.groups:
      g = len(heads)
      # The block rows, and the cache rows unless the window is the whole cache (then the
      # residual is the step's input itself, not a new buffer).
      it["kv_input"] += b * (m + (w if w < lp.cache_len else 0)) * d * act
      for k, v in kernels.residual_bytes(cfg, impl, b, m, g, w, train).items():
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


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes of the float32 parameters (the same again for their gradients)."""
  from span_lm.model.transformer import SpanTransformer  # pylint: disable=g-import-not-at-top
  plan = plan_lib.full_plan(cfg)
  shapes = jax.eval_shape(lambda: SpanTransformer(cfg, plan).init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def peak_activation_bytes(cfg: ModelConfig, plan: SpanPlan | None, batch: int,
                          block: int) -> int:
  """Residuals plus the backward pass's working set at the widest head group.

  The working set is an estimate, not XLA's schedule: the float32 (M, W + C) score block of the
  widest group and its gradient, live together while that group's backward runs.
  """
  plan = plan or plan_lib.full_plan(cfg)
  widest = max(len(h) * (w + choose_chunk(block, w, cfg.attn_chunk) + cfg.pers_mem)
               for lp in plan.layers for h, w in lp.groups)
  return sum(activation_bytes(cfg, plan, batch, block).values()) + 2 * batch * block * widest * 4


# --------------------------------------------------------------------------------------------- XLA

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_DOT = re.compile(r"\sdot\(%?([\w.\-]+),\s*%?([\w.\-]+)\)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def hlo_dot_flops(hlo_text: str) -> int:
  """2 x MACs of every dot instruction in an (optimised) HLO module's text."""
  shapes = {}
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if m:
      shapes[m.group(1)] = [int(x) for x in m.group(2).split(",") if x]
  total = 0
  for line in hlo_text.splitlines():
    dot = _DOT.search(line)
    if not dot or not _DEF.match(line):
      continue
    out = shapes[_DEF.match(line).group(1)]
    lhs = shapes[dot.group(1)]
    contract = [int(i) for i in _CONTRACT.search(line).group(1).split(",") if i]
    total += 2 * math.prod(out) * math.prod(lhs[i] for i in contract)
  return total


def default_optimizer():
  """The reference Adagrad the configs train with (the optimizer only adds elementwise work)."""
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  return optimizer_lib.make_optimizer(
      {"name": "adagrad", "lr": 0.07, "momentum": 0.0, "grad_clip": 0.03, "warmup": 100,
       "batch_split": 1})[0]


def xla_costs(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
              tx=None) -> dict[str, Any]:
  """Compiles the real train step (one device, donated state) and reads XLA's analyses."""
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  plan = plan or plan_lib.full_plan(cfg)
  tx = tx or default_optimizer()
  state = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, batch, 1, 0))
  tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32)
  batch_spec = {"x": tokens, "y": tokens, "reset": jax.ShapeDtypeStruct((), jnp.bool_)}
  fn = functools.partial(steps_lib.train_step, cfg=cfg, plan=plan, tx=tx)
  compiled = jax.jit(fn, donate_argnums=0).lower(state, batch_spec).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per module
  mem = compiled.memory_analysis()
  return {"flops": float(cost.get("flops", float("nan"))),
          "transcendentals": float(cost.get("transcendentals", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
          "dot_flops": hlo_dot_flops(compiled.as_text()),
          "temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes),
          "alias_bytes": int(mem.alias_size_in_bytes)}


# ------------------------------------------------------------------------------------------ report


def account(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
            xla: bool = False) -> dict[str, Any]:
  """Everything about one (model, plan, shapes): per-token MACs, train-step flops and memory."""
  plan = plan or plan_lib.full_plan(cfg)
  out = {"plan": plan.describe(), "attention_keys": plan.attention_keys(),
         "per_token_block": dataclasses.asdict(per_token(cfg, plan, block)),
         "per_token_generation": dataclasses.asdict(per_token(cfg, plan, 1)),
         "forward_macs": forward_macs(cfg, plan, block, batch),
         "train_step_flops": train_step_flops(cfg, plan, batch, block),
         "activation_bytes": activation_bytes(cfg, plan, batch, block),
         "peak_activation_bytes": peak_activation_bytes(cfg, plan, batch, block),
         "param_bytes": param_bytes(cfg), "batch": batch, "block": block}
  if xla:
    out["xla"] = xla_costs(cfg, plan, batch, block)
  return out
