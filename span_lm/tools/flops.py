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

`forward_macs` itemises this (each architecture's count is its ARCHS record's, model/macs.py);
`generation_macs` counts what `sample` runs per token instead (the ring decoder over projected
key/value caches: no cached state is re-projected). The training step does 3x the forward's
matmul work (every matmul has two operand gradients) except for the cache rows of the key/value
projection: the cache is a constant of the step and is projected by its own matmul, so it gets a
weight gradient only. Under remat='layer' the count adds one more forward of the layers, an
upper bound: XLA removes part of that recomputation (tiny test model: 466M of 575M).

`xla_costs` compiles the real train step and reads XLA's cost and memory analyses;
`hlo_dot_flops` sums its matmuls (dot instructions; on TPU the convolutions XLA writes them as),
which equal 2 x our matmul count exactly (tested on XLA:CPU, and on XLA:TPU HLO kept in
tests/fixtures/tpu_hlo). arch='sparse' has its own count (macs.sparse_forward_macs), equally exact.
XLA's total `flops` also counts elementwise work (softmax, masks, layer norms, the optimizer), a
few percent above the matmul count on tiny models (4-8% in tests/tools/test_tools.py), less as D grows.
"""
import dataclasses
import functools
import logging
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels import target
from span_lm.kernels.banded_reference import choose_chunk
from span_lm.model import ARCHS
from span_lm.model import caches as caches_lib
from span_lm.model import plan as plan_lib
from span_lm.model.macs import ATTENTION, COMPONENTS, OTHER, sparse_attention_macs
from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan



def forward_macs(cfg: ModelConfig, plan: SpanPlan | None, block: int, batch: int = 1) -> dict:
  """Multiply-adds of one forward pass over a (batch, block) input, by component (Python ints):
  the architecture's own count (model/macs.py), on `plan` (default: the full plan)."""
  return ARCHS[cfg.arch].forward_macs(cfg, plan or plan_lib.full_plan(cfg), block, batch)


def generation_macs(cfg: ModelConfig, plan: SpanPlan | None) -> dict:
  """Multiply-adds of one generated token as `sample` computes it (span_lm/tools/sample.py): the
  ring decoder (kernels/ring.py) over caches of projected keys and values, one token per step.
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
  """Bytes the forward pass keeps for the backward pass (JAX's residuals), by kind.

  The attention's own residuals (keys/values, score bands, weights) come from the implementation
  the door picks (its residual_bytes; the CPU one is checked in float32 against jax's saved
  residuals in tests); per layer this adds the key/value input rows, layer-norm and feed-forward
  intermediates. Dropout masks (train and dropout > 0) are approximate: a byte per element plus
  the dropped copy. With remat='layer' only the layer inputs and one layer's residuals are kept.
  These are JAX's residuals, which XLA:CPU keeps (tests/tools/test_tools.py). XLA:TPU does not:
  of the reference attention it keeps two float32 bands per head row whatever the span mode and
  dropout, and recomputes the rest in the backward pass (xla_tpu_score_bands), so where the target
  is a TPU (kernels.target) that is the score_bands entry.
  arch='sparse': JAX's own list of saved residuals for the model (one kind, 'residuals').
  """
  if not ARCHS[cfg.arch].banded:
    return {"residuals": _saved_residual_bytes(cfg, batch, block, train)}
  plan = plan or plan_lib.full_plan(cfg)
  b, m, d = batch, block, cfg.d_model
  act, f32 = jnp.dtype(cfg.dtype).itemsize, 4
  drop = train and cfg.dropout > 0
  impl = kernels.select(cfg, m, max(w for lp in plan.layers for _, w in lp.groups))
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
      res = impl.residual_bytes(cfg, b, m, g, w, train)
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


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes of the float32 parameters (the same again for their gradients)."""
  from span_lm.model import build_model  # pylint: disable=g-import-not-at-top
  plan = plan_lib.full_plan(cfg)
  shapes = jax.eval_shape(lambda: build_model(cfg, plan).init(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), caches_lib.init_caches(cfg, plan, 1)))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def xla_tpu_score_bands(cfg: ModelConfig, batch: int, m: int, g: int, w: int) -> int:
  """Bytes of score bands XLA:TPU keeps of one head group's reference attention: the float32
  content scores over each chunk's W + C keys and one float32 band over the W (+ N persistent)
  columns, per query row, whatever the span mode and dropout. It recomputes the rest of what
  JAX saves (softmax, span mask, renormalisation, dropout and its keep mask) in the backward
  pass. Measured on deviceless v5p compiles (libtpu, jax 0.10.2): the compiled temporaries of
  1- and 3-layer models (fixed/adaptive, with and without dropout) and of configs/enwik8_large.py
  and enwik8_pers.py (tests/fixtures/tpu_hlo/memory.json, docs/benchmarks.md)."""
  c = choose_chunk(m, w, cfg.attention.chunk)
  return batch * g * m * ((w + c) + (w + cfg.pers_mem)) * 4


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


