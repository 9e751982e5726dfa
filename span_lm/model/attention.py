"""Sequential self-attention of one layer over a hidden-state cache: projections, span
parameters and span loss, persistent memory and the head-group loop. The banded attention itself
(scores as (M, W) bands, the soft span mask) is behind the door in span_lm/kernels: `select`
picks the implementation once per layer shape and this module calls its functions; it names no
platform.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from span_lm import kernels
from span_lm.kernels import matmul
from span_lm.model import spans as spans_lib
from span_lm.model.config import ModelConfig
from span_lm.model.plan import LayerPlan


def torch_linear_init():
  """torch.nn.Linear's weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
  bound = 1.0 / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _selector(ids, width: int = 1):
  """(a, axis=1) -> the entries ids * width ... (ids + 1) * width - 1 of a along axis: a slice
  when the ids are contiguous, else a gather."""
  lo, hi = ids[0] * width, (ids[-1] + 1) * width
  if tuple(range(ids[0], ids[0] + len(ids))) == tuple(ids):
    return lambda a, ax=1: jax.lax.slice_in_dim(a, lo, hi, axis=ax)
  cols = jnp.asarray([c for i in ids for c in range(i * width, (i + 1) * width)])
  return lambda a, ax=1: jnp.take(a, cols, axis=ax)


class _DenseKernel(nn.Module):
  """Holds `kernel` exactly as nn.Dense(use_bias=False) would (same path, same init), so the
  key and value projections can run as one matmul without changing the parameter tree."""
  features: int

  @nn.compact
  def __call__(self):
    return self.param("kernel", torch_linear_init(), (self.features, self.features))


def _group_kv(impl, spec, cache, h_in, kv_block, k_kernel, v_kernel, head_ids, w: int, *,
              d: int, dh: int, nh: int, kv_cache: bool):
  """Keys and values of one head group only: its heads' columns of the projections (of a kernel,
  or of cached [keys | values] halves) over the last w cached states plus the block. A long head
  thus costs its own projections; the cache margin beyond the window is never read."""
  g = len(head_ids)
  pick = _selector(head_ids, dh)
  if kv_cache:  # the cached keys/values were projected with these same (frozen) weights
    both = jnp.concatenate([cache[:, cache.shape[1] - w:], kv_block], axis=1)  # B T 2D
    both = both if g == nh else jnp.concatenate(
        [pick(both[..., :d], 2), pick(both[..., d:], 2)], axis=-1)
    return impl.split_kv(spec, both, window=w, heads=g)
  w_kv = jnp.concatenate([pick(k_kernel), pick(v_kernel)], axis=1)  # D x 2gDh
  return impl.project_kv(spec, cache, h_in, w_kv, window=w, heads=g)


def _group_spans(take, z_H, z_BxMxH):
  """One group's spans, (1 or B, G, 1 or M) tokens (None: fixed): the door builds the mask."""
  if z_H is not None:
    return take(z_H, 0)[None, :, None]
  if z_BxMxH is not None:
    return take(z_BxMxH, 2).transpose(0, 2, 1)
  return None


def _group_segments(docs, w: int, m: int):
  """The door's segment ids for a window of w: the last w cached positions and the block."""
  if docs is None:
    return None
  q_ids, all_ids = docs
  return kernels.Segments(q_ids, all_ids[:, all_ids.shape[1] - (w + m):])


def _in_head_order(outs, order, nh: int):
  """The groups' outputs (B, G, M, Dh) as one (B, H, M, Dh) in head order."""
  out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
  if tuple(order) != tuple(range(nh)):
    inv = [0] * nh
    for pos, hid in enumerate(order):
      inv[hid] = pos
    out = jnp.take(out, jnp.asarray(inv), axis=1)
  return out


def _spans(param, cfg: ModelConfig, h_BxMxD, aux: dict):
  """The layer's spans in tokens, (z_H, z_BxMxH): learned per head (adaptive) or predicted per
  token (dynamic), None for a fixed span; their loss and statistics (and the spans) into aux.
  param: the attention module's `param` (its span_ratio); the predictor is its submodule."""
  nh, s = cfg.n_heads, cfg.span.size
  z_H = z_BxMxH = None
  if cfg.span.mode == "adaptive":
    ratio = param("span_ratio", nn.initializers.constant(cfg.span.init), (nh,))
    z_H = ratio.astype(jnp.float32) * s
    aux["span_loss"] = spans_lib.span_loss(ratio, cfg)
    aux["span_avg"], aux["span_max"] = spans_lib.span_stats(z_H, cfg)
    aux["span_z"] = z_H
  elif cfg.span.mode == "dynamic":
    pred = nn.Dense(nh, kernel_init=torch_linear_init(),
                    bias_init=nn.initializers.constant(cfg.span.dynamic_bias_init),
                    name="span_predictor")
    sig = jax.nn.sigmoid(pred(h_BxMxD.astype(jnp.float32)))
    z_BxMxH = s * sig
    aux["span_loss"] = spans_lib.span_loss(sig, cfg)
    aux["span_avg"], aux["span_max"] = spans_lib.span_stats(z_BxMxH, cfg)
    aux["dyn_spans"] = z_BxMxH
  else:
    aux["span_loss"] = jnp.zeros((), jnp.float32)
    aux["span_avg"] = aux["span_max"] = jnp.asarray(s, jnp.float32)
  return z_H, z_BxMxH


