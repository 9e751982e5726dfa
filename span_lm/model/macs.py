"""Multiply-adds of each architecture's forward pass, counted as span_lm computes them.

Each architecture's entry in model/archs.py holds its count (`Arch.forward_macs`), so the counts
live beside the models they describe; span_lm/model/costs.py builds the train-step FLOPs, MFU and
memory accounting on them (its docstring says how each component is counted and how the counts
were checked against the compiled programs' dot instructions).
"""
from span_lm import kernels

ATTENTION = ("attn_content", "attn_position", "attn_value", "attn_persistent")
OTHER = ("q_proj", "kv_proj", "out_proj", "span_predictor", "ff", "output")
COMPONENTS = ATTENTION + OTHER

# ---- span Transformer ----------------------------------------------------------------------------


def span_forward_macs(cfg, plan, block: int, batch: int = 1) -> dict:
  """Multiply-adds of the span Transformer's forward pass over a (batch, block) input, by
  component (Python ints), on the windows of span plan `plan`."""
  d, dh, m = cfg.d_model, cfg.head_dim, block
  out = dict.fromkeys(COMPONENTS, 0)
  for lp in plan.layers:
    out["q_proj"] += m * d * d
    out["out_proj"] += m * d * d
    for heads, w in lp.groups:
      g, c = len(heads), kernels.chunk(cfg.attn_spec, m, w)
      out["kv_proj"] += (w + m) * d * 2 * g * dh
      out["attn_content"] += g * m * (w + c) * dh
      out["attn_position"] += g * m * w * dh
      out["attn_value"] += g * m * (w + c) * dh
      out["attn_persistent"] += 2 * g * m * cfg.pers_mem * dh
    if cfg.span.mode == "dynamic":
      out["span_predictor"] += m * d * cfg.n_heads
    if cfg.pers_mem == 0:
      out["ff"] += 2 * m * d * cfg.d_ff
  out["output"] = m * d * cfg.vocab_size
  return {k: v * batch for k, v in out.items()}


# ---- Sparse Transformer --------------------------------------------------------------------------


def sparse_attention_macs(cfg, layer: int, n: int) -> tuple[int, int]:
  """(score, value) multiply-adds of one sequence's factorized attention in residual block
  `layer`, as span_lm/model/sparse.py computes them: heads grouped by pattern, the length padded
  to a multiple of the stride l (nb = n / l blocks), and per head
    dense          n x n keys (and every head under sparse.impl='dense', the masked reference);
    local  (A1)    strided: each block's l queries x the 2l keys of blocks b-1 and b; fixed: l x l;
    strided (A2)   the (l, nb) transpose: each column's nb queries x nb keys;
    summary (A2)   fixed: every query x the c summary keys of all nb blocks.
  Scores are d_qk / H long, values head_dim; masked products are computed (and counted) too.
  A block-skipping kernel (kernels/sparse/door.py, a row with kernel=True: splash) counts the
  blocks it computes: non-empty blocks x block area (its module's computed_pairs)."""
  from span_lm.kernels.sparse import door as sparse_door  # pylint: disable=g-import-not-at-top
  from span_lm.kernels.sparse import splash_sparse  # pylint: disable=g-import-not-at-top
  from span_lm.model import sparse  # pylint: disable=g-import-not-at-top
  h, dk, dv = cfg.n_heads, cfg.d_qk // cfg.n_heads, cfg.head_dim
  heads = sparse.layer_heads(cfg.sparse.pattern, cfg.sparse.combine, h, layer, cfg.sparse.stride,
                             cfg.sparse.c, cfg.sparse.distinct)
  keys = 0  # (query, key) pairs computed, summed over heads
  spec = sparse.door_spec(cfg.sparse.impl, heads, n, dk)
  impl = sparse_door.select(spec)
  if impl.kernel:  # the kernel's own tiles (splash's blocks, the Triton kernel's tiles)
    pairs = impl.ops.computed_pairs
    keys = sum(pairs(head, n) if impl.ops is splash_sparse else pairs(head, n, cfg.dtype)
               for head in heads)
    return keys * dk, keys * dv
  for head in heads:
    if spec.impl == "dense" or head.kind == "dense":
      keys += n * n
      continue
    l = head.stride
    nb = -(-n // l)
    if head.local:
      keys += nb * l * (2 * l if head.kind == "strided" else l)
    if head.summary:
      keys += l * nb * nb if head.kind == "strided" else nb * l * nb * head.c
  return keys * dk, keys * dv


def sparse_forward_macs(cfg, plan, block: int, batch: int = 1) -> dict:
  """forward_macs of arch='sparse' (span_lm/model/sparse_transformer.py): per residual block the
  query/key projections (d_qk wide) and value/output ones (D), the feed-forward, and the
  factorized attention (sparse_attention_macs); the output layer. No cache, no span predictor;
  the embeddings are gathers. `plan` is unused: the patterns are fixed by config.model.sparse."""
  del plan
  m, d = block, cfg.d_model
  out = dict.fromkeys(COMPONENTS, 0)
  for layer in range(cfg.n_layers):
    out["q_proj"] += m * d * cfg.d_qk
    out["kv_proj"] += m * d * (cfg.d_qk + cfg.n_heads * cfg.head_dim)
    out["out_proj"] += m * cfg.n_heads * cfg.head_dim * d
    scores, values = sparse_attention_macs(cfg, layer, m)
    out["attn_content"] += scores
    out["attn_value"] += values
    out["ff"] += 2 * m * d * cfg.d_ff
  out["output"] = m * d * cfg.vocab_size
  return {k: v * batch for k, v in out.items()}