def peak_activation_bytes(cfg: ModelConfig, plan: SpanPlan | None, batch: int,
                          block: int) -> int:
  """Residuals plus the backward pass's working set at the widest head group.

  The working set is an estimate, not XLA's schedule: the float32 (M, W + C) score block of the
  widest group and its gradient, live together while that group's backward runs (arch='sparse':
  the score block of its widest layer, over all heads).
  """
  if not ARCHS[cfg.arch].banded:
    widest = max(sum(sparse_attention_macs(cfg, i, block)) // (cfg.d_qk // cfg.n_heads
                                                                + cfg.head_dim)
                 for i in range(cfg.n_layers))
    return sum(activation_bytes(cfg, plan, batch, block).values()) + 2 * batch * widest * 4
  plan = plan or plan_lib.full_plan(cfg)
  widest = max(len(h) * (w + choose_chunk(block, w, cfg.attention.chunk) + cfg.pers_mem)
               for lp in plan.layers for h, w in lp.groups)
  return sum(activation_bytes(cfg, plan, batch, block).values()) + 2 * batch * block * widest * 4


# --------------------------------------------------------------------------------------------- XLA

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|branch_computations|true_computation|"
                    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _closing(s: str, i: int) -> int:
  """The index of the bracket closing the one at s[i] (any of ( [ {)."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j
  return len(s)


def _split_top(s: str) -> list[str]:
  """s split at the commas outside brackets."""
  out, depth, start = [], 0, 0
  for j, ch in enumerate(s):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      out.append(s[start:j].strip())
      start = j + 1
  out.append(s[start:].strip())
  return [x for x in out if x]


def _parse_instruction(rhs: str):
  """'f32[2,3]{1,0} dot(%a, %b), attrs' -> (dims or None for a tuple, opcode, operands, attrs)."""
  if rhs.startswith("("):
    dims, end = None, _closing(rhs, 0) + 1
  else:
    m = _ARRAY.match(rhs)
    dims = [int(x) for x in m.group(1).split(",") if x] if m else None
    end = rhs.find(" ")
  rest = rhs[end:].lstrip() if end > 0 else ""
  paren = rest.find("(")
  if paren <= 0:
    return dims, rest, [], ""
  close = _closing(rest, paren)
  return dims, rest[:paren], _split_top(rest[paren + 1:close]), rest[close + 1:]


def _window_hits(n: int, step: int, off: int, last: int, dil: int) -> int:
  """#{j in [0, n): q = j * step + off lies in [0, last] and q % dil == 0}."""
  lo, hi = max(0, -(off // step)), min(n - 1, (last - off) // step)  # -(a // b) = ceil(-a / b)
  if hi < lo:
    return 0
  if dil == 1:
    return hi - lo + 1
  period = dil // math.gcd(step, dil)
  first = next((j for j in range(lo, lo + period) if (j * step + off) % dil == 0), None)
  return 0 if first is None or first > hi else (hi - first) // period + 1


def _conv_pairs(n_out, n_win, n_in, stride, pad_lo, lhs_dil, rhs_dil) -> int:
  """(output position, window position) pairs of one spatial dimension that meet an input element
  (not padding, not a hole left by lhs dilation): the products that are not zero by position."""
  last = (n_in - 1) * lhs_dil
  if n_win <= n_out:
    return sum(_window_hits(n_out, stride, k * rhs_dil - pad_lo, last, lhs_dil)
               for k in range(n_win))
  return sum(_window_hits(n_win, rhs_dil, p * stride - pad_lo, last, lhs_dil)
             for p in range(n_out))


def _conv_macs(out, lhs, rhs, attrs) -> int:
  """Multiply-adds of an HLO convolution: output elements x input features (rhs 'i') x the window
  positions that meet input data. XLA:TPU writes matmuls as convolutions, batch dimensions as
  spatial ones whose window walks a dilated input (size=n stride=n-1 lhs_dilate=n: one hit per
  output position), so the window is counted position by position, not as its size."""
  labels = _DIM_LABELS.search(attrs)
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = sorted(c for c in out_l if c.isdigit())
  found = _WINDOW.search(attrs)
  window = dict(f.split("=", 1) for f in (found.group(1) if found else "").split() if "=" in f)

  def field(name, k, default):
    vals = window.get(name)
    return int(vals.split("x")[k]) if vals else default

  pads = window.get("pad", "").split("x") if window.get("pad") else None
  macs = rhs[rhs_l.index("i")] * math.prod(out[out_l.index(c)] for c in out_l if not c.isdigit())
  for k, c in enumerate(spatial):
    macs *= _conv_pairs(out[out_l.index(c)], rhs[rhs_l.index(c)], lhs[lhs_l.index(c)],
                        field("stride", k, 1), int(pads[k].split("_")[0]) if pads else 0,
                        field("lhs_dilate", k, 1), field("rhs_dilate", k, 1))
  return macs


def hlo_dot_flops(hlo_text: str) -> int:
  """2 x MACs of the matmuls in an (optimised) HLO module's text: its dot instructions, and the
  convolutions XLA:TPU writes matmuls as, inside fusions or not. Each computation counts once per
  call: fusions and calls by the call graph from ENTRY, while-loop bodies times their known trip
  count (once where XLA knows none), every branch of a conditional. Matmuls inside custom calls
  (a fused Pallas kernel) are not visible here."""
  comps, entry, cur = {}, None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line.startswith((" ", "HloModule")):
      cur = head.group(2)
      comps[cur], entry = [], cur if head.group(1) else entry
      continue
    ins = _INSTRUCTION.match(line)
    if ins:
      if cur is None:  # a fragment without computation headers: one computation
        cur = entry = ""
        comps[cur] = []
      comps[cur].append((ins.group(1),) + _parse_instruction(ins.group(2)))
  shapes = {name: dims for body in comps.values() for name, dims, *_ in body}

  def dims_of(operand):
    m = _ARRAY.match(operand)  # newer text writes the operand's shape before its name
    if m:
      return [int(x) for x in m.group(1).split(",") if x]
    return shapes[operand.split()[-1].lstrip("%")]

  def own(body):
    total = 0
    for _, out, op, args, attrs in body:
      if op == "dot":
        contract = _CONTRACT.search(attrs).group(1)
        lhs = dims_of(args[0])
        total += math.prod(out) * math.prod(lhs[int(i)] for i in contract.split(",") if i)
      elif op == "convolution":
        total += _conv_macs(out, dims_of(args[0]), dims_of(args[1]), attrs)
    return total

  @functools.cache
  def macs(name):
    total = own(comps[name])
    for *_, attrs in comps[name]:
      trips = _TRIP_COUNT.search(attrs)
      for kind, callees in _CALLS.findall(attrs):
        for callee in re.findall(r"%?([\w.\-]+)", callees):
          if callee in comps:
            total += (int(trips.group(1)) if kind == "body" and trips else 1) * macs(callee)
    return total

  if entry is None:
    return 2 * sum(own(body) for body in comps.values())
  return 2 * macs(entry)


def default_optimizer():
  """The reference Adagrad the configs train with (the optimizer only adds elementwise work)."""
  from span_lm.train import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  return optimizer_lib.make_optimizer(
      {"name": "adagrad", "lr": 0.07, "momentum": 0.0, "grad_clip": 0.03, "warmup": 100,
       "batch_split": 1})[0]


def compile_train_step(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
                       tx=None, *, devices=None):
  """The train step as a run compiles it (train/steps.build: mesh, shardings, donated state, the
  attention kernel's compiler options), for abstract inputs: a fresh state without loss scaling
  and a (batch, block) batch. On one device, or over `devices` (e.g. a deviceless TPU chip's)."""
  from span_lm.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  plan = plan or plan_lib.full_plan(cfg)
  tx = tx or default_optimizer()
  state = jax.eval_shape(lambda: steps_lib.init_state(cfg, tx, plan, batch, 1, 0))
  tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32)
  batch_spec = {"x": tokens, "y": tokens, "reset": jax.ShapeDtypeStruct((), jnp.bool_)}
  compiler = steps_lib.build(cfg, tx, batch=batch, eval_batch=1,
                             num_devices=None if devices else 1, devices=devices,
                             log=logging.getLogger("span_lm").debug)
  return compiler.train(plan, state, batch_spec)


def xla_costs(cfg: ModelConfig, plan: SpanPlan | None, batch: int, block: int,
              tx=None) -> dict[str, Any]:
  """Compiles the real train step (one device: compile_train_step) and reads XLA's analyses."""
  compiled = compile_train_step(cfg, plan, batch, block, tx)
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
            xla: bool = False, generation_plan: SpanPlan | None = None) -> dict[str, Any]:
  """Everything about one (model, plan, shapes): per-token MACs, train-step flops and memory.
  generation_plan: the plan `sample` decodes with (the tightest for the checkpoint's spans);
  default: `plan`."""
  plan = plan or plan_lib.full_plan(cfg)
  gen_plan = generation_plan or plan
  generates = ARCHS[cfg.arch].cache  # sample's ring decoder runs over the caches
  out = {"plan": plan.describe(), "attention_keys": plan.attention_keys(),
         "per_token_block": dataclasses.asdict(per_token(cfg, plan, block)),
         # arch='sparse' attends within its block, no cache: no one-token generation step
         "per_token_generation": (dataclasses.asdict(per_token_generation(cfg, gen_plan))
                                  if generates else None),
         "generation_plan": gen_plan.describe() if generates else None,
         "forward_macs": forward_macs(cfg, plan, block, batch),
         "train_step_flops": train_step_flops(cfg, plan, batch, block),
         "activation_bytes": activation_bytes(cfg, plan, batch, block),
         "peak_activation_bytes": peak_activation_bytes(cfg, plan, batch, block),
         "param_bytes": param_bytes(cfg), "batch": batch, "block": block}
  if xla:
    out["xla"] = xla_costs(cfg, plan, batch, block)
  return out