def _persistent_memory(param, cfg: ModelConfig):
  """The attention module's persistent keys (H, Dh, N) and values (H, N, Dh), already multiplied
  by sqrt(Dh) and sqrt(N) as the kernels take them, or (None, None)."""
  nh, dh = cfg.n_heads, cfg.head_dim
  pers_k = pers_v = None
  if cfg.pers_mem:
    n = cfg.pers_mem
    pers_k = param("pers_key", nn.initializers.normal(1.0 / math.sqrt(dh)), (nh, dh, n))
    pers_v = param("pers_val", nn.initializers.normal(1.0 / math.sqrt(n)), (nh, n, dh))
    pers_k = pers_k * math.sqrt(dh)
    pers_v = pers_v * math.sqrt(n)
  return pers_k, pers_v


def _projection(dt, d: int):
  """name -> the (D, D) projection of that name, as a callable of x. bf16/f16: the float32
  kernel into the matmul, which casts it (a float32 gradient); else nn.Dense in dt."""
  if dt in matmul.LOW:
    return lambda name: lambda x: matmul.dot(x.astype(dt), _DenseKernel(d, name=name)())
  return lambda name: nn.Dense(d, use_bias=False, kernel_init=torch_linear_init(), dtype=dt,
                               dot_general=matmul.dense_dot_general, name=name)


class SeqAttention(nn.Module):
  """Multi-head sequential attention of one layer, with its span parameters and persistent memory.

  Parameters (reference state_dict names in brackets, torch weights are (out, in)):
    proj_query/proj_key/proj_val/proj_out.kernel (D, D)   [attn.proj_*.weight, transposed]
    span_ratio (H,)                       [attn.attn.adaptive_span._mask.current_val (H, 1, 1)]
    span_predictor.kernel (D, H), .bias   [none: dynamic span is not in the reference]
    pers_key (H, Dh, N), pers_val (H, N, Dh)  [attn.attn.persistent_memory.key / .val]
  """
  cfg: ModelConfig
  plan: LayerPlan
  kv_cache: bool = False  # inference: the cache holds projected [keys | values] (B, L, 2D)

  @nn.compact
  def __call__(self, h_BxMxD, cache_BxLxD, key_pe_DxS, train: bool, ring_pos=None, docs=None):
    """ring_pos (kv_cache, one token): the cache is a ring of projected keys|values, slot j
    holding the token at the position congruent to j mod L, and ring_pos is this token's
    position; nothing is copied per token (kernels.decode).
    docs (model.doc_boundary): (document ids of the queries (B, M), of the newest cached
    positions and the block (B, L' + M), L' >= every window): the door's segment ids."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    b, m, d = h_BxMxD.shape
    nh, dh, s = cfg.n_heads, cfg.head_dim, cfg.span.size
    dense = _projection(dt, d)
    w_max = max(w for _, w in self.plan.groups)
    cache_len = cache_BxLxD[0].shape[2] if ring_pos is not None else cache_BxLxD.shape[1]
    if cache_len < w_max:
      raise ValueError(f"cache of {cache_len} states is shorter than the window {w_max}")
    q = dense("proj_query")(h_BxMxD).reshape(b, m, nh, dh).transpose(0, 2, 1, 3)  # B H M Dh
    # float32 kernels: the matmuls cast them to dt and keep their gradients in float32
    k_kernel = _DenseKernel(d, name="proj_key")()
    v_kernel = _DenseKernel(d, name="proj_val")()
    h_in = h_BxMxD.astype(dt)
    cache = cache_BxLxD if ring_pos is not None else cache_BxLxD.astype(dt)

    aux = {}
    if self.kv_cache:  # the block's keys and values for every head, for the next cache
      aux["kv"] = matmul.dot(h_in, jnp.concatenate([k_kernel, v_kernel], axis=1))  # B M 2D
    z_H, z_BxMxH = _spans(self.param, cfg, h_BxMxD, aux)
    pers_k, pers_v = _persistent_memory(self.param, cfg)

    drop = nn.Dropout(cfg.dropout)
    dropout = (lambda p: drop(p, deterministic=False)) if (train and cfg.dropout > 0) else None

    if ring_pos is not None:
      if not self.kv_cache or m != 1:
        raise ValueError("ring caches are for decoding one token at a time with kv_cache=True")
      span_z = z_H if z_H is not None else (None if z_BxMxH is None else z_BxMxH[:, 0])
      out = kernels.decode(cfg.attn_spec, q[:, :, 0], cache, key_pe_DxS, ring_pos,
                           self.plan.head_windows(nh), span_z=span_z, pers_k_HxDxN=pers_k,
                           pers_v_HxNxD=pers_v)
      return dense("proj_out")(out.astype(dt).reshape(b, 1, d)), aux

    spec = cfg.attn_spec  # what the door reads (the drop-in layer builds its own)
    impl = kernels.select(spec, m, w_max)
    outs, order = [], []
    for head_ids, w in self.plan.groups:
      take = _selector(head_ids)  # this group's heads along an axis
      kv = _group_kv(impl, spec, cache, h_in, aux.get("kv"), k_kernel, v_kernel, head_ids, w,
                     d=d, dh=dh, nh=nh, kv_cache=self.kv_cache)
      span_z = _group_spans(take, z_H, z_BxMxH)
      segments = _group_segments(docs, w, m)
      out = impl.attend(
          spec, take(q, 1), kv, key_pe_DxS[:, s - w:], span_z=span_z, segments=segments,
          pers_k_GxDxN=None if pers_k is None else take(pers_k, 0),
          pers_v_GxNxD=None if pers_v is None else take(pers_v, 0), dropout=dropout,
          dropout_seed=lambda: jax.random.bits(self.make_rng("dropout"), (), jnp.uint32))
      outs.append(out.astype(dt))
      order.extend(head_ids)
    out = _in_head_order(outs, order, nh).transpose(0, 2, 1, 3).reshape(b, m, d)
    return dense("proj_out")(out), aux
