"""Layer caches: zero caches for a plan, resizing to a new plan (as the reference: keep the newest
states, zero-pad on the left), and the ring layout one-token decoding reads in place.

With model.doc_boundary set, the caches carry one more entry after the layers' (`doc_ids`):
(B, seg_len) int32 over the newest seg_len = max(cache lengths) positions, 1 where the position
is in the document of the newest cached position, 0 elsewhere (an older document, or the zero
states a stream starts with: not attended). Zeroed, resized (zero-padded) and split by rows as
the layer caches are."""
import jax.numpy as jnp

from span_lm.model.config import ModelConfig
from span_lm.model.plan import SpanPlan, full_plan


def seg_len(plan: SpanPlan) -> int:
  """Positions the document-id cache covers: the longest layer cache."""
  return max(lp.cache_len for lp in plan.layers)


def has_doc_ids(cfg: ModelConfig) -> bool:
  return cfg.doc_boundary >= 0


def to_ring(caches, pos, n_heads: int):
  """Key/value caches in stream order ((B, L, 2D), oldest state first, as a block leaves them)
  as rings for decoding (SpanTransformer(..., ring_pos=)): per layer (keys, values), each
  (B, H, L, Dh), head-major so that a query reads them where they lie, and after `pos` tokens
  slot j holds the token whose position is congruent to j mod L. pos may be traced."""
  out = []
  for c in caches:
    b, l, d2 = c.shape
    kv = c.reshape(b, l, 2, n_heads, d2 // (2 * n_heads)).transpose(2, 0, 3, 1, 4)
    kv = jnp.roll(kv, jnp.asarray(pos) % l, axis=3)
    out.append((kv[0], kv[1]))
  return tuple(out)


def from_ring(rings, pos):
  """The inverse of to_ring: rings after `pos` tokens -> (B, L, 2D) caches in stream order."""
  out = []
  for k, v in rings:
    b, h, l, dh = k.shape
    kv = jnp.roll(jnp.stack([k, v]), -(jnp.asarray(pos) % l), axis=3)
    out.append(kv.transpose(1, 3, 0, 2, 4).reshape(b, l, 2 * h * dh))
  return tuple(out)


def init_caches(cfg: ModelConfig, plan: SpanPlan | None, batch: int, dtype=None,
                kv: bool = False):
  """Zero caches per layer: (B, L, D) hidden states, or (B, L, 2D) keys|values with kv=True.

  dtype (default: the model's compute dtype): attention reads a cache only through its key and
  value projections, in that dtype, so a bf16 model's bf16 caches give the same keys and values
  as float32 ones, in half the memory and half the per-step cache traffic."""
  plan = plan or full_plan(cfg)
  width = 2 * cfg.d_model if kv else cfg.d_model
  dtype = jnp.dtype(cfg.dtype) if dtype is None else dtype
  out = tuple(jnp.zeros((batch, lp.cache_len, width), dtype) for lp in plan.layers)
  if has_doc_ids(cfg):  # no document before the stream starts
    out += (jnp.zeros((batch, seg_len(plan)), jnp.int32),)
  return out


def resize_caches(caches, cfg: ModelConfig, plan: SpanPlan | None):
  """Fits caches to a plan: keeps the newest states, zero-pads on the left (as the reference)."""
  plan = plan or full_plan(cfg)
  lens = [lp.cache_len for lp in plan.layers]
  if has_doc_ids(cfg):  # the document ids: padded with 0, positions no query attends
    lens.append(seg_len(plan))
  if len(caches) != len(lens):
    raise ValueError(f"{len(caches)} caches for {len(lens)} entries (model.doc_boundary="
                     f"{cfg.doc_boundary} carries document ids last)")
  out = []
  for c, want in zip(caches, lens):
    n = c.shape[1]
    if n > want:
      c = c[:, n - want:]
    elif n < want:
      c = jnp.pad(c, ((0, 0), (want - n, 0)) + ((0, 0),) * (c.ndim - 2))
    out.append(c)
  return tuple(out)
